"""Compressed warm and cold tiers (config `warm.compression`, `cold.compression`): the same tier
interface as warm.py and cold.py, in the model's dtype at the edge, packed bytes inside.

A block is stored as uint8 `[L, layer_bytes]`, each layer slice packed by compression/codec.py
(int8, fp8 or int4 codes with float16 scales). `write_blocks` encodes where the data is (from a GPU:
native/quant_blocks.cu there, and only the packed bytes cross the link, straight into the warm slab's
rows); every read decodes straight into where the values are wanted (`codec.decode_into`): a step's token
reads into its output or stream buffer, `read_blocks_into` into a slot-major view (the hot slab's slots
on a promotion). `kernel_view` is None: the paged decode kernel reads these blocks decoded, never in place.

Token writes (warm and cold) go through open_blocks.py: a block being filled is kept at full precision
beside its packed bytes, which always encode its present tokens only (never a reused slot's old bytes,
never its own tokens quantized twice); full, it holds exactly what one whole write stores.

Between two tiers of the same compression the packed bytes move as they are (`read_packed` / `write_packed`):
a block is quantized once, when it first goes down, and never again on its way between warm and cold.

`CompressedColdTier` keeps everything of the cold tier (files, checksums over the packed bytes,
durability, peers) and only converts at its edge; its records are format version 2, whose header
and file names carry the compression (cold_format.py), so a record of another mode is never read.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import KVLayout
from ..compression import codec
from ..hw.block_copy import slot_runs
from ..hw.memory import allocate_slab
from .cold import ColdTier
from .open_blocks import OpenBlocks, TokenWrite, block_writes, cold_span_start, group_tokens, warm_tokens
from .warm import WarmTier

MAX_DECODE_RUNS = 4  # a layer read decodes run by run up to this many runs of consecutive slots, else gathers


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

    def decode_into(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        codec.decode_into(packed, self.mode, out)

    def decode_span(self, packed: torch.Tensor, first: int, count: int, out: torch.Tensor) -> None:
        """Tokens [first, first + count) of the blocks `packed` `[n, P]` (one layer, in token order)
        into `out` `[2, H, count, D]`: whole blocks straight in, a partial first or last block
        through a one-block temporary."""
        bs = self.shape[1]
        n = packed.shape[0]
        lo_block, hi_block = -(-first // bs), (first + count) // bs  # the whole blocks inside the span
        if lo_block < hi_block:
            span = out[:, :, lo_block * bs - first:hi_block * bs - first]
            self.decode_into(packed[lo_block:hi_block], span.unflatten(2, (hi_block - lo_block, bs))
                             .permute(2, 0, 1, 3, 4))
        for block in {b for b in (first // bs, (first + count - 1) // bs) if b < n and not lo_block <= b < hi_block}:
            whole = self.decode(packed[block:block + 1], out.dtype)[0]  # [2, H, bs, D]
            lo, hi = max(first, block * bs), min(first + count, (block + 1) * bs)
            out[:, :, lo - first:hi - first] = whole[:, :, lo - block * bs:hi - block * bs]


def decode_runs(tier_codec: _Codec, packed: torch.Tensor, dst_view: torch.Tensor, dst_slots: list[int]) -> None:
    """Packed blocks `[n, L, P]` decoded into `dst_view[dst_slots[i]]` of a slot-major view
    `[S, L, 2, H, bs, D]` (a hot slab's `slots_view()`, a records slab), one decode per run of
    consecutive destination slots; the packed bytes go to the destination's device first."""
    packed = packed.to(dst_view.device, non_blocking=True)
    for d0, i0, length in slot_runs(dst_slots, range(len(dst_slots))):
        tier_codec.decode_into(packed[i0:i0 + length], dst_view[d0:d0 + length])


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
        self.open_blocks = OpenBlocks(layout, dtype)

    def kernel_view(self, layer: int, device: torch.device):
        return None  # packed bytes: read through the gather path, decoded

    def _slot_tensor(self, slots) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.long)

    def read_packed(self, slots: list[int]) -> torch.Tensor:
        """The blocks' packed bytes `[n, L, layer_bytes]` (a copy)."""
        return self.slab.index_select(0, self._slot_tensor(slots))

    def write_packed(self, slots: list[int], packed: torch.Tensor) -> None:
        """Blocks packed in this tier's mode (from another tier of the same layout), as they are."""
        self.open_blocks.drop(slots)
        self.slab.index_copy_(0, self._slot_tensor(slots), packed.to("cpu"))

    def read_blocks(self, slots: list[int], device=None) -> torch.Tensor:
        """Whole blocks `[n, L, 2, H, bs, D]` in the model's dtype, decoded on `device` (default cpu)."""
        packed = self.read_packed(slots)
        if device is not None and torch.device(device).type != "cpu":
            packed = packed.to(device, non_blocking=self.pinned)
        return self.codec.decode(packed, self.dtype)

    def read_blocks_into(self, slots: list[int], dst_view: torch.Tensor, dst_slots: list[int]) -> None:
        """Blocks decoded straight into `dst_view[dst_slots[i]]` (a slot-major view, e.g. hot's)."""
        decode_runs(self.codec, self.read_packed(slots), dst_view, dst_slots)

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        packed = self.codec.encode(data)  # where the data is: from a GPU, native/quant_blocks.cu packs there
        self.open_blocks.drop(slots)
        if not packed.is_cuda:
            self.slab.index_copy_(0, self._slot_tensor(slots), packed)
            return
        for s0, i0, length in slot_runs(slots, range(len(slots))):  # one device-to-host copy per run of rows
            self.slab[s0:s0 + length].copy_(packed[i0:i0 + length], non_blocking=self.pinned)
        torch.cuda.current_stream(packed.device).synchronize()  # written when this returns, as on the CPU

    def forget(self, slots: list[int]) -> None:
        """Slots were freed: their open blocks go (a new block there starts from nothing)."""
        self.open_blocks.drop(slots)

    def close(self) -> None:
        self.open_blocks.clear()
        super().close()

    def block_view(self, slot: int) -> torch.Tensor:
        raise TypeError("a compressed warm tier has no block views: read_blocks decodes")

    def slots_view(self) -> torch.Tensor:
        raise TypeError("a compressed warm tier has no slot views: read_blocks decodes, write_blocks encodes")

    def _for_device(self, packed: torch.Tensor, device) -> torch.Tensor:
        """Packed slab bytes where a decode into `device` reads them: in place from a pinned slab
        when the native kernel reads it through UVA, else copied there."""
        if self.pinned and codec.reads_pinned_in_place(device):
            return packed
        return packed.to(device, non_blocking=self.pinned)

    def token_index(self, slots, offsets):
        """WarmTier's index; a run of whole blocks also carries its runs of consecutive slots
        `(first block, first slot, length)`, found once per step instead of once per layer."""
        index = super().token_index(slots, offsets)
        if index[0] != "blocks":
            return index
        block_slots = index[1].numpy()
        starts = np.concatenate(([0], np.flatnonzero(np.diff(block_slots) != 1) + 1)).astype(np.int64)
        lengths = np.diff(np.append(starts, len(block_slots)))
        runs = list(zip(starts.tolist(), block_slots[starts].tolist(), lengths.tolist())) if len(block_slots) else []
        return (*index, runs)

    def _packed_runs(self, layer: int, index) -> list[tuple[int, torch.Tensor]]:
        """`(first block, [k, P] packed slices)` of one layer per run of consecutive slots (views of
        the slab), or one gathered run when the slots are scattered."""
        block_slots, runs = index[1], index[4]
        if len(runs) > max(MAX_DECODE_RUNS, len(block_slots) // 4):
            return [(0, self.slab[:, layer].index_select(0, block_slots))]
        return [(b0, self.slab[s0:s0 + length, layer]) for b0, s0, length in runs]

    def _blocks_and_offsets(self, index):
        """(unique slots, each token's position among them, each token's offset) of a token_index."""
        bs = self.layout.block_size
        if index[0] == "blocks":
            block_slots, first, count = index[1:4]
            positions = (torch.arange(count) + first) // bs
            return block_slots, positions, (torch.arange(count) + first) % bs
        _, slots, offsets = index
        unique, positions = torch.unique(slots, return_inverse=True)
        return unique, positions, offsets

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        count = index[3] if index[0] == "blocks" else len(index[1])
        out = torch.empty((2, self.layout.num_kv_heads, count, self.layout.head_dim), dtype=self.dtype)
        self.read_tokens_into(layer, index, out)
        return out

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        """Decoded straight into `out` (`[2, H, n, D]`, any strides; on a GPU the packed bytes go
        there first and are decoded there); the tokens of open blocks at full precision."""
        token_slots = index[1].numpy()
        patches = self.open_blocks.snapshot(layer, token_slots)  # before the bytes are read
        if index[0] == "blocks":
            first, count = index[2], index[3]
            bs = self.layout.block_size
            for b0, packed in self._packed_runs(layer, index):
                lo, hi = max(b0 * bs, first), min((b0 + len(packed)) * bs, first + count)  # this run's tokens
                if lo < hi:
                    self.codec.decode_span(self._for_device(packed, out.device), lo - b0 * bs, hi - lo,
                                           out[:, :, lo - first:hi - first])
        else:
            slots, positions, offsets = self._blocks_and_offsets(index)
            slices = self.codec.decode(self.slab[slots, layer], out.dtype)
            tokens = slices[torch.as_tensor(positions), :, :, torch.as_tensor(offsets)]  # [t, 2, H, D]
            out.copy_(tokens.permute(1, 2, 0, 3), non_blocking=True)
        if patches:
            self.open_blocks.apply(out, patches, lambda slot: warm_tokens(index, slot, self.layout.block_size))

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        """Whole blocks encoded at once; tokens of a block being filled through its open block (the
        encoding of its present tokens is stored at once, from full precision)."""
        values = kv.detach().to("cpu", self.dtype)
        whole_slots, whole, parts = block_writes(index, values, self.layout.block_size, self.open_blocks.open_among)
        if whole_slots:
            self.slab[self._slot_tensor(whole_slots), layer] = self.codec.encode(whole)
        if not parts:
            return
        with self.open_blocks.lock:  # `load`: a stored layer slice, decoded (a block continued here)
            pieces = [self.open_blocks.write(slot, layer, offsets, part, lambda s=slot: self.codec.decode(
                self.slab[s:s + 1, layer], self.dtype)[0]) for slot, offsets, part in parts]
            self.slab[self._slot_tensor([slot for slot, _, _ in parts]), layer] = self.codec.encode(torch.stack(pieces))


class CompressedColdTier(ColdTier):
    """The cold tier over packed records (see the module docstring); `layout` is the stored one."""

    compressed = True

    def __init__(self, layout: KVLayout, num_slots: int, directory, backend: str = "auto", fsync: bool = True):
        super().__init__(layout, num_slots, directory, backend, fsync)
        self.codec = _Codec(layout)
        self.open_blocks = OpenBlocks(layout, self.codec.model_dtype)

    def _check(self, slot: int, layer: int, data: np.ndarray) -> None:
        """The checksum, then the scales: finite, or the record is corrupt (recomputed, never decoded)."""
        super()._check(slot, layer, data)
        if not codec.scales_finite(self.layout, data):
            raise self._corrupt(slot, f"cold tier slot {slot} layer {layer} holds NaN or infinite scales "
                                      f"in {self.file_path}")

    def packed_buffer(self, num_blocks: int) -> np.ndarray:
        return np.empty((num_blocks, self.layout.num_layers, self.layout.layer_bytes), dtype=np.uint8)

    def read_packed(self, slots: list[int], out=None) -> np.ndarray:
        """The records' packed bytes `[n, L, layer_bytes]` (into `out`, a contiguous uint8 array or
        CPU tensor, when given), every layer slice checked against its checksum (CorruptBlockError
        naming the slot otherwise)."""
        out = self.packed_buffer(len(slots)) if out is None else out
        host = out.numpy() if isinstance(out, torch.Tensor) else out  # a view: reads land in `out`
        with self._guard:
            self._read_blocks_into(slots, host)
        return host

    def write_packed(self, slots: list[int], packed) -> None:
        """Records of blocks already packed in this tier's mode (a compressed warm tier's bytes)."""
        host = np.ascontiguousarray(packed.numpy() if isinstance(packed, torch.Tensor) else packed)
        self.open_blocks.drop(slots)
        with self._guard:
            self._write_records(slots, host)

    def read_blocks(self, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        packed = torch.from_numpy(self.read_packed(slots))
        if out is None:
            return self.codec.decode(packed)
        self.codec.decode_into(packed, out)
        return out

    def read_blocks_into(self, slots: list[int], dst_view: torch.Tensor, dst_slots: list[int],
                         packed_out: np.ndarray | None = None) -> None:
        """Records decoded straight into `dst_view[dst_slots[i]]` (a slot-major view, e.g. hot's)."""
        decode_runs(self.codec, torch.from_numpy(self.read_packed(slots, packed_out)), dst_view, dst_slots)

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        self.write_packed(slots, self.codec.encode(data).to("cpu"))

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        num_tokens, _ = index
        out = torch.empty((2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim), dtype=self.codec.model_dtype)
        self.read_tokens_into(layer, index, out)
        return out

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        _, groups = index
        entries = list(groups.items())
        patches = self.open_blocks.snapshot(layer, np.fromiter(groups, dtype=np.int64, count=len(groups)))
        self._read_tokens_packed(layer, entries, out)
        if patches:  # open blocks' tokens at full precision
            self.open_blocks.apply(out, patches, lambda slot: group_tokens(groups[slot]))

    def _read_tokens_packed(self, layer: int, entries: list, out: torch.Tensor) -> None:
        packed = np.empty((len(entries), self.layout.layer_bytes), dtype=np.uint8)
        with self._guard:
            for i, (slot, _) in enumerate(entries):
                self._read_slice_locked(slot, layer, packed[i])  # checked; never an unwritten slice
        packed = torch.from_numpy(packed).to(out.device, non_blocking=True)
        start = cold_span_start(entries, self.layout.block_size, out.shape[2])
        if start is not None:  # the tokens run through the blocks in order: decoded straight into out
            self.codec.decode_span(packed, start, out.shape[2], out)
            return
        slices = self.codec.decode(packed, out.dtype)
        for i, (_, items) in enumerate(entries):  # per block: a slice of it, or its tokens picked
            if isinstance(items, tuple):
                position, offset, count = items
                out[:, :, position:position + count] = slices[i][:, :, offset:offset + count]
            else:
                positions = torch.as_tensor([p for p, _ in items], device=out.device)
                offsets = torch.as_tensor([o for _, o in items], device=out.device)
                out[:, :, positions] = slices[i][:, :, offsets]

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        """ColdTier's slice writes (locks, checksums, durability), each slice encoded from its open
        block (open_blocks.py) by `_put_tokens`."""
        _, groups = index
        first = {int(group_tokens(items)[0][0]): slot for slot, items in groups.items()}
        super().write_tokens(layer, index, TokenWrite(layer, kv.detach().to("cpu", self.codec.model_dtype), first))

    def _token_values(self, kv):
        return kv  # a TokenWrite

    def _put_tokens(self, buffer: np.ndarray, positions: list[int], offsets: list[int], host) -> None:
        """One slice of a token write (ColdTier.write_tokens holds the slot's lock; `buffer`: its
        stored bytes, zeros when it holds none)."""
        slot, layer = host.slot_at[positions[0]], host.layer
        packed = torch.from_numpy(buffer)
        held = bool(self.valid[slot, layer])
        load = (lambda: self.codec.decode(packed.unsqueeze(0))[0]) if held else (lambda: None)
        with self.open_blocks.lock:
            piece = self.open_blocks.write(slot, layer, torch.as_tensor(offsets, dtype=torch.long),
                                           host.values[:, :, positions], load)
            packed.copy_(self.codec.encode(piece.unsqueeze(0))[0])

    def forget(self, slots: list[int]) -> None:
        super().forget(slots)
        self.open_blocks.drop(slots)

    def close(self) -> None:
        self.open_blocks.clear()
        super().close()


def is_compressed(tier) -> bool:
    return bool(getattr(tier, "compressed", False))


def same_packing(src, dst) -> bool:
    """Whether blocks move between the two tiers as packed bytes (both compressed, one layout)."""
    return is_compressed(src) and is_compressed(dst) and src.layout == dst.layout
