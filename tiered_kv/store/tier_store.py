"""TierStore: one budget of hot/warm/cold blocks shared by every CacheBank that uses it.

It owns the tiers, their slot pools, the BlockIndex and the MemScheduler. Banks ask it for new
blocks, hand blocks back, publish and look up verified blocks by key, and read/write one layer
of tokens at a time; the scheduler decides placement and returns a Plan, which the
PlanExecutor carries out.

Concurrency model (DESIGN.md invariant 4): one re-entrant lock per store. Every method takes
it, so planning and applying a plan happen in one critical section and no plan is ever stale.
A bank's forward pass registers its blocks as pinned from layer 0 to its last layer
(`begin_step` / `end_step`); plans never move or drop pinned blocks, so the step's token
mapping stays valid without holding the lock while the model computes. An allocation that only
fails because other steps pin the blocks it would move waits for a step to end (bounded by
`PIN_WAIT_S`) instead of failing. Scratch buffers (staging, the cold tier's layer buffer) are
only touched under the lock. A store is not copied by `copy.deepcopy`: copies share it.
"""

from __future__ import annotations

import atexit
import math
import logging
import threading
import weakref
import time
from collections import deque

import numpy as np
import torch

from ..block_index import BlockIndex
from ..blocks import KVLayout
from ..config import Config, load_config
from ..errors import CapacityError, ColdPathInUseError, CorruptBlockError, LayoutError
from ..hw.block_copy import BlockCopier, device_staging
from ..hw.copy_engine import make_copy_engine
from ..hw.devices import resolve_device, resolve_pinned
from ..hw.link_monitor import make_link_monitor
from ..metrics.registry import Metrics
from ..metrics.stores import register_store
from ..remote import RemoteTier
from ..pool import SlotPool
from ..scheduler import COLD, HOT, TIER_NAMES, WARM, MemScheduler
from ..scheduler.access_log import AccessLog
from ..scheduler.mem_scheduler import Watermarks
from ..tiers import ColdTier, HotTier, WarmTier
from ..tiers.cold_files import ColdDirectory, open_cold_directory
from .durability import Durability
from .executor import PlanExecutor
from .layout import HotLayout
from .mover import Mover
from .stream_worker import StreamWorker
from .reporting import Reporting
from .step_access import StepAccess
from .token_map import TierRun, TokenMapper

log = logging.getLogger(__name__)

STAGING_BYTES = 32 * 2**20  # host staging for cold-tier batches
# device staging for batched hot<->warm moves (hw/block_copy.py), on a CUDA store only; capped at
# the hot capacity; beside the hot slab, not counted in hot.capacity
STAGING_DEVICE_BYTES = 64 * 2**20
PIN_WAIT_S = 60.0  # how long an allocation waits for other steps to unpin blocks it needs


_OPEN_STORES: "weakref.WeakSet[TierStore]" = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    """At interpreter exit, close every store still open (most programs never call close()), so
    published blocks reach the durable cold tier while the modules they need are still there."""
    for store in list(_OPEN_STORES):
        try:
            store.close()
        except Exception as error:  # exiting anyway: say so, keep closing the others
            log.warning("closing a store at exit failed: %s", error)


class TierStore(StepAccess, Durability, Reporting, HotLayout):
    def __init__(self, config: Config | dict | str | None = None):
        self.config = load_config(config if config is not None else {})
        self.device = resolve_device(self.config.hot.device)
        self.pinned = resolve_pinned(self.config.warm.pinned, self.device)
        self.lock = threading.RLock()
        self._step_ended = threading.Condition(self.lock)
        self.layout: KVLayout | None = None
        self.dtype: torch.dtype | None = None
        self.tiers: list = []
        self.pools: list[SlotPool] = []
        self.index = BlockIndex()
        settings = self.config.scheduler
        self.access_log = AccessLog(settings.ali_window, settings.default_cost_sensitivity)
        self.scheduler = MemScheduler(settings, self.access_log)
        self.watermarks: Watermarks | None = None
        self._mover: Mover | None = None
        self._stream_worker: StreamWorker | None = None  # started by the first hooked step that streams
        self._init_layout()
        self.copy_engine = make_copy_engine(self.device)
        self.link_monitor = make_link_monitor(self.device)
        self._executor: PlanExecutor | None = None
        self.mapper: TokenMapper | None = None
        self._pinned_by_step: dict[int, set[int]] = {}  # step owner -> its blocks
        self._deferred: deque = deque()  # (block ids, step owner) of banks the GC collected
        # counters and histograms of everything below (stats()["metrics"], tiered_kv.metrics.serve)
        self.metrics = Metrics(self.config.metrics.enabled)
        register_store(self)
        self._closed = False
        self._num_owners = 0  # banks that created this store and close it together
        self._cold_directory: ColdDirectory | None = None
        self.remote: RemoteTier | None = None  # the shared remote tier (config `remote:`), below cold
        _OPEN_STORES.add(self)
        self.cold_unavailable: str | None = None  # why this store runs without its cold tier
        if self.config.cold.capacity_blocks != 0 and self.config.cold.capacity_bytes != 0:
            # fail at start, not at the first spill, when the cold directory is unusable
            try:
                self._cold_directory = open_cold_directory(self.config.cold.path)
            except ColdPathInUseError as error:
                # one writer per cold directory: a second store (another chat process on the same
                # config) runs on hot and warm alone rather than failing or sharing unsafely
                self.cold_unavailable = str(error)
                log.warning("%s; this store runs without a cold tier (hot and warm only)", error)
        if self.config.remote.enabled:
            try:  # a wrong password (or, when required, an unreachable server) fails the start
                self.remote = RemoteTier(self.config.remote, self.metrics)
            except BaseException:
                self.close()
                raise

    def __deepcopy__(self, memo):
        return self  # a store is a shared resource: copies of banks share it

    def __reduce__(self):
        raise TypeError("a TierStore holds open files and device memory; it cannot be pickled")

    # ---- binding ---------------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        return self.layout is not None

    def bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        """Preallocate every tier for `layout`. A store serves one KV layout for its lifetime."""
        with self.lock:
            self._check_open()
            if self.layout is not None:
                if layout != self.layout or dtype != self.dtype:
                    raise LayoutError(
                        f"this TierStore serves KV layout {self.layout} ({self.dtype}); got {layout} ({dtype}). "
                        "Use one store per model shape and dtype")
                return
            self._bind(layout, dtype)

    def _bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        cfg = self.config
        capacities = [cfg.hot.resolve_blocks(layout.block_bytes), cfg.warm.resolve_blocks(layout.block_bytes),
                      cfg.cold.resolve_blocks(layout.block_bytes) if self._cold_directory is not None else 0]
        tiers = []
        try:
            tiers.append(HotTier(layout, capacities[HOT], self.device, dtype))
            tiers.append(WarmTier(layout, capacities[WARM], dtype, self.pinned))
            tiers.append(ColdTier(layout, capacities[COLD], self._cold_directory, cfg.cold.backend, cfg.cold.fsync)
                         if capacities[COLD] > 0 else None)
            # host buffer for moves into and out of cold, preallocated (and touched) once
            staging_blocks = max(1, min(STAGING_BYTES // layout.block_bytes, max(capacities)))
            staging = torch.zeros((staging_blocks, *layout.record_shape()), dtype=dtype, pin_memory=self.pinned)
            block_copier = BlockCopier(self.copy_engine, device_staging(
                "hot.capacity", STAGING_DEVICE_BYTES, layout, capacities[HOT], self.device, dtype))
        except BaseException:
            # a failed start removes what it made: files, directories, and this store
            for tier in tiers:
                if tier is not None:
                    tier.close()
            if self._cold_directory is not None:
                self._cold_directory.abort()
                self._cold_directory = None
            self._closed = True
            raise
        pools = [SlotPool(n, TIER_NAMES[t]) for t, n in enumerate(capacities)]
        if tiers[COLD] is not None:
            self._import_durable_records(tiers[COLD], pools[COLD])
        self.tiers, self.pools = tiers, pools
        self._executor = PlanExecutor(tiers, pools, self.index, staging, self.copy_engine, self.link_monitor,
                                      layout.block_bytes, self.is_pinned, block_copier, self.metrics)
        self.mapper = TokenMapper(tiers, layout, self.device, dtype, self.copy_engine, self.metrics)
        if tiers[COLD] is not None:
            tiers[COLD].metrics = self.metrics  # its durable writer times its writes and counts failures
        self.layout, self.dtype = layout, dtype
        tier_cfgs = (cfg.hot, cfg.warm, cfg.cold)
        self.watermarks = Watermarks(
            high_blocks=tuple(math.ceil(c.high_watermark * n) for c, n in zip(tier_cfgs, capacities)),
            low_blocks=tuple(int(c.low_watermark * n) for c, n in zip(tier_cfgs, capacities)))
        if cfg.scheduler.background:
            self._mover = Mover(self, cfg.scheduler.mover_interval_s)
        if self.remote is not None:
            self.remote.bind(layout, self._read_block_bytes)

    @property
    def capacities(self) -> list[int]:
        return [pool.num_slots for pool in self.pools]

    def free_slots(self) -> list[int]:
        return [pool.num_free for pool in self.pools]

    @property
    def total_capacity_blocks(self) -> int:
        return sum(self.capacities)

    @property
    def staging(self) -> torch.Tensor:
        return self._executor.staging

    # ---- block lifecycle -------------------------------------------------------------------
    def allocate(self, num_blocks: int, protect: frozenset[int] = frozenset(),
                 follow: list[tuple[int, int | None]] | None = None) -> list[int]:
        """New blocks, placed as high as possible. Raises CapacityError (changing nothing) when
        all tiers together cannot hold them, after waiting for running steps to unpin blocks.

        `follow` says, per group of the new blocks in order, (how many, the block they continue
        or None for a new sequence): a group's hot blocks then take consecutive hot slots, right
        after that block's slot when those are free, else where a free run leaves room to grow
        (SlotPool.allocate_run), so attention reads each sequence as one slice. Without it,
        slots come from the free lists (most recently freed first)."""
        if num_blocks == 0:
            return []
        if follow is not None and sum(count for count, _ in follow) != num_blocks:
            raise ValueError(f"allocate: follow {follow} covers {sum(c for c, _ in follow)} blocks, not {num_blocks}")
        with self.lock:
            self._check_open()
            self.drain_deferred()
            deadline = time.monotonic() + PIN_WAIT_S
            while True:
                plan = self.scheduler.plan_new_blocks(num_blocks, self.index, self.free_slots(), self.capacities,
                                                      protect, self.is_pinned)
                if plan is not None:
                    break
                remaining_s = deadline - time.monotonic()
                if not self._pinned_by_step or remaining_s <= 0:
                    raise self._capacity_error(num_blocks)
                self._step_ended.wait(remaining_s)
            self._executor.apply(plan)
            tiers = plan.new_block_tiers
            block_ids = []
            for start, count, previous in self._groups(follow or [(num_blocks, None)]):
                group_tiers = tiers[start:start + count]
                hot_slots = self._hot_slots(group_tiers.count(HOT), previous, follow is not None)
                for tier in group_tiers:
                    slot = hot_slots.pop(0) if tier == HOT else self.pools[tier].allocate(1)[0]
                    block_ids.append(self.index.add(tier, slot))
            return block_ids

    @staticmethod
    def _groups(follow: list[tuple[int, int | None]]):
        start = 0
        for count, previous in follow:
            yield start, count, previous
            start += count

    def _hot_slots(self, num_slots: int, previous: int | None, as_run: bool) -> list[int]:
        """Hot slots for a sequence's new blocks (the plan made room for them)."""
        if not num_slots:
            return []
        pool = self.pools[HOT]
        after = None
        if previous is not None and previous in self.index:
            entry = self.index.get(previous)
            after = entry.slot if entry.tier == HOT else None
        slots = pool.allocate_run(num_slots, after) if as_run else None
        if slots is None:  # no run is long enough: as few pieces as the free slots allow
            slots = pool.allocate_runs(num_slots, after) if as_run else pool.allocate(num_slots)
        if after is None or slots[0] != after + 1:
            self.note_layout_change()  # the sequence may not continue in place here
        return slots

    def _capacity_error(self, num_blocks: int) -> CapacityError:
        referenced = sum(1 for _, e in self.index.items() if e.ref_count > 0)
        hot, warm, cold = self.capacities
        return CapacityError(
            f"need {num_blocks} more blocks of {self.layout.block_size} tokens ({self.layout.block_bytes} bytes "
            f"each) but all tiers together hold {self.total_capacity_blocks} (hot {hot}, warm {warm}, cold {cold}) "
            f"and {referenced} are in use; raise a tier's capacity or shorten the conversation")

    def retain(self, block_ids: list[int]) -> None:
        with self.lock:
            for block_id in block_ids:
                self.index.incref(block_id)
            self.note_layout_change()  # another table now holds these blocks

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference each. Unreferenced published blocks stay as reusable cache."""
        with self.lock:
            if self._closed:
                return
            for block_id in block_ids:
                entry = self.index.get(block_id)
                if self.index.decref(block_id) == 0 and (entry.key is None or entry.is_corrupt):
                    self._executor.free_block(block_id)

    def copy_block(self, block_id: int) -> int:
        """Copy-on-write: a new block with the same content (the caller releases the old one)."""
        with self.lock:
            (new_id,) = self.allocate(1, protect=frozenset([block_id]))
            src, dst = self.index.get(block_id), self.index.get(new_id)
            self._executor.copy_data(src.tier, src.slot, dst.tier, dst.slot)
            self.copy_engine.before_device_use()  # compute reads the copy next
            return new_id

    # ---- content addressing ----------------------------------------------------------------
    def publish(self, block_id: int, key: bytes, root: bytes | None = None) -> bool:
        """Name a full, verified block by its key (chained from `root`, the model fingerprint) so
        other banks, and with a cold tier later processes, can reuse it."""
        with self.lock:
            published = self.index.publish(block_id, key, root)
            if published:
                self._executor.persist_if_published(block_id)
                if self.remote is not None and root is not None:
                    self.remote.enqueue(block_id, key, root)  # written behind, by the remote writer thread
            return published

    # ---- the remote tier -------------------------------------------------------------------
    def fetch_remote(self, keys: list[bytes], root: bytes) -> list[int]:
        """After a local miss: the leading run of `keys` the remote server holds intact, as new
        blocks of this store (placed as high as room allows, published, retained once for the
        caller). The network round trip runs outside the store lock; [] when there is no remote
        tier, the server is down or holds none of them, or the tiers have no room."""
        if self.remote is None or not keys or not self.is_bound:
            return []
        blocks = self.remote.fetch(keys, root)
        if not blocks:
            return []
        with self.lock:
            self._check_open()
            try:
                block_ids = self.allocate(len(blocks))
            except CapacityError:
                self.metrics.remote_misses.inc(("no_room",))
                return []
            shape = (1, *self.layout.record_shape())
            for block_id, key, data in zip(block_ids, keys, blocks):
                entry = self.index.get(block_id)
                block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).reshape(shape)
                self.tiers[entry.tier].write_blocks([entry.slot], block)
                self.remote.note_known(key)  # it came from there: never written back
                self.publish(block_id, key, root)
            self.copy_engine.after_host_to_device()
            return block_ids

    def _read_block_bytes(self, block_id: int, key: bytes):
        """The remote writer's read: the bytes (uint8 numpy, host) of `block_id` if it still holds
        `key` and is intact; else None. Under the store lock, so the block cannot move meanwhile."""
        with self.lock:
            if self._closed or block_id not in self.index:
                return None
            entry = self.index.get(block_id)
            if entry.key != key or entry.is_corrupt:
                return None
            try:
                data = self.tiers[entry.tier].read_blocks([entry.slot])
            except CorruptBlockError:
                return None
            return data.contiguous().view(torch.uint8).cpu().numpy()

    def lookup_and_retain(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (from the first) that the store holds intact,
        each retained once for the caller."""
        with self.lock:
            found = []
            for key in keys:
                block_id = self.index.lookup(key)
                if block_id is None or self.index.get(block_id).is_corrupt:
                    self.metrics.misses.inc()
                    break
                found.append(block_id)
            for block_id in found:
                self.index.incref(block_id)
            if found:
                self.note_layout_change()  # a table takes up blocks laid out for another
            return found

    def block_info(self, block_id: int):
        """(tier, ref_count, key) of a block, read under the lock."""
        with self.lock:
            entry = self.index.get(block_id)
            return entry.tier, entry.ref_count, entry.key

    # ---- placement -------------------------------------------------------------------------
    def promote(self, block_ids: list[int], owner: int | None = None) -> list[int]:
        """Bring blocks up (hot first), now: the caller waits. Returns ids found corrupt on the way
        (never served). `owner`'s pending background prefetch is taken over by this call: blocks
        already in flight are waited for, the rest planned here."""
        with self.lock:
            self.drain_deferred()
            if self._mover is not None:
                if owner is not None:
                    self._mover.drop_requests(owner)
                if self._mover.in_flight:
                    start_s = time.perf_counter()
                    self._mover.wait_for(block_ids)
                    self._executor._timed("promote", start_s)  # the caller waited for the blocks to land
            plan = self.scheduler.plan_promotion(block_ids, self.index, self.free_slots(), self.capacities,
                                                 self.is_pinned)
            return self._executor.apply(plan)

    def prefetch(self, owner: int, block_ids: list[int]) -> None:
        """Bring `owner`'s blocks up in the background (most wanted first) and return at once;
        without a mover (scheduler.background false), promote them now."""
        with self.lock:
            self._check_open()
            if self._mover is None:
                self.promote(block_ids, owner)
            else:
                self._mover.request_prefetch(owner, block_ids)

    def wait_for_background(self, timeout_s: float = 30.0) -> bool:
        """Wait until the mover has no prefetch request, no move in flight and no compaction to
        do (for tests and benchmarks that need a settled store). True when settled within
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                mover = self._mover
                if mover is None or (not mover.pending_requests and not mover.in_flight
                                     and not self.compaction_pending()):
                    return True
                mover.wake()
            time.sleep(0.005)
        return False

    def thread_move_seconds(self) -> dict:
        """Seconds the calling thread has spent waiting for demand moves (demote, promote)."""
        with self.lock:
            if self._executor is None:
                return {"demote": 0.0, "promote": 0.0}
            return dict(self._executor.thread_move_seconds())

    def forget_chat(self, owner: int) -> None:
        """A bank closed: its access history no longer describes a live chat."""
        with self.lock:
            self.access_log.forget_chat(owner)
            if self._mover is not None:
                self._mover.drop_requests(owner)

    def demote(self, block_ids: list[int], dst_tier: int) -> list[int]:
        """Move blocks down to `dst_tier` (WARM or COLD) as far as room allows."""
        with self.lock:
            plan = self.scheduler.plan_demotion(block_ids, dst_tier, self.index, self.free_slots(), self.capacities,
                                                self.is_pinned)
            return self._executor.apply(plan)

    def verify(self, block_ids: list[int]) -> list[int]:
        with self.lock:
            return self._executor.verify_cold(block_ids)

    def mark_corrupt(self, block_id: int) -> None:
        with self.lock:
            self._executor.mark_corrupt(block_id)

    def placements(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tier, slot) of each block, as two int64 arrays (for a step's token mapping)."""
        with self.lock:
            entries = [self.index.get(b) for b in block_ids]
            tiers = np.fromiter((e.tier for e in entries), dtype=np.int64, count=len(entries))
            slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
            return tiers, slots

    @property
    def placement_version(self) -> int:
        """Changes whenever any block changes tier or slot (a bank's cached placements go stale)."""
        return self.index.placement_version

    @property
    def order_version(self) -> int:
        """Changes whenever any tier's recency order changes."""
        return self.index.order_version

    # ---- reporting / teardown --------------------------------------------------------------
    def _drain_if_bound(self) -> None:
        if self.is_bound:
            try:
                self.drain_deferred()
            except Exception as error:
                log.warning("releasing collected banks' blocks at close failed: %s", error)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TierStore is closed; create a new one")

    @property
    def is_closed(self) -> bool:
        return self._closed

    def add_owner(self) -> None:
        with self.lock:
            self._num_owners += 1

    def drop_owner(self) -> None:
        """A bank that owns this store closed; the last one closes the store."""
        with self.lock:
            self._num_owners -= 1
            last = self._num_owners <= 0
        if last:
            self.close()

    @property
    def stream_worker(self) -> StreamWorker:
        """The thread (and CUDA side stream) that fetches hooked steps' layers ahead."""
        with self.lock:
            self._check_open()
            if self._stream_worker is None:
                self._stream_worker = StreamWorker(self.device)
            return self._stream_worker

    def close(self) -> None:
        remote = self.remote
        if remote is not None and not self.lock._is_owned():
            remote.close()  # its writer reads blocks under the lock: flush it before taking the lock
        mover = self._mover
        if mover is not None:
            # its batch in progress needs the lock to commit: wait for it unless we hold the lock
            mover.stop(wait=not self.lock._is_owned())
        worker = self._stream_worker
        if worker is not None:  # a fetch in flight reads under the lock: same rule
            if not self.lock._is_owned():
                worker.close()
        with self.lock:
            if self._closed:
                return
            self._drain_if_bound()
            self._persist_before_close()
            self._closed = True
            if self.remote is not None:
                self.remote.close(flush=False)  # flushed above unless close() was called under the lock
            self.link_monitor.close()
            if self._executor is not None:
                self._executor.close()
            for tier in self.tiers:
                if tier is not None:
                    tier.close()
            self.tiers[:] = [None] * len(self.tiers)
            if self._cold_directory is not None:
                self._cold_directory.close()  # releases the lock; keeps the block files
                self._cold_directory = None
            self._step_ended.notify_all()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = ["TierStore", "TierRun", "STAGING_BYTES"]
