"""What a store reports: tier use, hits, misses, bytes moved, link saturation (stats()).

Mixed into TierStore; read under the store lock.
"""

from __future__ import annotations

from ..scheduler import COLD, HOT, TIER_NAMES, WARM


class Reporting:
    # ---- counters, read back from the store's metrics (tiered_kv/metrics/registry.py) ----------
    @property
    def hits(self) -> dict[str, int]:
        """Blocks found by banks' steps, by the tier each was in."""
        return {name: int(self.metrics.hits.value((name,))) for name in TIER_NAMES}

    @property
    def misses(self) -> int:
        return int(self.metrics.misses.value())

    @property
    def turn_hits(self) -> dict[str, int]:
        """Blocks turns needed, by the tier each was in when its turn began."""
        return {name: int(self.metrics.turn_blocks.value((name,))) for name in TIER_NAMES}

    @property
    def turn_blocks(self) -> int:
        return int(self.metrics.turn_blocks.total())

    @property
    def bytes_moved(self) -> dict:
        if self._executor is None:
            return {f"{a}->{b}": 0 for a in TIER_NAMES for b in TIER_NAMES if a != b}
        return self._executor.bytes_moved

    def stats(self) -> dict:
        with self.lock:
            self.drain_deferred()
            tiers = {}
            for t, name in enumerate(TIER_NAMES):
                device = str(self.device) if t == HOT else ("cpu (pinned)" if self.pinned else "cpu") if t == WARM \
                    else "file"
                if not self.is_bound or self._closed:
                    tiers[name] = {"used_blocks": 0, "capacity_blocks": 0, "used_bytes": 0, "capacity_bytes": 0,
                                   "device": device}
                    continue
                pool = self.pools[t]
                if t == COLD:
                    device = getattr(self.tiers[COLD], "file_path", None) or (
                        f"unavailable: {self.cold_unavailable}" if self.cold_unavailable else "disabled")
                tiers[name] = {"used_blocks": pool.num_used, "capacity_blocks": pool.num_slots,
                               "used_bytes": pool.num_used * self.layout.block_bytes,
                               "capacity_bytes": pool.num_slots * self.layout.block_bytes, "device": device}
            # the block size in use, and whether `block_size: auto` chose it
            block_size = {"tokens": self.config.block_size, "auto": self.config.block_size_is_auto}
            out = {"tiers": tiers, "block_size": block_size, "hits": dict(self.hits), "misses": self.misses,
                   "bytes_moved": dict(self.bytes_moved), "link_saturation": self.link_monitor.saturation()}
            out.update(self._scheduler_stats())
            out.update(self.layout_stats())  # fragmentation, contiguity, contiguity_min (layout.py)
            out["metrics"] = self.metrics.snapshot()  # every counter and histogram (tiered_kv/metrics/)
            # the shared remote tier: hits, misses, bytes in and out, errors, latency (None: off)
            out["remote"] = self.remote.stats() if self.remote is not None else None
            return out

    def scratch_buffers(self) -> dict:
        """The store's preallocated copy buffers beside the tier slabs (None: not allocated):
        staging_host (moves into and out of cold), staging_device (hot<->warm batches, CUDA),
        mover_staging_host and mover_staging_device (the background mover's own)."""
        with self.lock:
            executor, mover = self._executor, self._mover
            return {
                "staging_host": executor.staging if executor is not None else None,
                "staging_device": executor.block_copier.staging if executor is not None else None,
                "mover_staging_host": mover.staging if mover is not None else None,
                "mover_staging_device": mover.block_copier.staging if mover is not None else None,
            }

    def _scheduler_stats(self) -> dict:
        """Hit rates per tier, moves by direction, background vs on-demand bytes, critical-path
        seconds, and the scheduler's current view (ALI of the live chats, BS, CS)."""
        turn_blocks, turn_hits = self.turn_blocks, self.turn_hits
        executor = self._executor
        moves = dict(executor.num_moves) if executor is not None else {"promotions": 0, "demotions": 0, "evictions": 0}
        move_s = dict(executor.move_s) if executor is not None else {"demote": 0.0, "promote": 0.0}
        mover = self._mover
        log = self.access_log
        return {
            "hit_rate": {name: (turn_hits[name] / turn_blocks if turn_blocks else None) for name in TIER_NAMES},
            "turn_blocks": turn_blocks,
            "moves": moves,
            "bytes_on_demand": executor.bytes_on_demand if executor is not None else 0,
            "bytes_background": executor.bytes_background if executor is not None else 0,
            "critical_path": {"move_s": move_s["demote"] + move_s["promote"], "demote_s": move_s["demote"],
                              "promote_s": move_s["promote"]},
            "scheduler": {
                "policy": self.scheduler.policy,
                "store_steps": log.now,
                "ali_window_steps": log.window_steps,
                "chats": {owner: {"ali": log.chat_ali(owner), "cost_sensitivity": chat.cost_sensitivity,
                                  "last_step": chat.last_step} for owner, chat in log.chats.items()},
                "link_saturation": self.link_monitor.saturation(),
                "link_monitor": self.link_monitor.name,
                "bs_threshold": self.config.scheduler.bs_threshold,
                "background": mover is not None,
                "background_batches": mover.num_batches if mover is not None else 0,
                "background_cancelled": mover.num_cancelled if mover is not None else 0,
            },
        }
