"""Whole-block copies between slot-major views, in a few large operations per batch.

A slot-major view is a tensor `[S, L, 2, H, bs, D]` whose index 0 is a slot: the warm slab and
a host staging buffer are such tensors (each record contiguous); the hot tier's `slots_view()`
is one too, strided (a hot block is L*2*H chunks of bs*D elements). `BlockCopier.copy(dst,
dst_slots, src, src_slots)` sets `dst[dst_slots[i]] = src[src_slots[i]]` for every i.

Between a CUDA device and host memory, copying block by block costs a DMA into a temporary and
a strided device copy per block (~35 us for a 360 KiB block). Here a batch goes through a
preallocated, contiguous device staging buffer `[C, L, 2, H, bs, D]` in chunks of at most C
blocks. Per chunk:
  host -> device: one DMA per run of consecutive host slots (the blocks are sorted by host slot
      first, so a chat's records, usually consecutive, move as one DMA) into staging, then ONE
      `index_copy_` from staging into the device view;
  device -> host: ONE `index_select` from the device view into staging, then one DMA per run
      of consecutive host slots out of it.
A copier runs inside a unit of a copy engine (hw/copy_engine.py): on CUDA everything it issues
goes on the engine's side stream, after the compute stream's earlier work and before the unit's
event; staging is only touched on that stream, so chunks reuse it without host waits. Its
caller (store/transfers.py) keeps the engine's rules: memory these copies use is in use until
the unit's event passed. One copier (and its staging) serves one batch at a time.

Staging memory: the caller allocates it on the device (TierStore: STAGING_DEVICE_BYTES, 64 MiB,
capped at the hot tier's capacity; the mover: its batch, 16 MiB). It is NOT counted against the
hot tier's capacity: `hot.capacity` sizes the slab, and staging is a fixed overhead beside it,
as the host staging for cold moves is beside the warm slab.

Where both sides are in the same memory (all of it on the CPU store; device to device), blocks
are copied directly, one `copy_` per run of slots consecutive on both sides: the same bytes in
at most as many copies as block by block, with no extra pass through staging.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .memory import allocate_slab


def slot_runs(dst_slots: Sequence[int], src_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the runs, in the given order, where both sides advance
    by one slot per block."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_slots, src_slots):
        if runs:
            d0, s0, length = runs[-1]
            if d == d0 + length and s == s0 + length:
                runs[-1] = (d0, s0, length + 1)
                continue
        runs.append((d, s, 1))
    return runs


class BlockCopier:
    """Copies whole blocks between slot-major views (see the module docstring).

    `staging`: a contiguous `[C, L, 2, H, bs, D]` buffer on the compute device (None on a CPU
    store); `chunk_blocks` (at most C) bounds how many blocks one chunk moves."""

    def __init__(self, staging: torch.Tensor | None = None, chunk_blocks: int | None = None):
        self.staging = staging
        if staging is not None:
            chunk_blocks = min(chunk_blocks or staging.shape[0], staging.shape[0])
        self.chunk_blocks = max(1, chunk_blocks or 1 << 30)
        self.num_calls = 0  # copy() calls, for tests and stats
        self.num_chunks = 0  # staged chunks (each one device op and its DMAs)

    def copy(self, dst: torch.Tensor, dst_slots: Sequence[int], src: torch.Tensor, src_slots: Sequence[int]) -> None:
        """dst[dst_slots[i]] = src[src_slots[i]] for every i (distinct destination slots)."""
        if len(dst_slots) != len(src_slots):
            raise ValueError(f"{len(dst_slots)} destination slots for {len(src_slots)} source slots")
        if not len(dst_slots):
            return
        self.num_calls += 1
        if self.staging is not None and dst.device != src.device:
            self.staged(dst, list(dst_slots), src, list(src_slots), to_device=dst.device == self.staging.device)
        else:
            self.direct(dst, list(dst_slots), src, list(src_slots))

    def direct(self, dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> None:
        """One copy_ per run of slots consecutive on both sides (sorted by source slot)."""
        pairs = sorted(zip(src_slots, dst_slots))
        for d, s, length in slot_runs([p[1] for p in pairs], [p[0] for p in pairs]):
            dst[d:d + length].copy_(src[s:s + length], non_blocking=True)

    def staged(self, dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int],
               to_device: bool) -> None:
        """Through `staging` in chunks: per chunk one DMA per run of consecutive host slots and
        one index op on the device side (`dst` when `to_device`, else `src`). Called inside a
        copy engine's unit (see copy); tests drive it with CPU tensors."""
        staging = self.staging
        if to_device:
            device_side, host_side = dst_slots, src_slots
        else:
            device_side, host_side = src_slots, dst_slots
        order = sorted(range(len(host_side)), key=host_side.__getitem__)
        host_sorted = [host_side[i] for i in order]
        device_index = _index_tensor([device_side[i] for i in order], staging.device)
        chunk_blocks = min(self.chunk_blocks, staging.shape[0])
        for start in range(0, len(order), chunk_blocks):
            hosts = host_sorted[start:start + chunk_blocks]
            count = len(hosts)
            buffer, index = staging[:count], device_index[start:start + count]
            runs = slot_runs(range(count), hosts)  # (staging position, host slot, length)
            if to_device:
                for position, host_slot, length in runs:
                    buffer[position:position + length].copy_(src[host_slot:host_slot + length], non_blocking=True)
                dst.index_copy_(0, index, buffer)
            else:
                torch.index_select(src, 0, index, out=buffer)
                for position, host_slot, length in runs:
                    dst[host_slot:host_slot + length].copy_(buffer[position:position + length], non_blocking=True)
            self.num_chunks += 1


def device_staging(key: str, max_bytes: int, layout, hot_blocks: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """A contiguous `[C, L, 2, H, bs, D]` buffer on a CUDA `device` for batched block copies
    (C: `max_bytes` worth of blocks, at most the hot tier's blocks, at least 1); None elsewhere.
    Checked like a slab: too little device memory is a ConfigError naming `key`."""
    if torch.device(device).type != "cuda" or hot_blocks <= 0:
        return None
    blocks = max(1, min(max_bytes // layout.block_bytes, hot_blocks))
    return allocate_slab(key, (blocks, *layout.record_shape()), dtype, device)


def _index_tensor(slots: list[int], device: torch.device) -> torch.Tensor:
    """Slots as a LongTensor on `device`; to a CUDA device through pinned memory, without a
    host wait on the (side) stream it is issued on."""
    index = torch.tensor(slots, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)
