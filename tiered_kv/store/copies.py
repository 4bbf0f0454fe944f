"""The bytes of a transfer batch: what one unit of the copy engine does. Only `Transfers.launch`
(transfers.py) runs these, inside `engine.submit`; nothing here touches the index or a pool.

- between hot and warm (and within one tier: compaction, copy-on-write): whole blocks through the
  staging set's BlockCopier (a few large copies per batch; hw/block_copy.py);
- into or out of cold: through the staging set's host buffer in chunks, one preadv per run of
  file slots; reads out of cold are double-buffered (a reader thread fills one half of the buffer
  while the other half is copied to its destination) and checked against their checksums: a
  block that fails is marked `corrupt` in its group and never copied anywhere;
- a read-out copies one block into host memory (the remote writer); a write-in fills new blocks
  from host bytes (a remote fetch);
- a compressed tier (tiers/compressed.py) has no slot views: its blocks go out through its
  `read_blocks` (decoded, on the destination's device) and come in through `write_blocks` (encoded).
Host memory a device copy of the unit still uses is reused only after `engine.host_wait()`.
A unit gets the batch's groups (batches.py): per direction, arrays of source and destination slots.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..blocks import COLD
from ..errors import CorruptBlockError
from ..hw.block_copy import BlockCopier
from ..hw.copy_engine import CopyEvent
from ..tiers.compressed import decode_runs, is_compressed, same_packing

MOVE, COPY, READ_OUT, WRITE_IN = "move", "copy", "read_out", "write_in"
BACKUP = "backup"  # a durable copy into cold of a block that stays where it is (write_behind.py)


class Staging:
    """The scratch of one batch at a time (the store keeps a set per mode: on-demand batches and
    the background mover's never share one): a host buffer `[C, L, 2, H, bs, D]` for moves through
    cold (page-locked on CUDA), a BlockCopier (with its device staging on CUDA), a reader thread.
    `lock` is held while a unit is submitted (one submitter at a time); units run in the engine's
    order, so the next one may be queued while one copies; `last_event` is the latest unit's (close
    waits for it)."""

    def __init__(self, host: torch.Tensor, copier: BlockCopier):
        self.host = host
        self.copier = copier
        self.lock = threading.Lock()
        self.last_event: CopyEvent | None = None
        self._reader: ThreadPoolExecutor | None = None

    def wait_idle(self) -> None:
        if self.last_event is not None:
            self.last_event.wait()

    def reader(self) -> ThreadPoolExecutor:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_kv-cold-read")
        return self._reader

    def close(self) -> None:
        self.wait_idle()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self.copier.staging = None


def run(tiers: list, groups: list, staging: Staging, engine, metrics, rates=None) -> None:
    """Copy every group's bytes: one unit of the copy engine (see the module docstring)."""
    for group in groups:
        kind, src_tier, dst_tier = group.kind, group.src_tier, group.dst_tier
        if kind == READ_OUT:
            _read_out(tiers, group, engine)
        elif kind == WRITE_IN:
            tiers[dst_tier].write_blocks(group.dst_slots.tolist(), torch.cat(group.data))
        elif COLD not in (src_tier, dst_tier) and (is_compressed(tiers[src_tier]) or is_compressed(tiers[dst_tier])):
            _through_codec(tiers, group, src_tier, dst_tier)
        elif COLD not in (src_tier, dst_tier):  # (a copy-on-write or a backup copies as a move does)
            staging.copier.copy(tiers[dst_tier].slots_view(), group.dst_slots, tiers[src_tier].slots_view(),
                                group.src_slots)
        elif src_tier == COLD:
            _out_of_cold(tiers, group, dst_tier, staging, engine, metrics, rates)
        else:
            _into_cold(tiers, group, src_tier, staging, engine)
    # no host wait here: device copies still queued are covered by the unit's event


def _through_codec(tiers: list, group, src_tier: int, dst_tier: int) -> None:
    """Between hot and a compressed warm tier: decoded straight into the destination's slots, or
    encoded on the source's device."""
    src, dst = tiers[src_tier], tiers[dst_tier]
    slots, dst_slots = group.src_slots.tolist(), group.dst_slots.tolist()
    if is_compressed(src):
        src.read_blocks_into(slots, dst.slots_view(), dst_slots)
    else:
        dst.write_blocks(dst_slots, src.read_blocks(slots))


def _gather(tiers: list, src_tier: int, slots: np.ndarray, buffer, staging: Staging) -> None:
    """Blocks of a hot or warm tier into the host staging `buffer`, in order."""
    if is_compressed(tiers[src_tier]):  # expanded straight into the buffer (another packing follows)
        tiers[src_tier].read_blocks_into(slots.tolist(), buffer, list(range(len(slots))))
    else:
        staging.copier.copy(buffer, np.arange(len(slots)), tiers[src_tier].slots_view(), slots)


def _packed_staging(buffer: torch.Tensor, layout) -> torch.Tensor:
    """The host staging `buffer` `[C, L, 2, H, bs, D]` seen as C packed blocks `[C, L, P]` (a
    packed block is smaller than the model's, so C of them fit in its bytes)."""
    flat = buffer.view(-1).view(torch.uint8)
    count = buffer.shape[0]
    return flat[:count * layout.block_bytes].view(count, layout.num_layers, layout.layer_bytes)


def _read_out(tiers: list, group, engine) -> None:
    for i, (src_slot, out) in enumerate(zip(group.src_slots.tolist(), group.data)):
        try:
            if group.src_tier == COLD:
                tiers[COLD].read_blocks([src_slot], out=out.unsqueeze(0))
            else:
                out.copy_(tiers[group.src_tier].read_blocks([src_slot])[0], non_blocking=True)
        except CorruptBlockError:
            group.corrupt[i] = True
    engine.host_wait()


def _into_cold(tiers: list, group, src_tier: int, staging: Staging, engine) -> None:
    """Chunks of blocks into host staging (a D2H through device staging on CUDA), then one pwritev
    per record; packed bytes of a warm tier packed as cold is go as they are. A failed write
    (ColdWriteError) raises: the batch fails, nothing moved."""
    chunk_blocks = staging.host.shape[0]
    src, cold = tiers[src_tier], tiers[COLD]
    for start in range(0, len(group), chunk_blocks):
        src_slots = group.src_slots[start:start + chunk_blocks]
        dst_slots = group.dst_slots[start:start + chunk_blocks].tolist()
        if same_packing(src, cold):
            cold.write_packed(dst_slots, src.read_packed(src_slots.tolist()))
            continue
        if is_compressed(cold) and not is_compressed(src):  # packed where the blocks are: on a GPU the
            cold.write_blocks(dst_slots, src.read_blocks(src_slots.tolist()))
            continue  # packed bytes cross the link, not the model's
        buffer = staging.host[:len(src_slots)]
        _gather(tiers, src_tier, src_slots, buffer, staging)
        engine.host_wait()  # pwritev reads the host buffer now
        cold.write_blocks(dst_slots, buffer)


def _out_of_cold(tiers: list, group, dst_tier: int, staging: Staging, engine, metrics, rates=None) -> None:
    """Chunks in file order through host staging, double-buffered: the reader thread fills one
    half while this thread copies the other half to the destination. A block failing its
    checksum is marked corrupt in the group and copied nowhere."""
    order = np.argsort(group.src_slots, kind="stable")  # positions in the group, in file order
    count = len(order)
    halves = 2 if staging.host.shape[0] >= 2 and count > staging.host.shape[0] // 2 else 1
    chunk_blocks = staging.host.shape[0] // halves
    chunks = [order[i:i + chunk_blocks] for i in range(0, count, chunk_blocks)]
    buffers = [staging.host[h * chunk_blocks:(h + 1) * chunk_blocks] for h in range(halves)]
    cold = tiers[COLD]
    src_slots, dst_slots, corrupt = group.src_slots, group.dst_slots, group.corrupt

    dst = tiers[dst_tier]
    packed = is_compressed(cold)  # records read as packed bytes: decoded (or kept packed) on the way in
    if packed:
        buffers = [_packed_staging(b, cold.layout) for b in buffers]
        read_into = cold.read_packed
    else:
        def read_into(slots, out):
            cold.read_blocks(slots, out=out)

    def read(k: int) -> None:
        chunk = chunks[k]
        buffer = buffers[k % halves][:len(chunk)]
        start = metrics.read_seconds.start()
        started_s = time.perf_counter()
        try:
            read_into(src_slots[chunk].tolist(), buffer)
        except CorruptBlockError:  # find the bad ones; the good ones still move
            for i, position in enumerate(chunk.tolist()):
                try:
                    read_into([int(src_slots[position])], buffer[i:i + 1])
                except CorruptBlockError:
                    corrupt[position] = True
        metrics.read_seconds.stop(("cold",), start)
        if rates is not None:  # the cold tier's read rate, as the restore decision sees it
            rates.note_read("cold", len(chunk) * cold.layout.block_bytes, time.perf_counter() - started_s)

    reader = staging.reader() if halves > 1 and len(chunks) > 1 else None
    pending = {k: reader.submit(read, k) for k in range(min(halves, len(chunks)))} if reader is not None else {}
    try:
        for k, chunk in enumerate(chunks):
            if reader is not None:
                pending.pop(k).result()
            else:
                read(k)
            buffer = buffers[k % halves][:len(chunk)]
            good = ~corrupt[chunk]
            if good.any():
                data = buffer if good.all() else buffer[np.flatnonzero(good).tolist()]
                slots = dst_slots[chunk[good]].tolist()
                if not packed:
                    dst.write_blocks(slots, data)
                elif same_packing(cold, dst):
                    dst.write_packed(slots, torch.as_tensor(data))
                elif is_compressed(dst):  # another mode: through the model's dtype
                    dst.write_blocks(slots, cold.codec.decode(torch.as_tensor(data)))
                else:
                    decode_runs(cold.codec, torch.as_tensor(data), dst.slots_view(), slots)
            engine.host_wait()  # the buffer is refilled next: its copy to the device must be done
            if reader is not None and k + halves < len(chunks):
                pending[k + halves] = reader.submit(read, k + halves)
    finally:
        for future in pending.values():  # a failing batch: no read may still fill the buffers
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the batch is failing anyway
                pass
