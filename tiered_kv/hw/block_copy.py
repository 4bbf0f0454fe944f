"""Whole-block copies between slot-major views, in a few large operations per batch.

A slot-major view is a tensor `[S, L, 2, H, bs, D]` whose index 0 is a slot: the warm slab and
a host staging buffer are such tensors (each record contiguous); the hot tier's `slots_view()`
is one too, strided (a hot block is L*2*H chunks of bs*D elements). `BlockCopier.copy(dst,
dst_slots, src, src_slots)` sets `dst[dst_slots[i]] = src[src_slots[i]]` for every i.

Between a CUDA device and host memory, copying block by block costs a DMA into a temporary and
a strided device copy per block (~35 us for a 360 KiB block). Here a batch goes through a
preallocated, contiguous device staging buffer `[C, L, 2, H, bs, D]`, split in two halves used in
turn (double-buffered), in chunks of at most C/2 blocks. Per chunk:
  host -> device: one DMA per run of consecutive host slots (the blocks are sorted by host slot
      first, so a chat's records, usually consecutive, move as one DMA) into a half, then ONE
      `index_copy_` from it into the device view;
  device -> host: ONE `index_select` from the device view into a half, then one DMA per run of
      consecutive host slots out of it.
The DMAs go on a copy stream of the copier's own and the index ops on the engine's side stream,
ordered by events per half: chunk k+1's DMA runs while chunk k's index op does (it waits only
for the index op that last used its half, chunk k-1's), instead of queueing behind it on one
stream. A copier runs inside a unit of a copy engine (hw/copy_engine.py): its copy stream first
waits for the side stream (so it comes after the fences of the steps whose slots it copies,
which the side stream waited on, and after the earlier units), and the side stream waits for
the copy stream at the end of every call, so the unit's event, recorded on the side stream,
covers every DMA. Its caller (store/transfers.py) keeps the
engine's rules: memory these copies use is in use until the unit's event passed. Units run in the
engine's order, one at a time per copier. On CPU tensors (tests) the same steps run in line.

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

import numpy as np
import torch

from .memory import allocate_slab


def slot_runs(dst_slots: Sequence[int], src_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the runs, in the given order, where both sides advance
    by one slot per block (sequences or int64 arrays; found with numpy, not block by block)."""
    dst = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    src = np.asarray(src_slots, dtype=np.int64).reshape(-1)
    if not len(dst):
        return []
    starts = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, len(dst)))
    return list(zip(dst[starts].tolist(), src[starts].tolist(), lengths.tolist()))


class BlockCopier:
    """Copies whole blocks between slot-major views (see the module docstring).

    `staging`: a contiguous `[C, L, 2, H, bs, D]` buffer on the compute device (None on a CPU
    store); `chunk_blocks` bounds how many blocks one chunk moves (at most C/2 when C >= 2: the
    buffer's two halves take chunks in turn)."""

    def __init__(self, staging: torch.Tensor | None = None, chunk_blocks: int | None = None):
        self.staging = staging
        if staging is not None:
            chunk_blocks = min(chunk_blocks or staging.shape[0], staging.shape[0])
        self.chunk_blocks = max(1, chunk_blocks or 1 << 30)
        self.num_calls = 0  # copy() calls, for tests and stats
        self.num_chunks = 0  # staged chunks (each one device op and its DMAs)
        self._copy_stream = None  # the DMAs' CUDA stream (made at first use)

    def copy(self, dst: torch.Tensor, dst_slots, src: torch.Tensor, src_slots) -> None:
        """dst[dst_slots[i]] = src[src_slots[i]] for every i (distinct destination slots; slots as
        sequences or int64 arrays)."""
        if len(dst_slots) != len(src_slots):
            raise ValueError(f"{len(dst_slots)} destination slots for {len(src_slots)} source slots")
        if not len(dst_slots):
            return
        self.num_calls += 1
        dst_slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
        src_slots = np.asarray(src_slots, dtype=np.int64).reshape(-1)
        if self.staging is not None and dst.device != src.device:
            self.staged(dst, dst_slots, src, src_slots, to_device=dst.device == self.staging.device)
        else:
            self.direct(dst, dst_slots, src, src_slots)

    def direct(self, dst: torch.Tensor, dst_slots, src: torch.Tensor, src_slots) -> None:
        """One copy_ per run of slots consecutive on both sides (sorted by source slot)."""
        src_slots = np.asarray(src_slots, dtype=np.int64).reshape(-1)
        dst_slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
        if len(src_slots) > 1 and (np.diff(src_slots) < 0).any():
            order = np.lexsort((dst_slots, src_slots))
            src_slots, dst_slots = src_slots[order], dst_slots[order]
        for d, s, length in slot_runs(dst_slots, src_slots):
            dst[d:d + length].copy_(src[s:s + length], non_blocking=True)

    def staged(self, dst: torch.Tensor, dst_slots, src: torch.Tensor, src_slots, to_device: bool) -> None:
        """Through `staging` in chunks, the buffer's halves in turn: per chunk one DMA per run of
        consecutive host slots and one index op on the device side (`dst` when `to_device`, else
        `src`). Called inside a copy engine's unit (see copy); tests drive it with CPU tensors."""
        staging = self.staging
        device_side = np.asarray(dst_slots if to_device else src_slots, dtype=np.int64).reshape(-1)
        host_side = np.asarray(src_slots if to_device else dst_slots, dtype=np.int64).reshape(-1)
        order = np.argsort(host_side, kind="stable")
        host_sorted = host_side[order]
        device_index = _index_tensor(device_side[order], staging.device)
        halves = 2 if staging.shape[0] >= 2 else 1
        half_blocks = staging.shape[0] // halves
        buffers = [staging[h * half_blocks:(h + 1) * half_blocks] for h in range(halves)]
        chunk_blocks = min(self.chunk_blocks, half_blocks)
        lanes = _Lanes(staging.device, halves, self._lanes_stream(staging.device))
        for k, start in enumerate(range(0, len(order), chunk_blocks)):
            hosts = host_sorted[start:start + chunk_blocks]
            count = len(hosts)
            half = k % halves
            buffer, index = buffers[half][:count], device_index[start:start + count]
            runs = slot_runs(np.arange(count), hosts)  # (staging position, host slot, length)
            if to_device:
                with lanes.dma(half):  # after the index op that last read this half
                    for position, host_slot, length in runs:
                        buffer[position:position + length].copy_(src[host_slot:host_slot + length], non_blocking=True)
                with lanes.device_op(half):  # after this chunk's DMAs
                    dst.index_copy_(0, index, buffer)
            else:
                with lanes.device_op(half):  # after the DMAs that last drained this half
                    torch.index_select(src, 0, index, out=buffer)
                with lanes.dma(half):  # after this chunk's index op
                    for position, host_slot, length in runs:
                        dst[host_slot:host_slot + length].copy_(buffer[position:position + length], non_blocking=True)
            self.num_chunks += 1
        lanes.join()

    def _lanes_stream(self, device: torch.device):
        if torch.device(device).type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        return self._copy_stream


class _Lanes:
    """The two streams of a staged copy on CUDA (index ops on the current stream, the engine's side
    stream; DMAs on the copier's copy stream) and one event per buffer half: each step waits for
    the last step that used its half (within a chunk, its other step; across chunks, the chunk
    before that used the half) and becomes that half's last step. So a chunk's DMA overlaps the
    other half's index op. On other devices every step runs in line and these are no-ops."""

    def __init__(self, device: torch.device, halves: int, copy_stream):
        self.copy_stream = copy_stream
        if copy_stream is None:
            return
        self.main = torch.cuda.current_stream(device)
        self.copy_stream.wait_stream(self.main)  # after the steps' fences and the earlier units
        self.last = [None] * halves  # per half: the event after the last step that used it

    def dma(self, half: int):
        return _StreamStep(self, self.copy_stream, half) if self.copy_stream is not None else _IN_LINE

    def device_op(self, half: int):
        return _StreamStep(self, self.main, half) if self.copy_stream is not None else _IN_LINE

    def join(self) -> None:
        """The side stream waits for every DMA issued (the unit's event comes after them)."""
        if self.copy_stream is not None:
            self.main.wait_stream(self.copy_stream)


class _StreamStep:
    """One step of a staged chunk on `stream`, after the last step that used its half."""

    def __init__(self, lanes: _Lanes, stream, half: int):
        self.lanes, self.stream, self.half = lanes, stream, half
        self._context = torch.cuda.stream(stream)

    def __enter__(self):
        self._context.__enter__()
        if self.lanes.last[self.half] is not None:
            self.stream.wait_event(self.lanes.last[self.half])
        return self

    def __exit__(self, *exc):
        event = torch.cuda.Event()
        event.record(self.stream)
        self.lanes.last[self.half] = event
        return self._context.__exit__(*exc)


class _InLine:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_IN_LINE = _InLine()


def device_staging(key: str, max_bytes: int, layout, hot_blocks: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """A contiguous `[C, L, 2, H, bs, D]` buffer on a CUDA `device` for batched block copies
    (C: `max_bytes` worth of blocks, at most the hot tier's blocks, at least 1); None elsewhere.
    Checked like a slab: too little device memory is a ConfigError naming `key`."""
    if torch.device(device).type != "cuda" or hot_blocks <= 0:
        return None
    blocks = max(1, min(max_bytes // layout.block_bytes, hot_blocks))
    return allocate_slab(key, (blocks, *layout.record_shape()), dtype, device)


def _index_tensor(slots: np.ndarray, device: torch.device) -> torch.Tensor:
    """Slots as a LongTensor on `device`; to a CUDA device through pinned memory, without a
    host wait on the (side) stream it is issued on."""
    index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)
