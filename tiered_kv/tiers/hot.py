"""Hot tier: paged blocks on the compute device (HBM under CUDA, RAM on cpu), in the paged
layout of paged.py: a sequence in consecutive slots is one contiguous token range per layer."""

from __future__ import annotations

from .paged import PagedTier


class HotTier(PagedTier):
    name = "hot"
    capacity_key = "hot.capacity"


__all__ = ["HotTier"]
