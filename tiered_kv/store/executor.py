"""PlanExecutor: carries out a scheduler Plan move by move, and copies block data between tiers.

Each move allocates its destination slot, copies, then frees its source slot, so a plan never
needs spare room. A run of moves between hot and warm in one direction takes its destination
slots move by move as single moves would (the same slots), then copies as one batch through the
BlockCopier (hw/block_copy.py: a few large copies, not one per block), then commits move by
move in plan order. Runs of moves into or out of the cold tier go through one preallocated host
staging buffer in chunks (one preadv per run of slots, one copy to the destination). A block
whose bytes fail their checksum on the way is marked corrupt (no data, no key, no slot) and
reported; it is never copied anywhere. The caller (TierStore) holds the store lock throughout:
the staging buffer and every tier's scratch space are used by one plan at a time.

GPU ordering: copies between device and host run on the copy engine's side stream; before the
host touches memory such a copy may still use, and before the staging buffer is refilled while
an asynchronous host-to-device copy may still be reading it, the executor waits on the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..block_index import BlockIndex
from ..errors import CorruptBlockError
from ..hw.block_copy import BlockCopier
from ..logs import Throttle
from ..metrics.registry import BACKGROUND, ON_DEMAND, Metrics
from ..pool import SlotPool
from ..scheduler import COLD, DROPPED, HOT, TIER_NAMES, WARM, Move, Plan

log = logging.getLogger(__name__)


class PlanExecutor:
    def __init__(self, tiers: list, pools: list[SlotPool], index: BlockIndex, staging: torch.Tensor,
                 copy_engine, link_monitor, block_bytes: int, is_pinned, block_copier: BlockCopier | None = None,
                 metrics: Metrics | None = None):
        self.tiers = tiers
        self.pools = pools
        self.index = index
        self.staging = staging
        self.copy_engine = copy_engine
        self.block_copier = block_copier if block_copier is not None else BlockCopier(copy_engine)
        self.link_monitor = link_monitor
        self.block_bytes = block_bytes
        self.is_pinned = is_pinned
        self.quarantined: list[tuple[int, int, int]] = []  # (block, tier, slot) of pinned corrupt blocks
        self.metrics = metrics if metrics is not None else Metrics()
        self._journals: dict[int, list[Move]] = {}  # thread id -> moves applied while it records
        self._reader: ThreadPoolExecutor | None = None  # reads cold chunks ahead (see _Reads)
        # what moved is counted in `metrics` (the store's); seconds callers spent moving are also
        # kept per thread, for a bank's own figures
        self._thread_move_s = threading.local()
        self._drop_warnings = Throttle(log)  # a full cache drops blocks every step: warn now and then

    # ---- what moved, read back from the store's metrics ----------------------------------------
    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved per direction ("hot->warm": n), on demand and background together."""
        out = {f"{a}->{b}": 0 for a in TIER_NAMES for b in TIER_NAMES if a != b}
        for (src, dst, _), num_bytes in self.metrics.bytes_moved.snapshot_values():
            out[f"{src}->{dst}"] += int(num_bytes)
        return out

    def _bytes_in_mode(self, mode: str) -> int:
        return int(sum(n for (_, _, m), n in self.metrics.bytes_moved.snapshot_values() if m == mode))

    @property
    def bytes_on_demand(self) -> int:
        return self._bytes_in_mode(ON_DEMAND)

    @property
    def bytes_background(self) -> int:
        return self._bytes_in_mode(BACKGROUND)

    @property
    def num_moves(self) -> dict[str, int]:
        m = self.metrics
        return {"promotions": int(m.promotions.value()), "demotions": int(m.demotions.value()),
                "evictions": int(m.evictions.value())}

    @property
    def num_relocations(self) -> int:
        """Compaction moves within the hot tier."""
        return int(self.metrics.relocations.value())

    @property
    def move_s(self) -> dict[str, float]:
        seconds = self.metrics.move_seconds
        return {"demote": seconds.value(("demote",)), "promote": seconds.value(("promote",))}

    def thread_move_seconds(self) -> dict:
        """Seconds this thread has spent in demand moves so far (demote, promote)."""
        totals = getattr(self._thread_move_s, "totals", None)
        if totals is None:
            totals = self._thread_move_s.totals = {"demote": 0.0, "promote": 0.0}
        return totals

    def _timed(self, direction: str, start_s: float, src_tier: int | None = None, dst_tier: int | None = None) -> None:
        """A caller waited since `start_s` for moves (between `src_tier` and `dst_tier` when known)."""
        elapsed = time.perf_counter() - start_s
        self.metrics.move_seconds.inc((direction,), elapsed)
        if src_tier is not None:
            self.metrics.copy_seconds.observe((TIER_NAMES[src_tier], TIER_NAMES[dst_tier]), elapsed)
        self.thread_move_seconds()[direction] += elapsed

    def _count_move(self, src_tier: int, dst_tier: int) -> None:
        m = self.metrics
        if dst_tier == DROPPED:
            m.evictions.inc()
            return
        m.blocks_moved.inc((TIER_NAMES[src_tier], TIER_NAMES[dst_tier]))
        if dst_tier > src_tier:
            m.demotions.inc()
        elif dst_tier < src_tier:
            m.promotions.inc()

    # ---- a journal of moves, so a failed step can put blocks back ------------------------------
    def start_journal(self) -> None:
        self._journals[threading.get_ident()] = []

    def stop_journal(self) -> list[Move]:
        return self._journals.pop(threading.get_ident(), [])

    def _record(self, block_id: int, src_tier: int, dst_tier: int) -> None:
        journal = self._journals.get(threading.get_ident())
        if journal is not None:
            journal.append(Move(block_id, src_tier, dst_tier))

    # ---- plans -----------------------------------------------------------------------------
    def apply(self, plan: Plan, batch_cold_moves: bool = True) -> list[int]:
        """Carry out a plan's moves in order. Returns the ids of blocks that failed a checksum
        while being moved; those are marked corrupt, keep no data, and must be recomputed."""
        hot_slots = self._reserve_hot_run(plan.moves, batch_cold_moves)
        evicted = self.num_moves["evictions"]
        try:
            return self._apply_moves(plan, batch_cold_moves, hot_slots)
        finally:
            if hot_slots:  # reserved for moves not made
                self.pools[HOT].free(list(hot_slots.values()))
            self.report_evictions(self.num_moves["evictions"] - evicted)

    def _apply_moves(self, plan: Plan, batch_cold_moves: bool, hot_slots: dict[int, int]) -> list[int]:
        corrupt: list[int] = []
        moves = list(plan.moves)
        while moves:
            start_s = time.perf_counter()
            batch = self._take_cold_batch(moves) if batch_cold_moves else []
            if batch:
                corrupt += self._apply_batch(batch)
                self._timed_batch(batch, start_s)
                continue
            batch = self._take_link_batch(moves)
            if batch:
                self._apply_link_batch(batch, hot_slots)
                self._timed_batch(batch, start_s)
                continue
            move = moves.pop(0)
            entry = self.index.get(move.block_id)
            if entry.tier != move.src_tier:
                raise RuntimeError(f"plan is stale: {move}, but block {move.block_id} is in tier {entry.tier}")
            if move.dst_tier == DROPPED:
                self.evict(move.block_id)
                continue
            self._apply_one(move, entry, corrupt, hot_slots.pop(move.block_id, None))
            self._timed_batch([move], start_s)
        self.copy_engine.before_device_use()
        return corrupt  # durability is the cold tier's writer thread's: nothing waits for it here

    def _timed_batch(self, moves: list, start_s: float) -> None:
        first = moves[0]
        self._timed("demote" if first.dst_tier > first.src_tier else "promote", start_s, first.src_tier, first.dst_tier)

    def _reserve_hot_run(self, moves: list[Move], batch_cold_moves: bool) -> dict[int, int]:
        """Consecutive hot slots for the plan's block-by-block moves into hot (a chat's history
        coming up from warm), in ascending block id order: a chat's blocks were allocated in
        token order, so they land in token order and attention reads them as one slice. Only
        when hot has room for every move into it without the plan's own demotions."""
        into_hot = [m for m in moves if m.dst_tier == HOT]
        single = [m.block_id for m in into_hot if m.dst_slot is None and (m.src_tier != COLD or not batch_cold_moves)]
        pool = self.pools[HOT]
        if len(single) < 2 or len(into_hot) > pool.num_free or any(m.dst_slot is not None for m in into_hot):
            return {}
        slots = pool.allocate_run(len(single))
        return dict(zip(sorted(single), slots)) if slots is not None else {}

    def _apply_one(self, move: Move, entry, corrupt: list[int], dst_slot: int | None = None) -> None:
        if dst_slot is None:
            dst_slot = self._allocate_slot(move.dst_tier, move)
        try:
            self.copy_data(move.src_tier, entry.slot, move.dst_tier, dst_slot)
        except CorruptBlockError:
            self.free_slot(move.dst_tier, dst_slot)
            self.mark_corrupt(move.block_id)  # frees its source slot, as the plan expects
            corrupt.append(move.block_id)
            return
        except BaseException:  # e.g. a cold write failed (ColdWriteError): the block stays, the slot goes back
            self.free_slot(move.dst_tier, dst_slot)
            raise
        self._commit_move(move.block_id, move.src_tier, entry.slot, move.dst_tier, dst_slot)

    def _commit_move(self, block_id: int, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        """The block's copy landed in `dst_slot`: it lives there now (journalled, counted)."""
        self.free_slot(src_tier, src_slot)
        self.index.move(block_id, dst_tier, dst_slot)
        self._count_move(src_tier, dst_tier)
        self._record(block_id, src_tier, dst_tier)
        self.persist_if_published(block_id)

    def evict(self, block_id: int) -> None:
        """Drop an unreferenced cached block (its data is discarded; see report_evictions)."""
        self.free_block(block_id)
        self.metrics.evictions.inc()

    def report_evictions(self, count: int, background: bool = False) -> None:
        """One warning for the `count` cached blocks a plan just dropped (throttled: a full cache
        drops some at every step)."""
        if count:
            self._drop_warnings.warning(
                "cache full: %s dropped %d cached block(s) (published, used by no chat), least valuable "
                "first; a chat that needs them again recomputes them (%d dropped so far)",
                "the background mover" if background else "a plan", count, self.num_moves["evictions"])

    def commit_background_move(self, block_id: int, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        """A background copy landed in `dst_slot`: the block lives there from now on (a move
        within one tier is compaction: the block keeps its place in the tier's orders)."""
        self.free_slot(src_tier, src_slot)
        if src_tier == dst_tier:
            self.index.relocate(block_id, dst_slot)
            self.metrics.relocations.inc()
            return
        self.index.move(block_id, dst_tier, dst_slot)
        self._count_move(src_tier, dst_tier)
        self._count(src_tier, dst_tier, self.block_bytes, background=True)
        self.persist_if_published(block_id)

    def _allocate_slot(self, tier: int, move) -> int:
        allocated = self.pools[tier].allocate(1)
        if allocated is None:
            raise RuntimeError(f"plan is infeasible: {move} but {TIER_NAMES[tier]} is full")
        return allocated[0]

    @staticmethod
    def _take_cold_batch(moves: list) -> list:
        """Pop the leading run of moves into or out of the cold tier between the same two tiers
        (a chat offloaded or promoted whole), to go through the staging buffer in chunks."""
        first = moves[0]
        if COLD not in (first.src_tier, first.dst_tier) or first.dst_tier == DROPPED:
            return []
        count = 1
        while count < len(moves) and (moves[count].src_tier, moves[count].dst_tier) == (first.src_tier, first.dst_tier):
            count += 1
        if count < 2:
            return []
        batch = moves[:count]
        del moves[:count]
        return batch

    def _take_link_batch(self, moves: list) -> list:
        """Pop the leading run of hot -> warm or warm -> hot moves, up to the first one a single
        move would refuse (its block not in its source tier, or moved earlier in the run): that
        one then fails on its own, after the run, exactly as move by move."""
        first = moves[0]
        if (first.src_tier, first.dst_tier) not in ((HOT, WARM), (WARM, HOT)):
            return []
        seen: set[int] = set()
        count = 0
        while count < len(moves):
            move = moves[count]
            if (move.src_tier, move.dst_tier) != (first.src_tier, first.dst_tier) or move.block_id in seen \
                    or move.block_id not in self.index or self.index.get(move.block_id).tier != move.src_tier:
                break
            seen.add(move.block_id)
            count += 1
        batch = moves[:count]
        del moves[:count]
        return batch

    def _apply_link_batch(self, batch: list, hot_slots: dict[int, int]) -> None:
        """Moves between hot and warm, one direction: destination slots taken move by move (a
        reserved hot run first, as `_apply_one`), one batched copy, then each move committed in
        plan order. When a destination tier runs out, the moves before that one are still made
        (as move by move) and the plan's infeasibility is raised after them."""
        src_tier, dst_tier = batch[0].src_tier, batch[0].dst_tier
        src_slots = [self.index.get(move.block_id).slot for move in batch]
        dst_slots: list[int] = []
        infeasible: RuntimeError | None = None
        for move in batch:
            slot = hot_slots.pop(move.block_id, None)
            if slot is None:
                try:
                    slot = self._allocate_slot(dst_tier, move)
                except RuntimeError as error:
                    infeasible = error
                    break
            dst_slots.append(slot)
        batch, src_slots = batch[:len(dst_slots)], src_slots[:len(dst_slots)]
        if batch:
            src, dst = self.tiers[src_tier], self.tiers[dst_tier]
            try:
                self.block_copier.copy(dst.slots_view(), dst_slots, src.slots_view(), src_slots)
            except BaseException:
                self.pools[dst_tier].free(dst_slots)
                raise
            self._count(src_tier, dst_tier, len(batch) * self.block_bytes)
            for move, src_slot, dst_slot in zip(batch, src_slots, dst_slots):
                self._commit_move(move.block_id, src_tier, src_slot, dst_tier, dst_slot)
        if infeasible is not None:
            raise infeasible

    def _apply_batch(self, batch: list) -> list[int]:
        """Moves between cold and another tier through the staging buffer. Reads out of cold run
        in ascending file order and double-buffered: a reader thread fills one half of staging
        while this thread copies the other half to its destination, so the disk never waits on
        the checksums and copies."""
        src_tier, dst_tier = batch[0].src_tier, batch[0].dst_tier
        batch = sorted(batch, key=lambda move: self.index.get(move.block_id).slot)  # independent moves
        halves = 2 if src_tier == COLD and self.staging.shape[0] >= 2 else 1
        chunk_blocks = self.staging.shape[0] // halves
        chunks = [batch[i:i + chunk_blocks] for i in range(0, len(batch), chunk_blocks)]
        buffers = [self.staging[h * chunk_blocks:(h + 1) * chunk_blocks] for h in range(halves)]
        slots = [[self.index.get(m.block_id).slot for m in chunk] for chunk in chunks]
        corrupt: list[int] = []
        # destination slots in ascending order, in the batch's (file, usually token) order: a chat
        # promoted whole lands in consecutive hot slots, which attention then reads as one view
        all_dst_slots = self.pools[dst_tier].allocate_run(len(batch)) if dst_tier == HOT else None
        if all_dst_slots is None:
            all_dst_slots = self.pools[dst_tier].allocate(len(batch))
        if all_dst_slots is None:
            raise RuntimeError(f"plan is infeasible: {len(batch)} moves into {TIER_NAMES[dst_tier]} but it is full")
        all_dst_slots.sort()
        dst_chunks = [all_dst_slots[i:i + chunk_blocks] for i in range(0, len(batch), chunk_blocks)]
        reads = _Reads(self, src_tier, chunks, slots, buffers)
        done_chunks = 0
        try:
            for k, chunk in enumerate(chunks):
                staging = reads.wait(k)  # None: a block of this chunk failed its checksum
                if staging is None:  # find the bad ones block by block; the good ones still move
                    self.pools[dst_tier].free(dst_chunks[k])
                    done_chunks = k + 1
                    corrupt += self.apply(Plan(moves=chunk), batch_cold_moves=False)
                    continue
                dst_slots = dst_chunks[k]
                self.tiers[dst_tier].write_blocks(dst_slots, staging)
                self.copy_engine.after_host_to_device()  # staging may be refilled only once this copy read it
                reads.release(k)
                for move, src_slot, dst_slot in zip(chunk, slots[k], dst_slots):
                    self._commit_move(move.block_id, src_tier, src_slot, dst_tier, dst_slot)
                done_chunks = k + 1
                self._count(src_tier, dst_tier, len(chunk) * self.block_bytes)
        except BaseException:
            unused = [slot for slots_k in dst_chunks[done_chunks:] for slot in slots_k]
            if unused:  # the moves not made give their destination slots back
                self.pools[dst_tier].free(unused)
            raise
        finally:
            reads.finish()
        return corrupt

    def close(self) -> None:
        self.copy_engine.synchronize()  # the side stream may still use the device staging
        self.block_copier.staging = None
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    # ---- single blocks ---------------------------------------------------------------------
    def copy_data(self, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        src, dst = self.tiers[src_tier], self.tiers[dst_tier]
        if hasattr(src, "block_view") and hasattr(dst, "block_view"):
            self.copy_engine.copy(dst.block_view(dst_slot), src.block_view(src_slot))
        else:
            # host code is about to touch host memory a side-stream copy may still be using
            self.copy_engine.before_host_read()
            dst.write_blocks([dst_slot], src.read_blocks([src_slot]))
            self.copy_engine.after_host_to_device()
        if src_tier != dst_tier:  # a copy-on-write inside one tier moves nothing between tiers
            self._count(src_tier, dst_tier, self.block_bytes)

    def _count(self, src_tier: int, dst_tier: int, num_bytes: int, background: bool = False) -> None:
        self.metrics.bytes_moved.inc((TIER_NAMES[src_tier], TIER_NAMES[dst_tier], BACKGROUND if background else ON_DEMAND),
                                     num_bytes)
        if HOT in (src_tier, dst_tier):
            self.link_monitor.record(num_bytes)

    def persist_if_published(self, block_id: int) -> None:
        """A published block whose whole data is in the cold tier gets a durable record there
        (written behind, off this thread: see ColdTier.persist), so a later process can reuse it."""
        entry = self.index.get(block_id)
        if entry.tier == COLD and entry.key is not None and entry.root is not None:
            try:
                self.tiers[COLD].persist(entry.slot, entry.key, entry.root)
            except ValueError as error:  # not whole yet: it stays a cold block, just not durable
                log.warning("block %d not made durable (it stays in the cold tier for this process): %s",
                            block_id, error)

    def free_block(self, block_id: int) -> None:
        entry = self.index.remove(block_id)
        if not entry.is_corrupt:  # a corrupt block already gave its slot back
            self.free_slot(entry.tier, entry.slot)

    def free_slot(self, tier: int, slot: int) -> None:
        self.pools[tier].free([slot])
        if tier == COLD:
            self.tiers[COLD].forget([slot])

    def mark_corrupt(self, block_id: int) -> None:
        """A corrupt block keeps its id (banks still list it) but no key, no data and no slot.
        While a running step pins it, its slot is quarantined instead of freed: that step mapped
        the slot, and must find the bad bytes there (and fail their check), never another block's."""
        entry = self.index.get(block_id)
        if entry.is_corrupt:
            return
        where = f" of {self.tiers[COLD].file_path}" if entry.tier == COLD and self.tiers[COLD] is not None else ""
        log.warning("block %d (%s slot %d%s) failed its checksum: it is never served; it is dropped and its "
                    "tokens must be recomputed", block_id, TIER_NAMES[entry.tier], entry.slot, where)
        self.metrics.checksum_failures.inc((TIER_NAMES[entry.tier],))
        if self.is_pinned(block_id):
            self.quarantined.append((block_id, entry.tier, entry.slot))
        else:
            self.free_slot(entry.tier, entry.slot)
        self.index.mark_corrupt(block_id)

    def free_quarantined(self) -> None:
        """Give back the slots of corrupt blocks that no running step pins any more."""
        keep = []
        for block_id, tier, slot in self.quarantined:
            if self.is_pinned(block_id):
                keep.append((block_id, tier, slot))
            else:
                self.free_slot(tier, slot)
        self.quarantined = keep

    def verify_cold(self, block_ids: list[int]) -> list[int]:
        """Check the cold blocks among `block_ids` against their checksums (the only tier whose
        bytes can rot outside this process). Failing ones are marked corrupt and returned."""
        if self.tiers[COLD] is None:
            return []
        by_slot = {}
        for block_id in block_ids:
            entry = self.index.get(block_id)
            if entry.tier == COLD:
                by_slot[entry.slot] = block_id
        bad = [by_slot[slot] for slot in self.tiers[COLD].verify(list(by_slot))]
        for block_id in bad:
            self.mark_corrupt(block_id)
        return bad


class _Reads:
    """The staging reads of one batch: chunk k lands in buffer k % len(buffers). Out of cold, the
    read of chunk k+1 runs on the executor's reader thread once chunk k's buffer is released;
    otherwise (device/host -> staging) each chunk is read when it is waited for."""

    def __init__(self, executor: PlanExecutor, src_tier: int, chunks: list, slots: list, buffers: list):
        self.executor, self.src_tier, self.slots, self.buffers = executor, src_tier, slots, buffers
        self.sizes = [len(chunk) for chunk in chunks]
        self.pending: dict[int, object] = {}
        if src_tier == COLD and chunks:
            self._start(0)
            if len(buffers) > 1 and len(chunks) > 1:
                self._start(1)

    def _buffer(self, k: int) -> torch.Tensor:
        return self.buffers[k % len(self.buffers)][:self.sizes[k]]

    def _read_cold(self, k: int) -> None:
        seconds = self.executor.metrics.read_seconds
        start = seconds.start()
        self.executor.tiers[COLD].read_blocks(self.slots[k], out=self._buffer(k))
        seconds.stop(("cold",), start)

    def _start(self, k: int) -> None:
        if self.executor._reader is None:
            self.executor._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_kv-cold-read")
        self.pending[k] = self.executor._reader.submit(self._read_cold, k)

    def wait(self, k: int) -> torch.Tensor | None:
        engine = self.executor.copy_engine
        if self.src_tier != COLD:
            engine.before_host_read()  # the previous chunk's copies out of staging are done
            src = self.executor.tiers[self.src_tier]
            self.executor.block_copier.copy(self._buffer(k), range(self.sizes[k]), src.slots_view(), self.slots[k])
            engine.before_host_read()
            return self._buffer(k)
        if k not in self.pending:  # one buffer: read now
            self._start(k)
        try:
            self.pending.pop(k).result()
        except CorruptBlockError:
            self.release(k)
            return None
        return self._buffer(k)

    def release(self, k: int) -> None:
        """Chunk k's buffer was copied out: start reading the chunk that will reuse it."""
        following = k + len(self.buffers)
        if self.src_tier == COLD and len(self.buffers) > 1 and following < len(self.sizes):
            self._start(following)

    def finish(self) -> None:
        """Wait for reads still in flight (staging must be idle when the batch returns)."""
        for future in self.pending.values():
            try:
                future.result()
            except Exception:  # an error already reported, or the batch is failing anyway
                pass
        self.pending.clear()
