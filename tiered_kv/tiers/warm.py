"""Warm tier: a host RAM slab, page-locked when CUDA exists so device copies run async (DMA).

Slab layout `[num_slots, L, 2, H, bs, D]`: one block is one contiguous record, byte-identical
to a cold-tier record, so warm<->cold moves are single reads/writes with no repacking.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import KVLayout


class WarmTier:
    name = "warm"

    def __init__(self, layout: KVLayout, num_slots: int, dtype: torch.dtype, pinned: bool):
        self.layout = layout
        self.num_slots = num_slots
        self.pinned = pinned
        self.slab = torch.zeros((num_slots, *layout.record_shape()), dtype=dtype, pin_memory=pinned)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    def read_blocks(self, slots: list[int]) -> torch.Tensor:
        return self.slab.index_select(0, torch.tensor(slots, dtype=torch.long))

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        self.slab.index_copy_(0, torch.tensor(slots, dtype=torch.long), data.to("cpu"))

    def block_view(self, slot: int) -> torch.Tensor:
        return self.slab[slot]

    def token_index(self, slots, offsets):
        return torch.as_tensor(np.asarray(slots, dtype=np.int64)), torch.as_tensor(np.asarray(offsets, dtype=np.int64))

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        slots, offsets = index
        # advanced indices separated by slices come first: [t, 2, H, D]
        return self.slab[slots, layer, :, :, offsets, :].permute(1, 2, 0, 3)

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        slots, offsets = index
        self.slab[slots, layer, :, :, offsets, :] = kv.permute(2, 0, 1, 3).to("cpu")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.slab = None
