"""Moves a caller needs now: a step's room and history, `promote` / `demote`, undoing a failed
step's moves, the moves to cold at close.

`carry_out(make_plan)` repeats, until the plan is done or nothing more can move:
    under the lock: make a plan from the store as it is now, `prepare` a batch of what can go;
    without it:     `launch` the batch and wait for its copies (the caller needs the bytes);
    under the lock: `complete` it.
A plan whose moves depend on each other (a victim leaves warm for cold before another takes its
warm slot) thus runs in a few rounds, each planned afresh. Blocks whose move failed are left out
of later rounds (`result.failed_blocks`): a copy that raises costs that move, never the caller's
step. The seconds the calling thread waited are charged to it (`thread_seconds`, a bank's
critical path) and to the store's metrics.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..metrics.registry import ON_DEMAND
from ..scheduler import Move, Plan
from .lock import StoreLock
from .state import StoreState
from .transfers import TransferBatch, Transfers

MAX_ROUNDS = 64  # a plan needs a few rounds (one per level of a demotion cascade); this bounds a livelock


@dataclass
class DemandResult:
    committed: list[Move] = field(default_factory=list)  # in the order they landed
    corrupt: list[int] = field(default_factory=list)  # blocks found corrupt on the way (never served)
    failed_blocks: set[int] = field(default_factory=set)  # blocks whose batch's copy raised
    errors: list[BaseException] = field(default_factory=list)

    def add(self, batch: TransferBatch) -> None:
        self.committed += batch.committed
        self.corrupt += batch.corrupt
        if batch.failed:
            self.failed_blocks.update(t.block_id for t in batch.failed)
            self.errors.append(batch.failure)


class DemandMoves:
    def __init__(self, lock: StoreLock, state: StoreState, transfers: Transfers):
        self.lock = lock
        self.state = state
        self.transfers = transfers
        self._thread = threading.local()

    def carry_out(self, make_plan: Callable[[DemandResult], Plan | None], movable=None,
                  result: DemandResult | None = None, quiet: bool = False) -> DemandResult:
        """See the module docstring. `make_plan(result)` runs under the lock each round; `movable`
        is the plan's predicate of blocks to leave alone (transfers.prepare); `quiet`: the caller
        reports failed copies itself. Called without the lock."""
        result = result if result is not None else DemandResult()
        for _ in range(MAX_ROUNDS):
            with self.lock:
                self.state.drain()
                plan = make_plan(result)
                if plan is None or not plan.moves:
                    break
                batch = self.transfers.prepare(plan.moves, ON_DEMAND, movable)
                batch.quiet = quiet
                if not batch.transfers:
                    if batch.settled_at_prepare:
                        continue
                    break  # nothing can move now
            self.run_batch(batch)
            result.add(batch)
            if len(batch.committed) + batch.settled_at_prepare == len(plan.moves):
                break  # every move of the plan landed: planning again would find none
        return result

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
        first = next((t for t in batch.transfers if t.src_tier >= 0 and t.dst_tier >= 0 and t.src_tier != t.dst_tier),
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
