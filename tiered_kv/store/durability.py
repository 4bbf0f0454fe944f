"""The store's side of the durable cold tier: durable records in at start, write-behind of what is
published, published blocks out at close.

At bind, the records an earlier process left durable in the cold tier become cached published
blocks (attach() finds them by key). A block published in cold is persisted at once; one published
above cold waits for its durable copy (durable_copies.py, written behind by the mover, or now by
`flush`). When the store closes, its published blocks move down to cold, most recent first as room
allows (through the transfers, like every move; a block with a copy just takes its slot), and it
waits until they are durable.
"""

from __future__ import annotations

import logging
import sys
import time

from ..blocks import COLD, HOT, WARM
from ..hw.block_io import ColdWriteError
from ..logs import error_name
from ..metrics.registry import ON_DEMAND
from ..pool import SlotPool
from . import write_behind
from .copies import BACKUP

log = logging.getLogger(__name__)


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


def published(store, items: list[tuple[int, bytes, bytes | None]], local: bool) -> None:
    """Blocks just published (store lock held): durable now when in cold, due for a durable copy
    when above it, queued for the remote writer."""
    state, above = store.state, []
    for block_id, key, root in items:
        state.persist_if_published(block_id)
        if root is not None and state.index.get(block_id).tier in (HOT, WARM):
            above.append(block_id)
        if store.remote is not None and root is not None and local:
            store.remote.enqueue(block_id, key, root)  # written behind, by the remote writer
    if above and state.copies is not None and store.config.cold.write_behind_s:
        state.copies.published(above, local, time.monotonic())


def flush(store, timeout_s: float) -> bool:
    """Every block due for a durable copy gets it now, and every record is durable (or known not to
    be: False, as when `timeout_s` passed). Called without the lock."""
    if not store.is_bound or store.state.copies is None:
        return True
    state, deadline, complete = store.state, time.monotonic() + timeout_s, True
    while time.monotonic() < deadline:
        version = store.change_version
        with store.lock:
            if store.is_closed:
                return False
            state.drain()
            due = state.copies.due(time.monotonic(), 1.0, len(state.copies.pending), force=True)
            batch, no_room = write_behind.prepare_backups(store.transfers, due, ON_DEMAND) if due else (None, 0)
            busy = any(g.kind == BACKUP for g in state.in_flight.groups())
        if no_room:
            complete = False  # cold is full of blocks of its own: those copies wait for room
        if batch is not None and batch.groups:
            store.demand.run_batch(batch)
        elif no_room and not busy:
            break
        elif busy or due:  # copies (or moves of blocks due) still in flight
            store.wait_for_change(version, min(0.05, deadline - time.monotonic()))
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


def persist_before_close(store) -> None:
    """Move `store`'s published blocks down to its cold tier as room allows, most recently used
    first, and wait until they are durable: the next process picks the conversations up from
    there. Called by close() without the lock, before the store is marked closed."""
    if not store.is_bound or store.state.tiers[COLD] is None or sys.is_finalizing():
        return  # (at finalization no writer thread runs any more: the atexit hook came first)
    state, metrics = store.state, store.metrics
    cold = state.tiers[COLD]
    with store.lock:
        upper = [b for tier in (HOT, WARM) for b in reversed(state.index.blocks_in(tier))
                 if state.index.get(b).key is not None]

    def left() -> int:
        with store.lock:
            return sum(1 for b in upper if b in state.index and state.index.get(b).tier in (HOT, WARM))

    if upper:
        def make_plan(result):
            wanted = [b for b in upper if b not in result.failed_blocks and b in state.index]
            return store.scheduler.plan_demotion(wanted, COLD, state.index, state.free_slots(), state.capacities,
                                                 state.is_pinned)

        result = store.demand.carry_out(make_plan, state.is_pinned, quiet=True)  # reported once, below
        remaining = left()
        if result.errors and remaining:
            error = result.errors[-1]
            metrics.dropped_blocks.inc(("close_write_failed",), remaining)
            log.warning("closing: moving published blocks to the cold tier %s failed (%s: %s); the ones not moved "
                        "are lost when this store closes, a later process recomputes them", cold.file_path,
                        error_name(error), getattr(error, "strerror", None) or error)
        elif remaining:
            metrics.dropped_blocks.inc(("close_no_room",), remaining)
            log.warning("closing: %d of %d published block(s) did not fit in the cold tier %s (no slot left "
                        "that could be freed); they are lost when this store closes, a later process recomputes "
                        "them", remaining, len(upper), cold.file_path)
    try:
        cold.flush()
    except ColdWriteError as error:  # the writer thread warned about each failure when it happened
        log.debug("closing: some records did not become durable: %s", error)
    except Exception as error:
        log.warning("closing: waiting for the cold tier %s to make records durable failed (%s: %s)",
                    cold.file_path, error_name(error), error)
