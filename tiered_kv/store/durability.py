"""The store's side of the durable cold tier: durable records in at start, published blocks out at close.

Mixed into TierStore. At bind, the records an earlier process left durable in the cold tier become
cached published blocks (attach() finds them by key); when the store closes, its published blocks
move down to cold, most recent first as room allows, and it waits until they are durable.
"""

from __future__ import annotations

import logging
import sys

from ..pool import SlotPool
from ..scheduler import COLD, HOT, WARM

log = logging.getLogger("tiered_kv")


class Durability:
    def _import_durable_records(self, cold, pool: SlotPool) -> None:
        """Blocks an earlier process left durable in the cold tier come back as cached published
        blocks (unreferenced, least recently used first): attach() finds them by key."""
        duplicates = []
        for slot, key, root in cold.durable_records():
            pool.take([slot])
            block_id = self.index.add(COLD, slot)
            self.index.decref(block_id)
            if not self.index.publish(block_id, key, root):
                duplicates.append(block_id)  # a second record of one key (a crash mid-move): drop it
        for block_id in duplicates:
            entry = self.index.remove(block_id)
            pool.free([entry.slot])
            cold.forget([entry.slot])

    def _persist_before_close(self) -> None:
        """A store that closes moves its published blocks down to the cold tier as room allows,
        most recently used first, and waits until they are durable: the next process picks the
        conversations up from there."""
        if not self.is_bound or self.tiers[COLD] is None or sys.is_finalizing():
            return  # (at finalization no writer thread runs any more: the atexit hook came first)
        upper = [b for tier in (HOT, WARM) for b in reversed(self.index.blocks_in(tier))
                 if self.index.get(b).key is not None]
        try:
            if upper:
                self.demote(upper, COLD)
            self.tiers[COLD].flush()
        except Exception as error:  # closing goes on: what is durable stays durable
            log.warning("tiered_kv: could not persist every published block before closing: %s", error)
