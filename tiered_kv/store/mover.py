"""Mover: the store's background thread that moves blocks off the critical path.

It carries out, in small batches, (1) prefetch requests (`bank.prefetch()` returns at once and
the mover brings that chat's blocks up), (2) the scheduler's optional plans (`plan_background`:
watermark and idle demotion, promotion by ALI), only while link saturation is below
`scheduler.bs_threshold`, and (3) compaction of the hot pool (`TierStore.plan_compaction`).

A batch holds the store lock only to plan and reserve (destination slots allocated, blocks
marked in flight so no plan touches them) and to commit (index updated, source slots freed).
The bytes are copied with the lock released, on the mover's own staging buffers (host, for
cold; on a CUDA store also a device one of BATCH_BYTES for batched hot<->warm copies, see
hw/block_copy.py) and copy engine (its own CUDA stream on GPU), so a forward pass that reads
other blocks never waits for a background copy. A step that starts using a block in flight cancels that move (`cancel`):
the commit then keeps the block where the step mapped it and gives the reserved slot back.
A demand promotion that needs blocks in flight waits for their batch to land (`wait_for`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import CorruptBlockError
from ..hw.block_copy import BlockCopier, device_staging
from ..hw.block_io import ColdWriteError
from ..hw.copy_engine import make_copy_engine
from ..logs import Throttle, error_name
from ..scheduler import COLD, DROPPED, HOT, TIER_NAMES, Plan

log = logging.getLogger(__name__)

BATCH_BYTES = 16 * 2**20  # data moved per batch (bounds how long a commit waits for copies)
COLD_BACKOFF_FIRST_S = 0.5  # after a failed write into cold, background moves into cold wait this long,
COLD_BACKOFF_MAX_S = 30.0  # doubling up to this while they keep failing
WAIT_FOR_LANDING_S = 30.0


@dataclass
class Flight:
    block_id: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    cancelled: bool = False
    failed: bool = False  # the copy did not complete (an I/O error): the block stays at its source
    corrupt: bool = False  # the source failed its checksum on the way


class Mover:
    def __init__(self, store, interval_s: float):
        self._store_ref = weakref.ref(store)  # the thread must not keep a dropped store alive
        self.interval_s = interval_s
        layout = store.layout
        self.batch_blocks = max(1, BATCH_BYTES // layout.block_bytes)
        self.copy_engine = make_copy_engine(store.device)
        self.staging = torch.empty((min(self.batch_blocks, max(store.capacities)) or 1, *layout.record_shape()),
                                   dtype=store.dtype, pin_memory=store.pinned)
        self.block_copier = BlockCopier(self.copy_engine, device_staging(
            "hot.capacity", BATCH_BYTES, layout, store.capacities[HOT], store.device, store.dtype))
        self.in_flight: dict[int, Flight] = {}
        self._requests: OrderedDict[int, list[int]] = OrderedDict()  # owner -> blocks, most wanted first
        self._expected: dict[int, frozenset[int]] = {}  # owner -> blocks prefetched for its coming turn
        self._landed = threading.Condition(store.lock)
        self._wake = threading.Event()
        self._stop = False
        settings = store.config.scheduler
        # ALI and idleness change with steps: replan an empty background plan every few of them
        self._recheck_steps = max(1, min(settings.ali_window, settings.idle_steps or settings.ali_window) // 8)
        self._quiet_since: tuple[int, tuple[int, ...]] | None = None
        self.num_batches = 0
        self.num_cancelled = 0
        self.bytes_moved = 0
        self._write_warnings = Throttle(log)  # a full disk fails every batch: warn now and then
        # after a failed write into cold (a full disk), background moves into cold wait this long,
        # doubling while they keep failing: the mover must not replan them every interval
        self._cold_retry_at = 0.0
        self._cold_backoff_s = COLD_BACKOFF_FIRST_S
        self._cold_retry_pending = False
        self._thread = threading.Thread(target=self._run, name="tiered_kv-mover", daemon=True)
        self._thread.start()

    @property
    def store(self):
        return self._store_ref()

    # ---- requests (store lock held by the caller) -----------------------------------------------
    def request_prefetch(self, owner: int, block_ids: list[int]) -> None:
        self._requests[owner] = list(block_ids)
        self._requests.move_to_end(owner)
        # until its next step, the chat is about to be read: no optional move takes its blocks
        # down again (its ALI or read count may be low: it has been idle)
        self._expected[owner] = frozenset(block_ids)
        self._wake.set()

    def drop_requests(self, owner: int) -> None:
        self._requests.pop(owner, None)
        self._expected.pop(owner, None)

    def step_started(self, owner: int) -> None:
        """The chat's turn began: its prefetch, done or not, is over."""
        if self._expected:
            self.drop_requests(owner)

    def _pinned_or_expected(self, except_owner: int | None = None):
        """A predicate for plans: pinned, in flight, or prefetched for another chat's coming turn."""
        store = self.store
        expected = [blocks for owner, blocks in self._expected.items() if owner != except_owner]
        if not expected:
            return store.is_pinned
        return lambda block_id: store.is_pinned(block_id) or any(block_id in blocks for blocks in expected)

    def cancel(self, block_ids) -> None:
        """A step is about to read or write these blocks where they are now."""
        if self.in_flight:
            for block_id, flight in self.in_flight.items():
                if block_id in block_ids:
                    flight.cancelled = True
                    self.num_cancelled += 1

    def wait_for(self, block_ids) -> None:
        """Block (releasing the store lock) until none of `block_ids` is in flight."""
        deadline = time.monotonic() + WAIT_FOR_LANDING_S
        while any(b in self.in_flight for b in block_ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # they are still where their index entries say: a promotion skips them
            self._landed.wait(remaining)

    def wake(self) -> None:
        self._wake.set()

    @property
    def pending_requests(self) -> int:
        return len(self._requests)

    def stop(self, wait: bool = True) -> None:
        """End the thread; with `wait`, once its current batch is done (the caller must not
        hold the store lock then: the batch needs it to commit)."""
        self._stop = True
        self._wake.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                while not self._stop and self._one_batch():
                    pass
            except Exception as error:  # never let the thread die silently; try again later
                store = self.store
                if store is None or store.is_closed:
                    return  # closed under a copy: nothing to report
                log.warning("background mover: %s (it tries again in %.3g s)", error, self.interval_s,
                            exc_info=True)
                time.sleep(self.interval_s)

    def _one_batch(self) -> bool:
        store = self.store
        if store is None:
            self._stop = True
            return False
        with store.lock:
            if store.is_closed:
                return False
            store.drain_deferred()
            plan = self._next_plan()
            if plan is None or not plan.moves:
                return False
            flights, dropped = self._reserve(plan)
            store._executor.report_evictions(dropped, background=True)
            if not flights:
                return dropped > 0
        try:
            self._copy(flights)
        finally:
            with store.lock:
                if store.is_closed:
                    self.in_flight.clear()
                else:
                    self._commit(flights)
                self._landed.notify_all()
        return True

    def _next_plan(self) -> Plan | None:
        store = self.store
        while self._requests:
            owner, block_ids = next(iter(self._requests.items()))
            wanted = [b for b in block_ids if b in store.index and store.index.get(b).tier not in (HOT, -1)]
            if not wanted:
                del self._requests[owner]
                continue
            plan = store.scheduler.plan_promotion(wanted, store.index, store.free_slots(), store.capacities,
                                                  self._pinned_or_expected(except_owner=owner))
            if plan.moves:
                return Plan(moves=plan.moves[:self.batch_blocks])
            del self._requests[owner]  # nothing more can come up now
        if self._background_may_have_work() and \
                store.link_monitor.saturation() <= store.config.scheduler.bs_threshold:
            plan = store.scheduler.plan_background(store.index, store.free_slots(), store.capacities,
                                                   store.watermarks, self._pinned_or_expected(), self.batch_blocks)
            plan = self._without_cold_moves_while_backing_off(plan)
            if plan.moves:
                return plan
            # nothing to do: plan again once tier use changes or enough steps passed to change scores
            self._quiet_since = (store.access_log.now, tuple(store.free_slots()))
        plan_compaction = getattr(store, "plan_compaction", None)
        return plan_compaction(self.batch_blocks) if plan_compaction is not None else None

    def _without_cold_moves_while_backing_off(self, plan: Plan) -> Plan:
        if time.monotonic() >= self._cold_retry_at:
            return plan
        self._cold_retry_pending = True  # plan again when the backoff ends, even if nothing changed
        return dataclasses.replace(plan, moves=[m for m in plan.moves if m.dst_tier != COLD])

    def _cold_write_failed(self) -> None:
        self._cold_retry_pending = True
        self._cold_retry_at = time.monotonic() + self._cold_backoff_s
        self._cold_backoff_s = min(COLD_BACKOFF_MAX_S, 2 * self._cold_backoff_s)

    def _background_may_have_work(self) -> bool:
        """False while nothing that a background plan reads changed since one came back empty
        (the mover wakes at every step's end: it must not replan O(blocks) each time)."""
        if self._quiet_since is None:
            return True
        if self._cold_retry_pending and time.monotonic() >= self._cold_retry_at:
            self._cold_retry_pending = False  # a backoff on moves into cold ended: try them again
            return True
        store = self.store
        step, free = self._quiet_since
        return tuple(store.free_slots()) != free or store.access_log.now - step >= self._recheck_steps

    # ---- reserve / copy / commit --------------------------------------------------------------
    def _reserve(self, plan: Plan) -> tuple[list[Flight], int]:
        """Destination slots for the plan's moves that have one free now; the others (a promotion
        waiting for the slot its victim's demotion frees) wait for a later batch, planned afresh.
        Drops are applied at once."""
        store, flights, dropped = self.store, [], 0
        for move in plan.moves:
            entry = store.index.get(move.block_id)
            if entry.tier != move.src_tier:
                continue
            if move.dst_tier == DROPPED:
                store._executor.evict(move.block_id)
                dropped += 1
                continue
            pool = store.pools[move.dst_tier]
            if move.dst_slot is None:
                slots = pool.allocate(1)
            elif not pool.is_used(move.dst_slot):
                pool.take([move.dst_slot])
                slots = [move.dst_slot]
            else:
                slots = None
            if slots is None:
                continue
            flight = Flight(move.block_id, move.src_tier, entry.slot, move.dst_tier, slots[0])
            self.in_flight[move.block_id] = flight
            flights.append(flight)
        return flights, dropped

    def _copy(self, flights: list[Flight]) -> None:
        """Copy every flight's bytes, without the store lock (their slots are reserved)."""
        tiers, engine = self.store.tiers, self.copy_engine
        with engine.stream_context():
            groups: dict[tuple[int, int], list[Flight]] = {}
            for flight in flights:
                groups.setdefault((flight.src_tier, flight.dst_tier), []).append(flight)
            for (src_tier, dst_tier), group in groups.items():
                if src_tier != dst_tier and COLD not in (src_tier, dst_tier):  # hot <-> warm: batched
                    self.block_copier.copy(tiers[dst_tier].slots_view(), [f.dst_slot for f in group],
                                           tiers[src_tier].slots_view(), [f.src_slot for f in group])
                    continue
                if COLD not in (src_tier, dst_tier):
                    for f in group:  # within hot (compaction): one async copy per block
                        engine.copy(tiers[dst_tier].block_view(f.dst_slot), tiers[src_tier].block_view(f.src_slot))
                    continue
                for start in range(0, len(group), self.staging.shape[0]):
                    self._copy_through_staging(group[start:start + self.staging.shape[0]], src_tier, dst_tier)
            engine.synchronize()

    def _copy_through_staging(self, chunk: list[Flight], src_tier: int, dst_tier: int) -> None:
        tiers, staging = self.store.tiers, self.staging[:len(chunk)]
        src_slots = [f.src_slot for f in chunk]
        if src_tier == COLD:
            try:
                tiers[COLD].read_blocks(src_slots, out=staging)
            except CorruptBlockError:
                good = []
                for i, f in enumerate(chunk):  # find the bad ones; the good ones still move
                    try:
                        tiers[COLD].read_blocks([f.src_slot], out=staging[i:i + 1])
                        good.append(i)
                    except CorruptBlockError:
                        f.corrupt = True
                chunk = [chunk[i] for i in good]
                staging = staging[good] if len(good) != len(src_slots) else staging
            if chunk:
                tiers[dst_tier].write_blocks([f.dst_slot for f in chunk], staging)
                self.copy_engine.synchronize()  # staging is reused by the next chunk
            return
        self.block_copier.copy(staging, range(len(chunk)), tiers[src_tier].slots_view(), src_slots)
        self.copy_engine.synchronize()
        try:
            tiers[COLD].write_blocks([f.dst_slot for f in chunk], staging)
            self._cold_backoff_s = COLD_BACKOFF_FIRST_S
        except ColdWriteError as error:
            self._cold_write_failed()
            self._write_warnings.warning(
                "background move of %d block(s) from %s to the cold tier %s failed (%s: %s): they stay in %s; "
                "moves into cold retry in %.1f s", len(chunk), TIER_NAMES[src_tier], tiers[COLD].file_path,
                error_name(error), error.strerror or error, TIER_NAMES[src_tier],
                self._cold_retry_at - time.monotonic())
            for f in chunk:
                f.failed = True

    def _commit(self, flights: list[Flight]) -> None:
        """Install each completed flight whose block is still where it was and unused by any
        step since; give the reserved slot back otherwise (store lock held)."""
        store, executor = self.store, self.store._executor
        for f in flights:
            self.in_flight.pop(f.block_id, None)
            entry = store.index.get(f.block_id) if f.block_id in store.index else None
            still_there = entry is not None and entry.tier == f.src_tier and entry.slot == f.src_slot
            if f.corrupt and still_there and not f.cancelled:
                executor.free_slot(f.dst_tier, f.dst_slot)
                executor.mark_corrupt(f.block_id)
                continue
            if f.cancelled or f.failed or f.corrupt or not still_there or store.is_pinned_by_step(f.block_id):
                executor.free_slot(f.dst_tier, f.dst_slot)
                continue
            executor.commit_background_move(f.block_id, f.src_tier, f.src_slot, f.dst_tier, f.dst_slot)
            self.bytes_moved += store.layout.block_bytes
        self.num_batches += 1
