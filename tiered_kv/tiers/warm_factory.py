"""Which warm tier a config makes: records, paged (a CPU store's, sharing hot's slab), or packed
(compressed). Apart from warm.py so that the packed tier, a WarmTier subclass, imports warm.py
without warm.py importing it back."""

from __future__ import annotations

import torch

from ..blocks import KVLayout
from ..errors import ConfigError
from .compressed import CompressedWarmTier
from .warm import PagedWarmTier, WarmTier


def is_paged_warm(layout: KVLayout, layout_name: str, hot_device) -> bool:
    """Whether config `warm.layout` ("auto": paged when the hot tier is on the CPU) makes warm a
    paged slab (never a compressed one)."""
    on_cpu = torch.device(hot_device).type == "cpu"
    return not layout.is_compressed and (layout_name == "paged" or (layout_name == "auto" and on_cpu))


def warm_tier(layout: KVLayout, num_slots: int, dtype: torch.dtype, pinned: bool, layout_name: str,
              hot_device, shared: tuple[torch.Tensor, int] | None = None) -> WarmTier | PagedWarmTier:
    """The warm tier for config `warm.layout` and `layout` (a compressed one: packed records,
    compressed.py); `shared`: a paged warm tier's place in a slab shared with hot (paged_slabs)."""
    if layout.is_compressed:
        return CompressedWarmTier(layout, num_slots, dtype, pinned)
    on_cpu = torch.device(hot_device).type == "cpu"
    if layout_name == "paged" and not on_cpu:
        raise ConfigError(f"config key 'warm.layout': got 'paged' with the hot tier on {hot_device}; allowed there: "
                          "'records' or 'auto' (paged serves a CPU store, whose attention reads warm in place; a "
                          "GPU reads warm by DMA and by its kernels, which need records)")
    if is_paged_warm(layout, layout_name, hot_device):
        return PagedWarmTier(layout, num_slots, dtype, pinned, shared)
    return WarmTier(layout, num_slots, dtype, pinned)


__all__ = ["is_paged_warm", "warm_tier"]
