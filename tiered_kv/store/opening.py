"""Opening a step: everything a forward pass needs made true, then handed over as a StepLease.

`Opening.open_step(request)`, in rounds that each hold the store lock only to plan and to commit
(the copies between them run through the transfers, without the lock):
  1. pin the chat's blocks: no other plan moves them, and background moves of them still in
     flight are cancelled (they stay where the step will map them);
  2. copy-on-write: a partly filled tail that is shared or published gets a private copy;
  3. new blocks for the new tokens, placed as high as room allows (other blocks moved down first);
  4. on a new turn, the history comes up (hot first); a move that fails leaves its block where it
     was, and the step reads it from there;
  5. under the lock once more: placements, token runs, the access log, the lease.
It returns None ("retry once something changed": `TierStore.wait_for_change`) when the room the
step needs is held by other steps' pins or blocks in flight, or one of its blocks is in another
caller's on-demand move — vLLM's `allocate_slots` contract; it raises CapacityError when all
tiers together cannot hold the step. What it allocated is released again in both cases.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from ..blocks import HOT, TIER_NAMES, tier_counts
from ..metrics.registry import BACKGROUND, ON_DEMAND, Metrics
from ..scheduler.access_log import AccessLog
from .allocation import Allocation, Retry
from .compaction import HotCompaction
from .leases import LeaseRow, StepLease, StepRequest, reads_host
from .life import StoreLife
from .lock import StoreLock
from .mover import Mover
from .placement import Placement
from .reporting import count_turn_start
from .state import StoreState
from .step_build import StepBuild
from .token_map import TokenMapper


def touch_order(request: StepRequest, tables: list[list[int]], new_blocks: list[list[int]], block_size: int,
                allocated: list[int]) -> np.ndarray:
    """Every block a step reads or writes, once, in the order its recency touch gives them: the
    oldest sequence position first, every row's (and layer group's) block at one position before
    any at the next. All of them are read at the same store step, so LRU breaks their ties by this
    order: a later step that needs room takes the oldest positions of every group first, never one
    group's newest history before another group's oldest (a hybrid model's first groups would read
    their most recent blocks from a compressed tier while its last ones kept older blocks in hot).
    Blocks no table holds any more (a tail replaced by its copy) come first."""
    ids: list[int] = []
    positions: list[int] = []
    for r, table in enumerate(tables):
        first = request.first_token(r, block_size) // block_size
        gap = request.new_first_block(r)
        ids += table
        if gap is None:
            positions += range(first, first + len(table))
        else:  # gapped: the old blocks, then the new ones from the gap on
            num_old = len(table) - len(new_blocks[r])
            positions += range(first, first + num_old)
            positions += range(gap, gap + len(new_blocks[r]))
    ordered = np.asarray(ids, dtype=np.int64)[np.argsort(np.asarray(positions, dtype=np.int64), kind="stable")].tolist()
    held = set(ordered)
    rest = [b for b in itertools.chain(request.block_set, allocated) if b not in held]
    return np.fromiter(dict.fromkeys(itertools.chain(rest, ordered)), dtype=np.int64)


@dataclass
class OwnerCache:
    """Per chat (step owner), what lets a step skip O(blocks) work when nothing moved."""

    placement_version: int = -1
    tables: list | None = None  # [(table, tiers, slots)] per row, valid at placement_version


class Opening:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, block_size: int, metrics: Metrics,
                 access_log: AccessLog, compaction: HotCompaction, mapper: TokenMapper, allocation: Allocation,
                 placement: Placement, mover: Mover | None):
        self.lock, self.life, self.state, self.block_size = lock, life, state, block_size
        self.metrics, self.access_log, self.compaction = metrics, access_log, compaction  # told of every step
        self.mapper = mapper  # a lease's staged reads and writes (token_map.py)
        self.allocation, self.placement = allocation, placement  # new blocks, copies; promotions, undo
        self.mover = mover  # None: scheduler.background is off
        self.owners: dict[int, OwnerCache] = {}

    # ---- the whole step ---------------------------------------------------------------------------
    def open_step(self, request: StepRequest) -> StepLease | None:
        state, owner = self.state, request.owner
        with self.lock:
            self.life.check_open()
            state.drain()
            if self._in_demand_flight(request.block_set):
                return None
            build = StepBuild(self, request)
            build.shared_tails = self._shared_tails(request)
            if request.count_turn_start and request.promotion_order:  # where the history was when the turn began
                count_turn_start(self.metrics, state.placements(request.promotion_order)[0])
            if request.new_turn and state.copies is not None:  # a second turn reads them (cold.admit: reused)
                state.copies.reused(request.promotion_order, time.monotonic())
            self._cancel_background(request.block_set)
            state.pin(owner, request.block_set)  # last: nothing that can raise comes between it and the try
        try:
            build.copy_tails()
            build.allocate_new_blocks()
            if request.new_turn:
                build.promote_history()
            with self.lock:
                self.life.check_open()
                state.drain()
                return self._finish(build)
        except Retry:
            build.give_back()
            return None
        except BaseException:
            build.give_back()
            raise

    def _shared_tails(self, request: StepRequest) -> list[int]:
        """Rows whose partly filled tail is about to change but is shared or published (its
        content must stay): they get a private copy first."""
        if not request.num_tokens_before % self.block_size:
            return []
        index = self.state.index
        return [r for r, table in enumerate(request.tables)
                if table and request.new_first_block(r) is None  # (a gapped row never writes its tail)
                and (index.get(table[-1]).ref_count > 1 or index.get(table[-1]).key is not None)]

    def _in_demand_flight(self, block_set: set[int]) -> bool:
        """Some block of the step is in another caller's on-demand move (not a backup: it does
        not move its block)."""
        return self.state.in_flight.any_moving(block_set, ON_DEMAND)

    def _cancel_background(self, block_set: set[int]) -> None:
        """Cancel the background moves of the step's blocks (each counted once): they stay where
        the step maps them."""
        cancelled = self.state.in_flight.cancel_moves(block_set, BACKGROUND)
        if cancelled and self.mover is not None:
            self.mover.num_cancelled += cancelled

    def _finish(self, build: "StepBuild") -> StepLease:
        state, request, block_size = self.state, build.request, self.block_size
        cache = self.owners.setdefault(request.owner, OwnerCache())
        rows, tables = [], []
        for r, committed in enumerate(request.tables):
            table = list(committed)
            if r in build.tail_copies:
                table[-1] = build.tail_copies[r][1]
            table += build.new_blocks[r]
            tables.append(table)
            tiers, slots = self._placements(cache, r, table)
            first = request.first_token(r, block_size)  # the row's tokens from here on
            gap_at = request.new_first_block(r)
            if gap_at is None:
                rows.append(LeaseRow(table, build.new_blocks[r], build.tail_copies.get(r), tiers, slots,
                                     request.num_tokens_before - first, request.num_tokens - first,
                                     request.num_tokens - first))
                continue
            # gapped: the old blocks are read (tokens before the step), the new ones written from gap_at on
            num_old, new_from = len(committed), gap_at * block_size
            rows.append(LeaseRow(table, build.new_blocks[r], None, tiers, slots, num_old * block_size,
                                 num_old * block_size + request.num_tokens - new_from,
                                 max(0, request.num_tokens_before - first), new_from - request.num_tokens_before))
        cache.tables = [(row.table, row.tiers, row.slots) for row in rows]
        cache.placement_version = state.index.placement_version
        block_ids = touch_order(request, tables, build.new_blocks, block_size, build.allocated)
        counts = tier_counts([(row.tiers, None) for row in rows])
        moved_down = build.result.committed.any_down()
        lease = StepLease(self, request.owner, request.num_tokens, request.num_new_tokens, rows, build.result.committed,
                          reads_host(rows, block_size), state.index.placement_version, block_ids)
        lease.tables, lease.tier_counts = tables, counts
        # a step that reads history outside hot, or pushed blocks down to make room: ALI may want
        # blocks up again (read lately, now below hot)
        self._record_step(lease, request.cost_sensitivity, request.new_turn,
                          read_lower_tiers=moved_down or any(t != HOT for t in counts))
        state.pin_more(request.owner, build.allocated)
        build.handed_over = True
        return lease

    def open_decode(self, previous: StepLease, block_set: set[int], num_new_tokens: int, cost_sensitivity: float,
                    tails: list[int]) -> StepLease | None:
        """The lease of the next decode step of the chat that held `previous`, when its new tokens
        land in its rows' `tails` (blocks it holds alone, never published) and none of its blocks
        moved since: O(rows), plus the moves anyone made since (usually none), instead of
        open_step's O(blocks). None: take open_step."""
        state = self.state
        index, owner = state.index, previous.owner
        with self.lock:
            self.life.check_open()
            state.drain()
            if state.in_flight.blocks and self._in_demand_flight(block_set):
                return None
            for tail in tails:  # (shared since, by a copy of the bank: copied on write by open_step)
                entry = index.peek(tail)
                if entry is None or entry.ref_count != 1 or entry.key is not None:
                    return None
            if index.placement_version != previous.placement_version and \
                    index.moved_since(previous.placement_version, block_set):
                return None
            if state.in_flight.blocks:
                self._cancel_background(block_set)
            state.pin(owner, block_set)
            lease = previous.extended(num_new_tokens)
            lease.placement_version = index.placement_version
            lease.tables, lease.tier_counts = previous.tables, previous.tier_counts
            self._record_step(lease, cost_sensitivity, False, read_lower_tiers=any(t != HOT for t in lease.tier_counts))
        return lease

    def _record_step(self, lease: StepLease, cost_sensitivity: float, new_turn: bool, read_lower_tiers: bool) -> None:
        """What every step tells the store's bookkeeping, O(1) for a repeated decode step (the
        lease's block ids array is the same object; the recency touch is applied lazily)."""
        state, owner = self.state, lease.owner
        state.index.touch_later(owner, lease.block_ids)
        self.access_log.record_step(owner, lease.block_ids, lease.tables, cost_sensitivity, new_turn=new_turn)
        state.index.clock = self.access_log.now
        self.compaction.note_step(owner, [(row.table, row.tiers, row.slots) for row in lease.rows])
        hits = self.metrics.hits
        for tier, count in lease.tier_counts.items():
            hits.inc((TIER_NAMES[tier],), count)
        if self.mover is not None:
            self.mover.step_started(owner, read_lower_tiers=read_lower_tiers)
        lease.stream = state.step_fences.current_stream()  # this thread's: the forward runs on it
        state.leases[owner] = lease

    def _placements(self, cache: OwnerCache, row: int, table: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Tiers and slots of `table`; when nothing moved since the chat's last step, only its new
        blocks are looked up (O(new blocks) a decode step)."""
        state = self.state
        if cache.placement_version == state.index.placement_version and cache.tables is not None \
                and row < len(cache.tables):
            cached, tiers, slots = cache.tables[row]
            n = len(cached)
            if n <= len(table) and table[:n] == cached:
                if n == len(table):
                    return tiers, slots
                more_tiers, more_slots = state.placements(table[n:])
                return np.concatenate((tiers, more_tiers)), np.concatenate((slots, more_slots))
        return state.placements(table)

    def forget(self, owner: int) -> None:
        """The chat's bank closed or was collected (store lock held): its access history, rows
        and requests describe no live chat any more."""
        self.owners.pop(owner, None)
        self.access_log.forget_chat(owner)
        self.compaction.forget(owner)
        if self.mover is not None:
            self.mover.drop_requests(owner)

    # ---- what a lease asks of the store (its mapper too) ------------------------------------------
    @property
    def device(self):
        return self.mapper.device

    def end_lease(self, lease: StepLease, aborted: bool) -> None:
        """StepLease.commit / abort (leases.py): a completion fence on the stream the step ran on,
        that its hot and warm slots wait for before they are reused or copied (fences.py); unpin;
        on abort release what the step allocated and undo its moves as far as room allows."""
        if lease.ended:
            return
        lease.ended = True
        state = self.state
        fence = state.step_fences.record(lease)  # (an event on the forward's stream: nothing waits)
        with self.lock:
            state.step_fences.add(lease, fence)  # before unpinning: its slots are in use until it passed
            state.leases.pop(lease.owner, None)
            state.unpin(lease.owner)
            closed = self.life.closed
            if aborted and not closed:
                state.release(lease.allocated_block_ids)
            state.changes.bump()
        if aborted and not closed and lease.moves:
            self.placement.undo_moves(lease.moves)

    def mark_corrupt(self, block_id: int | None, tier: int | None = None, slot: int | None = None) -> None:
        """A lease's read found a block's bytes bad: never served again (StoreState.mark_corrupt)."""
        state = self.state
        with self.lock:
            if self.life.closed:
                return
            if block_id is None and tier is not None and slot is not None:
                block_id = state.block_at(tier, slot)
            if block_id is not None and block_id in state.index:
                state.mark_corrupt(block_id)


__all__ = ["Opening", "OwnerCache"]
