"""The store's side of the durable cold tier: durable records in at start, every due copy now
(`flush`), published blocks out at close.

At bind, the records an earlier process left durable in the cold tier become cached published
blocks (attach() finds them by key). A block published in cold is persisted at once; one published
above cold waits for its durable copy (catalog.py; durable_copies.py, written behind by the
mover, or now by `flush`). When the store closes, its published blocks move down to cold, most
recent first as room allows (through the transfers, like every move; a block with a copy just
takes its slot), and it waits until they are durable.
"""

from __future__ import annotations

import logging
import sys
import time

from ..blocks import COLD, HOT, WARM
from ..hw.block_io import ColdWriteError
from ..logs import error_name
from ..metrics.registry import ON_DEMAND, Metrics
from ..pool import SlotPool
from ..scheduler import MemScheduler
from . import write_behind
from .copies import BACKUP
from .demand import DemandMoves
from .durable_copies import DurableCopies
from .life import StoreLife
from .lock import StoreLock
from .state import StoreState
from .transfers import Transfers

log = logging.getLogger(__name__)


def bind_cold(index, cold, pool: SlotPool, metrics: Metrics, admit: str) -> DurableCopies | None:
    """At bind, with a cold tier: its durable records in (`import_durable_records`), its durable
    writer timing its writes and counting failures into `metrics`, and the bookkeeping of the durable
    copies of blocks above it (cold.admit says which get one). None without a cold tier."""
    if cold is None:
        return None
    import_durable_records(index, cold, pool)
    cold.metrics = metrics
    return DurableCopies(admit)


def import_durable_records(index, cold, pool: SlotPool) -> None:
    """Blocks an earlier process left durable in `cold` come back as cached published blocks of
    `index` (unreferenced, least recently used first): attach() finds them by key."""
    duplicates = []
    for slot, key, root in cold.durable_records():
        pool.take([slot])
        block_id = index.add(COLD, slot)
        index.decref(block_id)
        if not index.publish(block_id, key, root):
            duplicates.append(block_id)  # a second record of one key (a crash mid-move): drop it
    for block_id in duplicates:
        entry = index.remove(block_id)
        pool.free([entry.slot])
        cold.forget([entry.slot])
    if duplicates:  # nothing is lost: the first record of each key serves it
        log.info("cold tier %s: dropped %d duplicate durable record(s) (a second record of one key, left by a "
                 "crash mid-move)", cold.file_path, len(duplicates))


class Durability:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, scheduler: MemScheduler,
                 transfers: Transfers, demand: DemandMoves, metrics: Metrics):
        self.lock, self.life, self.state = lock, life, state
        self.scheduler, self.transfers, self.demand, self.metrics = scheduler, transfers, demand, metrics

    def flush(self, timeout_s: float) -> bool:
        """Every block due for a durable copy gets it now, and every record is durable (or known not
        to be: False, as when `timeout_s` passed). Called without the lock."""
        state = self.state
        if state.copies is None:
            return True
        deadline, complete = time.monotonic() + timeout_s, True
        while time.monotonic() < deadline:
            version = state.changes.version
            with self.lock:
                if self.life.closed:
                    return False
                state.drain()
                due = state.copies.due(time.monotonic(), 1.0, len(state.copies.pending), force=True)
                batch, no_room = write_behind.prepare_backups(self.transfers, due, ON_DEMAND) if due else (None, 0)
                busy = any(g.kind == BACKUP for g in state.in_flight.groups())
            if no_room:
                complete = False  # cold is full of blocks of its own: those copies wait for room
            if batch is not None and batch.groups:
                self.demand.run_batch(batch)
            elif no_room and not busy:
                break
            elif busy or due:  # copies (or moves of blocks due) still in flight
                state.changes.wait(version, min(0.05, deadline - time.monotonic()))
            else:
                break
        cold = state.tiers[COLD]
        try:
            if cold is None:  # closed meanwhile
                return False
            cold.flush()
        except (ColdWriteError, ValueError):
            return False
        return complete and time.monotonic() < deadline

    def persist_before_close(self) -> None:
        """Move the published blocks down to the cold tier as room allows, most recently used first,
        and wait until they are durable: the next process picks the conversations up from there.
        Called by close() without the lock, before the store is marked closed."""
        state, metrics = self.state, self.metrics
        cold = state.tiers[COLD]
        if cold is None or sys.is_finalizing():
            return  # (at finalization no writer thread runs any more: the atexit hook came first)
        with self.lock:
            upper = [b for tier in (HOT, WARM) for b in reversed(state.index.blocks_in(tier))
                     if state.index.get(b).key is not None]
        if upper:
            def make_plan(result):
                wanted = [b for b in upper if b not in result.failed_blocks and b in state.index]
                return self.scheduler.plan_demotion(wanted, COLD, state.index, state.free_slots(), state.capacities,
                                                    state.is_pinned)

            result = self.demand.carry_out(make_plan, state.is_pinned, quiet=True)  # reported once, below
            with self.lock:
                remaining = sum(1 for b in upper if b in state.index and state.index.get(b).tier in (HOT, WARM))
            if result.errors and remaining:
                error = result.errors[-1]
                metrics.dropped_blocks.inc(("close_write_failed",), remaining)
                log.warning("closing: moving published blocks to the cold tier %s failed (%s: %s); the ones not "
                            "moved are lost when this store closes, a later process recomputes them", cold.file_path,
                            error_name(error), getattr(error, "strerror", None) or error)
            elif remaining:
                metrics.dropped_blocks.inc(("close_no_room",), remaining)
                log.warning("closing: %d of %d published block(s) did not fit in the cold tier %s (no slot left "
                            "that could be freed); they are lost when this store closes, a later process "
                            "recomputes them", remaining, len(upper), cold.file_path)
        try:
            cold.flush()
        except ColdWriteError as error:  # the writer thread warned about each failure when it happened
            log.debug("closing: some records did not become durable: %s", error)
        except Exception as error:
            log.warning("closing: waiting for the cold tier %s to make records durable failed (%s: %s)",
                        cold.file_path, error_name(error), error)
