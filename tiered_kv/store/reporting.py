"""Reporting: what a store tells about itself — `stats()`, the cheap counters a trace reads at every
step, the scratch buffers `diagnose` measures.

Every move, hit and byte figure is read from the store's `Metrics` (tiered_kv/metrics/), the one
bookkeeping of them; tier use from the slot pools. Callers of `stats()` and `counters()` need not
hold the store lock: these take it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..blocks import COLD, HOT, TIER_NAMES, WARM, KVLayout, tier_counts
from ..config import Config
from ..metrics.registry import BACKGROUND, ON_DEMAND, Metrics
from ..remote import RemoteTier
from ..scheduler.access_log import AccessLog
from ..scheduler.restore import Rates
from .compaction import HotCompaction
from .consistency import check_consistent
from .life import StoreLife
from .lock import StoreLock
from .mover import Mover
from .state import StoreState


def count_turn_start(metrics, tiers) -> None:
    """A turn began needing blocks found in `tiers` (an int array): the per-tier hit-rate figures."""
    for tier, count in tier_counts([(tiers, None)]).items():
        metrics.turn_blocks.inc((TIER_NAMES[tier],), count)


class Counters(NamedTuple):
    """A snapshot of a store's cheap counters (tiered_kv/trace reads one per step)."""

    used_blocks: tuple[int, ...]  # per tier, in TIER_NAMES order
    capacity_blocks: tuple[int, ...]
    bytes_moved: dict[str, int]  # cumulative, per direction ("hot->warm": bytes)
    num_moves: dict[str, int]  # cumulative promotions, demotions, evictions (blocks)
    bytes_background: int  # cumulative bytes the background mover moved
    turn_blocks_by_tier: dict[str, int]  # blocks turns began needing, by the tier they were found in
    turn_blocks: int


class Reporting:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, metrics: Metrics, config: Config,
                 compaction: HotCompaction, access_log: AccessLog, rates: Rates, link_monitor, copy_engine,
                 remote: RemoteTier | None, device: torch.device, pinned: bool):
        self.lock, self.life, self.state, self.metrics, self.config = lock, life, state, metrics, config
        self.compaction, self.access_log, self.rates = compaction, access_log, rates
        self.link_monitor, self.copy_engine, self.remote = link_monitor, copy_engine, remote
        self.device, self.pinned = device, pinned  # where hot and warm live
        # what binding makes (bind): each tier's layout, why cold is off, the staging sets, the mover
        self.stored_layouts: list[KVLayout] = []
        self.cold_unavailable: str | None = None
        self.staging: dict = {}
        self.mover: Mover | None = None

    def bind(self, stored_layouts: list[KVLayout], cold_unavailable: str | None, staging: dict,
             mover: Mover | None) -> None:
        self.stored_layouts, self.cold_unavailable, self.staging, self.mover = \
            stored_layouts, cold_unavailable, staging, mover

    # ---- counters, read from the metrics --------------------------------------------------------
    @property
    def hits(self) -> dict[str, int]:
        """Blocks found by banks' steps, by the tier each was in."""
        return {name: int(self.metrics.hits.value((name,))) for name in TIER_NAMES}

    @property
    def misses(self) -> int:
        return int(self.metrics.misses.value())

    @property
    def turn_blocks_by_tier(self) -> dict[str, int]:
        """Blocks turns needed, by the tier each was in when its turn began."""
        return {name: int(self.metrics.turn_blocks.value((name,))) for name in TIER_NAMES}

    @property
    def turn_blocks(self) -> int:
        return int(self.metrics.turn_blocks.total())

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved per direction ("hot->warm": n), on demand and background together."""
        out = {f"{a}->{b}": 0 for a in TIER_NAMES for b in TIER_NAMES if a != b}
        for (src, dst, _), num_bytes in self.metrics.bytes_moved.snapshot_values():
            out[f"{src}->{dst}"] += int(num_bytes)
        return out

    def bytes_in_mode(self, mode: str) -> int:
        return int(sum(n for (_, _, m), n in self.metrics.bytes_moved.snapshot_values() if m == mode))

    @property
    def num_moves(self) -> dict[str, int]:
        m = self.metrics
        return {"promotions": int(m.promotions.value()), "demotions": int(m.demotions.value()),
                "evictions": int(m.evictions.value())}

    @property
    def move_seconds(self) -> dict[str, float]:
        seconds = self.metrics.move_seconds
        return {"demote": seconds.value(("demote",)), "promote": seconds.value(("promote",))}

    def counters(self) -> Counters:
        """The cheap counters (pools and running totals; never the whole stats())."""
        with self.lock:
            pools = self.state.pools
            return Counters(
                used_blocks=tuple(self._used_blocks(t) for t in range(len(pools))) or (0,) * len(TIER_NAMES),
                capacity_blocks=tuple(pool.num_slots for pool in pools) or (0,) * len(TIER_NAMES),
                bytes_moved=self.bytes_moved, num_moves=self.num_moves,
                bytes_background=self.bytes_in_mode(BACKGROUND),
                turn_blocks_by_tier=self.turn_blocks_by_tier, turn_blocks=self.turn_blocks)

    def _used_blocks(self, tier: int) -> int:
        """Slots that hold blocks (or are reserved), not counting cold slots holding only durable copies."""
        state = self.state
        used = state.pools[tier].num_used
        return used - len(state.copies) if tier == COLD and state.copies else used

    def contiguity(self, tables: list[list[int]]) -> float:
        """One chat's contiguity (compaction.py): 1.0 when it has no hot block."""
        with self.lock:
            if not self.life.bound or self.life.closed:
                return 1.0
            return self.compaction.contiguity(tables)

    def check_consistency(self) -> list[str]:
        """What is wrong between the index, the pools, pins and transfers ([] when nothing is): every
        used slot belongs to one block, a reservation of a move in flight, a quarantined corrupt
        block or a deferred free (consistency.py). Tests call it after every fault."""
        with self.lock:
            if not self.life.bound or self.life.closed:
                return []
            self.state.drain()
            return check_consistent(self.state)

    # ---- stats() -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        state, config = self.state, self.config
        with self.lock:
            bound = self.life.bound and not self.life.closed
            if bound:
                state.drain()
            tiers = {}
            for t, name in enumerate(TIER_NAMES):
                device = str(self.device) if t == HOT else ("cpu (pinned)" if self.pinned else "cpu") if t == WARM \
                    else "file"
                if not bound:
                    tiers[name] = {"used_blocks": 0, "capacity_blocks": 0, "used_bytes": 0, "capacity_bytes": 0,
                                   "device": device, "block_bytes": 0, "compression": "none"}
                    continue
                pool = state.pools[t]
                if t == COLD:
                    cold = state.tiers[COLD]
                    device = getattr(cold, "file_path", None) or (
                        f"unavailable: {self.cold_unavailable}" if self.cold_unavailable else "disabled")
                used = self._used_blocks(t)
                stored = state.tiers[t].layout if state.tiers[t] is not None else \
                    self.stored_layouts[t]  # cold off: as configured
                block_bytes = stored.block_bytes  # as the tier stores a block: fewer bytes when compressed
                tiers[name] = {"used_blocks": used, "capacity_blocks": pool.num_slots, "used_bytes": used * block_bytes,
                               "capacity_bytes": pool.num_slots * block_bytes, "device": device,
                               "block_bytes": block_bytes, "compression": stored.compression}
                if t == COLD:  # slots holding durable copies of blocks above (counted free: they go first)
                    tiers[name]["copies_blocks"] = len(state.copies or ())
            block_size = {"tokens": config.block_size, "auto": config.block_size_is_auto}
            out = {"tiers": tiers, "block_size": block_size, "hits": self.hits, "misses": self.misses,
                   "bytes_moved": self.bytes_moved, "link_saturation": self.link_monitor.saturation()}
            out.update(self._scheduler_stats())
            out.update(self.compaction.layout_stats() if bound else
                       {"fragmentation": 0.0, "contiguity": 1.0, "contiguity_min": 1.0})
            out["copies"] = {"engine": self.copy_engine.name, "in_flight_blocks": len(state.in_flight),
                             "deferred_frees": state.num_deferred_frees,
                             "failed_moves": int(self.metrics.failed_moves.total())}
            out["durability"] = self._durability_stats()
            out["restore"] = {"mode": config.scheduler.restore,  # load or recompute (scheduler/restore.py)
                              "restored_tokens": int(self.metrics.restore_choice.value(("restored",))),
                              "recomputed_tokens": int(self.metrics.restore_choice.value(("recomputed",))),
                              "not_fetched_tokens": int(self.metrics.restore_choice.value(("not_fetched",))),
                              **self.rates.snapshot()}
            out["metrics"] = self.metrics.snapshot()  # every counter and histogram (tiered_kv/metrics/)
            # the shared remote tier: hits, misses, bytes in and out, errors, latency (None: off)
            out["remote"] = self.remote.stats() if self.remote is not None else None
            return out

    def _durability_stats(self) -> dict:
        """Durable copies in cold of blocks above it, what writing them cost, the drive's wear."""
        m, cold = self.metrics, self.config.cold
        copies = self.state.copies
        computed = m.tokens_computed.total()
        written = int(m.cold_bytes_written.value())
        return {"write_behind_s": cold.write_behind_s, "admit": cold.admit,
                "copies_blocks": len(copies) if copies is not None else 0,
                "pending_blocks": len(copies.pending) if copies is not None else 0,
                "copies_written": int(m.copies_written.value()), "adopted_copies": int(m.adopted_copies.value()),
                "write_failures": int(m.copies_failed.total() + m.write_errors.total()),
                "cold_bytes_written": written,
                "cold_bytes_per_token": written / computed if computed else 0.0,
                "peer_hits": int(m.peer_hits.value())}

    def _scheduler_stats(self) -> dict:
        """Hit rates per tier, moves by direction, background vs on-demand bytes, critical-path
        seconds, and the scheduler's current view (ALI of the live chats, BS, CS)."""
        turn_blocks, by_tier = self.turn_blocks, self.turn_blocks_by_tier
        move_s = self.move_seconds
        mover, log, settings = self.mover, self.access_log, self.config.scheduler
        return {
            "hit_rate": {name: (by_tier[name] / turn_blocks if turn_blocks else None) for name in TIER_NAMES},
            "turn_blocks": turn_blocks,
            "moves": self.num_moves,
            "bytes_on_demand": self.bytes_in_mode(ON_DEMAND),
            "bytes_background": self.bytes_in_mode(BACKGROUND),
            "critical_path": {"move_s": move_s["demote"] + move_s["promote"], "demote_s": move_s["demote"],
                              "promote_s": move_s["promote"]},
            "scheduler": {
                "policy": settings.policy,
                "store_steps": log.now,
                "ali_window_steps": log.window_steps,
                "chats": {owner: {"ali": log.chat_ali(owner), "cost_sensitivity": chat.cost_sensitivity,
                                  "last_step": chat.last_step} for owner, chat in log.chats.items()},
                "link_saturation": self.link_monitor.saturation(),
                "link_monitor": self.link_monitor.name,
                "bs_threshold": settings.bs_threshold,
                "background": mover is not None,
                "background_batches": mover.num_batches if mover is not None else 0,
                "background_cancelled": mover.num_cancelled if mover is not None else 0,
            },
        }

    def scratch_buffers(self) -> dict:
        """The store's preallocated copy buffers beside the tier slabs (None: not allocated):
        staging_host (on-demand moves into and out of cold), staging_device (on-demand hot<->warm
        batches, CUDA), mover_staging_host and mover_staging_device (the background mover's)."""
        with self.lock:
            on_demand, background = self.staging.get(ON_DEMAND), self.staging.get(BACKGROUND)
            if self.mover is None:
                background = None
            return {
                "staging_host": on_demand.host if on_demand is not None else None,
                "staging_device": on_demand.copier.staging if on_demand is not None else None,
                "mover_staging_host": background.host if background is not None else None,
                "mover_staging_device": background.copier.staging if background is not None else None,
            }
