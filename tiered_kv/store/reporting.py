"""What a store reports: tier use, hits, misses, bytes moved, link saturation (stats()).

Mixed into TierStore; read under the store lock.
"""

from __future__ import annotations

from ..scheduler import COLD, HOT, TIER_NAMES, WARM


class Reporting:
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
            return {"tiers": tiers, "hits": dict(self.hits), "misses": self.misses,
                    "bytes_moved": dict(self.bytes_moved), "link_saturation": self.link_monitor.saturation()}
