"""Building a store: what it opens at start (`start`: the copy engine, the cold directory, the
remote tier, what the tiers' compression is: compression/auto.py), then for one KV layout its tiers: the slabs, the cold file, the slot pools, the
staging sets of the transfers (one for on-demand batches, one for the background mover's) and
the watermarks in blocks. A failure partway leaves `made` holding what was built (the store
closes it); nothing here keeps state.
"""

from __future__ import annotations

import logging
import math

import torch

from ..blocks import COLD, HOT, TIER_NAMES, WARM, KVLayout
from ..compression.auto import CompressionChoice
from ..errors import ColdPathInUseError
from ..hw.block_copy import BlockCopier, device_staging
from ..hw.copy_engine import make_copy_engine
from ..hw.link_monitor import make_link_monitor
from ..metrics.registry import BACKGROUND, ON_DEMAND
from ..pool import SlotPool
from ..remote import RemoteTier
from ..scheduler.mem_scheduler import Watermarks
from ..tiers import ColdTier, HotTier
from ..tiers.compressed import CompressedColdTier
from ..tiers.cold_files import ColdDirectory, open_cold_directory
from ..tiers.cold_peers import PeerFiles
from ..tiers.paged import paged_slabs
from ..tiers.warm_factory import is_paged_warm, warm_tier
from .copies import Staging

log = logging.getLogger(__name__)

STAGING_BYTES = 32 * 2**20  # host staging for on-demand batches into and out of cold
# device staging for batched hot<->warm moves (hw/block_copy.py), on a CUDA store only; capped at
# the hot capacity; beside the hot slab, not counted in hot.capacity
STAGING_DEVICE_BYTES = 64 * 2**20
BACKGROUND_STAGING_BYTES = 16 * 2**20  # the mover's batches (mover.BATCH_BYTES)


def stored_layouts(config, layout: KVLayout) -> list[KVLayout]:
    """Each tier's layout: hot holds the model's dtype; warm and cold as their `compression` says
    (a compressed block is fewer bytes, so the same capacity holds more of them)."""
    return [layout, layout.stored(config.warm.compression), layout.stored(config.cold.compression)]


def capacities_of(config, layout: KVLayout, has_cold: bool) -> list[int]:
    hot, warm, cold = stored_layouts(config, layout)
    return [config.hot.resolve_blocks(hot.block_bytes), config.warm.resolve_blocks(warm.block_bytes),
            config.cold.resolve_blocks(cold.block_bytes) if has_cold else 0]


def start(config, device, metrics):
    """(link monitor, copy engine, cold directory or None, why the store may not write it or None,
    remote tier or None, the CompressionChoice: its record lives in the cold directory); a failure
    closes what it opened. A wrong password (or, when required, a
    server down) fails the start, as does an unusable cold directory: at start, not at the first spill."""
    link_monitor = make_link_monitor(device)
    engine = directory = unavailable = None
    try:
        engine = make_copy_engine(device, config.copies.engine, config.copies.delay_us)
        if config.cold.capacity_blocks != 0 and config.cold.capacity_bytes != 0:
            directory, unavailable = open_cold(config.cold.path)
        remote = RemoteTier(config.remote, metrics) if config.remote.enabled else None
    except BaseException:
        for opened in (engine, link_monitor, directory):
            if opened is not None:
                opened.close()
        raise
    return link_monitor, engine, directory, unavailable, remote, CompressionChoice(config, directory)


def open_cold(path: str) -> tuple[ColdDirectory, str | None]:
    """(the cold directory, why this store may not write it or None). When gc, or a store of an
    older tiered_kv, holds it exclusively past the wait, the store runs read-only on cold: the
    directory is opened without its lock, to read the other stores' durable records only."""
    try:
        return open_cold_directory(path), None
    except ColdPathInUseError as error:
        log.warning("%s; this store runs read-only on cold (hot and warm of its own; it reads the durable "
                    "records there, writes none)", error)
        return ColdDirectory(path, shared=False), str(error)


def build_tiers(config, layout: KVLayout, dtype: torch.dtype, device, pinned: bool, cold_directory, made: list,
                may_write_cold: bool = True):
    """(tiers, pools, why cold is unavailable or None) for `layout`; each tier is appended to `made`
    as soon as it exists. A store that cannot claim a block file of its own on the cold directory
    (or may not write there) runs without a cold tier, reading the other stores' records there."""
    capacities = capacities_of(config, layout, cold_directory is not None and may_write_cold)
    _, warm_layout, cold_layout = stored_layouts(config, layout)
    hot_shared = warm_shared = None
    if torch.device(device).type == "cpu" and not pinned and is_paged_warm(warm_layout, config.warm.layout, device):
        # one token axis over hot's slots then warm's: a step reads both with one gather per layer
        hot_shared, warm_shared = paged_slabs([("hot.capacity", capacities[HOT]), ("warm.capacity", capacities[WARM])],
                                              layout, dtype, device)
    made.append(HotTier(layout, capacities[HOT], device, dtype, shared=hot_shared))
    made.append(warm_tier(warm_layout, capacities[WARM], dtype, pinned, config.warm.layout, device, warm_shared))
    cold, unavailable = None, None
    if capacities[COLD] > 0:
        try:
            cold = (CompressedColdTier if cold_layout.is_compressed else ColdTier)(
                cold_layout, capacities[COLD], cold_directory, config.cold.backend, config.cold.fsync)
        except ColdPathInUseError as error:
            unavailable = str(error)
            log.warning("%s; this store runs read-only on cold (hot and warm of its own; it reads the other stores' "
                        "durable records there)", error)
            capacities[COLD] = 0
    made.append(cold)
    return list(made), [SlotPool(n, TIER_NAMES[t]) for t, n in enumerate(capacities)], unavailable


def peers_of(cold_directory, layout: KVLayout, cold) -> PeerFiles | None:
    """The other stores' block files on the cold directory (read-only), when there is one."""
    if cold_directory is None:
        return None
    return PeerFiles(cold_directory, layout, cold.file_number if cold is not None else None)


def build_staging(layout: KVLayout, dtype: torch.dtype, device, pinned: bool, capacities: list[int]) -> dict:
    """A staging set per batch mode: host buffer (page-locked on CUDA, touched once) and copier."""
    staging = {}
    for mode, host_bytes, device_bytes in ((ON_DEMAND, STAGING_BYTES, STAGING_DEVICE_BYTES),
                                           (BACKGROUND, BACKGROUND_STAGING_BYTES, BACKGROUND_STAGING_BYTES)):
        blocks = max(1, min(host_bytes // layout.block_bytes, max(capacities)))
        host = torch.zeros((blocks, *layout.record_shape()), dtype=dtype, pin_memory=pinned)
        copier = BlockCopier(device_staging("hot.capacity", device_bytes, layout, capacities[HOT], device, dtype))
        staging[mode] = Staging(host, copier)
    return staging


def watermarks_of(config, capacities: list[int]) -> Watermarks:
    tier_cfgs = (config.hot, config.warm, config.cold)
    return Watermarks(
        high_blocks=tuple(math.ceil(c.high_watermark * n) for c, n in zip(tier_cfgs, capacities)),
        low_blocks=tuple(int(c.low_watermark * n) for c, n in zip(tier_cfgs, capacities)))


__all__ = ["build_tiers", "build_staging", "watermarks_of", "STAGING_BYTES", "STAGING_DEVICE_BYTES", "COLD"]
