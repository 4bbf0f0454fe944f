"""A plan in the making: free slots per tier and each tier's victim order as the moves chosen so
far would leave them (`Simulation`). Ids only, no torch.

`make_room(tier)` frees slots by moving the tier's least valuable movable block one tier down
(making room there the same way, recursively), or, where nothing can go down, by dropping the
least valuable block no chat holds. A block this plan moved into a tier counts as the most recent
there. Nothing is applied: the scheduler returns the moves as a Plan, or None when they cannot fit.
The simulation records moves as arrays (a bulk move of many blocks at once, or one block at a time
while room is being made), never as an object per block.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Callable, Iterable

import numpy as np

from ..blocks import NUM_TIERS
from .index_view import IndexView
from .plan import DROPPED, UNKNOWN_SLOT, Plan
from .policies import VictimOrder


class Simulation:
    """Free-slot counts and per-tier victim order as the plan's moves so far would leave them."""

    def __init__(self, index: IndexView, free_slots: list[int], capacities: list[int],
                 is_movable: Callable[[int], bool], values: VictimOrder):
        self.index = index
        self.values = values
        self.free = list(free_slots)
        self.capacities = capacities
        self.is_movable = is_movable
        # the moves so far: chunks of arrays (bulk moves), then single moves not yet in a chunk
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (+ source slots)
        self._ids: list[int] = []
        self._src: list[int] = []
        self._dst: list[int] = []
        self.num_moves = 0
        self.tier_of: dict[int, int] = {}  # blocks this plan moved, and where to
        # victim orders, computed the first time a tier needs a victim (most plans need none)
        self._originals: list[Iterable[int] | None] = [None] * NUM_TIERS
        self._peeked: list[int | None] = [None] * NUM_TIERS
        self._arrived = [deque() for _ in range(NUM_TIERS)]  # moved in by this plan, oldest first
        self._pending: list[tuple[np.ndarray, int]] = []  # bulk moves not yet in tier_of and _arrived
        self._droppable: list[Iterable[int] | None] = [None] * NUM_TIERS

    def _settle_bulk(self) -> None:
        """Enter the bulk moves into tier_of and _arrived (only once a later decision reads them:
        a plan that ends with its bulk moves never pays for it)."""
        for block_ids, dst_tier in self._pending:
            ids = block_ids.tolist()
            self.tier_of.update(zip(ids, repeat(dst_tier)))
            self._arrived[dst_tier].extend(ids)
        self._pending = []

    def tier(self, block_id: int) -> int:
        if self._pending:
            self._settle_bulk()
        tier = self.tier_of.get(block_id)
        if tier is not None:
            return tier
        entry = self.index.peek(block_id)
        return entry.tier if entry is not None else DROPPED

    def _still_here(self, block_id: int, tier: int) -> bool:
        return self.tier(block_id) == tier and self.is_movable(block_id)

    def _victim(self, tier: int) -> int | None:
        """The least valuable movable block now in `tier` (not consumed)."""
        if self._pending:
            self._settle_bulk()
        peeked = self._peeked[tier]
        if peeked is not None and self._still_here(peeked, tier):
            return peeked
        if self._originals[tier] is None:
            self._originals[tier] = iter(self.values.order(tier))
        for block_id in self._originals[tier]:
            if block_id not in self.tier_of and self.is_movable(block_id):
                self._peeked[tier] = block_id
                return block_id
        self._peeked[tier] = None
        arrived = self._arrived[tier]
        while arrived and not self._still_here(arrived[0], tier):
            arrived.popleft()
        return arrived[0] if arrived else None

    def _drop_candidate(self, tier: int) -> int | None:
        if self._pending:
            self._settle_bulk()
        if self._droppable[tier] is None:
            self._droppable[tier] = iter(self.values.unreferenced_order(tier))
        for block_id in self._droppable[tier]:
            if block_id not in self.tier_of and self.is_movable(block_id):
                return block_id
        return next((b for b in self._arrived[tier] if self._still_here(b, tier)
                     and self.index.get(b).ref_count == 0), None)

    def make_room(self, tier: int, num_slots: int = 1) -> bool:
        """Free slots in `tier` by moving its LRU blocks down (recursively) or dropping cached ones."""
        if self.free[tier] >= num_slots:
            return True
        while self.free[tier] < num_slots:
            victim = self._victim(tier)
            if victim is None:
                return self._drop(tier)
            below = tier + 1
            while below < NUM_TIERS and self.capacities[below] == 0:
                below += 1
            if below < NUM_TIERS and self.make_room(below, 1):
                self.move(victim, tier, below)
            elif not self._drop(tier):
                return False
        return True

    def _drop(self, tier: int) -> bool:
        dropped = self._drop_candidate(tier)
        if dropped is None:
            return False
        self.drop(dropped, tier)
        return True

    def drop(self, block_id: int, tier: int) -> None:
        if self._pending:
            self._settle_bulk()
        self._record(block_id, tier, DROPPED)
        self.free[tier] += 1

    def move(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        if self._pending:
            self._settle_bulk()
        self._record(block_id, src_tier, dst_tier)
        self.free[src_tier] += 1
        self.free[dst_tier] -= 1
        self._arrived[dst_tier].append(block_id)

    def move_bulk(self, block_ids: np.ndarray, src_tiers: np.ndarray, dst_tier: int, src_slots: np.ndarray) -> None:
        """`move` for many blocks at once (each at its own source tier and slot, as the index says
        now), in order: the caller checked that `dst_tier` has a free slot for each."""
        count = len(block_ids)
        if not count:
            return
        self._flush()
        self._chunks.append((block_ids, src_tiers, np.full(count, dst_tier, dtype=np.int64), src_slots))
        self.num_moves += count
        self._pending.append((block_ids, dst_tier))
        for tier, leaving in enumerate(np.bincount(src_tiers, minlength=NUM_TIERS).tolist()):
            self.free[tier] += leaving
        self.free[dst_tier] -= count

    def _record(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        self._ids.append(block_id)
        self._src.append(src_tier)
        self._dst.append(dst_tier)
        self.num_moves += 1
        self.tier_of[block_id] = dst_tier

    def _flush(self) -> None:
        if self._ids:
            self._chunks.append((np.array(self._ids, dtype=np.int64), np.array(self._src, dtype=np.int64),
                                 np.array(self._dst, dtype=np.int64), np.full(len(self._ids), UNKNOWN_SLOT,
                                                                              dtype=np.int64)))
            self._ids, self._src, self._dst = [], [], []

    def plan(self, new_block_tiers: Iterable[int] = ()) -> Plan:
        """The moves so far, as a Plan (then `new_block_tiers`), with the source slots the bulk
        moves read from the index (at its placement version now: the store may trust them while
        that version holds)."""
        self._flush()
        if not self._chunks:
            return Plan(new_block_tiers=new_block_tiers)
        if len(self._chunks) == 1:
            ids, src, dst, slots = self._chunks[0]
        else:
            ids, src, dst, slots = (np.concatenate(parts) for parts in zip(*self._chunks))
        plan = Plan.of_arrays(ids, src, dst, new_block_tiers=new_block_tiers)
        return plan.with_sources(slots, getattr(self.index, "placement_version", None))


def movable_test(protect, is_pinned: Callable[[int], bool] | None) -> Callable[[int], bool]:
    """Whether a plan may move a block: not one the caller protects (`protect`: ids as a set, or an
    array whose set is built at the first question: most plans never ask), not one `is_pinned`
    names (a running step's, or one in flight)."""
    if isinstance(protect, np.ndarray):
        ids, built = protect, []

        def protected(block_id: int) -> bool:
            if not built:
                built.append(frozenset(ids.tolist()))
            return block_id in built[0]
    else:
        protected = (protect if isinstance(protect, (set, frozenset)) else frozenset(protect)).__contains__
    if is_pinned is None:
        return lambda block_id: not protected(block_id)
    return lambda block_id: not protected(block_id) and not is_pinned(block_id)


__all__ = ["Simulation", "movable_test"]
