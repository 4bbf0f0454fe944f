"""Cold tier: block records in one preallocated file in the store's ColdDirectory (NVMe).

File `kv-<layout signature>.blocks`, opened through the directory (O_NOFOLLOW, 0600, ours
alone; see cold_files.py), sized at start with posix_fallocate (a full disk fails then, not
mid-chat). Slot s's record starts at s * record_stride_bytes (4 KiB aligned for O_DIRECT / GPUDirect Storage) and holds the block's
`[L, 2, H, bs, D]` bytes; each layer slice has a CRC32 kept beside it, checked on every read.
A slice that fails its check, and a record that cannot be read whole (the file was truncated,
or the read failed), raise CorruptBlockError with `.slot` set: never served, recomputed instead.
Writes are made durable with fdatasync at `flush()` (end of each store step).
"""

from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np
import torch

from ..blocks import KVLayout
from ..errors import ConfigError, CorruptBlockError
from ..hw.block_io import KvikioBlockIO, PosixBlockIO, kvikio_usable
from .cold_files import ColdDirectory

ALIGN_BYTES = 4096
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": np.uint16}


def layout_signature(layout: KVLayout) -> str:
    text = f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}x{layout.block_size}x{layout.dtype_name}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ColdTier:
    """`num_slots` block records in `directory` (opened and locked by the store at start; the
    tier never closes it). A failed start leaves the directory as it found it: a file made now is
    removed, a reused one is cut back to its old size."""

    name = "cold"

    def __init__(self, layout: KVLayout, num_slots: int, directory: ColdDirectory, backend: str = "auto",
                 fsync: bool = True):
        self.layout = layout
        self.num_slots = num_slots
        self.fsync = fsync
        self.record_stride_bytes = -(-layout.block_bytes // ALIGN_BYTES) * ALIGN_BYTES
        self._np_dtype = _NP_DTYPES[layout.dtype_name]
        self._torch_dtype = getattr(torch, layout.dtype_name)
        can_use_kvikio = kvikio_usable() if backend in ("auto", "kvikio") else False
        if backend == "kvikio" and not can_use_kvikio:
            raise ConfigError(
                "config key 'cold.backend': got 'kvikio' but kvikio needs a CUDA device and the [gpu] extra "
                "(cupy-cuda12x, kvikio-cu12); allowed here: 'auto', 'posix'"
            )
        self._dirty = False
        self._fd = None
        self._file = directory.open_preallocated(f"kv-{layout_signature(layout)}.blocks",
                                                 num_slots * self.record_stride_bytes)
        self.file_path = self._file.path
        self._fd = self._file.fd
        try:
            self.io = KvikioBlockIO(self._fd) if can_use_kvikio else PosixBlockIO(self._fd)
        except BaseException:
            directory.discard(self._file)
            self._fd = None
            raise
        # CRC32 of each layer slice of each slot, and whether that slice holds written data
        self.crc32 = np.zeros((num_slots, layout.num_layers), dtype=np.uint32)
        self.valid = np.zeros((num_slots, layout.num_layers), dtype=bool)
        self._layer_buffer = np.empty((2, layout.num_kv_heads, layout.block_size, layout.head_dim), self._np_dtype)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    def _offset(self, slot: int, layer: int = 0) -> int:
        return slot * self.record_stride_bytes + layer * self.layout.layer_bytes

    # ---- whole blocks ----------------------------------------------------------------------
    def read_blocks(self, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks; into `out` (a CPU `[n, L, 2, H, bs, D]` buffer, e.g. the store's
        preallocated staging) when given, so large promotions fault in no fresh pages."""
        if out is None:
            out = self._to_torch(np.empty((len(slots), *self.layout.record_shape()), dtype=self._np_dtype))
        result = out
        out = self._to_numpy(out)  # a view: reads land in `result`
        packed = self.record_stride_bytes == self.layout.block_bytes  # records back to back on disk
        i = 0
        while i < len(slots):
            slot = slots[i]
            if not self.valid[slot].all():
                for layer in range(self.layout.num_layers):
                    self._read_layer_slice(slot, layer, out[i, layer])
                i += 1
                continue
            run = 1  # one preadv for a run of consecutive, fully written slots
            while (packed and i + run < len(slots) and slots[i + run] == slot + run
                   and self.valid[slot + run].all()):
                run += 1
            try:
                self.io.read_into(out[i:i + run], self._offset(slot))
            except OSError:  # find the slot whose record is short or unreadable
                for k in range(run):
                    self._read_bytes(slot + k, None, out[i + k])
            for k in range(run):
                for layer in range(self.layout.num_layers):
                    self._check(slot + k, layer, out[i + k, layer])
            i += run
        return result

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        host = self._to_numpy(data)
        for i, slot in enumerate(slots):
            record = host[i]
            self.io.write_from(record, self._offset(slot))
            for layer in range(self.layout.num_layers):
                self.crc32[slot, layer] = zlib.crc32(record[layer])
            self.valid[slot] = True
        self._dirty = True

    def forget(self, slots: list[int]) -> None:
        """Slots were freed: their bytes are no longer a block."""
        self.valid[slots] = False

    # ---- tokens of one layer ---------------------------------------------------------------
    def token_index(self, slots, offsets):
        groups: dict[int, list[tuple[int, int]]] = {}
        slots = np.asarray(slots, dtype=np.int64).tolist()
        offsets = np.asarray(offsets, dtype=np.int64).tolist()
        for position, (slot, offset) in enumerate(zip(slots, offsets)):
            groups.setdefault(slot, []).append((position, offset))
        return len(slots), groups

    def read_tokens(self, layer: int, index) -> torch.Tensor:
        num_tokens, groups = index
        out = np.empty((2, self.layout.num_kv_heads, num_tokens, self.layout.head_dim), dtype=self._np_dtype)
        for slot, items in groups.items():
            if not self.valid[slot, layer]:  # served KV must have been written: never zeros
                raise self._corrupt(slot, f"cold tier slot {slot} layer {layer} holds no written data "
                                          f"in {self.file_path}")
            self._read_layer_slice(slot, layer, self._layer_buffer)
            positions = [p for p, _ in items]
            offsets = [o for _, o in items]
            out[:, :, positions] = self._layer_buffer[:, :, offsets]
        return self._to_torch(out)

    def write_tokens(self, layer: int, index, kv: torch.Tensor) -> None:
        _, groups = index
        host = self._to_numpy(kv)
        for slot, items in groups.items():
            self._read_layer_slice(slot, layer, self._layer_buffer)  # read-modify-write of one slice
            positions = [p for p, _ in items]
            offsets = [o for _, o in items]
            self._layer_buffer[:, :, offsets] = host[:, :, positions]
            self.io.write_from(self._layer_buffer, self._offset(slot, layer))
            self.crc32[slot, layer] = zlib.crc32(self._layer_buffer)
            self.valid[slot, layer] = True
        self._dirty = True

    def _read_layer_slice(self, slot: int, layer: int, out: np.ndarray) -> None:
        """A slice as written, checked; zeros for a slice never written since the slot was taken
        (a block allocated this step, read-modify-written or moved before all its layers are)."""
        if not self.valid[slot, layer]:
            out.fill(0)
            return
        self._read_bytes(slot, layer, out)
        self._check(slot, layer, out)

    def _read_bytes(self, slot: int, layer: int | None, out: np.ndarray) -> None:
        """Read slot `slot` (one layer, or the whole record for None) into `out`. A record that
        cannot be read whole is as bad as one that fails its checksum: CorruptBlockError."""
        if self._fd is None:
            raise ValueError(f"cold tier on {self.file_path} is closed")
        try:
            self.io.read_into(out, self._offset(slot, layer or 0))
        except OSError as exc:
            part = "record" if layer is None else f"layer {layer}"
            raise self._corrupt(slot, f"cold tier slot {slot} {part} cannot be read from {self.file_path} "
                                      f"({exc.strerror or exc})") from None

    def _check(self, slot: int, layer: int, data: np.ndarray) -> None:
        if zlib.crc32(data) != self.crc32[slot, layer]:
            raise self._corrupt(slot, f"cold tier slot {slot} layer {layer} failed its CRC32 check in {self.file_path}")

    @staticmethod
    def _corrupt(slot: int, message: str) -> CorruptBlockError:
        error = CorruptBlockError(message)
        error.slot = slot
        return error

    def verify(self, slots: list[int]) -> list[int]:
        """Read each slot back and check every layer's CRC32. Returns the slots that fail."""
        bad = []
        for slot in slots:
            try:
                for layer in range(self.layout.num_layers):
                    self._read_layer_slice(slot, layer, self._layer_buffer)
            except CorruptBlockError:
                bad.append(slot)
        return bad

    # ---- conversions -----------------------------------------------------------------------
    def _to_numpy(self, tensor: torch.Tensor) -> np.ndarray:
        """A numpy view of `tensor` when it is a contiguous CPU tensor, else of a host copy."""
        host = tensor.detach().to("cpu").contiguous()
        if self.layout.dtype_name == "bfloat16":
            host = host.view(torch.uint16)
        return host.numpy()

    def _to_torch(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if self.layout.dtype_name == "bfloat16" else tensor

    # ---- durability ------------------------------------------------------------------------
    def flush(self) -> None:
        if self._dirty and self.fsync:
            self.io.sync()
        self._dirty = False

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            if hasattr(self, "io") and hasattr(self.io, "close"):
                self.io.close()
            os.close(self._fd)
            self._fd = None
