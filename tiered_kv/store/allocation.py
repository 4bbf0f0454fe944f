"""Allocation: new blocks, placed as high as room allows, and copy-on-write copies of blocks.

`allocate_pinned(owner, n)` works in rounds (the lock held only to plan and to place): plan room
for n new blocks (MemScheduler.plan_new_blocks), move what must go down through the demand
moves (demand.py), plan again, until the plan needs no move; then the blocks take their slots —
a sequence's hot blocks consecutive slots, right after the block they continue when those are
free (one slice for attention). Blocks whose move failed are never chosen as victims again in
that call, so a copy that raises costs that move: the new blocks go where there is room.
Running out is a value: `Retry` while others' pins or copies in flight hold the room,
CapacityError when all tiers together cannot hold the blocks.
"""

from __future__ import annotations

import itertools
import time

from ..blocks import COLD, HOT, KVLayout
from ..errors import CapacityError, CorruptBlockError
from ..metrics.registry import ON_DEMAND
from ..scheduler import MemScheduler
from .compaction import HotCompaction
from .demand import MAX_ROUNDS, DemandMoves, DemandResult
from .life import StoreLife
from .lock import StoreLock
from .state import StoreState
from .transfers import Transfers

PIN_WAIT_S = 60.0  # how long a step or allocation waits for other steps to free the room it needs
_PSEUDO_OWNERS = itertools.count(-1, -1)  # owners of store-internal pins (work outside a step)


def pseudo_owner() -> int:
    return next(_PSEUDO_OWNERS)


class Retry(Exception):
    """Room is held by other steps' pins or blocks in flight: try again once something changed."""


class Allocation:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, scheduler: MemScheduler,
                 compaction: HotCompaction, demand: DemandMoves, transfers: Transfers, layout: KVLayout):
        self.lock, self.life, self.state = lock, life, state
        self.scheduler, self.compaction = scheduler, compaction
        self.demand, self.transfers = demand, transfers
        self.layout = layout  # (what a CapacityError names)

    def allocate(self, num_blocks: int, protect: frozenset[int] = frozenset(),
                 follow: list[tuple[int, int | None]] | None = None) -> list[int]:
        """New blocks outside a step (ref_count 1, unpinned on return); waits up to PIN_WAIT_S
        while running steps hold the room. CapacityError changes nothing."""
        state = self.state
        owner = pseudo_owner()
        deadline = time.monotonic() + PIN_WAIT_S
        while True:
            version = state.changes.version
            with self.lock:
                self.life.check_open()
                state.pin(owner, set())
            try:
                return self.allocate_pinned(owner, num_blocks, protect, follow)
            except Retry:
                state.changes.wait(version, min(0.05, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    raise self.capacity_error(num_blocks) from None
            finally:
                with self.lock:
                    state.unpin(owner)

    def allocate_pinned(self, owner: int, num_blocks: int, protect: frozenset[int] = frozenset(),
                        follow=None, result: DemandResult | None = None) -> list[int]:
        """New blocks pinned by `owner` (which the caller pinned, and unpins): see the module docstring."""
        if num_blocks == 0:
            return []
        if follow is not None and sum(count for count, _ in follow) != num_blocks:
            raise ValueError(f"allocate: follow {follow} covers {sum(c for c, _ in follow)} blocks, not {num_blocks}")
        state = self.state
        result = result if result is not None else DemandResult()
        for _ in range(MAX_ROUNDS):
            with self.lock:
                self.life.check_open()
                state.drain()
                keep = protect | frozenset(result.failed_blocks)
                leave_alone = state.leave_alone_for(owner, keep)
                plan = self.scheduler.plan_new_blocks(num_blocks, state.index, state.free_slots(), state.capacities,
                                                      keep, leave_alone)
                if plan is None:
                    self._no_room(owner, num_blocks, result)
                if not plan.num_moves:
                    block_ids = self._place(plan.new_block_tiers, follow, owner)
                    state.pin_more(owner, block_ids)
                    return block_ids
                first, rest = self.demand.prepare_parts(plan, leave_alone)
            settled, copied, _ = self.demand.pipeline(first, rest, leave_alone, result)
            if not copied and not settled:
                raise Retry()  # the moves need slots that copies in flight still hold
        raise Retry()

    def _no_room(self, owner: int, num_blocks: int, result: DemandResult) -> None:
        state = self.state
        if state.pinned_by_others(owner) or state.in_flight or state.num_deferred_frees:
            raise Retry()
        if result.failed_blocks:  # the only room is held by blocks whose copies keep failing
            error = result.errors[-1]
            raise CapacityError(f"need {num_blocks} more block(s) but the moves that would make room failed "
                                f"({type(error).__name__}: {error}); nothing else can move") from error
        raise self.capacity_error(num_blocks)

    def _place(self, tiers: list[int], follow, owner: int) -> list[int]:
        """Index entries for new blocks in the plan's `tiers`, hot ones consecutive per `follow` group."""
        state = self.state
        block_ids = []
        start = 0
        for count, previous in follow or [(len(tiers), None)]:
            group = tiers[start:start + count]
            start += count
            hot_slots = iter(self._hot_slots(group.count(HOT), previous, follow is not None, owner))
            if COLD in group:
                state.cold_room(group.count(COLD))  # slots holding only durable copies give way
            for tier in group:
                slot = next(hot_slots) if tier == HOT else state.pools[tier].allocate(1)[0]
                block_ids.append(state.index.add(tier, slot))
        return block_ids

    def _hot_slots(self, num_slots: int, previous: int | None, as_run: bool, owner: int) -> list[int]:
        if not num_slots:
            return []
        state, pool = self.state, self.state.pools[HOT]
        after = None
        if previous is not None and previous in state.index:
            entry = state.index.get(previous)
            after = entry.slot if entry.tier == HOT else None
        slots = pool.allocate_run(num_slots, after) if as_run else None
        if slots is None:  # no run is long enough: as few pieces as the free slots allow
            slots = pool.allocate_runs(num_slots, after) if as_run else pool.allocate(num_slots)
        if after is None or slots[0] != after + 1:
            self.compaction.note_layout_change(owner)  # the sequence may not continue in place here
        return slots

    def capacity_error(self, num_blocks: int) -> CapacityError:
        referenced = sum(1 for _, e in self.state.index.items() if e.ref_count > 0)
        hot, warm, cold = capacities = self.state.capacities
        return CapacityError(
            f"need {num_blocks} more blocks of {self.layout.block_size} tokens ({self.layout.block_bytes} bytes "
            f"each) but all tiers together hold {sum(capacities)} (hot {hot}, warm {warm}, cold {cold}) "
            f"and {referenced} are in use; raise a tier's capacity or shorten the conversation")

    def copy_pinned(self, owner: int, sources: list[int], result: DemandResult | None = None) -> list[int]:
        """Copy-on-write: a new block with each source's content, pinned by `owner` (which pins
        the sources too). Raises the copy's error (nothing left behind) or CorruptBlockError."""
        state = self.state
        copies = self.allocate_pinned(owner, len(sources), frozenset(sources), None, result)
        with self.lock:
            batch = self.transfers.prepare_copies(list(zip(copies, sources)), ON_DEMAND)
        self.demand.run_batch(batch)
        if batch.any_corrupt():
            with self.lock:
                state.release([b for b in copies if b in state.index])
            raise CorruptBlockError(f"blocks {sources} failed their checksum while being copied and must be "
                                    "recomputed")
        if batch.failed_parts:  # complete() freed the copies whose bytes never landed
            with self.lock:
                state.release([b for b in copies if b in state.index])
            raise batch.failure
        return copies

    def copy_block(self, block_id: int) -> int:
        """A new block with the same content (the caller releases the old one)."""
        owner = pseudo_owner()
        with self.lock:
            self.life.check_open()
            self.state.pin(owner, {block_id})
        try:
            return self.copy_pinned(owner, [block_id])[0]
        finally:
            with self.lock:
                self.state.unpin(owner)
