"""AccessLog: which blocks each store step read, and the per-block signals derived from it. No torch.

A store step is one forward pass of one bank (one chat); it reads every block of that chat.
The store reports each step here (`record_step`) with the step's block ids, the chat's block
tables in token order and its cost sensitivity. From that the log keeps, per live block, in numpy
arrays that grow with the blocks alive at once, not with the ids ever handed out (one row each,
reused once the store removes the block: `follow(index)`, `forget_blocks`; access_rows.py):

  last_read_step   the store step that last read the block (-1: never read)
  num_reads        steps that read it since it was allocated, each read's count halving
                   every `lfu_half_life_turns` turns of the whole store (LFU with aging: a chat
                   that was busy yesterday does not hold its tier against today's)
  window_reads     steps among the last `window_steps` that read it   (ALI = that / the steps of
                   the window since it was first read)
  cost_sensitivity the highest CS among the chats that read it since it last went a whole
                   window unread (a shared prefix keeps its premium reader's CS); `default_cs`
                   for blocks nobody read yet
  heat             (the `turns` policy) the highest *turn heat* among the chats that read it: a
                   chat's heat is its count of turns, each decaying by half every
                   `half_life_turns` turns of the whole store (LRFU at chat granularity, in turns,
                   not steps: a long reply does not make its chat come back sooner). A chat's
                   blocks share its heat, the ones of this turn as much as its first ones, and a
                   prefix shared by several chats keeps the hottest one's. `bank.prefetch()` and
                   `attach()` count as the chat's turn (its user is typing), the step that follows
                   does not count it again. Kept as log2(heat) plus turns / half-life, so comparing
                   two blocks never needs the decay worked out.

A chat whose turn was announced keeps its blocks *awaited* until its next step reads them (or
`window_steps` store steps pass): the scheduler never picks them as victims before blocks nobody
awaits, under any policy. Without it the mover's watermark demotion took back what a prefetch
had just brought up (or the announced chat's blocks that were hot already) while its user typed.

At each turn the log also scores two predictors of who speaks next: heat and recency (the
chat's last step). Each one's miss rate is the running share of the other recent speakers (the
last RECENT_SPEAKERS chats to take a turn) it ranked above the chat that then spoke. Where
popular chats keep chatting, heat wins; where they leave (finished conversations), recency does;
`heat_predicts_better` says which, lately.

Recording a step that passes the chat's previous step's numpy int64 array again (the caller never
changes an array it passed) costs O(1), an equal new array one comparison: the chat's run of such
steps is folded into the rows when signals are read or its ids change, bitwise as step-by-step
recording leaves them (access_rows.py: lanes), plus O(blocks another chat's run reads too) a step.
A step with other ids costs O(its blocks) in vectorized numpy, and O(RECENT_SPEAKERS) when it begins
a turn, however many chats are open. Reading signals costs O(blocks asked), plus the pending runs'
blocks the first time.
Per chat (step owner) it keeps its latest block tables, CS and last step, so the scheduler can
demote idle chats and the compactor can lay chats out in token order.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from .access_rows import BlockRows, Lane

PREDICTOR_EWMA = 0.1  # weight of one turn in the predictors' running miss rates
RECENT_SPEAKERS = 64  # a turn's speaker is ranked against at most this many chats that spoke last


@dataclass
class ChatRecord:
    """What the log knows of one chat (a bank's step owner)."""

    tables: list[list[int]] = field(default_factory=list)  # block ids per row, token order
    cost_sensitivity: float = 0.5
    last_step: int = -1
    num_steps: int = 0
    heat_key: float = float("-inf")  # log2(turn heat) + turns / half-life (see the module docstring)
    turn_announced: bool = False  # a prefetch or attach counted the coming turn already


class AccessLog:
    def __init__(self, window_steps: int = 100, default_cs: float = 0.5, half_life_turns: float = 16.0,
                 lfu_half_life_turns: float = 16.0):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if not half_life_turns > 0 or not lfu_half_life_turns > 0:
            raise ValueError(f"half_life_turns and lfu_half_life_turns must be > 0, got {half_life_turns}, "
                             f"{lfu_half_life_turns}")
        self.window_steps = window_steps
        self.default_cs = default_cs
        self.half_life_turns = float(half_life_turns)
        self.lfu_half_life_turns = float(lfu_half_life_turns)
        self.now = 0  # store steps recorded so far
        self.turns = 0  # turns begun so far (steps with new_turn, or announced by prefetch / attach)
        # how badly each predictor ranked the chats that then took a turn (EWMA of the share of
        # other chats ranked above the speaker): `turns` follows the better one
        self.heat_miss = 0.5
        self.recency_miss = 0.5
        self.chats: dict[int, ChatRecord] = {}
        self._recent_speakers: OrderedDict[int, None] = OrderedDict()  # the last RECENT_SPEAKERS chats to take a turn
        self._window: deque[Lane] = deque()  # the lane of each of the last window_steps steps
        self._owner_window_steps: dict[int, int] = {}
        # per live block (num_reads is the decayed read count as of reads_turn, the turn clock at its last read)
        self._rows = BlockRows(default_cs, window_steps, self.lfu_half_life_turns)
        self._lanes: dict[int, Lane] = {}  # owner -> the lane of its latest step
        self._open: dict[int, Lane] = {}  # lane index -> lane, for the lanes of _lanes
        self._pending: dict[int, Lane] = {}  # lanes with steps not folded into the rows yet
        self._window_due: dict[int, Lane] = {}  # lanes whose window count changed since their rows took it
        self._num_lanes = 0
        self._awaited: dict[int, tuple[int, np.ndarray]] = {}  # owner -> (step announced, its block ids)

    @classmethod
    def from_settings(cls, settings) -> "AccessLog":
        """The log a store's scheduler settings (a SchedulerConfig) describe."""
        return cls(settings.ali_window, settings.default_cost_sensitivity, settings.half_life_turns,
                   settings.lfu_half_life_turns)

    # ---- recording -------------------------------------------------------------------------
    def record_step(self, owner: int, block_ids, tables: list[list[int]] | None = None,
                    cost_sensitivity: float | None = None, new_turn: bool = False) -> None:
        """One store step of chat `owner` read `block_ids` (any iterable of ints, each once);
        `new_turn`: it begins one of the chat's turns (a prefill). A numpy int64 array is kept, not
        copied: the caller must not change it afterwards; passing the chat's previous array again
        (nothing new read) records the step in O(1). `tables` is kept as given (not copied)."""
        cs = self.default_cs if cost_sensitivity is None else float(cost_sensitivity)
        ids = block_ids if type(block_ids) is np.ndarray and block_ids.dtype == np.int64 else _as_ids(block_ids)
        chat = self.chats.get(owner)
        if chat is None:
            chat = self.chats[owner] = ChatRecord()
        if self._awaited:
            self._awaited.pop(owner, None)  # its step reads them now: recency and use take over
        if new_turn and not chat.turn_announced:
            self._count_turn(owner, chat)
        chat.turn_announced = False  # any step of its own ends the announced turn's wait
        lane = self._lanes.get(owner)
        if lane is None or (ids is not lane.ids and not (len(ids) == len(lane.ids) and np.array_equal(ids, lane.ids))):
            lane = self._open_lane(owner, ids)
        else:
            lane.ids = ids  # (equal to the lane's: its rows stay)
        self._step(lane, chat.heat_key, cs)
        self._window.append(lane)
        lane.in_window += 1
        self._window_due[lane.index] = lane
        self._owner_window_steps[owner] = self._owner_window_steps.get(owner, 0) + 1
        if len(self._window) > self.window_steps:
            gone = self._window.popleft()
            gone.in_window -= 1
            if gone.in_window or gone.index in self._open:
                self._window_due[gone.index] = gone
            else:  # a closed lane's last step left the window: done with it (kept lanes stay bounded)
                self._window_due.pop(gone.index, None)
                self._rows.apply_window(gone)
            left = self._owner_window_steps[gone.owner] - 1
            if left:
                self._owner_window_steps[gone.owner] = left
            else:
                del self._owner_window_steps[gone.owner]
        if tables is not None:
            chat.tables = tables
        chat.cost_sensitivity = cs
        chat.last_step = self.now
        chat.num_steps += 1
        self.now += 1

    def _step(self, lane: Lane, heat_key: float, cs: float) -> None:
        """The lane's chat takes a step now: one more of its pending segment, or the first of a new
        one (the last folded in) when the turn clock, the chat's heat or its CS changed."""
        now = self.now
        if lane.steps and lane.turn == self.turns and lane.heat_key == heat_key and lane.cs == cs:
            if now - lane.last > self.window_steps:
                lane.gap = True
            lane.steps += 1
            lane.last = now
        else:
            if lane.steps:
                self._rows.flush(lane)
            lane.turn, lane.heat_key, lane.cs = self.turns, heat_key, cs
            lane.steps, lane.first, lane.last, lane.gap = 1, now, now, False
            self._pending[lane.index] = lane
        if len(lane.eager_rows):
            self._rows.read_shared(lane, now)

    def _open_lane(self, owner: int, ids: np.ndarray) -> Lane:
        self._close_lane(owner)
        lane = Lane(self._num_lanes, owner, ids, self._rows.rows_for(ids))
        self._num_lanes += 1
        self._rows.claim_rows(lane, self._open)
        self._lanes[owner] = self._open[lane.index] = lane
        return lane

    def _close_lane(self, owner: int) -> None:
        lane = self._lanes.pop(owner, None)
        if lane is not None:
            if lane.steps:
                self._rows.flush(lane)
            self._pending.pop(lane.index, None)
            del self._open[lane.index]
            self._rows.release(lane)

    def _settle(self) -> None:
        """Fold every pending step and window change into the rows (before signals are read)."""
        if self._pending:
            for lane in self._pending.values():
                if lane.steps:
                    self._rows.flush(lane)
            self._pending.clear()
        if self._window_due:
            for lane in self._window_due.values():
                self._rows.apply_window(lane)
            self._window_due.clear()

    def forget_blocks(self, block_ids) -> None:
        """The store removed these blocks: their rows are reused; they read as never read."""
        self._rows.forget(_as_ids(block_ids))

    def forget_block(self, block_id: int) -> None:
        self._rows.forget_one(block_id)

    def follow(self, index) -> None:
        """Forget each block `index` (the store's BlockIndex) removes, as it removes it: every way a
        store frees a block goes through `index.remove`, which tells its `on_removed`."""
        index.on_removed = self._rows.forget_one

    @property
    def num_rows(self) -> int:
        """Rows the log's arrays hold (a bound on its memory: live blocks at most, or MIN_ROWS)."""
        return self._rows.capacity

    def announce_turn(self, owner: int, block_ids) -> None:
        """`owner`'s next turn is coming (its prefetch, or attach): counted now, for its blocks too;
        the turn's first step does not count it again."""
        chat = self.chats.setdefault(owner, ChatRecord())
        if not chat.turn_announced:
            self._count_turn(owner, chat)
            chat.turn_announced = True
        ids = _as_ids(block_ids)
        self._awaited[owner] = (self.now, ids)
        if len(ids):
            rows = self._rows.rows_for(ids)
            self._rows.heat[rows] = np.maximum(self._rows.heat[rows], chat.heat_key)

    def _count_turn(self, owner: int, chat: ChatRecord) -> None:
        """chat's heat: decayed to now, plus one; the store's turn clock advances. First, how well
        each predictor saw this turn coming: the share of the other recent speakers (at most
        RECENT_SPEAKERS: O(1) per turn however many chats are open) it ranked above this one."""
        others = [c for o in self._recent_speakers if o != owner and (c := self.chats.get(o)) is not None
                  and c.last_step >= 0]
        self._recent_speakers[owner] = None
        self._recent_speakers.move_to_end(owner)
        if len(self._recent_speakers) > RECENT_SPEAKERS:
            self._recent_speakers.popitem(last=False)
        if others and chat.last_step >= 0:
            by_heat = sum(c.heat_key > chat.heat_key for c in others) / len(others)
            by_recency = sum(c.last_step > chat.last_step for c in others) / len(others)
            self.heat_miss += PREDICTOR_EWMA * (by_heat - self.heat_miss)
            self.recency_miss += PREDICTOR_EWMA * (by_recency - self.recency_miss)
        now = self.turns / self.half_life_turns
        decayed = 2.0 ** (chat.heat_key - now) if chat.heat_key > float("-inf") else 0.0
        chat.heat_key = math.log2(decayed + 1.0) + now
        self.turns += 1

    def forget_chat(self, owner: int) -> None:
        """The chat's bank closed or was collected: its tables are no longer a layout to keep."""
        self.chats.pop(owner, None)
        self._awaited.pop(owner, None)
        self._recent_speakers.pop(owner, None)
        self._close_lane(owner)  # (its steps stay counted)

    # ---- signals (arrays aligned with `ids`) ----------------------------------------------------
    def _take(self, name: str, ids, missing) -> np.ndarray:
        self._settle()
        ids = np.asarray(ids, dtype=np.int64)
        array = getattr(self._rows, name)
        out = np.full(len(ids), missing, dtype=array.dtype)
        rows = self._rows.find(ids)
        known = rows >= 0
        out[known] = array[rows[known]]
        return out

    def last_read_step(self, ids) -> np.ndarray:
        return self._take("last_read", ids, -1)

    def num_reads(self, ids) -> np.ndarray:
        """Reads of each block, each one halved for every `lfu_half_life_turns` turns since it."""
        age_turns = self.turns - self._take("reads_turn", ids, 0.0)
        return self._take("num_reads", ids, 0.0) * np.exp2(-age_turns / self.lfu_half_life_turns)

    def window_reads(self, ids) -> np.ndarray:
        return self._take("window_reads", ids, 0)

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
        first = self._take("first_read", ids, -1)
        steps = np.clip(np.minimum(self.now - first, self.window_steps), 1, None)
        return np.where(first < 0, 0.0, self.window_reads(ids) / steps)

    def heat(self, ids) -> np.ndarray:
        """Each block's heat key (module docstring): higher is hotter, comparable across blocks at
        any moment; -inf for blocks no chat's turn has touched (never read yet)."""
        return self._take("heat", ids, -np.inf)

    @property
    def heat_predicts_better(self) -> bool:
        """Whether turn heat has ranked the chats that then spoke above the others better than
        recency has, lately (`turns` then orders victims by heat first, else by recency first)."""
        return self.heat_miss < self.recency_miss

    @property
    def active_chats(self) -> int:
        """Chats with a step among the last `window_steps` store steps (stepping concurrently)."""
        return len(self._owner_window_steps)

    def heat_now(self, ids) -> np.ndarray:
        """The heat itself: decayed turn counts now (for reports and tests)."""
        keys = self.heat(ids)
        return np.where(np.isfinite(keys), np.exp2(keys - self.turns / self.half_life_turns), 0.0)

    def awaited(self, ids) -> np.ndarray:
        """Whether each block belongs to a chat whose announced turn has not read it yet (module
        docstring); announcements older than the window lapse (a user who never sent the turn)."""
        ids = np.asarray(ids, dtype=np.int64)
        oldest = self.now - self.window_steps
        for owner in [o for o, (since, _) in self._awaited.items() if since < oldest]:
            del self._awaited[owner]
        if not self._awaited:
            return np.zeros(len(ids), dtype=bool)
        return np.isin(ids, np.concatenate([b for _, b in self._awaited.values()]))

    def cost_sensitivity(self, ids) -> np.ndarray:
        return self._take("cs", ids, self.default_cs)

    def record_attention(self, ids, masses, decay: float) -> None:  # a sampled step's mass per block (access_rows)
        self._rows.note_attention(_as_ids(ids), np.asarray(masses, dtype=np.float64), decay)

    def attention_mass(self, ids) -> np.ndarray:
        return self._take("attention", ids, 0.0)

    def chat_ali(self, owner: int) -> float:
        """The share of the window's store steps that were this chat's."""
        return self._owner_window_steps.get(owner, 0) / self.steps_in_window


def _as_ids(block_ids) -> np.ndarray:  # block ids as a new int64 array (of any iterable; an array is copied)
    if isinstance(block_ids, np.ndarray):
        return np.array(block_ids, dtype=np.int64).reshape(-1)
    return np.fromiter(block_ids, dtype=np.int64)
