"""Moves a caller needs now: a step's room and history, `promote` / `demote`, undoing a failed
step's moves, the moves to cold at close.

`carry_out(make_plan)` repeats, until the plan is done or nothing more can move:
    under the lock: make a plan from the store as it is now, `prepare` its first sub-batch;
    then `pipeline`: launch that batch (no lock) and, while it copies, prepare the next
    sub-batch (under the lock) and launch it too, so the copy engine gets unit k+1 before unit k
    completes; then complete batch k (under the lock) once its copies are done, prepare k+2 while
    k+1 copies, and so on: at most PIPELINE_DEPTH batches launched and not completed.
A plan is cut into sub-batches of SUB_BATCH_BYTES only where the copies run on hardware of their
own (the CUDA engine: DMA), so that preparing a batch overlaps the copy before it. On a CPU the
copy is the cores' own work: the sync engine copies inside launch, and the thread engine runs it
on the same cores the preparing thread needs (bench/moves.py, 2 cores: 0.84x a plain copy cut in
64 MiB sub-batches, 0.97x as one batch), so a plan goes as one batch there (`sub_batch_blocks` 0;
tests set it to run the pipeline on the thread engine). A plan whose moves depend on each other (a victim leaves
warm for cold before another takes its warm slot) runs in a few rounds, each planned afresh: a
sub-batch takes the room there is when it is prepared, and what finds none waits for the next
round. Blocks whose move failed are left out of later rounds (`result.failed_blocks`): a copy
that raises costs that move, never the caller's step. The seconds the calling thread waited are
charged to it (`thread_seconds`, a bank's critical path) and to the store's metrics.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..metrics.registry import ON_DEMAND
from ..scheduler.plan import MoveList, Plan
from .lock import StoreLock
from .state import StoreState
from .transfers import TransferBatch, Transfers

MAX_ROUNDS = 64  # a plan needs a few rounds (one per level of a demotion cascade); this bounds a livelock
SUB_BATCH_BYTES = 64 * 2**20  # an on-demand plan is cut into batches of this much data (PIPELINED_ENGINES)
PIPELINE_DEPTH = 2  # batches launched and not completed yet, at most (one copying, the next queued)
PIPELINED_ENGINES = ("cuda",)  # engines whose copies run beside the host (DMA), so preparing overlaps them


@dataclass
class DemandResult:
    committed: MoveList = field(default_factory=MoveList)  # in the order they landed
    corrupt: list[int] = field(default_factory=list)  # blocks found corrupt on the way (never served)
    failed_blocks: set[int] = field(default_factory=set)  # blocks whose batch's copy raised
    errors: list[BaseException] = field(default_factory=list)

    def add(self, batch: TransferBatch) -> None:
        self.committed.extend(batch.committed)
        self.corrupt += batch.corrupt
        if batch.failed_parts:
            self.failed_blocks.update(batch.failed_block_ids().tolist())
            self.errors.append(batch.failure)


class DemandMoves:
    def __init__(self, lock: StoreLock, state: StoreState, transfers: Transfers, block_bytes: int = 0):
        self.lock = lock
        self.state = state
        self.transfers = transfers
        # blocks per sub-batch; 0: a plan goes as one batch (see the module docstring)
        pipelined = getattr(transfers.engine, "name", None) in PIPELINED_ENGINES
        self.sub_batch_blocks = max(1, SUB_BATCH_BYTES // block_bytes) if pipelined and block_bytes > 0 else 0
        self._thread = threading.local()

    def carry_out(self, make_plan: Callable[[DemandResult], Plan | None], leave_alone=None,
                  result: DemandResult | None = None, quiet: bool = False) -> DemandResult:
        """See the module docstring. `make_plan(result)` runs under the lock each round; `leave_alone`
        is the plan's predicate of blocks to leave alone (transfers.prepare); `quiet`: the caller
        reports failed copies itself. Called without the lock."""
        result = result if result is not None else DemandResult()
        for _ in range(MAX_ROUNDS):
            with self.lock:
                self.state.drain()
                plan = make_plan(result)
                if plan is None or not plan.num_moves:
                    break
                first, rest = self.prepare_parts(plan, leave_alone, quiet)
            settled, copied, committed = self.pipeline(first, rest, leave_alone, result, quiet)
            if not copied:
                if settled:
                    continue
                break  # nothing can move now
            if committed + settled == plan.num_moves:
                break  # every move of the plan landed: planning again would find none
        return result

    def parts(self, plan: Plan) -> list[Plan]:
        """`plan` cut into sub-batches (see the module docstring)."""
        size = self.sub_batch_blocks
        if not size or plan.num_moves <= size:
            return [plan]
        return [plan.take(slice(start, start + size)) for start in range(0, plan.num_moves, size)]

    def prepare_parts(self, plan: Plan, leave_alone=None, quiet: bool = False) -> tuple[TransferBatch, list[Plan]]:
        """(the first sub-batch of `plan`, prepared, the other sub-plans) (store lock held)."""
        parts = self.parts(plan)
        return self._prepare(parts[0], leave_alone, quiet), parts[1:]

    def _prepare(self, part: Plan, leave_alone, quiet: bool) -> TransferBatch:
        batch = self.transfers.prepare(part, ON_DEMAND, leave_alone)
        batch.quiet = quiet
        return batch

    def pipeline(self, batch: TransferBatch, rest: list[Plan], leave_alone=None, result: DemandResult | None = None,
                 quiet: bool = False) -> tuple[int, int, int]:
        """Launch `batch` (prepared), prepare and launch each sub-plan of `rest` while the batch
        before it copies, complete each batch in order once its copies are done (called without
        the lock; see the module docstring). Returns (moves settled at prepare, blocks launched to
        copy, moves committed). An interrupt raised meanwhile reaches the caller once every batch
        launched is completed (as failed where it was the one interrupted) and every batch only
        prepared is given back."""
        result = result if result is not None else DemandResult()
        launched: deque[TransferBatch] = deque()
        settled = copied = committed = 0
        finishing = None
        waited_since = [0.0]  # end of the last completion: waits are charged without overlap
        k = 0
        try:
            while batch is not None:
                settled += batch.settled_at_prepare
                if batch.groups:
                    copied += batch.num_copies
                    self.transfers.start(batch)  # (an error fails the batch; an interrupt is raised)
                    launched.append(batch)
                batch = None
                while launched and (len(launched) >= PIPELINE_DEPTH or k == len(rest)):
                    finishing = launched.popleft()  # (the one after it is queued already)
                    committed += self._finish(finishing, result, waited_since)
                    finishing = None
                if k < len(rest):
                    with self.lock:  # while the batch launched last copies
                        self.state.drain()
                        batch = self._prepare(rest[k], leave_alone, quiet)
                    k += 1
        except BaseException as interrupt:
            leftovers = [b for b in (finishing, *launched, batch) if b is not None]
            for b in leftovers:
                b.wait()
            with self.lock:
                for b in leftovers:
                    if b.event is None and b.error is None:  # prepared, never launched
                        self.transfers.abandon(b, interrupt)
                    else:
                        self.transfers.complete(b)
            for b in leftovers:
                result.add(b)
            raise
        return settled, copied, committed

    def _finish(self, batch: TransferBatch, result: DemandResult, waited_since: list[float]) -> int:
        """Wait for the batch's copies (no lock), complete it (lock); returns the moves committed."""
        try:
            batch.wait()
        finally:
            with self.lock:
                self.transfers.complete(batch)  # (a failed batch gives its reservations back)
        end_s = time.perf_counter()
        self._charge(batch, end_s - max(batch.started_s or end_s, waited_since[0]))
        waited_since[0] = end_s
        result.add(batch)
        return len(batch.committed)

    def run_batch(self, batch: TransferBatch) -> None:
        """launch and wait (no lock), then complete (lock); the wait is charged to this thread."""
        start_s = time.perf_counter()
        try:
            self.transfers.run(batch)  # an interrupt is raised again here, once the copies are done
        finally:
            with self.lock:
                self.transfers.complete(batch)  # (a failed batch gives its reservations back)
        self._charge(batch, time.perf_counter() - start_s)

    def _charge(self, batch: TransferBatch, seconds: float) -> None:
        first = next((g for g in batch.groups if g.src_tier >= 0 and g.dst_tier >= 0 and g.src_tier != g.dst_tier),
                     None)
        if first is None:
            return
        direction = "demote" if first.dst_tier > first.src_tier else "promote"
        self.transfers.metrics.move_seconds.inc((direction,), seconds)
        self.thread_seconds()[direction] += seconds

    def thread_seconds(self) -> dict[str, float]:
        """Seconds this thread has waited for demand moves so far, by direction."""
        totals = getattr(self._thread, "totals", None)
        if totals is None:
            totals = self._thread.totals = {"demote": 0.0, "promote": 0.0}
        return totals

    def charge_wait(self, direction: str, seconds: float) -> None:
        """This thread waited `seconds` for moves made elsewhere (a background prefetch landing)."""
        self.transfers.metrics.move_seconds.inc((direction,), seconds)
        self.thread_seconds()[direction] += seconds
