"""Warm tier: a host RAM slab, page-locked when CUDA exists so device copies run async (DMA).

Two layouts (config `warm.layout`), chosen by who reads warm blocks:
- `WarmTier`, records `[num_slots, L, 2, H, bs, D]`: one block is one contiguous record,
  byte-identical to a cold-tier record: a run of blocks is one DMA to or from a GPU, and one
  read or write of the cold file. The layout of a store whose hot tier is a GPU.
- `PagedWarmTier`, the hot tier's paged layout (paged.py): on a CPU store attention reads a run
  of warm blocks in place, as a view of the slab, as it reads hot ones; a hot<->warm move is
  L*2*H contiguous copies per run of blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import KVLayout
from ..hw.block_copy import slot_runs
from ..hw.memory import allocate_slab
from .paged import PagedTier


class WarmTier:
    name = "warm"

    def __init__(self, layout: KVLayout, num_slots: int, dtype: torch.dtype, pinned: bool):
        self.layout = layout
        self.num_slots = num_slots
        self.pinned = pinned
        # checked against host RAM first: ConfigError('warm.capacity'), not an OOM kill
        self.slab = allocate_slab("warm.capacity", (num_slots, *layout.record_shape()), dtype, torch.device("cpu"),
                                  pin_memory=pinned)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.slab.numel() * self.slab.element_size() if self.slab is not None else 0

    def kernel_view(self, layer: int, device: torch.device):
        """`(K, V)` of layer `layer` as `[num_slots, H, bs, D]` views of the slab, for a kernel on
        `device` that reads blocks in place: on CUDA only from a page-locked slab (through UVA);
        None when the device cannot read it where it lies."""
        if self.slab is None or not self.num_slots:
            return None
        if torch.device(device).type == "cuda" and not self.pinned:
            return None
        return self.slab[:, layer, 0], self.slab[:, layer, 1]

    def read_blocks(self, slots: list[int]) -> torch.Tensor:
        return self.slab.index_select(0, torch.tensor(slots, dtype=torch.long))

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        self.slab.index_copy_(0, torch.tensor(slots, dtype=torch.long), data.to("cpu"))

    def block_view(self, slot: int) -> torch.Tensor:
        return self.slab[slot]

    def slots_view(self) -> torch.Tensor:
        """Every slot as `[num_slots, L, 2, H, bs, D]` (the slab), for batched block copies."""
        return self.slab

    def token_index(self, slots, offsets):
        """("blocks", block slots, first offset, count) when the tokens run through whole blocks
        in order (the usual case: one block-level gather per layer), else per-token indices."""
        slots = np.asarray(slots, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        bs = self.layout.block_size
        count = len(slots)
        if count:
            first = int(offsets[0])
            if (offsets == (first + np.arange(count)) % bs).all():
                starts = np.concatenate(([0], np.nonzero(offsets[1:] == 0)[0] + 1))
                block_slots = slots[starts]
                if (np.repeat(block_slots, bs)[first:first + count] == slots).all():
                    return "blocks", torch.from_numpy(block_slots), first, count
        return "tokens", torch.from_numpy(slots), torch.from_numpy(offsets)

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        if index[0] == "blocks":
            _, block_slots, first, count = index
            blocks = self.slab[:, layer].index_select(0, block_slots)  # [n, 2, H, bs, D]
            n, _, heads, bs, dim = blocks.shape
            return blocks.permute(1, 2, 0, 3, 4).reshape(2, heads, n * bs, dim)[:, :, first:first + count]
        _, slots, offsets = index
        # advanced indices separated by slices come first: [t, 2, H, D]
        return self.slab[slots, layer, :, :, offsets, :].permute(1, 2, 0, 3)

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        """Like read_tokens, copied into `out` (`[2, H, n, D]`, a strided view is fine): runs of
        consecutive slots of whole blocks are one strided copy each, with no temporary."""
        if index[0] != "blocks" or out.device.type != "cpu":
            out.copy_(self.read_tokens(layer, index), non_blocking=True)
            return
        _, block_slots, first, count = index
        bs = self.layout.block_size
        slots = block_slots.tolist()
        runs = slot_runs(range(len(slots)), slots)  # (first block, first slot, number of blocks)
        if len(runs) > max(4, len(slots) // 4):  # scattered slots: one gather beats many small copies
            out.copy_(self.read_tokens(layer, index))
            return
        for start, slot, length in runs:
            lo = max(start * bs, first)  # tokens of this run of blocks, in the request's order
            hi = min((start + length) * bs, first + count)
            src = self.slab[slot:slot + length, layer].permute(1, 2, 0, 3, 4)  # [2, H, k, bs, D]
            dst = out[:, :, lo - first:hi - first]
            if hi - lo == length * bs:  # whole blocks: one strided copy, no temporary
                dst.view(dst.shape[0], dst.shape[1], length, bs, dst.shape[3]).copy_(src)
            else:  # a partial first or last block
                whole = src.reshape(src.shape[0], src.shape[1], length * bs, src.shape[4])
                dst.copy_(whole[:, :, lo - start * bs:hi - start * bs])

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        if index[0] == "blocks":
            _, block_slots, first, count = index
            slots = torch.repeat_interleave(block_slots, self.layout.block_size)[first:first + count]
            offsets = (torch.arange(count) + first) % self.layout.block_size
        else:
            _, slots, offsets = index
        self.slab[slots, layer, :, :, offsets, :] = kv.permute(2, 0, 1, 3).to("cpu")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.slab = None


class PagedWarmTier(PagedTier):
    """Warm blocks in host RAM in the paged layout (see the module docstring)."""

    name = "warm"
    capacity_key = "warm.capacity"

    def __init__(self, layout: KVLayout, num_slots: int, dtype: torch.dtype, pinned: bool,
                 shared: tuple[torch.Tensor, int] | None = None):
        super().__init__(layout, num_slots, torch.device("cpu"), dtype, pin_memory=pinned, shared=shared)
        self.pinned = pinned
