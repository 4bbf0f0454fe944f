"""Transfers: the one path by which bytes move between tiers, and the only code that frees a slot
after a copy (DESIGN.md, invariant 7; docs/design.md, "A move").

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

from ..block_index import BlockEntry
from ..blocks import COLD, DROPPED, HOT, TIER_NAMES, WARM
from ..hw.block_io import ColdWriteError
from ..hw.copy_engine import CopyEvent
from ..logs import Throttle
from ..metrics.registry import BACKGROUND, Metrics
from ..scheduler import Move
from . import copies
from .batches import Transfer, TransferBatch
from . import failures, write_behind
from .copies import BACKUP, COPY, MOVE, READ_OUT, WRITE_IN
from .state import StoreState

log = logging.getLogger(__name__)

RUNS_FROM_BLOCKS = 8  # a batch of this many moves into warm takes its slots in runs (into hot: 2)


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
        self._failure_warnings = Throttle(log)
        self.closed = False  # after close(): nothing is prepared any more

    # ---- prepare (store lock held) -------------------------------------------------------------
    def prepare(self, moves: list[Move], mode: str, movable=None) -> TransferBatch:
        """A batch of the `moves` that can go now: each block still where the move says, not in
        flight, allowed by `movable` (a plan's predicate of blocks to leave alone), and with a free
        destination slot (the first moves in plan order get them). The others wait for a later
        batch, planned afresh. Destination slots are taken per tier at once, in as few runs as
        the pool allows, so that a chat's blocks copy as a few large runs (see `_reserve_runs`)."""
        state, index, in_flight = self.state, self.state.index, self.state.in_flight
        batch = TransferBatch(mode)
        if self.closed:  # a caller still running while its store closed: nothing moves any more
            return batch
        taken: set[int] = set()
        wanted: dict[int, list] = {}  # destination tier -> [(block id, src tier, src slot, move)] in plan order
        placed: list[tuple[int, BlockEntry, int, int]] = []  # compaction: (block, entry, tier, slot)
        peek = index.peek
        for move in moves:
            block_id, src_tier, dst_tier, dst_slot = move
            if block_id in taken or block_id in in_flight or (movable is not None and movable(block_id)):
                continue
            entry = peek(block_id)
            if entry is None or entry.tier != src_tier:
                continue
            taken.add(block_id)
            if dst_tier == COLD and state.copies and block_id in state.copies:
                state.adopt_copy(block_id)  # down to its durable copy: nothing to write
                batch.num_adopted += 1
            elif dst_tier == DROPPED:
                if entry.ref_count == 0:
                    if state.evict(block_id):
                        batch.num_evictions += 1
                    else:
                        batch.num_adopted += 1
            elif dst_slot is not None:
                placed.append((block_id, entry, dst_tier, dst_slot))
            else:
                group = wanted.get(dst_tier)
                if group is None:
                    group = wanted[dst_tier] = []
                group.append((block_id, entry.tier, entry.slot, move))
        transfers = batch.transfers
        for block_id, entry, tier, slot in placed:
            if self._reserve(tier, slot):
                transfers.append(Transfer(block_id, entry.tier, entry.slot, tier, slot, batch))
        for tier, group in wanted.items():
            group = group[:state.cold_room(len(group)) if tier == COLD else state.pools[tier].num_free]
            # slots in runs: into hot in token order (a chat's ids grow with its tokens; attention
            # reads one slice), below in source order (both sides of the copy advance together).
            # The order of the transfers is the order blocks enter the tier's recency order: into
            # hot token order too (a chat's oldest tokens are its first victims, so its hot part
            # stays one run), below the plan's (its victims' LRU order)
            order = sorted(range(len(group)), key=(lambda i: group[i][0]) if tier == HOT else
                           (lambda i: group[i][1] << 40 | group[i][2]))  # (source tier, source slot)
            slots = [0] * len(group)
            for i, slot in zip(order, self._reserve_runs(tier, len(group))):
                slots[i] = slot
            transfers += [Transfer(group[i][0], group[i][1], group[i][2], tier, slots[i], batch, move=group[i][3])
                          for i in (order if tier == HOT else range(len(group)))]
        for t in transfers:
            in_flight[t.block_id] = t
        state.report_evictions(batch.num_evictions, "the background mover" if mode == BACKGROUND else "a plan")
        return batch

    def prepare_copies(self, pairs: list[tuple[int, int]], mode: str) -> TransferBatch:
        """Copy-on-write: fill each new block (first of a pair, already allocated) from the
        other block's slot (its caller keeps that block from moving)."""
        batch = TransferBatch(mode)
        for new_id, src_id in pairs:
            src, dst = self.state.index.get(src_id), self.state.index.get(new_id)
            self._add(batch, Transfer(new_id, src.tier, src.slot, dst.tier, dst.slot, batch, kind=COPY, src_block=src_id))
        return batch

    def prepare_write_in(self, blocks: list[tuple[int, object]], mode: str) -> TransferBatch:
        """Fill new blocks (already allocated) from host tensors `[1, L, 2, H, bs, D]`."""
        batch = TransferBatch(mode)
        for block_id, data in blocks:
            entry = self.state.index.get(block_id)
            self._add(batch, Transfer(block_id, -1, -1, entry.tier, entry.slot, batch, kind=WRITE_IN, data=data))
        return batch

    def prepare_read_out(self, block_id: int, out, mode: str) -> TransferBatch:
        """Copy one block into the host tensor `out` (its caller pins the block meanwhile)."""
        batch = TransferBatch(mode)
        entry = self.state.index.get(block_id)
        batch.transfers.append(Transfer(block_id, entry.tier, entry.slot, -1, -1, batch, kind=READ_OUT, data=out))
        return batch

    def _add(self, batch: TransferBatch, transfer: Transfer) -> None:
        self.state.in_flight[transfer.block_id] = transfer
        batch.transfers.append(transfer)

    def _reserve(self, tier: int, slot: int) -> bool:
        pool = self.state.pools[tier]
        if 0 <= slot < pool.num_slots and not pool.is_used(slot):
            pool.take([slot])
            return True
        return False

    def _reserve_runs(self, tier: int, num_slots: int) -> list[int]:
        """`num_slots` free slots of `tier` (the caller checked there are): in hot and warm as few
        consecutive runs as the pool has (one, when a free run is long enough), in cold the
        pool's order (a file slot's place matters little; its pool can be very large)."""
        pool = self.state.pools[tier]
        if tier == COLD or num_slots < (2 if tier == HOT else RUNS_FROM_BLOCKS):
            return pool.allocate(num_slots) or []
        return pool.allocate_run(num_slots) or pool.allocate_runs(num_slots) or []

    # ---- launch (no lock) ----------------------------------------------------------------------
    def launch(self, batch: TransferBatch) -> None:
        """Issue the batch's copies as one unit of the copy engine; the batch's event passes when
        they are done. An exception here fails the whole batch (see the module docstring)."""
        batch.started_s = time.perf_counter()
        if not batch.transfers:
            return
        staging, after = self.staging[batch.mode], self.state.step_fences.for_transfers(batch.transfers)
        tiers, transfers = self.state.tiers, list(batch.transfers)
        with staging.lock:  # one batch at a time per staging set; waits for its previous user's copies
            staging.wait_idle()
            try:
                batch.event = self.engine.submit(lambda: copies.run(tiers, transfers, staging, self.engine,
                                                                    self.metrics, self.rates), after=after)
            except BaseException as interrupt:  # (an interrupt: the copies issued so far keep their event)
                batch.event = getattr(interrupt, "copy_event", None)
                raise
            finally:
                staging.last_event = batch.event

    def run(self, batch: TransferBatch) -> None:
        """launch, then wait for the copies (no lock held). A raising launch marks the batch failed;
        an interrupt (KeyboardInterrupt) is raised again once the batch can be completed."""
        try:
            self.launch(batch)
        except Exception as error:  # noqa: BLE001 - the batch fails; complete() reports it
            batch.error = error
        except BaseException as error:
            batch.error = error
            batch.wait()
            raise
        batch.wait()

    # ---- complete (store lock held) ------------------------------------------------------------
    def complete(self, batch: TransferBatch) -> None:
        """Commit what copied without error; give back what did not (see the module docstring).
        The bookkeeping is per batch: one index update, one free and one count per direction."""
        if batch.completed:
            return
        batch.completed = True
        state, index, in_flight, event = self.state, self.state.index, self.state.in_flight, batch.event
        error = batch.failure
        landed: dict[tuple[int, int], int] = {}  # (src, dst) -> blocks whose bytes landed
        commits: dict[tuple[int, int], tuple[list, list, list]] = {}  # -> (blocks, dst slots, src slots)
        given_back: dict[int, list[int]] = {}  # tier -> reserved slots no block took
        backups = []
        for t in batch.transfers:
            if t.kind == BACKUP:
                backups.append(t)
                continue
            if t.kind != MOVE:
                if t.kind != READ_OUT:
                    self._complete_fill(t, batch, error, landed)
                continue
            block_id = t.block_id
            if in_flight.get(block_id) is t:
                del in_flight[block_id]
            entry = index.peek(block_id)
            still_there = entry is not None and entry.tier == t.src_tier and entry.slot == t.src_slot
            if error is None and still_there and not t.cancelled and not t.corrupt:
                group = commits.get((t.src_tier, t.dst_tier))
                if group is None:
                    group = commits[(t.src_tier, t.dst_tier)] = ([], [], [])
                group[0].append(block_id)
                group[1].append(t.dst_slot)
                group[2].append(t.src_slot)
                batch.committed.append(t.move if t.move is not None else Move(block_id, t.src_tier, t.dst_tier))
                continue
            given_back.setdefault(t.dst_tier, []).append(t.dst_slot)
            if error is not None:
                batch.failed.append(t)
            elif t.corrupt and still_there and not t.cancelled:
                state.mark_corrupt(block_id)
                batch.corrupt.append(block_id)
        for (src, dst), (block_ids, dst_slots, src_slots) in commits.items():
            self._commit_moves(src, dst, block_ids, dst_slots, src_slots, event)
            if src != dst:
                landed[(src, dst)] = landed.get((src, dst), 0) + len(block_ids)
        if backups:
            write_behind.complete_backups(self, backups, error, landed, given_back)
        for tier, slot in batch.frees:
            given_back.setdefault(tier, []).append(slot)
        batch.frees.clear()
        for tier, slots in given_back.items():
            state.free_slots_after(tier, slots, after=event)
        for (src, dst), count in landed.items():
            self._count_bytes(src, dst, count * self.moved_bytes[(src, dst)], batch.mode)
        self._observe_copy_seconds(batch, landed)
        if isinstance(error, ColdWriteError):
            failures.drop_cached_that_failed_into_cold(state, batch)
        if error is not None and batch.failed:
            failures.report(self.metrics, self._failure_warnings, batch, error)
        state.changes.bump()

    def _complete_fill(self, t: Transfer, batch: TransferBatch, error, landed: dict) -> None:
        """A copy-on-write or write-in: the new block is at its destination already."""
        state, index = self.state, self.state.index
        if t.corrupt and error is None and t.src_block in index:  # the source's bytes are bad
            state.mark_corrupt(t.src_block)
            batch.corrupt.append(t.src_block)
        if error is not None and not t.cancelled:
            batch.failed.append(t)  # its bytes never landed: the block goes, never served
            state.free_block(t.block_id)  # (in flight still: its slot waits for the event)
        elif t.kind == COPY and not t.cancelled and t.src_tier != t.dst_tier:
            landed[(t.src_tier, t.dst_tier)] = landed.get((t.src_tier, t.dst_tier), 0) + 1
        if state.in_flight.get(t.block_id) is t:
            del state.in_flight[t.block_id]

    def _commit_moves(self, src: int, dst: int, block_ids: list[int], dst_slots: list[int], src_slots: list[int],
                      event: CopyEvent | None) -> None:
        """The blocks live at their destinations from now on; their source slots are freed once
        the event has passed."""
        state, metrics, count = self.state, self.metrics, len(block_ids)
        if src == dst:  # compaction: each block keeps its place in the tier's orders
            for block_id, slot in zip(block_ids, dst_slots):
                state.index.relocate(block_id, slot)
            metrics.relocations.inc((), count)
        else:
            state.index.move_many(block_ids, src, dst, dst_slots)
            metrics.blocks_moved.inc((TIER_NAMES[src], TIER_NAMES[dst]), count)
            (metrics.demotions if dst > src else metrics.promotions).inc((), count)
            if dst == COLD:
                for block_id in block_ids:
                    state.persist_if_published(block_id)
            elif src == COLD:
                src_slots = write_behind.keep_records(state, block_ids, src_slots)
        state.free_slots_after(src, src_slots, after=event)

    def _count_bytes(self, src_tier: int, dst_tier: int, num_bytes: int, mode: str) -> None:
        self.metrics.bytes_moved.inc((TIER_NAMES[src_tier], TIER_NAMES[dst_tier], mode), num_bytes)
        if HOT in (src_tier, dst_tier):
            self.link_monitor.record(num_bytes)

    def _observe_copy_seconds(self, batch: TransferBatch, directions) -> None:
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


__all__ = ["Transfers", "Transfer", "TransferBatch"]
