"""A paged slab: the layout attention reads in place, shared by the hot tier and, on a CPU
store, the warm tier (warm.layout "paged").

Slab layout `[L, 2, H, num_slots * block_size, D]`: within a layer, slot s holds tokens
s*bs .. s*bs+bs-1 along the token axis. A sequence whose blocks sit in consecutive slots is
therefore one contiguous token range, and attention reads it as a view with no copy; other
sequences are gathered with one index_select per layer (the same traffic as DynamicCache's cat).
A run of blocks moves between two paged slabs as L*2*H contiguous copies.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import KVLayout
from ..hw.memory import allocate_slab, check_fits


MAX_SLICE_RUNS = 8  # a token index of up to this many contiguous runs copies run by run
MIN_TOKENS_PER_SLICE_RUN = 16  # (on average): shorter runs are gathered in one index_select


def slab_shape(layout: KVLayout, num_slots: int) -> tuple[int, ...]:
    """`[L, 2, H, num_slots * block_size, D]`: the paged layout."""
    return (layout.num_layers, 2, layout.num_kv_heads, num_slots * layout.block_size, layout.head_dim)


def paged_slabs(keys_and_slots: list[tuple[str, int]], layout: KVLayout, dtype: torch.dtype,
                device: torch.device) -> list[tuple[torch.Tensor, int]]:
    """One paged slab whose token axis holds several tiers' slots one after another (hot's, then
    warm's), as each tier's `shared` argument. A step then reads blocks of all of them with one
    gather per layer. Each part is checked against the memory left once the parts before it are
    counted, so a ConfigError names the key of the tier that does not fit."""
    total = 0
    for key, num_slots in keys_and_slots:
        total += num_slots
        check_fits(key, slab_shape(layout, total), dtype, device)
    whole = allocate_slab(keys_and_slots[-1][0], slab_shape(layout, total), dtype, device)
    shared, first = [], 0
    for _, num_slots in keys_and_slots:
        shared.append((whole, first))
        first += num_slots
    return shared


class SliceRuns(tuple):
    """A token index of a few contiguous runs of a paged slab, in token order (slices)."""

    def placed(self):
        """`(slice, first position in the request)` per run."""
        at = 0
        for run in self:
            yield run, at
            at += run.stop - run.start


class PagedTier:
    """A tier whose slab is paged (see the module docstring); `name` names it in errors."""

    name = "paged"
    capacity_key = "hot.capacity"  # the config key a slab too large for its memory names

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device, dtype: torch.dtype,
                 pin_memory: bool = False, shared: tuple[torch.Tensor, int] | None = None):
        """`shared`: (a slab shared with other paged tiers, the first of its slots that is this
        tier's): one token axis over hot's and warm's slots on a CPU store (`paged_slabs`), so a
        step gathers from both with one index. None: a slab of its own."""
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        bs = layout.block_size
        if shared is None:
            # checked against the device's free memory first: a ConfigError naming the key, not an OOM
            whole = allocate_slab(self.capacity_key, slab_shape(layout, num_slots), dtype, device, pin_memory=pin_memory)
            shared = (whole, 0)
        self.whole_slab, self.first_slot = shared  # where this tier's slot s is slot first_slot + s of whole_slab
        self.slab = self.whole_slab[:, :, :, self.first_slot * bs:(self.first_slot + num_slots) * bs]
        self._blocks = self.slab.view(layout.num_layers, 2, layout.num_kv_heads, num_slots, bs, layout.head_dim)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slab as allocated (diagnose reports them beside the capacity)."""
        return self.slab.numel() * self.slab.element_size() if self.slab is not None else 0

    def _slot_tensor(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def read_blocks(self, slots: list[int]) -> torch.Tensor:
        return self._blocks.index_select(3, self._slot_tensor(slots)).permute(3, 0, 1, 2, 4, 5)

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        data = data.to(self.device, non_blocking=True)
        self._blocks.index_copy_(3, self._slot_tensor(slots), data.permute(1, 2, 3, 0, 4, 5))

    def block_view(self, slot: int) -> torch.Tensor:
        """Slot `slot` as a (strided) `[L, 2, H, bs, D]` view, for async single-block copies."""
        return self._blocks[:, :, :, slot]

    def slots_view(self) -> torch.Tensor:
        """Every slot as a (strided) `[num_slots, L, 2, H, bs, D]` view, for batched block copies."""
        return self._blocks.permute(3, 0, 1, 2, 4, 5)

    def kernel_view(self, layer: int, device: torch.device):
        """`(K, V)` of layer `layer` as `[num_slots, H, bs, D]` views of the slab, for a kernel on
        `device` that reads blocks where they lie (the paged decode kernel); None elsewhere."""
        if self.slab is None or self.slab.device.type != torch.device(device).type:
            return None
        heads, bs, dim = self.layout.num_kv_heads, self.layout.block_size, self.layout.head_dim
        return tuple(self.slab[layer, kv].view(heads, self.num_slots, bs, dim).permute(1, 0, 2, 3) for kv in (0, 1))

    def token_index(self, slots, offsets):
        """A slice when the tokens are one contiguous run of the slab; `SliceRuns` when they are a
        few (a row whose blocks lie in a few runs of consecutive slots: copied run by run, at
        memcpy speed); else a LongTensor of token positions (gathered)."""
        flat = np.asarray(slots, dtype=np.int64) * self.layout.block_size + np.asarray(offsets, dtype=np.int64)
        if len(flat) and flat[-1] - flat[0] == len(flat) - 1 and bool((np.diff(flat) == 1).all()):
            return slice(int(flat[0]), int(flat[-1]) + 1)
        if len(flat) >= MIN_TOKENS_PER_SLICE_RUN:
            breaks = np.flatnonzero(np.diff(flat) != 1) + 1
            if len(breaks) < MAX_SLICE_RUNS and len(flat) >= MIN_TOKENS_PER_SLICE_RUN * (len(breaks) + 1):
                bounds = [0, *breaks.tolist(), len(flat)]
                return SliceRuns(slice(int(flat[a]), int(flat[b - 1]) + 1) for a, b in zip(bounds[:-1], bounds[1:]))
        return torch.from_numpy(flat).to(self.device)

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        if isinstance(index, slice):
            return self.slab[layer, :, :, index]
        if isinstance(index, SliceRuns):
            return torch.cat([self.slab[layer, :, :, run] for run in index], dim=2)
        return self.slab[layer].index_select(2, index)

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        if isinstance(index, SliceRuns):
            for run, at in index.placed():
                out[:, :, at:at + run.stop - run.start].copy_(self.slab[layer, :, :, run])
            return
        out.copy_(self.read_tokens(layer, index))

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        kv = kv.to(self.device, non_blocking=True)
        if isinstance(index, slice):
            self.slab[layer, :, :, index].copy_(kv)
        elif isinstance(index, SliceRuns):
            for run, at in index.placed():
                self.slab[layer, :, :, run].copy_(kv[:, :, at:at + run.stop - run.start])
        else:
            self.slab[layer].index_copy_(2, index, kv)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.slab = self._blocks = self.whole_slab = None
