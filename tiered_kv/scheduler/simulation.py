"""A plan in the making: free slots per tier and each tier's victim order as the moves chosen so
far would leave them (`Simulation`). Ids only, no torch.

`make_room(tier)` frees slots by moving the tier's least valuable movable block one tier down
(making room there the same way, recursively), or, where nothing can go down, by dropping the
least valuable block no chat holds. A block this plan moved into a tier counts as the most recent
there. Nothing is applied: the scheduler returns the moves as a Plan, or None when they cannot fit.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..blocks import NUM_TIERS
from .index_view import IndexView
from .plan import DROPPED, Move
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
        self.moves: list[Move] = []
        self.tier_of: dict[int, int] = {}  # blocks this plan moved, and where to
        # victim orders, computed the first time a tier needs a victim (most plans need none)
        self._originals: list[Iterable[int] | None] = [None] * NUM_TIERS
        self._peeked: list[int | None] = [None] * NUM_TIERS
        self._arrived = [deque() for _ in range(NUM_TIERS)]  # moved in by this plan, oldest first
        self._droppable: list[Iterable[int] | None] = [None] * NUM_TIERS

    def tier(self, block_id: int) -> int:
        tier = self.tier_of.get(block_id)
        if tier is not None:
            return tier
        entry = self.index.peek(block_id)
        return entry.tier if entry is not None else DROPPED

    def _still_here(self, block_id: int, tier: int) -> bool:
        return self.tier(block_id) == tier and self.is_movable(block_id)

    def _victim(self, tier: int) -> int | None:
        """The least valuable movable block now in `tier` (not consumed)."""
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
        self._record(Move(block_id, tier, DROPPED))
        self.free[tier] += 1

    def move(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        self.moves.append(Move(block_id, src_tier, dst_tier))
        self.tier_of[block_id] = dst_tier
        self.free[src_tier] += 1
        self.free[dst_tier] -= 1
        self._arrived[dst_tier].append(block_id)

    def _record(self, move: Move) -> None:
        self.moves.append(move)
        self.tier_of[move.block_id] = move.dst_tier


def movable_test(protect: Iterable[int], is_pinned: Callable[[int], bool] | None) -> Callable[[int], bool]:
    """Whether a plan may move a block: not one the caller protects, not one `is_pinned` names (a
    running step's, or one in flight)."""
    protect = protect if isinstance(protect, (set, frozenset)) else frozenset(protect)
    if is_pinned is None:
        return lambda block_id: block_id not in protect
    return lambda block_id: block_id not in protect and not is_pinned(block_id)

