"""MemScheduler: decides where blocks go and returns a Plan. Ids only, no torch.

It reads the BlockIndex (tiers, recency orders, references), the AccessLog (which store steps
read which blocks) and the free slot count of each tier, simulates the moves, and returns a Plan
the TierStore applies as a unit under the same lock. Nothing is applied when a plan is
infeasible (None is returned), so a request that cannot fit leaves the store untouched.

Victims. When a tier is full, its movable block of least *value* moves one tier down (a block
arriving in a tier counts as the most recent there); where nothing can go down, the least
valuable unreferenced block of the tier is dropped. A block's value under each policy:

  lru   the last store step that read it or brought it into its tier
  fifo  the store step it entered its current tier
  lfu   how many store steps read it, each read halved every `lfu_half_life_turns` store turns
  ali   the turn heat of the hottest chat that read it (access_log.py: decayed turn counts),
        blocks read in the last quarter of the ALI window above any heat, while heat has
        predicted the next speaker better than recency; else lru's value. The other key breaks
        ties (recency under heat, heat under recency)

plus a cost-sensitivity bonus of `cs_weight * CS` (in the policy's own unit: `* ali_window` for
the step-valued ones), so a high-CS chat's blocks go last and a low-CS chat's first. Ties keep
least-recently-used order. Above every value: the blocks of a chat whose turn was announced
(prefetch, attach) and has not read them yet, under every policy.
Blocks the caller protects and blocks pinned by a running step (or in flight in a background
move) are never moved.

Background plans (`plan_background`, carried out by the store's mover off the critical path):
demote by policy when a tier is fuller than its high watermark, down to its low one; demote
chats idle for `idle_steps`; under `ali` with `ali_promote`, bring blocks whose ALI says hot
(> ali_hot) or warm (> ali_warm) up while the tier is under its low watermark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ..block_index import BlockIndex
from ..blocks import NUM_TIERS
from ..config import ALLOWED_POLICIES, SchedulerConfig
from .access_log import AccessLog
from .arrays import as_ids, first_occurrences, leave_alone_mask, placements_of
from .plan import COLD, HOT, WARM, Plan
from .simulation import Simulation, Values, movable as _movable


@dataclass(frozen=True)
class Watermarks:
    """Per tier, in blocks: above `high` the mover demotes down to `low`."""

    high_blocks: tuple[int, int, int]
    low_blocks: tuple[int, int, int]


class MemScheduler:
    """Plans for one store. `settings` is a SchedulerConfig (or just a policy name, the rest
    defaulted); `access_log` is the store's (a private empty one when not given)."""

    def __init__(self, settings: SchedulerConfig | str = "lru", access_log: AccessLog | None = None):
        if isinstance(settings, str):
            if settings not in ALLOWED_POLICIES:
                raise ValueError(f"scheduler.policy {settings!r} is not known; allowed: {ALLOWED_POLICIES}")
            settings = SchedulerConfig(policy=settings)
        self.settings = settings
        self.policy = settings.policy
        self.cs_weight = settings.cs_weight
        self.access_log = access_log if access_log is not None else AccessLog.from_settings(settings)

    def _simulation(self, index, free_slots, capacities, movable) -> Simulation:
        return Simulation(index, free_slots, capacities, movable, Values(self, index))

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
        ids = np.asarray(list(block_ids), dtype=np.int64)
        log = self.access_log
        return log.ali(ids) + self.cs_weight * log.cost_sensitivity(ids)

    def target_tiers(self, block_ids) -> np.ndarray:
        """Where ALI says each block belongs: hot above ali_hot, warm above ali_warm, else cold."""
        scores = self.scores(block_ids)
        return np.where(scores > self.settings.ali_hot, HOT, np.where(scores > self.settings.ali_warm, WARM, COLD))

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
        sim = self._simulation(index, free_slots, capacities, _movable(protect, is_pinned))
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
        index: BlockIndex,
        free_slots: list[int],
        capacities: list[int],
        is_pinned: Callable[[int], bool] | None = None,
    ) -> Plan:
        """Bring `block_ids` (one chat's blocks, most important first) as close to hot as space
        allows, moving only other blocks out of the way. Blocks that cannot reach hot leave cold
        for warm when warm has room. A block pinned by a running step (a prefix another chat
        shares) stays where that step reads it."""
        ids, tiers, slots = self._candidates(block_ids, index, is_pinned, lambda tiers: tiers != HOT)
        sim = self._simulation(index, free_slots, capacities, _movable(as_ids(block_ids), is_pinned))
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
        ids, tiers, slots = self._candidates(block_ids, index, is_pinned, lambda tiers: tiers < dst_tier)
        sim = self._simulation(index, free_slots, capacities, _movable(as_ids(block_ids), is_pinned))
        straight = min(len(ids), max(0, sim.free[dst_tier]))
        sim.move_bulk(ids[:straight], tiers[:straight], dst_tier, slots[:straight])  # room there: all at once
        for block_id, tier in zip(ids[straight:].tolist(), tiers[straight:].tolist()):
            if not sim.make_room(dst_tier, 1):
                break
            sim.move(block_id, tier, dst_tier)
        return sim.plan()

    def plan_background(
        self,
        index: BlockIndex,
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
        3. under `ali` with `ali_promote`, warm and cold blocks read in the last tenth of the ALI window (a working
           set that spilled) whose score names a higher tier come up while that tier stays
           under its low watermark (most valuable first; the room between the low and high
           marks stays free for the blocks new turns allocate).
        Never moves pinned blocks; never cascades (each move needs a free slot where it goes).
        """
        sim = self._simulation(index, free_slots, capacities, _movable(frozenset(), is_pinned))
        self._demote_over_watermarks(sim, index, capacities, watermarks, max_moves)
        self._demote_idle(sim, index, capacities, max_moves)
        if self.policy == "ali" and self.settings.ali_promote:
            self._promote_by_score(sim, index, capacities, watermarks, max_moves)
        return sim.plan()

    def _lower_tier_with_room(self, sim: Simulation, capacities: list[int], below: int) -> int | None:
        for tier in range(below, NUM_TIERS):
            if capacities[tier] > 0 and sim.free[tier] > 0:
                return tier
        return None

    def _demote_over_watermarks(self, sim, index, capacities, watermarks, max_moves) -> None:
        for tier in (WARM, HOT):
            used = capacities[tier] - sim.free[tier]
            if capacities[tier] == 0 or used <= watermarks.high_blocks[tier]:
                continue
            order = sim.values.order(tier)
            targets = dict(zip(order, self.target_tiers(order).tolist())) if order else {}
            awaited = set(np.asarray(order, dtype=np.int64)[self.access_log.awaited(order)].tolist()) if order else set()
            for block_id in order:
                if used <= watermarks.low_blocks[tier] or sim.num_moves >= max_moves:
                    break
                if not sim.is_movable(block_id) or sim.tier(block_id) != tier:
                    continue
                if targets[block_id] <= tier or block_id in awaited:
                    continue  # its score says it belongs here, or a turn awaits it: it would only come back
                # one tier down (the cheapest to bring back), lower only when that one is full
                dst = self._lower_tier_with_room(sim, capacities, tier + 1) if tier + 1 < NUM_TIERS else None
                if dst is not None:
                    sim.move(block_id, tier, dst)
                elif index.get(block_id).ref_count == 0:
                    sim.drop(block_id, tier)
                else:
                    continue
                used -= 1

    def _demote_idle(self, sim, index, capacities, max_moves) -> None:
        idle_steps = self.settings.idle_steps
        if idle_steps == 0 or capacities[WARM] == 0 or index.count_in(HOT) == 0:
            return
        ids = np.fromiter(index.recency(HOT), dtype=np.int64, count=index.count_in(HOT))
        log = self.access_log
        last = np.maximum(log.last_read_step(ids), np.asarray(index.arrival_steps(ids), dtype=np.int64))
        limit = idle_steps * (1.0 + log.cost_sensitivity(ids))
        for block_id in ids[((log.now - last) > limit) & ~log.awaited(ids)].tolist():
            if sim.num_moves >= max_moves or sim.free[WARM] == 0:
                return
            if sim.is_movable(block_id) and sim.tier(block_id) == HOT:
                sim.move(block_id, HOT, WARM)

    def idle_outlook(self, index: BlockIndex, capacities: list[int]) -> tuple[int | None, bool]:
        """After a background plan: (the earliest store step at which one more hot block may
        turn idle, or None when idle demotion is off; whether some hot block is idle already
        (one the plan could not move: pinned, or no room in warm)). Blocks that arrive in hot
        later turn idle no sooner than `idle_steps` from now, so the step is capped there."""
        idle_steps = self.settings.idle_steps
        if idle_steps == 0 or capacities[WARM] == 0:
            return None, False
        log = self.access_log
        if index.count_in(HOT) == 0:
            return log.now + idle_steps, False
        ids = np.fromiter(index.recency(HOT), dtype=np.int64, count=index.count_in(HOT))
        last = np.maximum(log.last_read_step(ids), np.asarray(index.arrival_steps(ids), dtype=np.int64))
        turns_idle = np.floor(last + idle_steps * (1.0 + log.cost_sensitivity(ids))).astype(np.int64) + 1
        idle_now = turns_idle <= log.now
        later = turns_idle[~idle_now]
        next_step = min(int(later.min()) if len(later) else log.now + idle_steps, log.now + idle_steps)
        return next_step, bool(idle_now.any())

    def _promote_by_score(self, sim, index, capacities, watermarks, max_moves) -> None:
        candidates = [b for tier in (WARM, COLD) for b in index.recency(tier)]
        if not candidates:
            return
        # only blocks read lately from where they are (a working set that spilled): a chat idle
        # between turns comes up by prefetch or at its turn, not by speculation
        log = self.access_log
        recent = log.last_read_step(candidates) >= log.now - max(1, log.window_steps // 10)
        candidates = [b for b, keep in zip(candidates, recent.tolist()) if keep]
        if not candidates:
            return
        scores = self.scores(candidates)
        targets = self.target_tiers(candidates)
        for i in np.argsort(-scores, kind="stable").tolist():
            if sim.num_moves >= max_moves:
                return
            block_id, target = candidates[i], int(targets[i])
            tier = sim.tier(block_id)
            if target >= tier or not sim.is_movable(block_id):
                continue
            for dst in range(target, tier):
                used = capacities[dst] - sim.free[dst]
                if capacities[dst] > 0 and sim.free[dst] > 0 and used + 1 <= watermarks.low_blocks[dst]:
                    sim.move(block_id, tier, dst)
                    break
