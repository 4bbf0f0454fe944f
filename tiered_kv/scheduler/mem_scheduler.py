"""MemScheduler: decides where blocks go and returns a Plan. Ids only, no torch.

It reads the BlockIndex (tier, last access, references) and the free slot count of each tier,
simulates the moves on a private copy, and returns a Plan the TierStore applies as a unit.
Policy "lru": the least recently used block of a full tier moves one tier down; at the bottom
only unreferenced cached blocks may be dropped. Nothing is applied when a plan is infeasible
(None is returned), so a request that cannot fit leaves the store untouched.
"""

from __future__ import annotations

import bisect

from ..block_index import BlockIndex
from .plan import COLD, DROPPED, HOT, WARM, Move, Plan

NUM_TIERS = 3
ALLOWED_POLICIES = ("lru",)


class _Simulation:
    """Free-slot counts and per-tier LRU queues as the plan's moves would leave them."""

    def __init__(self, index: BlockIndex, free_slots: list[int], capacities: list[int], protect: frozenset[int]):
        self.index = index
        self.free = list(free_slots)
        self.capacities = capacities
        self.protect = protect
        self.moves: list[Move] = []
        # per tier: sorted list of (last_access, block_id) for blocks that may be moved
        self.queues: list[list[tuple[int, int]]] = [[] for _ in range(NUM_TIERS)]
        for block_id, entry in index.items():
            if block_id not in protect and entry.tier >= 0:  # corrupt blocks hold no slot
                self.queues[entry.tier].append((entry.last_access, block_id))
        for queue in self.queues:
            queue.sort()
        self.tier_of: dict[int, int] = {}

    def tier(self, block_id: int) -> int:
        return self.tier_of.get(block_id, self.index.get(block_id).tier if block_id in self.index else -1)

    def make_room(self, tier: int, num_slots: int = 1) -> bool:
        """Free slots in `tier` by moving its LRU blocks down (recursively) or dropping cached ones."""
        while self.free[tier] < num_slots:
            queue = self.queues[tier]
            if not queue:
                return False
            last_access, victim = queue[0]
            below = tier + 1
            while below < NUM_TIERS and self.capacities[below] == 0:
                below += 1
            if below < NUM_TIERS and self.make_room(below, 1):
                queue.pop(0)
                self._record(Move(victim, tier, below))
                self.free[below] -= 1
                bisect.insort(self.queues[below], (last_access, victim))
            else:
                # nothing can go down: drop the least recently used unreferenced (cached) block
                droppable = next((i for i, (_, b) in enumerate(queue) if self.index.get(b).ref_count == 0), None)
                if droppable is None:
                    return False
                _, dropped = queue.pop(droppable)
                self._record(Move(dropped, tier, DROPPED))
            self.free[tier] += 1
        return True

    def move_up(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        """Record a move chosen by the caller (not by LRU): promotions and explicit demotions."""
        self._record(Move(block_id, src_tier, dst_tier))
        self.free[src_tier] += 1
        self.free[dst_tier] -= 1

    def _record(self, move: Move) -> None:
        self.moves.append(move)
        self.tier_of[move.block_id] = move.dst_tier


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
        protect: frozenset[int] = frozenset(),
    ) -> Plan | None:
        """Place `num_new_blocks` new blocks as high as possible, pushing LRU blocks down.

        Returns None when all tiers together cannot hold them (nothing is to be applied)."""
        sim = _Simulation(index, free_slots, capacities, protect)
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
    ) -> Plan:
        """Bring `block_ids` (one chat's blocks, most important first) as close to hot as space
        allows, moving only other blocks out of the way. Blocks that cannot reach hot leave cold
        for warm when warm has room."""
        wanted = frozenset(block_ids)
        sim = _Simulation(index, free_slots, capacities, protect=wanted)
        for block_id in block_ids:
            tier = sim.tier(block_id)
            if tier == HOT or tier < 0:  # already hot, or corrupt (no data to move)
                continue
            if capacities[HOT] > 0 and sim.make_room(HOT, 1):
                sim.move_up(block_id, tier, HOT)
            elif tier == COLD and capacities[WARM] > 0 and sim.make_room(WARM, 1):
                sim.move_up(block_id, tier, WARM)
        return Plan(moves=sim.moves)

    def plan_demotion(
        self,
        block_ids: list[int],
        dst_tier: int,
        index: BlockIndex,
        free_slots: list[int],
        capacities: list[int],
    ) -> Plan:
        """Move `block_ids` (an idle chat's blocks) down to `dst_tier`, making room there by the
        usual LRU cascade. Blocks already at or below `dst_tier` stay; when `dst_tier` runs out
        of room the rest stay where they are (a partial plan, never an error)."""
        if capacities[dst_tier] == 0:
            return Plan()
        wanted = frozenset(block_ids)
        sim = _Simulation(index, free_slots, capacities, protect=wanted)
        for block_id in block_ids:
            tier = sim.tier(block_id)
            if tier < 0 or tier >= dst_tier:
                continue
            if not sim.make_room(dst_tier, 1):
                break
            sim.move_up(block_id, tier, dst_tier)  # same bookkeeping, downward
        return Plan(moves=sim.moves)
