"""Background plans: the optional moves the store's mover carries out off the critical path (the
scheduler's `plan_background`), and when one may find work again (`idle_outlook`). Ids only, no torch.

Two signals decide them besides the policy's victim order:

  locality  ALI (access locality index: the share of the last `ali_window` store steps that read a
            block) plus the CS bonus `cs_weight * CS`; it names the tier a block belongs in: hot
            above `ali_hot`, warm above `ali_warm`, else cold (`Locality.target_tiers`). Under
            every policy a watermark demotion leaves a block whose locality names its tier or a
            higher one (a working set it would only fetch back); with `ali_promote`, the `turns`
            policy also brings spilled blocks up to where it names.
  idleness  the store steps since a hot block was last read or arrived, against `idle_steps`
            times 1 + CS.

No plan here cascades: each move needs a free slot where it goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import NUM_TIERS
from .index_view import IndexView
from .plan import COLD, HOT, WARM
from .simulation import Simulation


@dataclass(frozen=True)
class Watermarks:
    """Per tier, in blocks: above `high` the mover demotes down to `low`."""

    high_blocks: tuple[int, int, int]
    low_blocks: tuple[int, int, int]


class Locality:
    """Where ALI says blocks belong (module docstring), from the access log and the settings."""

    def __init__(self, log, settings):
        self.log, self.settings = log, settings

    def scores(self, block_ids) -> np.ndarray:
        """ALI plus the CS bonus (`cs_weight * CS`) of each block: what its target tier is read from."""
        ids = np.asarray(list(block_ids), dtype=np.int64)
        log = self.log
        return log.ali(ids) + self.settings.cs_weight * log.cost_sensitivity(ids)

    def target_tiers(self, block_ids) -> np.ndarray:
        """Where ALI says each block belongs: hot above ali_hot, warm above ali_warm, else cold."""
        scores = self.scores(block_ids)
        return np.where(scores > self.settings.ali_hot, HOT, np.where(scores > self.settings.ali_warm, WARM, COLD))


def _lower_tier_with_room(sim: Simulation, capacities: list[int], below: int) -> int | None:
    for tier in range(below, NUM_TIERS):
        if capacities[tier] > 0 and sim.free[tier] > 0:
            return tier
    return None


def demote_over_watermarks(sim: Simulation, index: IndexView, capacities: list[int], watermarks: Watermarks,
                           max_moves: int, locality: Locality) -> None:
    """A tier fuller than its high watermark gives up its least valuable blocks down to its low one
    (warm first, so hot's victims find room there), one tier down (lower only when that one is
    full); blocks whose locality names their tier or a higher one stay, and so do the blocks an
    announced turn awaits. Unreferenced blocks with nowhere to go are dropped."""
    for tier in (WARM, HOT):
        used = capacities[tier] - sim.free[tier]
        if capacities[tier] == 0 or used <= watermarks.high_blocks[tier]:
            continue
        order = sim.values.order(tier)
        targets = dict(zip(order, locality.target_tiers(order).tolist())) if order else {}
        awaited = set(np.asarray(order, dtype=np.int64)[locality.log.awaited(order)].tolist()) if order else set()
        for block_id in order:
            if used <= watermarks.low_blocks[tier] or sim.num_moves >= max_moves:
                break
            if not sim.is_movable(block_id) or sim.tier(block_id) != tier:
                continue
            if targets[block_id] <= tier or block_id in awaited:
                continue  # its score says it belongs here, or a turn awaits it: it would only come back
            # one tier down (the cheapest to bring back), lower only when that one is full
            dst = _lower_tier_with_room(sim, capacities, tier + 1) if tier + 1 < NUM_TIERS else None
            if dst is not None:
                sim.move(block_id, tier, dst)
            elif index.get(block_id).ref_count == 0:
                sim.drop(block_id, tier)
            else:
                continue
            used -= 1


def demote_idle(sim: Simulation, index: IndexView, capacities: list[int], max_moves: int, log, idle_steps: int) -> None:
    """Hot blocks unread for `idle_steps` store steps (times 1 + CS) go to warm (not awaited ones)."""
    if idle_steps == 0 or capacities[WARM] == 0 or index.count_in(HOT) == 0:
        return
    ids = np.fromiter(index.recency(HOT), dtype=np.int64, count=index.count_in(HOT))
    last = np.maximum(log.last_read_step(ids), np.asarray(index.arrival_steps(ids), dtype=np.int64))
    limit = idle_steps * (1.0 + log.cost_sensitivity(ids))
    for block_id in ids[((log.now - last) > limit) & ~log.awaited(ids)].tolist():
        if sim.num_moves >= max_moves or sim.free[WARM] == 0:
            return
        if sim.is_movable(block_id) and sim.tier(block_id) == HOT:
            sim.move(block_id, HOT, WARM)


def idle_outlook(index: IndexView, capacities: list[int], log, idle_steps: int) -> tuple[int | None, bool]:
    """After a background plan: (the earliest store step at which one more hot block may turn idle,
    or None when idle demotion is off; whether some hot block is idle already (one the plan could
    not move: pinned, or no room in warm)). Blocks that arrive in hot later turn idle no sooner
    than `idle_steps` from now, so the step is capped there."""
    if idle_steps == 0 or capacities[WARM] == 0:
        return None, False
    if index.count_in(HOT) == 0:
        return log.now + idle_steps, False
    ids = np.fromiter(index.recency(HOT), dtype=np.int64, count=index.count_in(HOT))
    last = np.maximum(log.last_read_step(ids), np.asarray(index.arrival_steps(ids), dtype=np.int64))
    turns_idle = np.floor(last + idle_steps * (1.0 + log.cost_sensitivity(ids))).astype(np.int64) + 1
    idle_now = turns_idle <= log.now
    later = turns_idle[~idle_now]
    next_step = min(int(later.min()) if len(later) else log.now + idle_steps, log.now + idle_steps)
    return next_step, bool(idle_now.any())


def promote_by_locality(sim: Simulation, index: IndexView, capacities: list[int], watermarks: Watermarks,
                        max_moves: int, locality: Locality) -> None:
    """Warm and cold blocks read in the last tenth of the ALI window (a working set that spilled)
    whose locality names a higher tier come up while that tier stays under its low watermark (most
    valuable first; the room between the low and high marks stays free for new turns' blocks)."""
    candidates = [b for tier in (WARM, COLD) for b in index.recency(tier)]
    if not candidates:
        return
    # only blocks read lately from where they are (a working set that spilled): a chat idle
    # between turns comes up by prefetch or at its turn, not by speculation
    log = locality.log
    recent = log.last_read_step(candidates) >= log.now - max(1, log.window_steps // 10)
    candidates = [b for b, keep in zip(candidates, recent.tolist()) if keep]
    if not candidates:
        return
    scores = locality.scores(candidates)
    targets = locality.target_tiers(candidates)
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
