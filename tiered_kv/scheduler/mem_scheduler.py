"""MemScheduler: decides where blocks go and returns a Plan. Ids only, no torch.

It reads the BlockIndex (tiers, recency orders, references) and the free slot count of each
tier, simulates the moves, and returns a Plan the TierStore applies as a unit under the same
lock. The simulation walks each tier's recency order lazily from the least recently used end,
so a plan costs O(moves + blocks skipped), never O(blocks in the store).

Policy "lru": the least recently used movable block of a full tier moves one tier down (a block
arriving in a tier counts as the most recent there); where nothing can go down, the least
recently used unreferenced block of the tier is dropped. Blocks the caller protects and blocks
pinned by a running step are never moved. Nothing is applied when a plan is infeasible (None is
returned), so a request that cannot fit leaves the store untouched.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..block_index import NO_TIER, NUM_TIERS, BlockIndex
from .plan import COLD, DROPPED, HOT, WARM, Move, Plan

ALLOWED_POLICIES = ("lru",)


class _Simulation:
    """Free-slot counts and per-tier victim order as the plan's moves so far would leave them."""

    def __init__(self, index: BlockIndex, free_slots: list[int], capacities: list[int],
                 is_movable: Callable[[int], bool]):
        self.index = index
        self.free = list(free_slots)
        self.capacities = capacities
        self.is_movable = is_movable
        self.moves: list[Move] = []
        self.tier_of: dict[int, int] = {}  # blocks this plan moved, and where to
        self._originals = [iter(index.recency(t)) for t in range(NUM_TIERS)]
        self._peeked: list[int | None] = [None] * NUM_TIERS
        self._arrived = [deque() for _ in range(NUM_TIERS)]  # moved in by this plan, oldest first
        self._droppable = [iter(index.unreferenced(t)) for t in range(NUM_TIERS)]

    def tier(self, block_id: int) -> int:
        if block_id in self.tier_of:
            return self.tier_of[block_id]
        return self.index.get(block_id).tier if block_id in self.index else NO_TIER

    def _still_here(self, block_id: int, tier: int) -> bool:
        return self.tier(block_id) == tier and self.is_movable(block_id)

    def _victim(self, tier: int) -> int | None:
        """The least recently used movable block now in `tier` (not consumed)."""
        peeked = self._peeked[tier]
        if peeked is not None and self._still_here(peeked, tier):
            return peeked
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
        for block_id in self._droppable[tier]:
            if block_id not in self.tier_of and self.is_movable(block_id):
                return block_id
        return next((b for b in self._arrived[tier] if self._still_here(b, tier)
                     and self.index.get(b).ref_count == 0), None)

    def make_room(self, tier: int, num_slots: int = 1) -> bool:
        """Free slots in `tier` by moving its LRU blocks down (recursively) or dropping cached ones."""
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
        self._record(Move(dropped, tier, DROPPED))
        self.free[tier] += 1
        return True

    def move(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        self._record(Move(block_id, src_tier, dst_tier))
        self.free[src_tier] += 1
        self.free[dst_tier] -= 1
        self._arrived[dst_tier].append(block_id)

    def _record(self, move: Move) -> None:
        self.moves.append(move)
        self.tier_of[move.block_id] = move.dst_tier


def _movable(protect: Iterable[int], is_pinned: Callable[[int], bool] | None) -> Callable[[int], bool]:
    protect = protect if isinstance(protect, (set, frozenset)) else frozenset(protect)
    if is_pinned is None:
        return lambda block_id: block_id not in protect
    return lambda block_id: block_id not in protect and not is_pinned(block_id)


class MemScheduler:
    def __init__(self, policy: str = "lru"):
        if policy not in ALLOWED_POLICIES:
            raise ValueError(f"scheduler.policy {policy!r} is not known; allowed: {ALLOWED_POLICIES}")
        self.policy = policy

    def plan_new_blocks(
        self,
        num_new_blocks: int,
        index: BlockIndex,
        free_slots: list[int],
        capacities: list[int],
        protect: Iterable[int] = frozenset(),
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan | None:
        """Place `num_new_blocks` new blocks as high as possible, pushing LRU blocks down.

        Returns None when all tiers together cannot hold them (nothing is to be applied)."""
        sim = _Simulation(index, free_slots, capacities, _movable(protect, is_pinned))
        tiers = [t for t in (HOT, WARM, COLD) if capacities[t] > 0]
        placed: list[int] = []
        for _ in range(num_new_blocks):
            for tier in tiers:
                if sim.make_room(tier, 1):
                    sim.free[tier] -= 1
                    placed.append(tier)
                    break
            else:
                return None
        return Plan(moves=sim.moves, new_block_tiers=placed)

    def plan_promotion(
        self,
        block_ids: list[int],
        index: BlockIndex,
        free_slots: list[int],
        capacities: list[int],
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Bring `block_ids` (one chat's blocks, most important first) as close to hot as space
        allows, moving only other blocks out of the way. Blocks that cannot reach hot leave cold
        for warm when warm has room. A block pinned by a running step (a prefix another chat
        shares) stays where that step reads it."""
        sim = _Simulation(index, free_slots, capacities, _movable(frozenset(block_ids), is_pinned))
        for block_id in block_ids:
            tier = sim.tier(block_id)
            if tier == HOT or tier == NO_TIER:  # already hot, or corrupt (no data to move)
                continue
            if is_pinned is not None and is_pinned(block_id):  # another chat's running step reads it there
                continue
            if capacities[HOT] > 0 and sim.make_room(HOT, 1):
                sim.move(block_id, tier, HOT)
            elif tier == COLD and capacities[WARM] > 0 and sim.make_room(WARM, 1):
                sim.move(block_id, tier, WARM)
        return Plan(moves=sim.moves)

    def plan_demotion(
        self,
        block_ids: list[int],
        dst_tier: int,
        index: BlockIndex,
        free_slots: list[int],
        capacities: list[int],
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Move `block_ids` (an idle chat's blocks) down to `dst_tier`, making room there by the
        usual LRU cascade. Blocks already at or below `dst_tier`, and pinned ones, stay; when
        `dst_tier` runs out of room the rest stay where they are (a partial plan, never an error)."""
        if capacities[dst_tier] == 0:
            return Plan()
        sim = _Simulation(index, free_slots, capacities, _movable(frozenset(block_ids), is_pinned))
        for block_id in block_ids:
            tier = sim.tier(block_id)
            if tier == NO_TIER or tier >= dst_tier or (is_pinned is not None and is_pinned(block_id)):
                continue
            if not sim.make_room(dst_tier, 1):
                break
            sim.move(block_id, tier, dst_tier)
        return Plan(moves=sim.moves)
