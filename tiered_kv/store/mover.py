"""Mover: the store's background thread that moves blocks off the critical path.

It carries out, in small batches, (1) prefetch requests (`bank.prefetch()` returns at once and
the mover brings that chat's blocks up), (2) the scheduler's optional plans (`plan_background`:
watermark and idle demotion, promotion by ALI), only while link saturation is below
`scheduler.bs_threshold`, and (3) compaction of the hot pool (compaction.py).

Every batch goes through the transfers (transfers.py) like any other move: planned and prepared
under the store lock, copied without it on the background staging set (so a forward pass that
reads other blocks never waits for a background copy), completed under the lock once its copies
are done. A step that starts using a block in flight cancels that move (opening.py): the block
stays where the step maps it. After a failed write into cold (a full disk) background moves into
cold back off, doubling from COLD_BACKOFF_FIRST_S, instead of replanning every interval.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict

from ..blocks import COLD, HOT, WARM
from ..config import Config
from ..hw.block_io import ColdWriteError
from ..metrics.registry import BACKGROUND, ON_DEMAND
from ..scheduler import MemScheduler, Plan
from ..scheduler.access_log import AccessLog
from ..scheduler.arrays import ABSENT, as_ids, placements_of
from ..scheduler.mem_scheduler import Watermarks
from . import write_behind
from .compaction import HotCompaction
from .copies import BACKUP
from .leave_alone import LeaveAlone
from .life import StoreLife
from .lock import StoreLock
from .state import StoreState
from .transfers import Transfers

log = logging.getLogger(__name__)

BATCH_BYTES = 16 * 2**20  # data moved per batch (bounds how long a step may find a block in flight)
COLD_BACKOFF_FIRST_S = 0.5  # after a failed write into cold, background moves into cold wait this long,
COLD_BACKOFF_MAX_S = 30.0  # doubling up to this while they keep failing
FAILED_MOVE_BACKOFF_S = 0.5  # a block whose background move failed is not planned again for this long
QUEUE_YIELD_MAX_S = 0.05  # the longest the mover waits for a busy copy engine before it queues anyway


class Mover:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, scheduler: MemScheduler,
                 access_log: AccessLog, compaction: HotCompaction, transfers: Transfers, link_monitor,
                 watermarks: Watermarks, config: Config, block_bytes: int):
        # (none of these holds the store: a store nobody holds is collected, and its close() stops the thread)
        self.lock, self.life, self.state = lock, life, state
        self.scheduler, self.access_log, self.compaction = scheduler, access_log, compaction
        self.transfers, self.link_monitor, self.watermarks = transfers, link_monitor, watermarks
        settings = config.scheduler
        self.bs_threshold, self.write_behind_s = settings.bs_threshold, config.cold.write_behind_s
        self.interval_s = settings.mover_interval_s
        self.batch_blocks = max(1, BATCH_BYTES // block_bytes)
        self._requests: OrderedDict[int, list[int]] = OrderedDict()  # owner -> blocks, most wanted first
        self._expected: dict[int, frozenset[int]] = {}  # owner -> blocks prefetched for its coming turn
        self._wake = threading.Event()
        self._stop = False
        self.busy = False  # a batch is between prepare and complete
        # ALI and idleness change with steps: replan an empty background plan every few of them
        self._recheck_steps = max(1, min(settings.ali_window, settings.idle_steps or settings.ali_window) // 8)
        self._quiet: _Quiet | None = None  # what the last empty background plan saw
        self._lower_read_step = -1  # store step of the last step that read blocks outside hot
        self.num_batches = 0
        self.num_cancelled = 0
        self.num_yielded = 0  # rounds the mover waited because a turn's own moves were under way
        self._queue_busy_since: float | None = None  # when the copy engine was first seen busy, in a row
        self.num_expired = 0  # prefetch requests dropped at their deadline with blocks still below
        self.bytes_moved = 0
        self._cold_retry_at = 0.0
        self._cold_backoff_s = COLD_BACKOFF_FIRST_S
        self._cold_retry_pending = False
        self._failed_until: dict[int, float] = {}  # block -> when its background move may be tried again
        self._thread = threading.Thread(target=self._run, name="tiered_kv-mover", daemon=True)

    def start(self) -> None:
        """Start the thread (once the store is bound, outside its lock)."""
        self._thread.start()

    # ---- requests (store lock held by the caller) -----------------------------------------------
    def request_prefetch(self, owner: int, block_ids: list[int], deadline: float | None = None) -> None:
        """Bring `block_ids` up, most wanted first, until `deadline` (time.monotonic(); None: until done)."""
        self._requests[owner] = (as_ids(block_ids).copy(), deadline)
        self._requests.move_to_end(owner)
        # until its next step, the chat is about to be read: no optional move takes its blocks
        # down again (its ALI or read count may be low: it has been idle)
        self._expected[owner] = frozenset(block_ids)
        self._wake.set()

    def expect(self, owner: int, block_ids: list[int]) -> None:
        """`owner`'s next step reads these blocks (just promoted for it): until it starts, no
        optional move takes them down again."""
        self._expected[owner] = frozenset(block_ids)

    def drop_requests(self, owner: int) -> None:
        self._requests.pop(owner, None)
        self._expected.pop(owner, None)

    def step_started(self, owner: int, read_lower_tiers: bool = False) -> None:
        """The chat's step began (its prefetch, done or not, is over); `read_lower_tiers`: it
        reads blocks outside hot (a working set that spilled, which ALI may bring up)."""
        if read_lower_tiers:
            self._lower_read_step = self.access_log.now
        if self._expected:
            self.drop_requests(owner)

    def _leave_alone(self, except_owner: int | None = None):
        """A plan's predicate: pinned, in flight, prefetched for another chat's coming turn, or
        recently failed to move (a copy that keeps raising must not be retried in a tight loop)."""
        state = self.state
        expected = [blocks for owner, blocks in self._expected.items() if owner != except_owner]
        if self._failed_until:
            now = time.monotonic()
            self._failed_until = {b: t for b, t in self._failed_until.items() if t > now}
        failed = self._failed_until
        if not expected and not failed:
            return state.is_pinned
        return LeaveAlone(state, extra=(failed, *expected))

    def wake(self) -> None:
        self._wake.set()

    @property
    def pending_requests(self) -> int:
        return len(self._requests)

    def stop(self) -> None:
        """End the thread once its current batch is done (the caller must not hold the store lock:
        the batch needs it to complete)."""
        self._stop = True
        self._wake.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
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
                if self.life.closed:
                    return
                log.warning("background mover: %s (it tries again in %.3g s)", error, self.interval_s,
                            exc_info=True)
                time.sleep(self.interval_s)

    def _one_batch(self) -> bool:
        transfers = self.transfers
        with self.lock:
            if self.life.is_closing:
                return False
            self.state.drain()
            if self._turn_is_moving():  # a turn's own moves go first: background waits an interval
                self.num_yielded += 1
                return False
            plan, leave_alone = self._prefetch_plan()  # a coming turn first, then durability, then the rest
            batch = self._backups() if plan is None else None
            if batch is None:
                if plan is None:
                    plan, leave_alone = self._next_plan()
                if plan is None or not plan.num_moves:
                    return False
                batch = transfers.prepare(plan, BACKGROUND, leave_alone)
                if not batch.groups:
                    return batch.settled_at_prepare > 0
            self.busy = True
        try:
            transfers.run(batch)  # launch and wait for the copies, without the lock
        finally:
            with self.lock:
                transfers.complete(batch)
                self.busy = False
                self._after(batch)
        return batch.failure is None  # after a failed batch, wait for the next interval

    def _after(self, batch) -> None:
        if batch.failed_parts:
            retry_at = time.monotonic() + FAILED_MOVE_BACKOFF_S
            self._failed_until.update(dict.fromkeys(batch.failed_block_ids().tolist(), retry_at))
        self.num_batches += 1
        moved = self.transfers.moved_bytes  # (an eviction carries nothing)
        self.bytes_moved += sum(moved.get(direction, 0) * count for direction, count in batch.committed.counts().items())
        into_cold = any(g.dst_tier == COLD for g in batch.groups)
        if isinstance(batch.failure, ColdWriteError) and into_cold:
            self._cold_retry_pending = True
            self._cold_retry_at = time.monotonic() + self._cold_backoff_s
            log.debug("background moves into the cold tier wait %.1f s after a failed write (%s)",
                      self._cold_backoff_s, batch.failure)
            self._cold_backoff_s = min(COLD_BACKOFF_MAX_S, 2 * self._cold_backoff_s)
        elif into_cold and batch.failure is None:
            self._cold_backoff_s = COLD_BACKOFF_FIRST_S

    def _backups(self):
        """A batch of durable copies for blocks published above cold (write-behind), once due; None
        when none is (or while writes into cold back off after a failure)."""
        copies, interval_s = self.state.copies, self.write_behind_s
        if copies is None or not copies.pending or time.monotonic() < self._cold_retry_at:
            return None
        due = copies.due(time.monotonic(), interval_s, self.batch_blocks)
        batch = write_behind.prepare_backups(self.transfers, due, BACKGROUND)[0] if due else None
        return batch if batch is not None and batch.groups else None

    def _turn_is_moving(self) -> bool:
        """A caller's own moves (a turn's room and history) are in flight, or the copy engine has
        units queued (it runs them in order: a background batch queued now would be ahead of the
        next turn's). The queue-depth signal of every machine (NVML's link load is the GPU's). A
        queue busy with units no turn is waiting for holds background back QUEUE_YIELD_MAX_S at most."""
        if any(g.batch.mode == ON_DEMAND and g.kind != BACKUP for g in self.state.in_flight.groups()):
            return True
        if self.transfers.engine.queue_depth() == 0:
            self._queue_busy_since = None
            return False
        # units the store does not track (a long copy, someone else's work): wait a while, not forever
        now = time.monotonic()
        if self._queue_busy_since is None:
            self._queue_busy_since = now
        return now - self._queue_busy_since < QUEUE_YIELD_MAX_S

    def _prefetch_plan(self):
        """(the next batch of the oldest prefetch request still wanted, its leave-alone predicate),
        or (None, None); a request past its deadline is dropped (bank.prefetch(deadline_s))."""
        state = self.state
        now = time.monotonic()
        while self._requests:
            owner, (block_ids, deadline) = next(iter(self._requests.items()))
            tiers, _ = placements_of(state.index, block_ids)  # (ABSENT: freed since the request)
            present = block_ids[tiers != ABSENT]
            below = bool(((tiers >= 0) & (tiers != HOT)).any())  # (DROPPED: corrupt, nothing to bring up)
            if not below or (deadline is not None and now >= deadline):
                self.num_expired += below
                del self._requests[owner]
                continue
            leave_alone = self._leave_alone(except_owner=owner)
            # plan for all of the chat's blocks, not just the ones still below: those up already
            # must not be pushed down to make room for the rest (a chat larger than hot swapped
            # its own blocks in a loop until its turn came)
            plan = self.scheduler.plan_promotion(present, state.index, state.free_slots(), state.capacities,
                                                 leave_alone)
            if plan.num_moves:
                return plan.head(self.batch_blocks), leave_alone
            del self._requests[owner]  # nothing more can come up now
        return None, None

    def _next_plan(self):
        """(plan, the predicate of blocks it must leave alone), or (None, None)."""
        state, scheduler = self.state, self.scheduler
        if self._background_may_have_work() and self.link_monitor.saturation() <= self.bs_threshold:
            leave_alone = self._leave_alone()
            plan = scheduler.plan_background(state.index, state.free_slots(), state.capacities,
                                             self.watermarks, leave_alone, self.batch_blocks)
            plan = self._without_cold_moves_while_backing_off(plan)
            if plan.num_moves:
                self._quiet = None
                return plan, leave_alone
            # nothing to do: plan again only once something a plan reads changed (see below)
            idle_step, idle_stuck = scheduler.idle_outlook(state.index, state.capacities)
            self._quiet = _Quiet(self.access_log.now, tuple(state.free_slots()), idle_step, idle_stuck)
        return self.compaction.plan(self.batch_blocks), state.is_pinned

    def _without_cold_moves_while_backing_off(self, plan: Plan) -> Plan:
        if time.monotonic() >= self._cold_retry_at:
            return plan
        self._cold_retry_pending = True  # plan again when the backoff ends, even if nothing changed
        return plan.take(plan.dst_tiers != COLD)

    def _background_may_have_work(self) -> bool:
        """False while nothing a background plan reads changed since one came back empty: O(1),
        so idle chats cost nothing however many there are (the mover wakes every interval).
        A plan may find work again once a block turns idle (`idle_outlook`), or, after tier use
        changed or `_recheck_steps` steps passed (scores move with steps), while a tier is over
        its high watermark, an idle block found no room, or (ALI) a step lately read blocks
        outside hot (or pushed some down) while a tier above them is under its low watermark;
        and once blocks whose move failed may be tried again."""
        quiet = self._quiet
        if quiet is None:
            return True
        if self._cold_retry_pending and time.monotonic() >= self._cold_retry_at:
            self._cold_retry_pending = False  # a backoff on moves into cold ended: try them again
            return True
        state, now = self.state, self.access_log.now
        if quiet.idle_step is not None and now >= quiet.idle_step:
            return True
        if self._failed_until and min(self._failed_until.values()) <= time.monotonic():
            return True  # blocks whose move failed may be tried again
        free = tuple(state.free_slots())
        if free == quiet.free_slots and now - quiet.step < self._recheck_steps:
            return False
        capacities, marks = state.capacities, self.watermarks
        used = [capacity - f for capacity, f in zip(capacities, free)]
        if any(capacities[t] and used[t] > marks.high_blocks[t] and self._can_demote(t, free) for t in (HOT, WARM)):
            return True
        if quiet.idle_stuck:
            return True
        window = self.access_log.window_steps
        return self.scheduler.promotes_by_locality and self._lower_read_step >= now - max(1, window // 10) \
            and any(capacities[t] and used[t] < marks.low_blocks[t] for t in (HOT, WARM))

    def _can_demote(self, tier: int, free: tuple[int, ...]) -> bool:
        """Some block of `tier` could go: a lower tier has a free slot, or one is unreferenced (dropped)."""
        capacities = self.state.capacities
        return any(capacities[t] and free[t] for t in range(tier + 1, len(free))) or \
            bool(len(self.state.index.unreferenced(tier)))


@dataclasses.dataclass(frozen=True)
class _Quiet:
    step: int  # store step of the empty plan
    free_slots: tuple[int, ...]  # free slots per tier then
    idle_step: int | None  # when a hot block may turn idle next (None: idle demotion off)
    idle_stuck: bool  # a hot block was idle already but the plan could not move it
