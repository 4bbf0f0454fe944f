"""Compressed warm and cold tiers (config `warm.compression`, `cold.compression`): the same tier
interface as warm.py and cold.py, in the model's dtype at the edge, packed bytes inside.

A block is stored as uint8 `[L, layer_bytes]`, each layer slice packed by compression/codec.py
(int8, fp8 or int4 codes with float16 scales). `write_blocks` encodes, `read_blocks` decodes (on the
device asked for, so a promotion to a GPU copies the packed bytes and decodes there); token reads
decode only the blocks they touch, of one layer; a token write re-encodes the slices it changes
(read-modify-write, as the cold tier's own slice writes do). `kernel_view` is None: a kernel reads
these blocks through the gather path (decoded into its buffer), never in place.

`CompressedColdTier` keeps everything of the cold tier (files, checksums over the packed bytes,
durability, peers) and only converts at its edge; its records are format version 2, whose header
and file names carry the compression (cold_format.py), so a record of another mode is never read.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import KVLayout
from ..compression import codec
from ..hw.memory import allocate_slab
from .cold import ColdTier, _positions_and_offsets
from .warm import WarmTier


class _Codec:
    """The codec of one compressed layout: packed `[..., P]` <-> slices `[..., 2, H, bs, D]`."""

    def __init__(self, layout: KVLayout):
        self.mode = layout.compression
        self.shape = (layout.num_kv_heads, layout.block_size, layout.head_dim)
        self.model_dtype = codec.model_dtype(layout.dtype_name)

    def encode(self, slices: torch.Tensor) -> torch.Tensor:
        return codec.encode(slices, self.mode)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return codec.decode(packed, self.mode, *self.shape, dtype or self.model_dtype)


def _gather_tokens(slices: torch.Tensor, blocks, offsets) -> torch.Tensor:
    """`[2, H, t, D]` of decoded slices `[n, 2, H, bs, D]` at (block, offset) per token."""
    return slices[torch.as_tensor(blocks), :, :, torch.as_tensor(offsets)].permute(1, 2, 0, 3)


class CompressedWarmTier(WarmTier):
    """Warm blocks in host RAM (page-locked on CUDA), packed: uint8 `[num_slots, L, layer_bytes]`."""

    compressed = True

    def __init__(self, layout: KVLayout, num_slots: int, dtype: torch.dtype, pinned: bool):
        self.layout = layout
        self.num_slots = num_slots
        self.pinned = pinned
        self.dtype = dtype
        self.codec = _Codec(layout)
        self.slab = allocate_slab("warm.capacity", (num_slots, layout.num_layers, layout.layer_bytes), torch.uint8,
                                  torch.device("cpu"), pin_memory=pinned)

    def kernel_view(self, layer: int, device: torch.device):
        return None  # packed bytes: read through the gather path, decoded

    def read_blocks(self, slots: list[int], device=None) -> torch.Tensor:
        """Whole blocks `[n, L, 2, H, bs, D]` in the model's dtype, decoded on `device` (default cpu)."""
        packed = self.slab.index_select(0, torch.tensor(slots, dtype=torch.long))
        if device is not None and torch.device(device).type != "cpu":
            packed = packed.to(device, non_blocking=self.pinned)
        return self.codec.decode(packed, self.dtype)

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        packed = self.codec.encode(data)  # on the data's device: a demotion from a GPU packs there
        self.slab.index_copy_(0, torch.tensor(slots, dtype=torch.long), packed.to("cpu"))

    def block_view(self, slot: int) -> torch.Tensor:
        raise TypeError("a compressed warm tier has no block views: read_blocks decodes")

    def slots_view(self) -> torch.Tensor:
        raise TypeError("a compressed warm tier has no slot views: read_blocks decodes, write_blocks encodes")

    def _blocks_and_offsets(self, index):
        """(unique slots, each token's position among them, each token's offset) of a token_index."""
        bs = self.layout.block_size
        if index[0] == "blocks":
            _, block_slots, first, count = index
            positions = (torch.arange(count) + first) // bs
            return block_slots, positions, (torch.arange(count) + first) % bs
        _, slots, offsets = index
        unique, positions = torch.unique(slots, return_inverse=True)
        return unique, positions, offsets

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        if index[0] == "blocks":
            _, block_slots, first, count = index
            slices = self.codec.decode(self.slab[:, layer].index_select(0, block_slots), self.dtype)
            n, _, heads, bs, dim = slices.shape
            return slices.permute(1, 2, 0, 3, 4).reshape(2, heads, n * bs, dim)[:, :, first:first + count]
        slots, positions, offsets = self._blocks_and_offsets(index)
        return _gather_tokens(self.codec.decode(self.slab[slots, layer], self.dtype), positions, offsets)

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        out.copy_(self.read_tokens(layer, index), non_blocking=True)

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        """Re-encode the slices these tokens change (their blocks' other tokens are decoded and kept)."""
        slots, positions, offsets = self._blocks_and_offsets(index)
        slices = self.codec.decode(self.slab[slots, layer], torch.float32)
        slices[positions, :, :, offsets] = kv.detach().to("cpu", torch.float32).permute(2, 0, 1, 3)
        self.slab[slots, layer] = self.codec.encode(slices)


class CompressedColdTier(ColdTier):
    """The cold tier over packed records (see the module docstring); `layout` is the stored one."""

    compressed = True

    def __init__(self, layout: KVLayout, num_slots: int, directory, backend: str = "auto", fsync: bool = True):
        super().__init__(layout, num_slots, directory, backend, fsync)
        self.codec = _Codec(layout)

    def _packed(self, num_blocks: int) -> np.ndarray:
        return np.empty((num_blocks, self.layout.num_layers, self.layout.layer_bytes), dtype=np.uint8)

    def read_blocks(self, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._packed(len(slots))
        with self._guard:
            self._read_blocks_into(slots, packed)  # every layer slice checked against its checksum
        blocks = self.codec.decode(torch.from_numpy(packed))
        if out is None:
            return blocks
        out.copy_(blocks)
        return out

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        packed = np.ascontiguousarray(self.codec.encode(data).to("cpu").numpy())
        with self._guard:
            self._write_records(slots, packed)

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        num_tokens, _ = index
        out = torch.empty((2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim), dtype=self.codec.model_dtype)
        self.read_tokens_into(layer, index, out)
        return out

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        _, groups = index
        entries = list(groups.items())
        packed = np.empty((len(entries), self.layout.layer_bytes), dtype=np.uint8)
        with self._guard:
            for i, (slot, _) in enumerate(entries):
                self._read_slice_locked(slot, layer, packed[i])  # checked; never an unwritten slice
        slices = self.codec.decode(torch.from_numpy(packed), out.dtype)
        positions, blocks, offsets = [], [], []
        for i, (_, items) in enumerate(entries):
            p, o = _positions_and_offsets(items)
            positions += p
            offsets += o
            blocks += [i] * len(p)
        tokens = _gather_tokens(slices, blocks, offsets)
        out[:, :, torch.as_tensor(positions, device=out.device)] = tokens.to(out.device, non_blocking=True)

    def _token_values(self, kv: torch.Tensor):
        return kv.detach().to("cpu", torch.float32)

    def _put_tokens(self, buffer: np.ndarray, positions: list[int], offsets: list[int], host) -> None:
        packed = torch.from_numpy(buffer)
        slices = self.codec.decode(packed.unsqueeze(0), torch.float32)[0]
        slices[:, :, offsets] = host[:, :, positions]
        packed.copy_(self.codec.encode(slices.unsqueeze(0))[0])


def is_compressed(tier) -> bool:
    return bool(getattr(tier, "compressed", False))
