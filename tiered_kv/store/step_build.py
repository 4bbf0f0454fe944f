"""One `Opening.open_step` call's work across its rounds (opening.py): the copy-on-write of shared
tails, the new blocks, the history brought up on a new turn, and giving back what it allocated
when the step does not happen."""

from __future__ import annotations

import numpy as np

from ..blocks import COLD, HOT
from ..errors import CorruptBlockError
from ..scheduler import Plan
from ..scheduler.arrays import as_ids
from .demand import DemandResult
from .leases import StepRequest


class StepBuild:
    """The state of one open_step call across its rounds."""

    def __init__(self, opening, request: StepRequest):
        self.opening, self.store, self.request = opening, opening.store, request
        self.tail_copies: dict[int, tuple[int, int]] = {}  # row -> (old tail, its copy)
        self.new_blocks: list[list[int]] = [[] for _ in request.tables]
        self.allocated: list[int] = []
        self.result = DemandResult()
        self.handed_over = False
        self.shared_tails: list[int] = []  # rows whose tail is copied on write (found under the lock)

    def copy_tails(self) -> None:
        """Copy-on-write of the shared tails (a copy that raises is tried again: its batch changed
        nothing)."""
        rows, store = self.shared_tails, self.store
        if not rows:
            return
        tails = [self.request.tables[r][-1] for r in rows]
        for attempt in range(3):
            try:
                copies = store.allocation.copy_pinned(self.request.owner, tails, self.result)
            except CorruptBlockError:
                raise
            except Exception:  # noqa: BLE001 - counted and logged by the transfers; tried again
                if attempt == 2:
                    raise
                continue
            self.allocated += copies
            for r, tail, copy in zip(rows, tails, copies):
                self.tail_copies[r] = (tail, copy)
            return  # (the copies join the chat's rows at its step: compaction.note_step)

    def allocate_new_blocks(self) -> None:
        request, store = self.request, self.store
        block_size = store.config.block_size
        needed = [-(-request.num_tokens // block_size) - (request.first_token(r, block_size) // block_size + len(table)
                                                           if request.new_first_block(r) is None
                                                           else request.new_first_block(r))
                  for r, table in enumerate(request.tables)]
        total = sum(needed)
        if not total:
            return
        previous = [self.tail_copies[r][1] if r in self.tail_copies
                    else (table[-1] if table and request.new_first_block(r) is None else None)
                    for r, table in enumerate(request.tables)]
        protect = frozenset(self.allocated)
        new_ids = store.allocation.allocate_pinned(request.owner, total, protect, list(zip(needed, previous)),
                                                   self.result)
        self.allocated += new_ids
        for r, count in enumerate(needed):
            self.new_blocks[r] = new_ids[:count]
            del new_ids[:count]

    def promote_history(self) -> None:
        request, store = self.request, self.store
        order = request.promotion_order
        if not order:
            return
        state = store.state
        with store.lock:
            tiers, _ = state.placements(order)
            if (tiers == HOT).all():
                return
        new = frozenset(self.allocated)
        movable = state.movable_by(request.owner, new)  # this step's own new blocks stay where they are

        ids = as_ids(order)  # (blocks gone from the index meanwhile: the planner leaves them out)

        def make_plan(result: DemandResult) -> Plan | None:
            wanted = ids[~np.isin(ids, list(result.failed_blocks))] if result.failed_blocks else ids
            return store.scheduler.plan_promotion(wanted, state.index, state.free_slots(), state.capacities, movable)

        store.demand.carry_out(make_plan, movable, self.result)
        if request.verify_cold:
            with store.lock:
                cold = [b for b in order if b in state.index and state.index.get(b).tier == COLD]
            store.placement.verify(cold)

    def give_back(self) -> None:
        """The step does not happen: release what was allocated, unpin (moves made stay made)."""
        if self.handed_over:
            return
        store = self.store
        with store.lock:
            if not store.is_closed:
                store.state.release(self.allocated)
            store.state.unpin(self.request.owner)
            store.state.changes.bump()
        self.allocated = []


__all__ = ["StepBuild"]
