"""One `Opening.open_step` call's work across its rounds (opening.py): the copy-on-write of shared
tails, the new blocks, the history brought up on a new turn, and giving back what it allocated
when the step does not happen."""

from __future__ import annotations

from ..blocks import COLD, HOT
from ..errors import CorruptBlockError
from ..scheduler.arrays import as_ids
from .demand import DemandResult
from .leases import StepRequest


class StepBuild:
    """The state of one open_step call across its rounds."""

    def __init__(self, opening, request: StepRequest):
        self.opening, self.request = opening, request  # (its lock, state, allocation and placement serve here)
        self.tail_copies: dict[int, tuple[int, int]] = {}  # row -> (old tail, its copy)
        self.new_blocks: list[list[int]] = [[] for _ in request.tables]
        self.allocated: list[int] = []
        self.result = DemandResult()
        self.handed_over = False
        self.shared_tails: list[int] = []  # rows whose tail is copied on write (found under the lock)

    def copy_tails(self) -> None:
        """Copy-on-write of the shared tails (a copy that raises is tried again: its batch changed
        nothing)."""
        rows = self.shared_tails
        if not rows:
            return
        tails = [self.request.tables[r][-1] for r in rows]
        for attempt in range(3):
            try:
                copies = self.opening.allocation.copy_pinned(self.request.owner, tails, self.result)
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
        request, block_size = self.request, self.opening.block_size
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
        new_ids = self.opening.allocation.allocate_pinned(request.owner, total, protect, list(zip(needed, previous)),
                                                          self.result)
        self.allocated += new_ids
        for r, count in enumerate(needed):
            self.new_blocks[r] = new_ids[:count]
            del new_ids[:count]

    def promote_history(self) -> None:
        request, opening = self.request, self.opening
        order = request.promotion_order
        if not order:
            return
        state = opening.state
        with opening.lock:
            tiers, _ = state.placements(order)
            if (tiers == HOT).all():
                return
        # this step's own new blocks stay where they are
        leave_alone = state.leave_alone_for(request.owner, frozenset(self.allocated))
        opening.placement.bring_up(as_ids(order), leave_alone, self.result)
        if request.verify_cold:
            with opening.lock:
                cold = [b for b in order if b in state.index and state.index.get(b).tier == COLD]
            opening.placement.verify(cold)

    def give_back(self) -> None:
        """The step does not happen: release what was allocated, unpin (moves made stay made)."""
        if self.handed_over:
            return
        opening, state = self.opening, self.opening.state
        with opening.lock:
            if not opening.life.closed:
                state.release(self.allocated)
            state.unpin(self.request.owner)
            state.changes.bump()
        self.allocated = []


__all__ = ["StepBuild"]
