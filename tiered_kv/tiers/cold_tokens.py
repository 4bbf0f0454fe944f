"""The cold tier's token reads and writes: the tokens of one layer, at (slot, offset) each
(`ColdTokens`, mixed into ColdTier, as DurableRecords is).

A token index groups the tokens by slot: per block, a run `(first position, first offset, count)`
when its tokens are consecutive in both the request and the block, else `[(position, offset), ...]`.
A read is the hot loop of a turn over cold history: per block one preadv and one XXH3 of its slice
of the layer, into a per-caller batch buffer (`TokenScratch`), then one copy into the output. A write is
a read-modify-write of each slice under its slot's lock, withdrawing the record's durable row first
(a changed record is not durable).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import xxhash

from ..hw.block_io import PosixBlockIO
from .cold_format import checksum


class ColdTokens:
    """ColdTier's token methods. Uses the tier's `layout`, `io`, `valid`, `checksums`, `_guard`,
    `_scratch` (a ScratchPool of `TokenScratch`), `_header_live`, `_withdraw`, `_slot_lock`,
    `_read_slice_locked`, `_read_layer_slice`, `_naming_the_file`, `_no_peer_reading`,
    `_count_written`, `_to_numpy`, `_to_torch` and `_dirty`."""

    def token_index(self, slots, offsets):
        groups: dict[int, list[tuple[int, int]]] = {}
        slots = np.asarray(slots, dtype=np.int64).tolist()
        offsets = np.asarray(offsets, dtype=np.int64).tolist()
        for position, (slot, offset) in enumerate(zip(slots, offsets)):
            groups.setdefault(slot, []).append((position, offset))
        for slot, items in groups.items():  # consecutive tokens of one block: (position, offset, count)
            p0, o0 = items[0]
            if all(p == p0 + i and o == o0 + i for i, (p, o) in enumerate(items)):
                groups[slot] = (p0, o0, len(items))
        return len(slots), groups

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        num_tokens, _ = index
        out = self._to_torch(np.empty((2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim),
                                      dtype=self._np_dtype))
        with self._guard, self._scratch.take() as scratch:
            self._read_tokens_host(layer, index, out, scratch)
        return out

    def read_tokens_into(self, layer: int, index, out: torch.Tensor) -> None:
        """Like read_tokens, into `out` (`[2, H, n, D]`, a strided view is fine)."""
        if out.device.type != "cpu":
            out.copy_(self.read_tokens(layer, index))
            return
        with self._guard, self._scratch.take() as scratch:
            self._read_tokens_host(layer, index, out, scratch)

    def _read_tokens_host(self, layer: int, index, out: torch.Tensor, scratch: "TokenScratch") -> None:
        """The hot loop of a turn over cold history: per block, one preadv and one XXH3 of its
        slice of this layer (the general read path only when a read comes back short), into a
        batch buffer; then one copy of the batch into `out` (a CPU tensor) when the blocks are
        whole and in order."""
        _, groups = index
        entries = list(groups.items())
        batch, views = scratch.batch(len(entries))
        # validity and checksum of the slices read, gathered once: O(blocks read), never O(capacity)
        slots = list(groups)
        valid, sums = self.valid[slots, layer].tolist(), self.checksums[slots, layer].tolist()
        slice_bytes, base, stride = self.layout.layer_bytes, layer * self.layout.layer_bytes, self.record_stride_bytes
        fd = self.io.fd if isinstance(self.io, PosixBlockIO) else None
        pread, digest = os.preadv, xxhash.xxh3_64_intdigest
        for i, (slot, _) in enumerate(entries):  # ~7,000 iterations a turn at 4k tokens: kept tight
            view = views[i]
            try:
                complete = valid[i] and fd is not None and pread(fd, [view], slot * stride + base) == slice_bytes
            except OSError:
                complete = False
            if not complete or digest(view) != sums[i]:
                # read again with the slot's lock: a step may have been writing this very slice (its
                # new tokens in the tail block) meanwhile; the general path says why when it still fails
                self._read_slice_locked(slot, layer, batch[i])
        bs = self.layout.block_size
        first = entries[0][1][0] if entries and isinstance(entries[0][1], tuple) else None
        if first is not None and all(isinstance(items, tuple) and items == (first + i * bs, 0, bs)
                                     for i, (_, items) in enumerate(entries)):
            n = len(entries)  # one transposing copy; torch's runs on its intra-op threads
            span = out[:, :, first:first + n * bs]
            span.view(span.shape[0], span.shape[1], n, bs, span.shape[3]).copy_(
                self._to_torch(batch[:n]).permute(1, 2, 0, 3, 4))
            return
        out_np = (out.view(torch.uint16) if self.layout.dtype_name == "bfloat16" else out).numpy()  # shares memory
        for i, (_, items) in enumerate(entries):
            if isinstance(items, tuple):  # (first position, first offset, count): one slice
                position, offset, count = items
                out_np[:, :, position:position + count] = batch[i][:, :, offset:offset + count]
            else:
                positions, offsets = _positions_and_offsets(items)
                out_np[:, :, positions] = batch[i][:, :, offsets]

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        _, groups = index
        host = self._token_values(kv)
        with self._guard, self._scratch.take() as scratch:
            was_durable = set(self._withdraw(list(groups), zero_header=True))  # a changed record is not durable
            buffer = scratch.layer_buffer
            for slot, items in groups.items():
                with self._slot_lock(slot):  # a read of this slice (the stream worker's) waits for it
                    self._read_layer_slice(slot, layer, buffer)  # read-modify-write of one slice
                    self._put_tokens(buffer, *_positions_and_offsets(items), host)
                    self.valid[slot, layer] = False
                    with self._naming_the_file(), \
                            self._no_peer_reading(slot, slot in was_durable or self._header_live[slot]):
                        self.io.write_from(buffer, self._offset(slot, layer))
                    self.checksums[slot, layer] = checksum(buffer)
                    self.valid[slot, layer] = True
        self._count_written(len(groups) * self.layout.layer_bytes)
        self._dirty = True

    def _token_values(self, kv: torch.Tensor):
        """`write_tokens`' values as `_put_tokens` takes them."""
        return self._to_numpy(kv)

    @staticmethod
    def _put_tokens(buffer: np.ndarray, positions: list[int], offsets: list[int], host) -> None:
        """Tokens `positions` of `host` into one layer slice at `offsets` (read-modify-write)."""
        buffer[:, :, offsets] = host[:, :, positions]


class TokenScratch:
    """One caller's scratch: a layer slice for read-modify-write and checks, and a batch of slices
    (with a byte view of each) for a layer read, grown on demand."""

    def __init__(self, slice_shape: tuple, dtype, slice_bytes: int):
        self.layer_buffer = np.empty(slice_shape, dtype)
        self._slice_shape, self._dtype, self._slice_bytes = slice_shape, dtype, slice_bytes
        self._batch: tuple[np.ndarray, list[memoryview]] | None = None

    def batch(self, num_blocks: int) -> tuple[np.ndarray, list[memoryview]]:
        """`[>= num_blocks, 2, H, bs, D]` and a byte view of each row."""
        if self._batch is None or len(self._batch[0]) < num_blocks:
            batch = np.empty((max(num_blocks, 64), *self._slice_shape), dtype=self._dtype)
            flat, size = memoryview(batch.reshape(-1).view(np.uint8)), self._slice_bytes
            self._batch = (batch, [flat[i * size:(i + 1) * size] for i in range(len(batch))])
        return self._batch


def _positions_and_offsets(items) -> tuple[list[int], list[int]]:
    """A token_index group as (positions in the request, offsets in the block)."""
    if isinstance(items, tuple):
        position, offset, count = items
        return list(range(position, position + count)), list(range(offset, offset + count))
    return [p for p, _ in items], [o for _, o in items]
