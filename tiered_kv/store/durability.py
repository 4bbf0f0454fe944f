"""The store's side of the durable cold tier: durable records in at start, published blocks out at close.

Mixed into TierStore. At bind, the records an earlier process left durable in the cold tier become
cached published blocks (attach() finds them by key); when the store closes, its published blocks
move down to cold, most recent first as room allows, and it waits until they are durable.
"""

from __future__ import annotations

import logging
import sys

from ..hw.block_io import ColdWriteError
from ..logs import error_name
from ..pool import SlotPool
from ..scheduler import COLD, HOT, WARM

log = logging.getLogger(__name__)


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
        if duplicates:  # nothing is lost: the first record of each key serves it
            log.info("cold tier %s: dropped %d duplicate durable record(s) (a second record of one key, left by a "
                     "crash mid-move)", cold.file_path, len(duplicates))

    def _persist_before_close(self) -> None:
        """A store that closes moves its published blocks down to the cold tier as room allows,
        most recently used first, and waits until they are durable: the next process picks the
        conversations up from there."""
        if not self.is_bound or self.tiers[COLD] is None or sys.is_finalizing():
            return  # (at finalization no writer thread runs any more: the atexit hook came first)
        cold = self.tiers[COLD]
        upper = [b for tier in (HOT, WARM) for b in reversed(self.index.blocks_in(tier))
                 if self.index.get(b).key is not None]
        try:
            if upper:
                self.demote(upper, COLD)
        except Exception as error:  # closing goes on: what is durable stays durable
            left = sum(1 for b in upper if b in self.index and self.index.get(b).tier in (HOT, WARM))
            self.metrics.dropped_blocks.inc(("close_write_failed",), left)
            log.warning("closing: moving published blocks to the cold tier %s failed (%s: %s); the ones not moved "
                        "are lost when this store closes, a later process recomputes them", cold.file_path,
                        error_name(error), getattr(error, "strerror", None) or error)
        else:
            left = sum(1 for b in upper if b in self.index and self.index.get(b).tier in (HOT, WARM))
            if left:
                self.metrics.dropped_blocks.inc(("close_no_room",), left)
                log.warning("closing: %d of %d published block(s) did not fit in the cold tier %s (no slot left "
                            "that could be freed); they are lost when this store closes, a later process recomputes "
                            "them", left, len(upper), cold.file_path)
        try:
            cold.flush()
        except ColdWriteError as error:  # the writer thread warned about each failure when it happened
            log.debug("closing: some records did not become durable: %s", error)
        except Exception as error:
            log.warning("closing: waiting for the cold tier %s to make records durable failed (%s: %s)",
                        cold.file_path, error_name(error), error)
