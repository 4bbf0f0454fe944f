"""Transfers: the one path by which bytes move between tiers, and the only code that frees a slot
after a copy (docs/design.md, invariant 7; docs/design.md, "A move").

Every move — on demand for a step, in the background, compaction, remote fetch and the remote
writer's reads — is a `TransferBatch` that goes

    prepare   (store lock held)  reserve each destination slot, mark each block in flight;
                                 evictions in the plan are applied here (they copy nothing)
    launch    (no lock)          copy, as one unit of the copy engine (hw/copy_engine.py): at once
                                 (sync), later on the engine's thread (thread), or on its CUDA
                                 side stream; one completion event for the batch
    (wait)    (no lock)          for the event, where the caller needs the bytes
    complete  (store lock held)  commit the moves whose copy finished without error: the block
                                 lives at its destination from now on; its source slot is freed
                                 once the event has passed (the deferred list in state.py)

A batch is arrays, never an object per block (batches.py): a plan's moves come in as arrays
(scheduler/plan.py), prepare chooses and reserves by arrays (reserving.py), the in-flight map is
registered and settled per group (in_flight.py), complete commits each direction with one index
update and frees slots by arrays (completing.py). A launch does not wait for the previous unit on
its staging set: the copy engine runs units in order, so the next batch can be queued while one
copies (demand.py pipelines a large move that way).

Any exception in `launch` — raised by it, or by the unit on the engine's thread — fails every
move of its batch: nothing is committed, the reserved slots go back once the event has passed,
the blocks stay where they were, and the failure is counted (`failed_moves_total`) and logged.
A block failing its checksum on the way is marked corrupt (never served); the others still count.
A move whose block a step began to use meanwhile is cancelled: it stays where the step mapped it.
`store.transfers` is public: tests wrap `launch` to inject faults and delays.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..blocks import HOT, TIER_NAMES, WARM
from ..logs import Throttle
from ..metrics.registry import BACKGROUND, Metrics
from ..scheduler.plan import Plan
from . import completing, copies, reserving
from .batches import Transfer, TransferBatch, TransferGroup
from .copies import COPY, READ_OUT, WRITE_IN
from .state import StoreState

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, state: StoreState, engine, metrics: Metrics, link_monitor, tier_block_bytes: list[int],
                 staging: dict, rates=None):
        self.state = state
        self.engine = engine
        self.metrics = metrics
        self.link_monitor = link_monitor
        # per (source, destination) tier, the bytes a block's move carries: the smaller tier's block
        self.moved_bytes = {(s, d): min(a, b) for s, a in enumerate(tier_block_bytes)
                            for d, b in enumerate(tier_block_bytes)}
        self.staging = staging  # mode -> copies.Staging (host staging, device staging, reader)
        self.rates = rates  # scheduler.restore.Rates: read rates measured here (cold reads, warm moves)
        self.failure_warnings = Throttle(log)
        self.closed = False  # after close(): nothing is prepared any more

    # ---- prepare (store lock held) -------------------------------------------------------------
    def prepare(self, moves, mode: str, leave_alone=None) -> TransferBatch:
        """A batch of the moves (a Plan, or a list of Move) that can go now: each block's first
        move, the block still where the move says, not in flight, not named by `leave_alone` (a plan's
        predicate of blocks to leave alone), and with a free destination slot (the first moves in
        plan order get them). The others wait for a later batch, planned afresh
        (`batch.num_left_out` counts them). Destination slots are taken per tier at once, in as
        few runs as the pool allows, so that a chat's blocks copy as a few large runs."""
        batch = TransferBatch(mode)
        plan = moves if isinstance(moves, Plan) else Plan(moves)
        if self.closed or not plan.num_moves:  # (closed: a caller still running while its store closed)
            return batch
        reserving.prepare_moves(self.state, batch, plan, leave_alone)
        self.state.report_evictions(batch.num_evictions, "the background mover" if mode == BACKGROUND else "a plan")
        return batch

    def prepare_copies(self, pairs: list[tuple[int, int]], mode: str) -> TransferBatch:
        """Copy-on-write: fill each new block (first of a pair, already allocated) from the
        other block's slot (its caller keeps that block from moving)."""
        batch = TransferBatch(mode)
        index = self.state.index
        found = {}  # (source tier, destination tier) -> [(new, src block, src slot, dst slot)]
        for new_id, src_id in pairs:
            src, dst = index.get(src_id), index.get(new_id)
            found.setdefault((src.tier, dst.tier), []).append((new_id, src_id, src.slot, dst.slot))
        for (src_tier, dst_tier), rows in found.items():
            new_ids, src_ids, src_slots, dst_slots = (np.array(column, dtype=np.int64) for column in zip(*rows))
            self._add(batch, TransferGroup(batch, COPY, src_tier, dst_tier, new_ids, src_slots, dst_slots,
                                           src_blocks=src_ids))
        return batch

    def prepare_write_in(self, blocks: list[tuple[int, object]], mode: str) -> TransferBatch:
        """Fill new blocks (already allocated) from host tensors `[1, L, 2, H, bs, D]`."""
        batch = TransferBatch(mode)
        found = {}  # destination tier -> [(block, slot, data)]
        for block_id, data in blocks:
            entry = self.state.index.get(block_id)
            found.setdefault(entry.tier, []).append((block_id, entry.slot, data))
        for tier, rows in found.items():
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            self._add(batch, TransferGroup(batch, WRITE_IN, -1, tier, ids, np.full(len(rows), -1, dtype=np.int64),
                                           np.array([r[1] for r in rows], dtype=np.int64), data=[r[2] for r in rows]))
        return batch

    def prepare_read_out(self, block_id: int, out, mode: str) -> TransferBatch:
        """Copy one block into the host tensor `out` (its caller pins the block meanwhile; it is
        not marked in flight: nothing moves it)."""
        batch = TransferBatch(mode)
        entry = self.state.index.get(block_id)
        batch.groups.append(TransferGroup(batch, READ_OUT, entry.tier, -1, np.array([block_id], dtype=np.int64),
                                          np.array([entry.slot], dtype=np.int64), np.array([-1], dtype=np.int64),
                                          data=[out]))
        return batch

    def _add(self, batch: TransferBatch, group: TransferGroup) -> None:
        self.state.in_flight.add(group)
        batch.groups.append(group)

    # ---- launch (no lock) ----------------------------------------------------------------------
    def launch(self, batch: TransferBatch) -> None:
        """Issue the batch's copies as one unit of the copy engine; the batch's event passes when
        they are done. An exception here fails the whole batch (see the module docstring). The
        unit queues behind the engine's earlier units (which use the same staging set in order)."""
        batch.started_s = time.perf_counter()
        if not batch.groups:
            return
        staging, after = self.staging[batch.mode], self.state.step_fences.for_transfers(batch.groups)
        tiers, groups = self.state.tiers, list(batch.groups)
        with staging.lock:  # one submitter at a time per staging set (a CUDA unit issues its copies here)
            try:
                batch.event = self.engine.submit(lambda: copies.run(tiers, groups, staging, self.engine,
                                                                    self.metrics, self.rates), after=after)
            except BaseException as interrupt:  # (an interrupt: the copies issued so far keep their event)
                batch.event = getattr(interrupt, "copy_event", None)
                raise
            finally:
                staging.last_event = batch.event

    def start(self, batch: TransferBatch) -> None:
        """launch, without waiting: a raising launch marks the batch failed (its copies issued so
        far stay covered by its event); an interrupt is raised again (the caller completes the batch)."""
        try:
            self.launch(batch)
        except Exception as error:  # noqa: BLE001 - the batch fails; complete() reports it
            batch.error = error
        except BaseException as error:
            batch.error = error
            raise

    def run(self, batch: TransferBatch) -> None:
        """launch, then wait for the copies (no lock held). A raising launch marks the batch failed;
        an interrupt (KeyboardInterrupt) is raised again once the batch can be completed."""
        try:
            self.start(batch)
        except BaseException:
            batch.wait()
            raise
        batch.wait()

    # ---- complete (store lock held) ------------------------------------------------------------
    def complete(self, batch: TransferBatch) -> None:
        """Commit what copied without error; give back what did not (see the module docstring and
        completing.py). The bookkeeping is per group: one index update, one free and one count
        per direction."""
        if batch.completed:
            return
        batch.completed = True
        completing.complete(self, batch)

    def abandon(self, batch: TransferBatch, error: BaseException) -> None:
        """A prepared batch that will never be launched (its caller stops: an interrupt): it fails
        as a copy that raised, changing nothing (store lock held)."""
        if batch.completed:
            return
        batch.error = batch.error or error
        batch.quiet = True
        self.complete(batch)

    def count_bytes(self, src_tier: int, dst_tier: int, num_bytes: int, mode: str) -> None:
        self.metrics.bytes_moved.inc((TIER_NAMES[src_tier], TIER_NAMES[dst_tier], mode), num_bytes)
        if HOT in (src_tier, dst_tier):
            self.link_monitor.record(num_bytes)

    def observe_copy_seconds(self, batch: TransferBatch, directions: dict) -> None:
        """Seconds from launch to complete per direction that landed (only warm -> hot: a warm read rate)."""
        if batch.started_s:
            elapsed = time.perf_counter() - batch.started_s
            for src, dst in directions:
                self.metrics.copy_seconds.observe((TIER_NAMES[src], TIER_NAMES[dst]), elapsed)
            if self.rates is not None and list(directions) == [(WARM, HOT)]:
                self.rates.note_read("warm", directions[(WARM, HOT)] * self.moved_bytes[(WARM, HOT)], elapsed)

    def close(self) -> None:
        """Wait for every copy issued, then stop the engine and the staging readers."""
        self.closed = True
        self.engine.synchronize()
        self.engine.close()
        for staging in self.staging.values():
            staging.close()


__all__ = ["Transfers", "Transfer", "TransferBatch", "TransferGroup"]
