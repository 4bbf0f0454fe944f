"""AccessLog: which blocks each store step read, and the per-block signals derived from it. No torch.

A store step is one forward pass of one bank (one chat); it reads every block of that chat.
The store reports each step here (`record_step`) with the step's block ids, the chat's block
tables in token order and its cost sensitivity. From that the log keeps, per block id, in numpy
arrays that grow with the ids (ids are never reused):

  last_read_step   the store step that last read the block (-1: never read)
  num_reads        steps that read it since it was allocated          (LFU)
  window_reads     steps among the last `window_steps` that read it   (ALI = that / the steps of
                   the window since it was first read)
  cost_sensitivity the highest CS among the chats that read it since it last went a whole
                   window unread (a shared prefix keeps its premium reader's CS); `default_cs`
                   for blocks nobody read yet

Recording a step costs O(its blocks) in vectorized numpy; reading signals costs O(blocks asked).
Per chat (step owner) it keeps its latest block tables, CS and last step, so the scheduler can
demote idle chats and the compactor can lay chats out in token order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ChatRecord:
    """What the log knows of one chat (a bank's step owner)."""

    tables: list[list[int]] = field(default_factory=list)  # block ids per row, token order
    cost_sensitivity: float = 0.5
    last_step: int = -1
    num_steps: int = 0


class AccessLog:
    def __init__(self, window_steps: int = 100, default_cs: float = 0.5):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.window_steps = window_steps
        self.default_cs = default_cs
        self.now = 0  # store steps recorded so far
        self.chats: dict[int, ChatRecord] = {}
        self._window: deque[np.ndarray] = deque()  # block ids read by each of the last window_steps steps
        self._window_owners: deque[int] = deque()  # and whose step each was
        self._owner_window_steps: dict[int, int] = {}
        self._last_read = np.full(0, -1, dtype=np.int64)
        self._first_read = np.full(0, -1, dtype=np.int64)
        self._num_reads = np.zeros(0, dtype=np.int64)
        self._window_reads = np.zeros(0, dtype=np.int64)
        self._cs = np.zeros(0, dtype=np.float64)

    # ---- recording -------------------------------------------------------------------------
    def record_step(self, owner: int, block_ids, tables: list[list[int]] | None = None,
                    cost_sensitivity: float | None = None) -> None:
        """One store step of chat `owner` read `block_ids` (any iterable of ints, each once)."""
        cs = self.default_cs if cost_sensitivity is None else float(cost_sensitivity)
        ids = np.fromiter(block_ids, dtype=np.int64)
        if len(ids):
            self._grow(int(ids.max()) + 1)
            last = self._last_read[ids]
            recent = (last >= 0) & (last >= self.now - self.window_steps)
            self._cs[ids] = np.where(recent, np.maximum(self._cs[ids], cs), cs)
            self._last_read[ids] = self.now
            first = self._first_read[ids]
            self._first_read[ids] = np.where(first < 0, self.now, first)
            self._num_reads[ids] += 1
            self._window_reads[ids] += 1
        self._window.append(ids)
        self._window_owners.append(owner)
        self._owner_window_steps[owner] = self._owner_window_steps.get(owner, 0) + 1
        if len(self._window) > self.window_steps:
            self._window_reads[self._window.popleft()] -= 1
            gone = self._window_owners.popleft()
            left = self._owner_window_steps[gone] - 1
            if left:
                self._owner_window_steps[gone] = left
            else:
                del self._owner_window_steps[gone]
        chat = self.chats.setdefault(owner, ChatRecord())
        if tables is not None:
            chat.tables = tables
        chat.cost_sensitivity = cs
        chat.last_step = self.now
        chat.num_steps += 1
        self.now += 1

    def forget_chat(self, owner: int) -> None:
        """The chat's bank closed or was collected: its tables are no longer a layout to keep."""
        self.chats.pop(owner, None)

    def _grow(self, size: int) -> None:
        if size <= len(self._last_read):
            return
        new_size = max(size, 2 * len(self._last_read), 1024)
        extra = new_size - len(self._last_read)
        self._last_read = np.concatenate((self._last_read, np.full(extra, -1, dtype=np.int64)))
        self._first_read = np.concatenate((self._first_read, np.full(extra, -1, dtype=np.int64)))
        self._num_reads = np.concatenate((self._num_reads, np.zeros(extra, dtype=np.int64)))
        self._window_reads = np.concatenate((self._window_reads, np.zeros(extra, dtype=np.int64)))
        self._cs = np.concatenate((self._cs, np.full(extra, self.default_cs, dtype=np.float64)))

    # ---- signals (arrays aligned with `ids`) ----------------------------------------------------
    def _take(self, array: np.ndarray, ids: np.ndarray, missing) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.full(len(ids), missing, dtype=array.dtype)
        known = ids < len(array)
        out[known] = array[ids[known]]
        return out

    def last_read_step(self, ids) -> np.ndarray:
        return self._take(self._last_read, ids, -1)

    def num_reads(self, ids) -> np.ndarray:
        return self._take(self._num_reads, ids, 0)

    def window_reads(self, ids) -> np.ndarray:
        return self._take(self._window_reads, ids, 0)

    @property
    def steps_in_window(self) -> int:
        """The window's length so far: `window_steps` once that many steps were recorded."""
        return max(1, min(self.now, self.window_steps))

    def ali(self, ids) -> np.ndarray:
        """Access locality index: the share of the last `window_steps` store steps that read
        each block, counting only steps since the block was first read (a block cannot be read
        before it exists: a chat's newest block, read by every step since, scores like its
        oldest one)."""
        ids = np.asarray(ids, dtype=np.int64)
        first = self._take(self._first_read, ids, -1)
        steps = np.clip(np.minimum(self.now - first, self.window_steps), 1, None)
        return np.where(first < 0, 0.0, self.window_reads(ids) / steps)

    def cost_sensitivity(self, ids) -> np.ndarray:
        return self._take(self._cs, ids, self.default_cs)

    def chat_ali(self, owner: int) -> float:
        """The share of the window's store steps that were this chat's."""
        return self._owner_window_steps.get(owner, 0) / self.steps_in_window
