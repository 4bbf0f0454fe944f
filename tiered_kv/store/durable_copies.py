"""Durable copies: records in cold of blocks that live in hot or warm (write-behind; issue 19).

Tiers are exclusive for a block's *working* data, but not for its durable record. A published block
may also hold a cold slot with a durable record of its bytes (its copy):

- write-behind: a block published above cold waits in `pending`; within `cold.write_behind_s` the
  mover copies a batch of them into cold slots (a backup transfer: transfers.py) and persists each
  record, so a crash loses at most the blocks published in the last interval;
- a block promoted out of cold keeps its record: its cold slot becomes its copy;
- a block going down into cold, or dropped from warm as cache, takes its copy's slot back: no byte
  is written;
- copies are the first room cold gives up: a slot holding only a copy counts as free, and the
  copies of the coldest blocks (warm before hot, least recently used first) are reclaimed first.

Which blocks get a copy (`cold.admit`): "published", blocks this process computed and verified;
"reused", only those once a second turn or chat read them; "all", also blocks that came from
elsewhere (another process's cold file, the remote tier). Ids only, no torch; under the store lock.
"""

from __future__ import annotations

from collections import OrderedDict

from ..blocks import HOT, WARM


class DurableCopies:
    def __init__(self, admit: str):
        self.admit = admit
        self.slot_of: dict[int, int] = {}  # block id -> the cold slot holding its durable copy
        self.pending: OrderedDict[int, float] = OrderedDict()  # block id -> when it became due (monotonic s)
        self._waiting_for_reuse: set[int] = set()  # admit "reused": published, not read again yet

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slot_of

    # ---- what needs a copy -----------------------------------------------------------------------
    def published(self, block_ids, local: bool, now_s: float) -> None:
        """Blocks just published above cold; `local`: computed here (not fetched from elsewhere)."""
        if self.admit == "all" or (local and self.admit == "published"):
            for block_id in block_ids:
                if block_id not in self.slot_of:
                    self.pending[block_id] = now_s
        elif local and self.admit == "reused":
            self._waiting_for_reuse.update(b for b in block_ids if b not in self.slot_of)

    def reused(self, block_ids, now_s: float) -> None:
        """A second turn or chat read these blocks (admit "reused": now they are worth a copy)."""
        if self._waiting_for_reuse:
            for block_id in block_ids:
                if block_id in self._waiting_for_reuse:
                    self._waiting_for_reuse.discard(block_id)
                    self.pending[block_id] = now_s

    def due(self, now_s: float, write_behind_s: float, limit: int, force: bool = False) -> list[int]:
        """Up to `limit` pending blocks, oldest first, once the oldest has waited half the interval
        (so copies go in batches, and none waits longer than the interval) or `force`; else []."""
        if not self.pending or not write_behind_s:
            return []
        oldest = next(iter(self.pending.values()))
        if not force and now_s - oldest < write_behind_s / 2 and len(self.pending) < limit:
            return []
        taken = []
        while self.pending and len(taken) < limit:
            taken.append(self.pending.popitem(last=False)[0])
        return taken

    def retry_later(self, block_id: int, now_s: float) -> None:
        """A copy that could not be made (its write failed): try again with the next batch."""
        if block_id not in self.slot_of:
            self.pending[block_id] = now_s

    # ---- copies held ------------------------------------------------------------------------------
    def add(self, block_id: int, slot: int) -> None:
        self.slot_of[block_id] = slot
        self.pending.pop(block_id, None)
        self._waiting_for_reuse.discard(block_id)

    def pop(self, block_id: int) -> int | None:
        """The block is gone, or takes its copy's slot as its own: forget it; its copy's slot, if any."""
        self.pending.pop(block_id, None)
        self._waiting_for_reuse.discard(block_id)
        return self.slot_of.pop(block_id, None)

    def coldest(self, index, count: int) -> list[int]:
        """Up to `count` blocks whose copies go first when cold needs room: warm before hot, least
        recently used first."""
        out = []
        if count <= 0:
            return out
        for tier in (WARM, HOT):
            for block_id in index.recency(tier):
                if block_id in self.slot_of:
                    out.append(block_id)
                    if len(out) == count:
                        return out
        return out + [b for b in self.slot_of if b not in index][:count - len(out)]
