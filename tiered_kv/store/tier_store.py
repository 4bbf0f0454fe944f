"""TierStore: one budget of hot/warm/cold blocks shared by every CacheBank that uses it.

A thin façade over components that own their state (docs/design.md):
  state.py       the block index, the tiers and their slot pools, pins, blocks in flight, deferred frees
  transfers.py   the one path bytes move by (prepare/launch/complete), by arrays (batches.py, reserving.py, ...)
  demand.py      moves a caller needs now, in rounds around the copies, sub-batches pipelined
  allocation.py  new blocks placed as high as room allows; copy-on-write copies
  opening.py     a step's lease: room, copy-on-write, promotion, pins, token runs, at once
  leases.py      what a forward pass holds while it reads and writes its blocks without the lock
  placement.py   promote, prefetch, demote, undo, verify: moves a caller asks for by name
  remote_io.py   fetches from other processes' cold files and the remote tier (write-in), remote writes
  mover.py       the background thread: prefetch, watermark and idle demotion, compaction
  compaction.py  where hot blocks lie and how to make a chat contiguous again
  durability.py  durable records in at start, published blocks out to cold at close, flush; the durable
                 copies of blocks above cold (durable_copies.py) and their backups (write_behind.py)
  reporting.py   stats() and the cheap counters (consistency.py: the self-check)

Concurrency (DESIGN.md, invariants 4, 7, 8): one lock per store (`lock`, which only the store's
components take: no bank, hook or tool does), held to plan, reserve, commit and pin, never while
anything waits — copies, file and network I/O and waits for copy events happen between critical
sections. A store is not copied by `copy.deepcopy`: copies of banks share it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

import numpy as np
import torch

from ..blocks import COLD, TIER_NAMES, KVLayout
from ..config import Config, load_config
from ..errors import BankClosedError, LayoutError
from ..hw.copy_engine import make_copy_engine
from ..hw.devices import resolve_device, resolve_pinned
from ..hw.link_monitor import make_link_monitor
from ..metrics.registry import Metrics
from ..metrics.stores import register_store
from ..pool import SlotPool
from ..remote import RemoteTier
from ..scheduler import MemScheduler
from ..scheduler.access_log import AccessLog
from ..scheduler.mem_scheduler import Watermarks
from ..scheduler.restore import Rates
from ..tiers.cold_files import ColdDirectory
from . import building, durability
from .building import STAGING_BYTES
from .allocation import PIN_WAIT_S, Allocation
from .compaction import HotCompaction
from .demand import DemandMoves
from .device_slab import DeviceSlab
from .durable_copies import DurableCopies
from .leases import StepLease, StepRequest
from .lock import StoreLock
from .mover import Mover
from .opening import Opening
from .placement import Placement
from .remote_io import RemoteIO
from .reporting import Reporting
from .state import StoreState
from .token_map import TokenMapper
from .transfers import Transfers

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # how long close() waits for running steps to end

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


class TierStore:
    def __init__(self, config: Config | dict | str | None = None):
        self.config = load_config(config if config is not None else {})
        self.device = resolve_device(self.config.hot.device)
        self.pinned = resolve_pinned(self.config.warm.pinned, self.device)
        self.lock = StoreLock()
        self.metrics = Metrics(self.config.metrics.enabled)
        self.state = StoreState(self.metrics)
        self.state.on_collected = lambda owner: self.opening.forget(owner)  # a bank the collector took
        settings = self.config.scheduler
        self.access_log = AccessLog.from_settings(settings)
        self.access_log.follow(self.state.index)  # it forgets the blocks the index removes: memory follows live blocks
        self.rates = Rates()  # read rates and the prefill cost, measured: what a turn restores (restore.py)
        self.scheduler = MemScheduler(settings, self.access_log)
        self.compaction = HotCompaction(self.state, self.access_log, settings)
        self.reporting = Reporting(self)
        self.opening = Opening(self)
        self.allocation = Allocation(self)
        self.placement = Placement(self)
        self.remote_io = RemoteIO(self)
        self.layout: KVLayout | None = None
        self.dtype: torch.dtype | None = None
        self.watermarks: Watermarks | None = None
        self.transfers: Transfers | None = None
        self.demand: DemandMoves | None = None
        self.mapper: TokenMapper | None = None
        self.device_slab: DeviceSlab | None = None  # what a prepared step addresses (device_slab.py), once bound
        self.mover: Mover | None = None
        self._closing = False  # close() began: no new lease, no background move
        self._closed = False
        self._close_lock = threading.Lock()
        self._num_owners = 0  # banks that created this store and close it together
        self._cold_directory: ColdDirectory | None = None
        self.remote: RemoteTier | None = None
        self.cold_unavailable: str | None = None  # why this store runs without its cold tier
        self.peers = None  # other processes' cold files on this cold.path (tiers/cold_peers.py), once bound
        self.link_monitor = make_link_monitor(self.device)
        register_store(self)
        _OPEN_STORES.add(self)
        try:
            self.copy_engine = make_copy_engine(self.device, self.config.copies.engine, self.config.copies.delay_us)
            self.state.step_fences.engine = self.copy_engine  # fences on the streams steps run on
            if self.config.cold.capacity_blocks != 0 and self.config.cold.capacity_bytes != 0:
                # fail at start, not at the first spill, when the cold directory is unusable
                self._cold_directory, self.cold_unavailable = building.open_cold(self.config.cold.path)
            if self.config.remote.enabled:  # a wrong password (or, when required, a server down) fails the start
                self.remote = RemoteTier(self.config.remote, self.metrics)
        except BaseException:
            self.copy_engine = getattr(self, "copy_engine", None)
            self.close()
            raise

    def __deepcopy__(self, memo):
        return self  # a store is a shared resource: copies of banks share it

    def __reduce__(self):
        raise TypeError("a TierStore holds open files and device memory; it cannot be pickled")

    # ---- what tests and tools inspect ----------------------------------------------------------
    @property
    def index(self):
        return self.state.index

    @property
    def tiers(self) -> list:
        return self.state.tiers

    @property
    def pools(self) -> list[SlotPool]:
        return self.state.pools

    @property
    def capacities(self) -> list[int]:
        return self.state.capacities

    @property
    def total_capacity_blocks(self) -> int:
        return sum(self.capacities)

    @property
    def is_bound(self) -> bool:
        return self.layout is not None

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_closing(self) -> bool:
        return self._closing or self._closed

    # ---- binding ---------------------------------------------------------------------------------
    def bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        """Preallocate every tier for `layout`. A store serves one KV layout for its lifetime."""
        with self.lock:
            self.check_open()
            if self.layout is not None:
                if layout != self.layout or dtype != self.dtype:
                    raise LayoutError(
                        f"this TierStore serves KV layout {self.layout} ({self.dtype}); got {layout} ({dtype}). "
                        "Use one store per model shape and dtype")
                return
            try:
                self._bind(layout, dtype)
            except BaseException:
                self._closed = True  # a failed start removes what it made (files, threads) and this store
                self._release_resources(failed_start=True)
                raise
        if self.config.scheduler.background:
            self.mover = Mover(self, self.config.scheduler.mover_interval_s)
        if self.remote is not None:
            self.remote.bind(layout.stored(self.config.remote.compression), self.remote_io.read_block_bytes)

    def _bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        made = self.state.tiers  # what building made, closed by _release_resources if it fails partway
        tiers, pools, unavailable = building.build_tiers(self.config, layout, dtype, self.device, self.pinned,
                                                         self._cold_directory, made, self.cold_unavailable is None)
        self.cold_unavailable = self.cold_unavailable or unavailable
        self.peers = building.peers_of(self._cold_directory, layout.stored(self.config.cold.compression), tiers[COLD])
        staging = building.build_staging(layout, dtype, self.device, self.pinned, [p.num_slots for p in pools])
        if tiers[COLD] is not None:
            durability.import_durable_records(self.state.index, tiers[COLD], pools[COLD])
            tiers[COLD].metrics = self.metrics  # its durable writer times its writes and counts failures
            self.state.copies = DurableCopies(self.config.cold.admit)
        self.state.bind(tiers, pools)
        tier_block_bytes = [stored.block_bytes for stored in building.stored_layouts(self.config, layout)]
        self.transfers = Transfers(self.state, self.copy_engine, self.metrics, self.link_monitor, tier_block_bytes,
                                   staging, self.rates)
        self.demand = DemandMoves(self.lock, self.state, self.transfers, layout.block_bytes)
        self.mapper = TokenMapper(tiers, layout, self.device, dtype, self.metrics)
        self.device_slab = DeviceSlab(tiers, self.device, layout.block_size)
        self.layout, self.dtype = layout, dtype
        self.watermarks = building.watermarks_of(self.config, self.capacities)

    # ---- steps -----------------------------------------------------------------------------------
    def open_step(self, request: StepRequest) -> StepLease | None:
        """A lease on everything one forward pass reads and writes (opening.py), or None: retry
        once something changed (`wait_for_change`). BankClosedError on a closed store."""
        return self.opening.open_step(request)

    @property
    def change_version(self) -> int:
        return self.state.changes.version

    def wait_for_change(self, since: int, timeout_s: float) -> bool:
        """Block (without the store lock) until a step ended, a transfer completed or blocks were
        released since `change_version` was `since`; False after `timeout_s`."""
        return self.state.changes.wait(since, timeout_s)

    def check_open(self) -> None:
        if self._closing or self._closed:
            raise BankClosedError("this TierStore is closed (or closing); create a new store and bank")

    # ---- blocks -----------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, protect: frozenset[int] = frozenset(),
                 follow: list[tuple[int, int | None]] | None = None) -> list[int]:
        """New blocks (ref_count 1), placed as high as possible (allocation.py). CapacityError
        (changing nothing) when all tiers together cannot hold them, after waiting up to
        PIN_WAIT_S for running steps to free the room they hold. `follow` (per group of the new
        blocks, in order: how many, and the block they continue or None) gives each group
        consecutive hot slots, right after that block's when free: one slice for attention."""
        return self.allocation.allocate(num_blocks, protect, follow)

    def retain(self, block_ids: list[int]) -> None:
        with self.lock:
            for block_id in block_ids:
                self.state.index.incref(block_id)
            self.compaction.note_layout_change()  # another table now holds these blocks

    def release(self, block_ids: list[int], for_good: bool = False) -> None:
        """Drop one reference each. Unreferenced published blocks stay as reusable cache, unless
        `for_good`: blocks that left a sliding window, which nobody reads again (never moved down)."""
        with self.lock:
            if self._closed:
                return
            self.state.release(block_ids, keep_published=not for_good)
            self.state.changes.bump()

    def release_later(self, block_ids: list[int], owner: int) -> None:
        """For a bank the garbage collector took: its references and pins go at the store's next
        operation. Takes no lock (the collector may run while this very thread holds it)."""
        self.state.release_later(block_ids, owner)

    def placements(self, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """(tier, slot) of each block, as two int64 arrays."""
        with self.lock:
            return self.state.placements(block_ids)

    # ---- content addressing ------------------------------------------------------------------------
    def publish(self, block_id: int, key: bytes, root: bytes | None = None) -> bool:
        """Name a full, verified block by its key (chained from `root`, the model fingerprint) so
        other banks, and with a cold tier later processes, can reuse it."""
        return self.publish_many([(block_id, key, root)])[0]

    def publish_many(self, items: list[tuple[int, bytes, bytes | None]], local: bool = True) -> list[bool]:
        """`local`: computed here (False: fetched from another process or the remote tier)."""
        with self.lock:
            out = [self.state.index.publish(block_id, key, root) for block_id, key, root in items]
            durability.published(self, [item for item, ok in zip(items, out) if ok], local)
            return out

    def lookup_and_retain(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (from the first) that the store holds intact,
        each retained once for the caller."""
        with self.lock:
            index, found = self.state.index, []
            for key in keys:
                block_id = index.lookup(key)
                if block_id is None or index.get(block_id).is_corrupt:
                    self.metrics.misses.inc()
                    break
                found.append(block_id)
            for block_id in found:
                index.incref(block_id)
            if found and self.state.copies is not None:  # another chat reads them (cold.admit: reused)
                self.state.copies.reused(found, time.monotonic())
            if found:
                self.compaction.note_layout_change()  # a table takes up blocks laid out for another
            return found

    def holds(self, keys: list[bytes]) -> list[bool]:
        """Whether the store holds each key's block intact (nothing retained)."""
        with self.lock:
            index = self.state.index
            return [(b := index.lookup(key)) is not None and not index.get(b).is_corrupt for key in keys]

    def fetch_remote(self, keys: list[bytes], root: bytes) -> list[int]:
        """After a local miss: the leading run of `keys` that other stores' cold files here, then the remote
        server, hold intact, as new published blocks retained once for the caller (remote_io.py)."""
        found = self.remote_io.fetch_peers(keys, root)
        return found if len(found) == len(keys) else found + self.remote_io.fetch(keys[len(found):], root)

    # ---- placement (placement.py) --------------------------------------------------------------------
    def promote(self, block_ids: list[int], owner: int | None = None) -> list[int]:
        """Bring blocks up (hot first), now; returns the ids found corrupt on the way (never served)."""
        return self.placement.promote(block_ids, owner)

    def prefetch(self, owner: int, block_ids: list[int], deadline_s: float | None = None) -> None:
        """Bring `owner`'s blocks up in the background and return at once (without a mover: now)."""
        self.placement.prefetch(owner, block_ids, deadline_s)

    def demote(self, block_ids: list[int], dst_tier: int) -> list[int]:
        """Move blocks down to `dst_tier` (WARM or COLD) as far as room allows; returns corrupt ids."""
        return self.placement.demote(block_ids, dst_tier)

    def forget_chat(self, owner: int) -> None:
        """A bank closed: its access history no longer describes a live chat."""
        with self.lock:
            self.opening.forget(owner)

    def wait_for_background(self, timeout_s: float = 30.0) -> bool:
        """Wait until the mover has no prefetch request, no batch in flight and no compaction to
        do (for tests and benchmarks that need a settled store). True when settled in time."""
        return self.placement.wait_for_background(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Every published block durable in cold now (write-behind, not waiting); False: not in `timeout_s`."""
        return durability.flush(self, timeout_s)

    def verify(self, block_ids: list[int]) -> list[int]:
        """Check the cold blocks among `block_ids` against their checksums; returns (and marks) the bad ones."""
        return self.placement.verify(block_ids)

    # ---- reporting (reporting.py) ----------------------------------------------------------------------
    def stats(self) -> dict:
        return self.reporting.stats()

    def check_consistency(self) -> list[str]:
        """[] when the index, pools, pins and transfers agree (what tests check after every fault)."""
        return self.reporting.check_consistency()

    # ---- lifecycle ------------------------------------------------------------------------------------
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

    def close(self) -> None:
        """Close from any thread, with moves in flight: refuse new leases and background moves, join
        every thread the store owns (remote writer, mover, copy engine, cold writer and
        readers, NVML sampler), move published blocks to cold and wait until durable, release the
        tiers. Steps still running on other threads get CLOSE_WAIT_S to end first."""
        if self.lock.held_by_me:
            raise RuntimeError("TierStore.close() was called under the store's own lock; this is a bug in tiered_kv")
        with self._close_lock:
            if self._closed:
                return
            with self.lock:
                self._closing = True
            if self.remote is not None:
                self.remote.close()  # its writer reads blocks through the transfers: before they stop
            if self.mover is not None:
                self.mover.stop()
            self._wait_for_leases(CLOSE_WAIT_S)  # running steps end first
            if self.is_bound:
                try:
                    with self.lock:
                        self.state.drain()
                    durability.persist_before_close(self)
                except Exception as error:
                    log.warning("closing: saving published blocks failed: %s", error)
            with self.lock:
                self._closed = True
            self._release_resources()
            self.state.changes.bump()

    def _wait_for_leases(self, timeout_s: float) -> None:
        """Until the steps running on other threads ended (this thread's own cannot end meanwhile)."""
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()
        while True:
            version = self.change_version
            with self.lock:
                self.state.drain()  # leases of banks the collector took end here
                running = sum(1 for lease in self.state.leases.values() if lease.thread_id != me)
            if not running:
                return
            if not self.wait_for_change(version, deadline - time.monotonic()):
                log.warning("closing: %d step(s) still running on other threads after %.0f s; their reads of this "
                            "store now fail", running, timeout_s)
                return

    def _release_resources(self, failed_start: bool = False) -> None:
        """Stop the engine and the sampler, close the tiers and the cold directory (idempotent); a
        failed start also removes the files and directories it made."""
        if self.remote is not None:
            self.remote.close(flush=False)
        if self.transfers is not None:
            self.transfers.close()
        elif getattr(self, "copy_engine", None) is not None:
            self.copy_engine.close()
        self.link_monitor.close()
        for i, tier in enumerate(self.state.tiers):
            if tier is not None:
                try:
                    tier.close()
                except Exception as error:  # keep closing the others
                    log.warning("closing the %s tier failed: %s", TIER_NAMES[i], error)
        self.state.tiers[:] = [None] * len(self.state.tiers)
        if self.peers is not None:
            self.peers.close()
        if self._cold_directory is not None:
            if failed_start:
                self._cold_directory.abort()
            else:
                self._cold_directory.close()  # releases its lock; keeps the block files
            self._cold_directory = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = ["TierStore", "STAGING_BYTES", "PIN_WAIT_S", "StepRequest", "StepLease"]
