"""The store's side of a forward pass: pins, layer reads and writes, deferred releases.

Mixed into TierStore; every method takes the store lock. A step pins its bank's blocks from
layer 0 to its last layer (`begin_step` / `end_step`): plans never move or drop a pinned block,
so the step's token mapping stays valid while the model computes without the lock.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..errors import CorruptBlockError
from ..scheduler import TIER_NAMES, Move, Plan
from .token_map import TierRun, raise_if_corrupt


class StepAccess:
    def is_pinned(self, block_id: int) -> bool:
        """A running step uses the block, or a background move has it in flight: plans leave it."""
        mover = self._mover
        if mover is not None and block_id in mover.in_flight:
            return True
        return self.is_pinned_by_step(block_id)

    def is_pinned_by_step(self, block_id: int) -> bool:
        return any(block_id in blocks for blocks in self._pinned_by_step.values())

    def release_later(self, block_ids: list[int], step_block_ids: list[int], step_owner: int) -> None:
        """For a bank collected by the garbage collector: queue its references and its step's
        pins, to be dropped at the store's next operation. Takes no lock (the collector may run
        while this very thread holds it mid-operation); deque.append is atomic."""
        self._deferred.append((list(block_ids) + list(step_block_ids), step_owner))

    def drain_deferred(self) -> None:
        with self.lock:
            while self._deferred and not self._closed:
                block_ids, step_owner = self._deferred.popleft()
                self._pinned_by_step.pop(step_owner, None)
                self.access_log.forget_chat(step_owner)
                if self._mover is not None:
                    self._mover.drop_requests(step_owner)
                self.release(block_ids)
                self._executor.free_quarantined()
                self._step_ended.notify_all()

    # ---- tokens of one layer ---------------------------------------------------------------
    def map_tokens(self, block_ids: list[int], offsets: list[int]) -> list[TierRun]:
        """Runs for arbitrary tokens, each given as (block id, offset in block). The caller keeps
        the blocks from moving (a pinned step, or no other thread) while it uses the runs."""
        with self.lock:
            tiers, slots = self.placements(block_ids)
            raise_if_corrupt(tiers, np.asarray(block_ids, dtype=np.int64), "blocks")
            return self.mapper.group_by_tier(tiers, slots, np.asarray(offsets, dtype=np.int64))

    def map_segments(self, tiers: np.ndarray, slots: np.ndarray, start_token: int, end_token: int):
        """Like map_range, as segments of one tier each (TokenMapper.map_segments)."""
        with self.lock:
            return self.mapper.map_segments(tiers, slots, start_token, end_token)

    def map_range(self, tiers: np.ndarray, slots: np.ndarray, start_token: int, end_token: int) -> list[TierRun]:
        """Runs for tokens [start_token, end_token) of a sequence whose blocks lie at (tiers, slots)."""
        with self.lock:
            return self.mapper.map_range(tiers, slots, start_token, end_token)

    def read_layer(self, layer: int, runs: list[TierRun], num_tokens: int) -> torch.Tensor:
        """One layer's K/V of the mapped tokens. A slice that fails its check marks its block
        corrupt (never served; banks holding it drop it and recompute) before the error goes up."""
        with self.lock, self._corrupt_blocks_marked():
            return self.mapper.read_layer(layer, runs, num_tokens)

    def read_runs_into(self, layer: int, items: list) -> None:
        """For each `(run, out, positions)`: copy one layer's K/V of the run's tokens into `out`
        (`[2, H, n, D]`, a stream buffer's slice), at `positions` along the token axis, or in
        order when positions is None. Corrupt slices are marked as in read_layer."""
        with self.lock, self._corrupt_blocks_marked():
            for run, out, positions in items:
                self.mapper.read_into(layer, run, out, positions)

    def read_run(self, layer: int, run: TierRun) -> torch.Tensor:
        """`[2, H, n, D]` of one run: a view of the slab for a hot slice (no copy)."""
        with self.lock, self._corrupt_blocks_marked():
            return self.mapper.read_run(layer, run)

    @contextlib.contextmanager
    def _corrupt_blocks_marked(self):
        try:
            yield
        except CorruptBlockError as error:
            block_id = self._block_at(getattr(error, "tier", None), getattr(error, "slot", None))
            if block_id is not None:
                self._executor.mark_corrupt(block_id)
                error.block_id = block_id
            raise

    def _block_at(self, tier, slot) -> int | None:
        """The block at (tier, slot): a scan, on the rare path of a failed read only."""
        if tier is None or slot is None:
            return None
        return next((b for b, e in self.index.items() if e.tier == tier and e.slot == slot), None)

    def write_layer(self, layer: int, runs: list[TierRun], kv: torch.Tensor) -> None:
        with self.lock:
            self.mapper.write_layer(layer, runs, kv)

    # ---- steps -----------------------------------------------------------------------------
    def begin_step(self, owner: int, block_ids: set[int], tables: list[list[int]] | None = None,
                   cost_sensitivity: float | None = None) -> None:
        """Pin `block_ids` for a forward pass of `owner` until end_step(owner), and count the
        step in the access log (the step reads every one of them; `tables` are the chat's
        block ids per row in token order). Background moves of these blocks still in flight
        are cancelled: they stay where this step maps them."""
        with self.lock:
            self._pinned_by_step[owner] = block_ids
            if self._mover is not None:
                self._mover.cancel(block_ids)
                self._mover.step_started(owner)
            self.access_log.record_step(owner, block_ids, tables, cost_sensitivity)
            self.index.clock = self.access_log.now

    def end_step(self, owner: int, read_host_tiers: bool = False) -> None:
        """Unpin a step's blocks (it ended or was rolled back). Cold records become durable off
        this path, on the cold tier's writer thread (see ColdTier.persist)."""
        with self.lock:
            if self._pinned_by_step.pop(owner, None) is None:
                return
            self._executor.free_quarantined()
            if read_host_tiers:
                self.copy_engine.after_host_to_device()  # warm slots may be reused by the host next
            self._step_ended.notify_all()  # the mover is not woken: it looks every mover_interval_s

    def touch(self, block_ids) -> None:
        with self.lock:
            self.index.touch(block_ids)

    def count_hits(self, tier_counts: dict[int, int]) -> None:
        for tier, count in tier_counts.items():
            self.metrics.hits.inc((TIER_NAMES[tier],), count)

    def count_turn_start(self, tier_counts: dict[int, int]) -> None:
        """A turn began needing these blocks, found in these tiers (the hit-rate figures)."""
        for tier, count in tier_counts.items():
            self.metrics.turn_blocks.inc((TIER_NAMES[tier],), count)

    # ---- undoing a failed step's moves -------------------------------------------------------
    def start_journal(self) -> None:
        """Record the moves this thread's next operations apply (see `undo_moves`)."""
        with self.lock:
            self._executor.start_journal()

    def stop_journal(self) -> list:
        with self.lock:
            return self._executor.stop_journal()

    def undo_moves(self, moves: list) -> None:
        """Put blocks back where they were before `moves` (newest first), as far as each block
        is still where the move left it, unpinned, and its old tier has a free slot. Dropped
        blocks cannot come back; everything else returns, so a rolled-back step leaves tier use
        as it found it."""
        with self.lock:
            back = []
            free = self.free_slots()
            tier_now: dict[int, int] = {}  # as the moves back so far leave them
            for move in reversed(moves):
                block_id = move.block_id
                if block_id not in self.index or self.is_pinned(block_id):
                    continue
                tier = tier_now.get(block_id, self.index.get(block_id).tier)
                if tier != move.dst_tier or free[move.src_tier] == 0:
                    continue
                back.append(Move(block_id, move.dst_tier, move.src_tier))
                tier_now[block_id] = move.src_tier
                free[move.src_tier] -= 1
                free[move.dst_tier] += 1
            if back:
                self._executor.apply(Plan(moves=back), batch_cold_moves=False)
