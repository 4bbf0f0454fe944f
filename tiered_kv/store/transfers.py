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
from dataclasses import dataclass, field

from ..blocks import DROPPED, HOT, TIER_NAMES
from ..hw.copy_engine import CopyEvent
from ..logs import Throttle, error_name
from ..metrics.registry import BACKGROUND, Metrics
from ..scheduler import Move
from . import copies
from .copies import COPY, MOVE, READ_OUT, WRITE_IN
from .state import StoreState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Transfer:
    """One block's copy. A move takes the block to (dst_tier, dst_slot); a copy fills a new block
    (`block_id`, already at its destination) from another block's slot; a read-out copies a block
    into host memory (`out`); a write-in fills a new block from host bytes (`data`)."""

    block_id: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    batch: "TransferBatch"
    kind: str = MOVE
    data: object = None  # write-in: the block's bytes (a host tensor); read-out: the host tensor filled
    cancelled: bool = False  # a step began to use the block where it was, or it was freed
    corrupt: bool = False  # the source failed its checksum on the way
    src_block: int | None = None  # a copy: the block copied from


@dataclass(eq=False)
class TransferBatch:
    mode: str  # metrics.registry.ON_DEMAND | BACKGROUND
    transfers: list[Transfer] = field(default_factory=list)
    event: CopyEvent | None = None
    error: BaseException | None = None  # raised by launch (or recorded by the engine on the event)
    frees: list[tuple[int, int]] = field(default_factory=list)  # slots to free once the copies are done
    num_evictions: int = 0
    started_s: float = 0.0
    quiet: bool = False  # the caller reports a failure itself (the moves to cold at close)
    # filled by complete():
    committed: list[Move] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    failed: list[Transfer] = field(default_factory=list)
    completed: bool = False

    @property
    def failure(self) -> BaseException | None:
        if self.error is not None:
            return self.error
        return self.event.error if self.event is not None else None

    def wait(self) -> None:
        """Until the batch's copies are done (no store lock may be held)."""
        if self.event is not None:
            self.event.wait()


class Transfers:
    def __init__(self, state: StoreState, engine, metrics: Metrics, link_monitor, block_bytes: int, staging: dict):
        self.state = state
        self.engine = engine
        self.metrics = metrics
        self.link_monitor = link_monitor
        self.block_bytes = block_bytes
        self.staging = staging  # mode -> copies.Staging (host staging, device staging, reader)
        self._failure_warnings = Throttle(log)
        self.closed = False  # after close(): nothing is prepared any more

    # ---- prepare (store lock held) -------------------------------------------------------------
    def prepare(self, moves: list[Move], mode: str, movable=None) -> TransferBatch:
        """A batch of the `moves` that can go now: each block still where the move says, not in
        flight, allowed by `movable` (a plan's predicate of blocks to leave alone), and with a free
        destination slot. The others wait for a later batch, planned afresh."""
        state, index = self.state, self.state.index
        batch = TransferBatch(mode)
        if self.closed:  # a caller still running while its store closed: nothing moves any more
            return batch
        hot_run = self._hot_run([m for m in moves if m.dst_tier == HOT and m.dst_slot is None])
        taken: set[int] = set()
        for move in moves:
            block_id = move.block_id
            if block_id in taken or block_id not in index or block_id in state.in_flight \
                    or (movable is not None and movable(block_id)):
                continue
            entry = index.get(block_id)
            if entry.tier != move.src_tier:
                continue
            if move.dst_tier == DROPPED:
                if entry.ref_count == 0:
                    state.evict(block_id)
                    batch.num_evictions += 1
                    taken.add(block_id)
                continue
            slot = hot_run.pop(block_id, None) if move.dst_tier == HOT else None
            if slot is None:
                slot = self._reserve(move.dst_tier, move.dst_slot)
            if slot is None:
                continue
            self._add(batch, Transfer(block_id, entry.tier, entry.slot, move.dst_tier, slot, batch))
            taken.add(block_id)
        if hot_run:
            state.pools[HOT].free(list(hot_run.values()))
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

    def _reserve(self, tier: int, slot: int | None) -> int | None:
        pool = self.state.pools[tier]
        if slot is None:
            return (pool.allocate(1) or [None])[0]
        if 0 <= slot < pool.num_slots and not pool.is_used(slot):
            pool.take([slot])
            return slot
        return None

    def _hot_run(self, into_hot: list[Move]) -> dict[int, int]:
        """Consecutive hot slots for moves into hot, in ascending block id order (a chat's blocks
        were allocated in token order: they land in token order, and attention reads them as one
        slice), when hot has a free run for all of them."""
        pool = self.state.pools[HOT] if self.state.pools else None
        if pool is None or len(into_hot) < 2 or len(into_hot) > pool.num_free:
            return {}
        slots = pool.allocate_run(len(into_hot))
        return dict(zip(sorted(m.block_id for m in into_hot), slots)) if slots is not None else {}

    # ---- launch (no lock) ----------------------------------------------------------------------
    def launch(self, batch: TransferBatch) -> None:
        """Issue the batch's copies as one unit of the copy engine; the batch's event passes when
        they are done. An exception here fails the whole batch (see the module docstring)."""
        batch.started_s = time.perf_counter()
        if not batch.transfers:
            return
        staging = self.staging[batch.mode]
        tiers, transfers = self.state.tiers, list(batch.transfers)
        with staging.lock:  # one batch at a time per staging set; waits for its previous user's copies
            staging.wait_idle()
            try:
                batch.event = self.engine.submit(lambda: copies.run(tiers, transfers, staging, self.engine,
                                                                    self.metrics))
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
        """Commit what copied without error; give back what did not (see the module docstring)."""
        if batch.completed:
            return
        batch.completed = True
        state, index, event = self.state, self.state.index, batch.event
        error = batch.failure
        landed_bytes: dict[tuple[int, int], int] = {}
        for t in batch.transfers:
            if t.kind == READ_OUT:
                continue
            if t.kind in (COPY, WRITE_IN):  # the new block is at its destination already
                if t.corrupt and error is None and t.src_block in index:  # the source's bytes are bad
                    state.mark_corrupt(t.src_block)
                    batch.corrupt.append(t.src_block)
                if error is not None and not t.cancelled:
                    batch.failed.append(t)  # its bytes never landed: the block goes, never served
                    state.free_block(t.block_id)  # (in flight still: its slot waits for the event)
                elif t.kind == COPY and not t.cancelled and t.src_tier != t.dst_tier:
                    landed_bytes[(t.src_tier, t.dst_tier)] = landed_bytes.get((t.src_tier, t.dst_tier), 0) + 1
                if state.in_flight.get(t.block_id) is t:
                    del state.in_flight[t.block_id]
                continue
            if state.in_flight.get(t.block_id) is t:
                del state.in_flight[t.block_id]
            entry = index.get(t.block_id) if t.block_id in index else None
            still_there = entry is not None and entry.tier == t.src_tier and entry.slot == t.src_slot
            if error is not None or t.cancelled or not still_there or t.corrupt:
                state.free_slot(t.dst_tier, t.dst_slot, after=event)
                if error is not None:
                    batch.failed.append(t)
                elif t.corrupt and still_there and not t.cancelled:
                    state.mark_corrupt(t.block_id)
                    batch.corrupt.append(t.block_id)
                continue
            self._commit_move(t, event)
            batch.committed.append(Move(t.block_id, t.src_tier, t.dst_tier))
            if t.src_tier != t.dst_tier:
                landed_bytes[(t.src_tier, t.dst_tier)] = landed_bytes.get((t.src_tier, t.dst_tier), 0) + 1
        for tier, slot in batch.frees:
            state.free_slot(tier, slot, after=event)
        batch.frees.clear()
        for (src, dst), count in landed_bytes.items():
            self._count_bytes(src, dst, count * self.block_bytes, batch.mode)
        self._observe_copy_seconds(batch, landed_bytes)
        if error is not None and batch.failed:
            self._report_failure(batch, error)
        state.changes.bump()

    def _commit_move(self, t: Transfer, event: CopyEvent | None) -> None:
        state, metrics = self.state, self.metrics
        if t.src_tier == t.dst_tier:  # compaction: the block keeps its place in the tier's orders
            state.index.relocate(t.block_id, t.dst_slot)
            metrics.relocations.inc()
        else:
            state.index.move(t.block_id, t.dst_tier, t.dst_slot)
            metrics.blocks_moved.inc((TIER_NAMES[t.src_tier], TIER_NAMES[t.dst_tier]))
            (metrics.demotions if t.dst_tier > t.src_tier else metrics.promotions).inc()
            state.persist_if_published(t.block_id)
        state.free_slot(t.src_tier, t.src_slot, after=event)

    def _count_bytes(self, src_tier: int, dst_tier: int, num_bytes: int, mode: str) -> None:
        self.metrics.bytes_moved.inc((TIER_NAMES[src_tier], TIER_NAMES[dst_tier], mode), num_bytes)
        if HOT in (src_tier, dst_tier):
            self.link_monitor.record(num_bytes)

    def _report_failure(self, batch: TransferBatch, error: BaseException) -> None:
        """Counted always; one warning per interval (a full disk fails every batch): what failed,
        why (the errno name, the file), and that the blocks stay where they were."""
        self.metrics.failed_moves.inc((batch.mode, error_name(error)), len(batch.failed))
        if batch.quiet:
            return
        directions: dict[str, int] = {}
        for t in batch.failed:
            direction = f"{TIER_NAMES[t.src_tier] if t.src_tier >= 0 else 'host'}->{TIER_NAMES[t.dst_tier]}"
            directions[direction] = directions.get(direction, 0) + 1
        sources = sorted({TIER_NAMES[t.src_tier] for t in batch.failed if t.src_tier >= 0})
        where = f", {error.filename}" if getattr(error, "filename", None) else ""
        self._failure_warnings.warning(
            "%s move of %d block(s) (%s) failed (%s: %s%s): nothing moved, they stay in %s",
            "background" if batch.mode == BACKGROUND else "on-demand", len(batch.failed),
            ", ".join(f"{n} {d}" for d, n in directions.items()), error_name(error),
            getattr(error, "strerror", None) or error, where, " and ".join(sources) or "place")

    def _observe_copy_seconds(self, batch: TransferBatch, directions) -> None:
        """Seconds from launch to complete, once per direction that landed."""
        if batch.started_s:
            elapsed = time.perf_counter() - batch.started_s
            for src, dst in directions:
                self.metrics.copy_seconds.observe((TIER_NAMES[src], TIER_NAMES[dst]), elapsed)

    def close(self) -> None:
        """Wait for every copy issued, then stop the engine and the staging readers."""
        self.closed = True
        self.engine.synchronize()
        self.engine.close()
        for staging in self.staging.values():
            staging.close()


__all__ = ["Transfers", "Transfer", "TransferBatch"]
