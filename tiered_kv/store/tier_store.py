"""TierStore: one budget of hot/warm/cold blocks shared by every CacheBank that uses it.

A façade: it makes the components below, hands each the collaborators it uses (the state, the
lock, the transfers, ...; none gets the store) and delegates to them (docs/design.md):
  life.py        open, bound, closing, closed: what every component asks before it starts work
  closing.py     close(): in order, from any thread, with moves in flight; the exit hook
  state.py       the block index, the tiers and their slot pools, pins, blocks in flight, deferred frees
  transfers.py   the one path bytes move by (prepare/launch/complete), by arrays (batches.py, reserving.py, ...)
  demand.py      moves a caller needs now, in rounds around the copies, sub-batches pipelined
  allocation.py  new blocks placed as high as room allows; copy-on-write copies
  opening.py     a step's lease: room, copy-on-write, promotion, pins, token runs, at once
  leases.py      what a forward pass holds while it reads and writes its blocks without the lock
  placement.py   promote, prefetch, demote, undo, verify: moves a caller asks for by name
  catalog.py     the blocks as banks hold them: references (retain, release), names (publish, look up)
  remote_io.py   fetches from other processes' cold files and the remote tier (write-in), remote writes
  mover.py       the background thread: prefetch, watermark and idle demotion, compaction
  compaction.py  where hot blocks lie and how to make a chat contiguous again
  durability.py  durable records in at start, flush, published blocks out to cold at close; the durable
                 copies of blocks above cold (durable_copies.py) and their backups (write_behind.py)
  reporting.py   stats() and the cheap counters (consistency.py: the self-check)

Concurrency (docs/design.md, invariants 4, 7, 8): one lock per store (`lock`, which only the store's
components take: no bank, hook or tool does), held to plan, reserve, commit and pin, never while
anything waits — copies, file and network I/O and waits for copy events happen between critical
sections. A store is not copied by `copy.deepcopy`: copies of banks share it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import COLD, KVLayout
from ..config import Config, load_config
from ..errors import LayoutError
from ..hw.devices import resolve_device, resolve_pinned
from ..metrics.registry import Metrics
from ..metrics.stores import register_store
from ..pool import SlotPool
from ..scheduler import MemScheduler
from ..scheduler.access_log import AccessLog
from ..scheduler.mem_scheduler import Watermarks
from ..scheduler.restore import Rates
from . import building
from .building import STAGING_BYTES
from .allocation import PIN_WAIT_S, Allocation
from .catalog import Catalog
from .closing import Closing, close_at_exit
from .compaction import HotCompaction
from .demand import DemandMoves
from .device_slab import DeviceSlab
from .durability import Durability, bind_cold
from .leases import StepLease, StepRequest
from .life import StoreLife
from .lock import StoreLock
from .mover import Mover
from .opening import Opening
from .placement import Placement
from .remote_io import RemoteIO
from .reporting import Reporting
from .state import StoreState
from .token_map import TokenMapper
from .transfers import Transfers


class TierStore:
    def __init__(self, config: Config | dict | str | None = None):
        self.config = load_config(config if config is not None else {})
        self.device = resolve_device(self.config.hot.device)
        self.pinned = resolve_pinned(self.config.warm.pinned, self.device)
        self.lock = StoreLock()
        self.life = StoreLife()
        self.metrics = Metrics(self.config.metrics.enabled)
        self.state = StoreState(self.metrics)
        settings = self.config.scheduler
        self.access_log = AccessLog.from_settings(settings)
        self.access_log.follow(self.state.index)  # it forgets the blocks the index removes: memory follows live blocks
        self.rates = Rates()  # read rates and the prefill cost, measured: what a turn restores (restore.py)
        self.scheduler = MemScheduler(settings, self.access_log)
        self.compaction = HotCompaction(self.state, self.access_log, settings)
        # made by bind(), for one KV layout (their sizes follow from it)
        self.layout: KVLayout | None = None
        self.dtype: torch.dtype | None = None
        self.watermarks: Watermarks | None = None
        self.transfers: Transfers | None = None
        self.demand: DemandMoves | None = None
        self.mapper: TokenMapper | None = None
        self.device_slab: DeviceSlab | None = None  # what a prepared step addresses (device_slab.py)
        self.mover: Mover | None = None  # (None as well with scheduler.background off)
        self.allocation: Allocation | None = None
        self.placement: Placement | None = None
        self.opening: Opening | None = None
        self.remote_io: RemoteIO | None = None
        self.durability: Durability | None = None
        self.peers = None  # other processes' cold files on this cold.path (tiers/cold_peers.py), once bound
        register_store(self)
        try:  # (cold_unavailable: why this store runs without a cold tier of its own; compression: auto.py's)
            (self.link_monitor, self.copy_engine, self._cold_directory, self.cold_unavailable, self.remote,
             self.compression) = building.start(self.config, self.device, self.metrics)
        except BaseException:
            self.life.closed = True  # (start closed what it opened)
            raise
        self.state.step_fences.engine = self.copy_engine  # fences on the streams steps run on
        self._closing = Closing(self.lock, self.life, self.state, self.link_monitor, self.copy_engine,
                                self._cold_directory, self.remote)
        close_at_exit(self.close)
        self.reporting = Reporting(self.lock, self.life, self.state, self.metrics, self.config, self.compaction,
                                   self.access_log, self.rates, self.link_monitor, self.copy_engine, self.remote,
                                   self.device, self.pinned)
        self.catalog = Catalog(self.lock, self.life, self.state, self.compaction, self.metrics, self.remote,
                               self.config.cold.write_behind_s)

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
        return self.life.bound

    @property
    def is_closed(self) -> bool:
        return self.life.closed

    @property
    def is_closing(self) -> bool:
        return self.life.is_closing

    # ---- binding ---------------------------------------------------------------------------------
    def bind(self, layout: KVLayout, dtype: torch.dtype) -> None:
        """Preallocate every tier for `layout` (one for the store's life; `compression: auto` resolved first)."""
        with self.lock:
            self.check_open()
            if self.life.bound:
                if layout != self.layout or dtype != self.dtype:
                    raise LayoutError(
                        f"this TierStore serves KV layout {self.layout} ({self.dtype}); got {layout} ({dtype}). "
                        "Use one store per model shape and dtype")
                return
            config = self.compression.bound_config(layout)  # (a ConfigError here leaves the store as it was)
            try:
                self._bind(layout, dtype, config)
            except BaseException:
                self.life.closed = True  # a failed start removes what it made (files, threads) and this store
                self._closing.release(self.transfers, self.peers, failed_start=True)
                raise
        if self.mover is not None:
            self.mover.start()
        if self.remote is not None:
            self.remote.bind(layout.stored(config.remote.compression), self.remote_io.read_block_bytes)

    def _bind(self, layout: KVLayout, dtype: torch.dtype, config: Config) -> None:  # config: auto resolved
        made = self.state.tiers  # what building made, closed by Closing.release if it fails partway
        tiers, pools, unavailable = building.build_tiers(config, layout, dtype, self.device, self.pinned,
                                                         self._cold_directory, made, self.cold_unavailable is None)
        self.cold_unavailable = self.cold_unavailable or unavailable
        self.peers = building.peers_of(self._cold_directory, layout.stored(config.cold.compression), tiers[COLD])
        staging = building.build_staging(layout, dtype, self.device, self.pinned, [p.num_slots for p in pools])
        self.state.copies = bind_cold(self.state.index, tiers[COLD], pools[COLD], self.metrics, self.config.cold.admit)
        self.state.bind(tiers, pools)
        stored = building.stored_layouts(config, layout)
        self.transfers = Transfers(self.state, self.copy_engine, self.metrics, self.link_monitor,
                                   [s.block_bytes for s in stored], staging, self.rates)
        self.demand = DemandMoves(self.lock, self.state, self.transfers, layout.block_bytes)
        self.mapper = TokenMapper(tiers, layout, self.device, dtype, self.metrics)
        self.device_slab = DeviceSlab(tiers, self.device, layout.block_size)
        self.layout, self.dtype = layout, dtype
        self.watermarks = building.watermarks_of(self.config, self.capacities)
        # the components that serve blocks, each given what it uses (docs/design.md)
        lock, life, state, scheduler, access_log, compaction = \
            self.lock, self.life, self.state, self.scheduler, self.access_log, self.compaction
        transfers, demand, metrics = self.transfers, self.demand, self.metrics
        if self.config.scheduler.background:  # (its thread starts once bind() let go of the lock)
            self.mover = Mover(lock, life, state, scheduler, access_log, compaction, transfers, self.link_monitor,
                               self.watermarks, self.config, layout.block_bytes)
        self.allocation = Allocation(lock, life, state, scheduler, compaction, demand, transfers, layout)
        self.placement = Placement(lock, life, state, scheduler, access_log, compaction, demand, self.mover)
        self.opening = Opening(lock, life, state, self.config.block_size, metrics, access_log, compaction,
                               self.mapper, self.allocation, self.placement, self.mover)
        state.on_collected = self.opening.forget  # a bank the collector took
        self.remote_io = RemoteIO(lock, life, state, transfers, demand, self.allocation.allocate_pinned,
                                  self.catalog.publish_many, metrics, self.rates, layout, dtype, self.pinned,
                                  self.remote, self.peers)
        self.durability = Durability(lock, life, state, scheduler, transfers, demand, metrics)
        self.reporting.bind(stored, self.cold_unavailable, staging, self.mover)
        self.life.bound = True

    # ---- steps -----------------------------------------------------------------------------------
    def open_step(self, request: StepRequest) -> StepLease | None:
        """A lease on everything one forward pass reads and writes (opening.py), or None: retry
        once something changed (`wait_for_change`). BankClosedError on a closed store."""
        return self._bound(self.opening).open_step(request)

    @property
    def change_version(self) -> int:
        return self.state.changes.version

    def wait_for_change(self, since: int, timeout_s: float) -> bool:
        """Block (without the store lock) until a step ended, a transfer completed or blocks were
        released since `change_version` was `since`; False after `timeout_s`."""
        return self.state.changes.wait(since, timeout_s)

    def check_open(self) -> None:
        self.life.check_open()

    def _bound(self, component):
        """`component`, which bind() made; BankClosedError on a closed store, else RuntimeError before bind."""
        if component is None:
            self.check_open()
            raise RuntimeError("this TierStore is not bound to a KV layout yet: bind() it first (a bank does)")
        return component

    # ---- blocks -----------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, protect: frozenset[int] = frozenset(),
                 follow: list[tuple[int, int | None]] | None = None) -> list[int]:
        """New blocks (ref_count 1), placed as high as possible (allocation.py). CapacityError
        (changing nothing) when all tiers together cannot hold them, after waiting up to
        PIN_WAIT_S for running steps to free the room they hold. `follow` (per group of the new
        blocks, in order: how many, and the block they continue or None) gives each group
        consecutive hot slots, right after that block's when free: one slice for attention."""
        return self._bound(self.allocation).allocate(num_blocks, protect, follow)

    def retain(self, block_ids: list[int]) -> None:
        self.catalog.retain(block_ids)

    def release(self, block_ids: list[int], for_good: bool = False) -> None:
        """Drop one reference each; `for_good`: never kept as cache (catalog.py)."""
        self.catalog.release(block_ids, for_good)

    def release_later(self, block_ids: list[int], owner: int) -> None:
        """For a bank the garbage collector took: its references and pins go at the store's next
        operation. Takes no lock (the collector may run while this very thread holds it)."""
        self.state.release_later(block_ids, owner)

    def placements(self, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """(tier, slot) of each block, as two int64 arrays."""
        with self.lock:
            return self.state.placements(block_ids)

    # ---- content addressing (catalog.py) ---------------------------------------------------------------
    def publish(self, block_id: int, key: bytes, root: bytes | None = None) -> bool:
        """Name a full, verified block by its key (chained from `root`, the model fingerprint) so
        other banks, and with a cold tier later processes, can reuse it."""
        return self.publish_many([(block_id, key, root)])[0]

    def publish_many(self, items: list[tuple[int, bytes, bytes | None]], local: bool = True) -> list[bool]:
        """`local`: computed here (False: fetched from another process or the remote tier)."""
        return self.catalog.publish_many(items, local)

    def lookup_and_retain(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (from the first) that the store holds intact,
        each retained once for the caller."""
        return self.catalog.lookup_and_retain(keys)

    def holds(self, keys: list[bytes]) -> list[bool]:
        """Whether the store holds each key's block intact (nothing retained)."""
        return self.catalog.holds(keys)

    def fetch_remote(self, keys: list[bytes], root: bytes) -> list[int]:
        """After a local miss: the leading run of `keys` that other stores' cold files here, then the remote
        server, hold intact, as new published blocks retained once for the caller (remote_io.py)."""
        return self.remote_io.fetch_elsewhere(keys, root) if self.remote_io is not None else []

    # ---- placement (placement.py) --------------------------------------------------------------------
    def promote(self, block_ids: list[int], owner: int | None = None) -> list[int]:
        """Bring blocks up (hot first), now; returns the ids found corrupt on the way (never served)."""
        return self._bound(self.placement).promote(block_ids, owner)

    def prefetch(self, owner: int, block_ids: list[int], deadline_s: float | None = None) -> None:
        """Bring `owner`'s blocks up in the background and return at once (without a mover: now)."""
        self._bound(self.placement).prefetch(owner, block_ids, deadline_s)

    def demote(self, block_ids: list[int], dst_tier: int) -> list[int]:
        """Move blocks down to `dst_tier` (WARM or COLD) as far as room allows; returns corrupt ids."""
        return self._bound(self.placement).demote(block_ids, dst_tier)

    def forget_chat(self, owner: int) -> None:
        """A bank closed: its access history no longer describes a live chat."""
        with self.lock:
            if self.opening is not None:
                self.opening.forget(owner)

    def wait_for_background(self, timeout_s: float = 30.0) -> bool:
        """Wait until the mover has no prefetch request, no batch in flight and no compaction to
        do (for tests and benchmarks that need a settled store). True when settled in time."""
        return self.placement is None or self.placement.wait_for_background(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Every published block durable in cold now (write-behind, not waiting); False: not in `timeout_s`."""
        return self.durability is None or self.durability.flush(timeout_s)

    def verify(self, block_ids: list[int]) -> list[int]:
        """Check the cold blocks among `block_ids` against their checksums; returns (and marks) the bad ones."""
        return self.placement.verify(block_ids) if self.placement is not None else []

    # ---- reporting (reporting.py) ----------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.reporting.stats(), "compression": self.compression.report()}

    def check_consistency(self) -> list[str]:
        """[] when the index, pools, pins and transfers agree (what tests check after every fault)."""
        return self.reporting.check_consistency()

    # ---- lifecycle ------------------------------------------------------------------------------------
    def add_owner(self) -> None:
        self._closing.add_owner()

    def drop_owner(self) -> None:
        """A bank that owns this store closed; the last one closes the store."""
        if self._closing.drop_owner():
            self.close()

    def close(self) -> None:
        """Close from any thread, with moves in flight: refuse new leases and background moves, join
        every thread the store owns (remote writer, mover, copy engine, cold writer and
        readers, NVML sampler), move published blocks to cold and wait until durable, release the
        tiers. Steps still running on other threads get CLOSE_WAIT_S to end first (closing.py)."""
        self._closing.close(self.mover, self.durability, self.transfers, self.peers)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = ["TierStore", "STAGING_BYTES", "PIN_WAIT_S", "StepRequest", "StepLease"]
