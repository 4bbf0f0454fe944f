"""MemScheduler: decides where blocks go and returns a Plan. Ids only, no torch.

It reads the store's BlockIndex through an IndexView (index_view.py: tiers, recency orders, references), the AccessLog (which store steps
read which blocks) and the free slot count of each tier, simulates the moves (simulation.py), and
returns a Plan the TierStore applies as a unit under the same lock. Nothing is applied when a plan
is infeasible (None is returned), so a request that cannot fit leaves the store untouched.

Victims. When a tier is full, its movable block of least *value* under the policy (policies.py:
lru, lfu, fifo, turns) moves one tier down (a block arriving in a tier counts as the most recent
there); where nothing can go down, the least valuable unreferenced block of the tier is dropped.
Above every value: the blocks of a chat whose turn was announced (prefetch, attach) and has not
read them yet, under every policy. Blocks the caller protects and blocks pinned by a running step
(or in flight in a background move) are never moved.

Background plans (`plan_background`, carried out by the store's mover off the critical path;
background.py): demote by policy when a tier is fuller than its high watermark, down to its low
one; demote chats idle for `idle_steps`; under `turns` with `ali_promote`, bring blocks whose ALI
says hot (> ali_hot) or warm (> ali_warm) up while the tier is under its low watermark.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..config import ALLOWED_POLICIES, POLICY_ALIASES, SchedulerConfig
from . import background
from .access_log import AccessLog
from .arrays import as_ids, first_occurrences, leave_alone_mask, placements_of
from .background import Locality, Watermarks
from .index_view import IndexView
from .plan import COLD, HOT, WARM, Plan
from .policies import VictimOrder, policy_for
from .simulation import Simulation, movable_test

__all__ = ["ALLOWED_POLICIES", "MemScheduler", "Watermarks"]


class MemScheduler:
    """Plans for one store. `settings` is a SchedulerConfig (or just a policy name, the rest
    defaulted); `access_log` is the store's (a private empty one when not given). `policy` is the
    policy's name ("turns" when the config said "ali", its former name)."""

    def __init__(self, settings: SchedulerConfig | str = "lru", access_log: AccessLog | None = None):
        if isinstance(settings, str):
            if settings not in ALLOWED_POLICIES and settings not in POLICY_ALIASES:
                raise ValueError(f"scheduler.policy {settings!r} is not known; allowed: {ALLOWED_POLICIES} "
                                 f"(or a former name: {', '.join(POLICY_ALIASES)})")
            settings = SchedulerConfig(policy=settings)
        self.settings = settings
        self.policy = settings.policy
        self.cs_weight = settings.cs_weight
        self.access_log = access_log if access_log is not None else AccessLog.from_settings(settings)
        self.locality = Locality(self.access_log, settings)

    def _simulation(self, index, free_slots, capacities, movable) -> Simulation:
        policy = policy_for(self.policy, index, self.access_log, self.cs_weight, self.settings.attention_weight)
        return Simulation(index, free_slots, capacities, movable, VictimOrder(policy, index, self.access_log))

    @property
    def promotes_by_locality(self) -> bool:
        """Whether background plans also bring spilled blocks up to where ALI says they belong
        (the `turns` policy with `ali_promote`)."""
        return self.policy == "turns" and self.settings.ali_promote

    @staticmethod
    def _candidates(block_ids, index, is_pinned, wanted) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, tiers, slots) of the blocks a promotion or demotion considers, in order: each
        block's first occurrence, present and intact, not pinned, and `wanted(tiers)` (a mask of its tier)."""
        ids = as_ids(block_ids)
        tiers, slots = placements_of(index, ids)
        keep = first_occurrences(ids) & (tiers >= 0) & wanted(tiers)  # (DROPPED: corrupt; ABSENT: gone)
        if is_pinned is not None and keep.any():  # another chat's running step reads it there
            keep[keep] = ~leave_alone_mask(is_pinned, ids[keep])
        return ids[keep], tiers[keep], slots[keep]

    # ---- signals ---------------------------------------------------------------------------
    def scores(self, block_ids) -> np.ndarray:
        """ALI plus the CS bonus (`cs_weight * CS`) of each block: what its target tier is read from."""
        return self.locality.scores(block_ids)

    def target_tiers(self, block_ids) -> np.ndarray:
        """Where ALI says each block belongs: hot above ali_hot, warm above ali_warm, else cold."""
        return self.locality.target_tiers(block_ids)

    def plan_new_blocks(
        self,
        num_new_blocks: int,
        index: IndexView,
        free_slots: list[int],
        capacities: list[int],
        protect: Iterable[int] = frozenset(),
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan | None:
        """Place `num_new_blocks` new blocks as high as possible, pushing LRU blocks down.

        Returns None when all tiers together cannot hold them (nothing is to be applied)."""
        sim = self._simulation(index, free_slots, capacities, movable_test(protect, is_pinned))
        tiers = [t for t in (HOT, WARM, COLD) if capacities[t] > 0]
        placed: list[int] = []
        if tiers and sim.free[tiers[0]] > 0:  # the first tier's free slots need no room made: at once
            placed = [tiers[0]] * min(num_new_blocks, sim.free[tiers[0]])
            sim.free[tiers[0]] -= len(placed)
        for _ in range(num_new_blocks - len(placed)):
            for tier in tiers:
                if sim.make_room(tier, 1):
                    sim.free[tier] -= 1
                    placed.append(tier)
                    break
            else:
                return None
        return sim.plan(new_block_tiers=placed)

    def plan_promotion(
        self,
        block_ids: list[int],
        index: IndexView,
        free_slots: list[int],
        capacities: list[int],
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Bring `block_ids` (one chat's blocks, most important first) as close to hot as space
        allows, moving only other blocks out of the way. Blocks that cannot reach hot leave cold
        for warm when warm has room. A block pinned by a running step (a prefix another chat
        shares) stays where that step reads it."""
        ids, tiers, slots = self._candidates(block_ids, index, is_pinned, lambda tiers: tiers != HOT)
        sim = self._simulation(index, free_slots, capacities, movable_test(as_ids(block_ids), is_pinned))
        straight = min(len(ids), sim.free[HOT]) if capacities[HOT] > 0 else 0
        sim.move_bulk(ids[:straight], tiers[:straight], HOT, slots[:straight])  # free hot slots: all at once
        for block_id, tier in zip(ids[straight:].tolist(), tiers[straight:].tolist()):
            if capacities[HOT] > 0 and sim.make_room(HOT, 1):
                sim.move(block_id, tier, HOT)
            elif tier == COLD and capacities[WARM] > 0 and sim.make_room(WARM, 1):
                sim.move(block_id, tier, WARM)
        return sim.plan()

    def plan_demotion(
        self,
        block_ids: list[int],
        dst_tier: int,
        index: IndexView,
        free_slots: list[int],
        capacities: list[int],
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Move `block_ids` (an idle chat's blocks) down to `dst_tier`, making room there by the
        usual LRU cascade. Blocks already at or below `dst_tier`, and pinned ones, stay; when
        `dst_tier` runs out of room the rest stay where they are (a partial plan, never an error)."""
        if capacities[dst_tier] == 0:
            return Plan()
        ids, tiers, slots = self._candidates(block_ids, index, is_pinned, lambda tiers: tiers < dst_tier)
        sim = self._simulation(index, free_slots, capacities, movable_test(as_ids(block_ids), is_pinned))
        straight = min(len(ids), max(0, sim.free[dst_tier]))
        sim.move_bulk(ids[:straight], tiers[:straight], dst_tier, slots[:straight])  # room there: all at once
        for block_id, tier in zip(ids[straight:].tolist(), tiers[straight:].tolist()):
            if not sim.make_room(dst_tier, 1):
                break
            sim.move(block_id, tier, dst_tier)
        return sim.plan()

    def plan_background(
        self,
        index: IndexView,
        free_slots: list[int],
        capacities: list[int],
        watermarks: Watermarks,
        is_pinned: Callable[[int], bool] | None = None,
        max_moves: int = 64,
    ) -> Plan:
        """Optional moves, for the mover to carry out off the critical path (at most `max_moves`):

        1. a tier fuller than its high watermark demotes its least valuable blocks down to its
           low watermark (warm first, so hot's victims find room there), one tier down (lower
           only when that one is full). A block whose score names its tier or a higher one
           stays (a working set it would only fetch back), and so do the blocks an announced
           turn awaits (a prefetch's, or the coming chat's already hot ones). Unreferenced
           cached blocks with nowhere to go are dropped.
        2. hot blocks unread for `idle_steps` store steps (times 1 + CS) go to warm (not awaited ones).
        3. under `turns` with `ali_promote`, warm and cold blocks read in the last tenth of the ALI window (a working
           set that spilled) whose score names a higher tier come up while that tier stays
           under its low watermark (most valuable first; the room between the low and high
           marks stays free for the blocks new turns allocate).
        Never moves pinned blocks; never cascades (each move needs a free slot where it goes).
        """
        sim = self._simulation(index, free_slots, capacities, movable_test(frozenset(), is_pinned))
        background.demote_over_watermarks(sim, index, capacities, watermarks, max_moves, self.locality)
        background.demote_idle(sim, index, capacities, max_moves, self.access_log, self.settings.idle_steps)
        if self.promotes_by_locality:
            background.promote_by_locality(sim, index, capacities, watermarks, max_moves, self.locality)
        return sim.plan()

    def idle_outlook(self, index: IndexView, capacities: list[int]) -> tuple[int | None, bool]:
        """After a background plan: (the earliest store step at which one more hot block may
        turn idle, or None when idle demotion is off; whether some hot block is idle already
        (one the plan could not move: pinned, or no room in warm)). Blocks that arrive in hot
        later turn idle no sooner than `idle_steps` from now, so the step is capped there."""
        return background.idle_outlook(index, capacities, self.access_log, self.settings.idle_steps)
