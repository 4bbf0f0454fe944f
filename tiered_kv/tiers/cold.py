"""Cold tier: block records in one preallocated file per layout in the store's ColdDirectory (NVMe),
durable across processes.

Format (versioned; cold_format.py): file `kv-v1-<layout>.blocks`, opened through the directory
(O_NOFOLLOW, 0600, ours alone; cold_files.py), sized at start with posix_fallocate (a full disk fails
then, not mid-chat). Slot s's record starts at s * record_stride_bytes (4 KiB aligned) and holds the
block's `[L, 2, H, bs, D]` bytes, then a header (key, root, one XXH3-64 per layer slice).

Threads: steps read and write their (pinned) blocks without the store lock while copies and the
durable writer use other slots; per-call scratch comes from a pool, and every read and write runs
under an I/O guard that `close` waits on before it closes the file (shared_io.py). A step's token
reads and writes of one layer are in cold_tokens.py.

Reads check every layer slice against its checksum: a slice that fails, and a record that cannot be
read whole (truncated file, failed read), raise CorruptBlockError with `.slot` set: never served,
recomputed instead. A slice never written since its slot was taken is never served as tokens; whole
block moves carry it as zeros (a block allocated this step).

Durability (DESIGN invariant 6; cold_index.py): `persist(slot, key, root)` queues the record; a
background thread writes its header, fdatasyncs, then commits its index row, batching whatever is
queued. A new tier on the same directory loads the rows whose header still matches (`durable_records`).
Any write to a durable slot, and `forget`, withdraw its row in queue order (and zero its header), so
a reused slot is not named by a stale row; should a crash still leave one, the data checksums catch
it on read. Writes that fail raise ColdWriteError (block_io.py) and leave the slice unwritten.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import numpy as np
import torch

from ..blocks import KVLayout
from ..errors import ConfigError, CorruptBlockError
from ..hw.block_io import ColdWriteError, KvikioBlockIO, PosixBlockIO, kvikio_unusable_reason
from ..logs import Throttle, log_once
from . import cold_format as fmt
from .cold_files import ColdDirectory
from .cold_format import ALIGN_BYTES, checksum, layout_signature  # noqa: F401  (re-exported for tests and tools)
from .cold_durable import DurableRecords, DurableWriter, _Op
from .cold_index import ColdIndex
from .cold_peers import PEER_READ_WAIT_S, record_lock, record_unlock
from .cold_tokens import ColdTokens, TokenScratch
from .shared_io import IoGuard, ScratchPool

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 30.0  # close() waits this long for reads and writes still running on other threads
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": np.uint16}


class ColdTier(ColdTokens, DurableRecords):
    """`num_slots` block records in `directory` (opened and locked by the store at start; the
    tier never closes it). A failed start leaves the directory as it found it: a file made now is
    removed, a reused one is cut back to its old size. Records persisted by an earlier tier on the
    same directory and layout are valid from the start: see `durable_records`."""

    name = "cold"

    def __init__(self, layout: KVLayout, num_slots: int, directory: ColdDirectory, backend: str = "auto",
                 fsync: bool = True):
        self.layout = layout
        self.num_slots = num_slots
        self.fsync = fsync
        self.record_stride_bytes = fmt.record_stride_bytes(layout)
        self._header_offset = fmt.header_offset_bytes(layout)
        # the bytes of a record as this tier stores them: the model's dtype, or a compressed layout's
        # packed bytes (uint8 `[L, layer_bytes]`; compressed.py's CompressedColdTier converts at the tier's edge)
        self._np_dtype = np.uint8 if layout.is_compressed else _NP_DTYPES[layout.dtype_name]
        self._torch_dtype = getattr(torch, layout.dtype_name)
        no_kvikio = kvikio_unusable_reason() if backend in ("auto", "kvikio") else "cold.backend: posix"
        can_use_kvikio = no_kvikio is None
        if backend == "kvikio" and not can_use_kvikio:
            raise ConfigError(
                "config key 'cold.backend': got 'kvikio' but kvikio needs a CUDA device and the [gpu] extra "
                f"(cupy-cuda12x, kvikio-cu12) ({no_kvikio}); allowed here: 'auto', 'posix'"
            )
        if backend == "auto" and not can_use_kvikio:
            log_once(log, logging.INFO, "cold tier I/O: POSIX preadv/pwritev (cold.backend: auto; kvikio "
                     "unusable: %s)", no_kvikio)
        self._dirty = False
        self._fd = None
        self.bytes_written = 0  # block data written into the file (records and layer slices)
        self._file, self.file_number = directory.claim_block_file(
            lambda n: fmt.block_file_name(layout, n), num_slots * self.record_stride_bytes, fmt.MAX_FILES)
        self.file_path = self._file.path
        self._fd = self._file.fd
        self._guard = IoGuard(f"cold tier {self.file_path}")
        # checksum of each layer slice of each slot, and whether that slice holds written data
        self.checksums = np.zeros((num_slots, layout.num_layers), dtype=np.uint64)
        self.valid = np.zeros((num_slots, layout.num_layers), dtype=bool)
        # durable: the slot has (or a queued persist will give it) an index row; generation: bumped
        # whenever that stops being true, so a queued persist of an older generation is dropped
        self._durable = np.zeros(num_slots, dtype=bool)
        # forgotten, its header not zeroed yet (the writer thread does it, after the row's deletion,
        # once no peer reads the record): a rewrite of the slot waits for peers' reads too
        self._header_live = np.zeros(num_slots, dtype=bool)
        self._generation = np.zeros(num_slots, dtype=np.int64)
        self._state_lock = threading.Lock()
        self._write_warnings = Throttle(log)  # failed header writes / syncs / commits (a full disk repeats)
        self._slice_shape = (layout.layer_bytes,) if layout.is_compressed else \
            (2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        self._slot_locks = [threading.Lock() for _ in range(64)]  # striped: a slice's write vs its reads
        self._scratch = ScratchPool(lambda: TokenScratch(self._slice_shape, self._np_dtype, layout.layer_bytes))
        self._zero_tail = np.zeros(self.record_stride_bytes - layout.block_bytes, dtype=np.uint8)
        self._zero_header = self._zero_tail[-fmt.header_bytes(layout):]
        self.index = ColdIndex(directory, fmt.index_file_name(layout, self.file_number), fmt.layout_text(layout),
                               synchronous=fsync)
        self._index_usable = True
        try:
            self.io = KvikioBlockIO(self._fd) if can_use_kvikio else PosixBlockIO(self._fd)
            self._records = self._load_durable_records()
        except BaseException:
            self.index.close()
            directory.discard(self._file)
            self._fd = None
            raise
        self._writer = DurableWriter(self)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the block file (preallocated at start)."""
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def _offset(self, slot: int, layer: int = 0) -> int:
        return slot * self.record_stride_bytes + layer * self.layout.layer_bytes

    def _header_at(self, slot: int) -> int:
        return slot * self.record_stride_bytes + self._header_offset

    # ---- whole blocks ----------------------------------------------------------------------
    def read_blocks(self, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks; into `out` (a CPU `[n, L, 2, H, bs, D]` buffer, e.g. the store's
        preallocated staging) when given, so large promotions fault in no fresh pages."""
        if out is None:
            out = self._to_torch(np.empty((len(slots), *self.layout.record_shape()), dtype=self._np_dtype))
        with self._guard:
            self._read_blocks_into(slots, self._to_numpy(out))  # a view: reads land in `out`
        return out

    def _read_blocks_into(self, slots: list[int], out: np.ndarray) -> None:
        i = 0
        while i < len(slots):
            slot = slots[i]
            if not self.valid[slot].all():
                for layer in range(self.layout.num_layers):
                    self._read_layer_slice(slot, layer, out[i, layer])
                i += 1
                continue
            run = 1  # one preadv for a run of consecutive, fully written slots
            while i + run < len(slots) and slots[i + run] == slot + run and self.valid[slot + run].all():
                run += 1
            try:
                self.io.read_strided_into(out[i:i + run], self._offset(slot), self.record_stride_bytes)
            except OSError:  # find the slot whose record is short or unreadable
                for k in range(run):
                    self._read_bytes(slot + k, None, out[i + k])
            for k in range(run):
                for layer in range(self.layout.num_layers):
                    self._check(slot + k, layer, out[i + k, layer])
            i += run
        touched = [int(s) for s in slots if self._durable[s]]
        if touched:
            self._writer.enqueue([_Op("touch", s) for s in touched])

    def write_blocks(self, slots: list[int], data: torch.Tensor) -> None:
        """Whole records, their headers zeroed in the same pwritev (not durable until `persist`).
        ColdWriteError when the disk refuses; that slot is then unwritten."""
        host = self._to_numpy(data)
        with self._guard:
            self._write_records(slots, host)

    def _write_records(self, slots: list[int], host: np.ndarray) -> None:
        was_durable = set(self._withdraw(slots, zero_header=False))  # the writes below zero the headers
        for i, slot in enumerate(slots):
            record = host[i]
            self.valid[slot] = False
            header_live = slot in was_durable or bool(self._header_live[slot])
            with self._naming_the_file(), self._no_peer_reading(slot, header_live):
                if header_live:  # zeroed first: a write a kill cuts short must not leave the old header naming new bytes
                    self.io.write_from(self._zero_header, self._header_at(slot))
                self.io.write_gather([record, self._zero_tail], self._offset(slot))
            for layer in range(self.layout.num_layers):
                self.checksums[slot, layer] = checksum(record[layer])
            self.valid[slot] = True
        self._count_written(len(slots) * self.layout.block_bytes)
        self._dirty = True

    def _count_written(self, num_bytes: int) -> None:
        self.bytes_written += num_bytes
        if self.metrics is not None:
            self.metrics.cold_bytes_written.inc((), num_bytes)

    def is_durable(self, slot: int) -> bool:
        """The slot holds a record that is (or a queued persist makes) durable."""
        return bool(self._durable[slot])

    @contextlib.contextmanager
    def _naming_the_file(self):
        """A failed write's ColdWriteError names this tier's file (it goes up to the caller, which
        reports it: a background move warns, a step raises it)."""
        try:
            yield
        except ColdWriteError as exc:
            if exc.filename is None:
                exc.filename = self.file_path
            raise

    @contextlib.contextmanager
    def _no_peer_reading(self, slot: int, was_durable: bool):
        """Around an overwrite of a slot another process may be reading (it held a durable record):
        wait until no peer holds its shared record lock (cold_peers.py), PEER_READ_WAIT_S at most;
        a peer that reads later finds the checksums changed and never serves the bytes."""
        if not was_durable:
            yield
            return
        locked = record_lock(self._fd, slot, self.record_stride_bytes, exclusive=True, wait_s=PEER_READ_WAIT_S)
        try:
            yield
        finally:
            if locked:
                record_unlock(self._fd, slot, self.record_stride_bytes)

    def forget(self, slots: list[int]) -> None:
        """Slots were freed: their bytes are no longer a block, and no durable row names them. Runs
        under the store lock, so it never waits: the rows' deletion is queued, and the writer thread
        zeroes the headers after it, once no peer reads those records."""
        self.valid[slots] = False
        with self._guard:
            withdrawn = self._withdraw(slots, zero_header=False)
        self._header_live[withdrawn] = True

    def _slot_lock(self, slot: int) -> threading.Lock:
        return self._slot_locks[slot % len(self._slot_locks)]

    def _read_slice_locked(self, slot: int, layer: int, out: np.ndarray) -> None:
        """A slice as written and checked, with no write of the slot running meanwhile; never zeros."""
        with self._slot_lock(slot):
            if not self.valid[slot, layer]:  # served KV must have been written
                raise self._corrupt(slot, f"cold tier slot {slot} layer {layer} holds no written data "
                                          f"in {self.file_path}")
            self._read_bytes(slot, layer, out)
            self._check(slot, layer, out)

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
        if checksum(data) != self.checksums[slot, layer]:
            raise self._corrupt(slot, f"cold tier slot {slot} layer {layer} failed its checksum (XXH3-64) check "
                                      f"in {self.file_path}")

    @staticmethod
    def _corrupt(slot: int, message: str) -> CorruptBlockError:
        error = CorruptBlockError(message)
        error.slot = slot
        return error

    def verify(self, slots: list[int]) -> list[int]:
        """Read each slot back and check every layer's checksum. Returns the slots that fail."""
        bad = []
        with self._guard, self._scratch.take() as scratch:
            for slot in slots:
                try:
                    for layer in range(self.layout.num_layers):
                        self._read_layer_slice(slot, layer, scratch.layer_buffer)
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
        """Wait until every record persisted so far is durable (header, fdatasync unless `fsync` is
        off, index row), or known not to be: ColdWriteError then, naming the first failure; those
        records stay valid here, only not durable. Data that was never persisted is not synced:
        without a row it is never read by another process, so syncing it would be pure latency."""
        self._dirty = False
        if self._fd is None:
            return
        errors = self._writer.wait()
        if errors:
            first = errors[0]
            raise ColdWriteError(getattr(first, "errno", None) or 0,
                                 f"cold tier {self.file_path}: {len(errors)} persist batch(es) failed; "
                                 f"first: {first}")

    def close(self) -> None:
        """Refuse new reads and writes and wait for running ones (CLOSE_WAIT_S at most), flush
        (failures are logged), stop the writer thread, close the index and the file."""
        if self._fd is None:
            return
        if not self._guard.close_when_idle(CLOSE_WAIT_S):  # a read still runs: never pull its descriptor
            log.warning("cold tier %s: I/O still running %.0f s after close; the file stays open", self.file_path,
                        CLOSE_WAIT_S)
            self._writer.stop()
            return
        try:
            errors = self._writer.stop()
            for error in errors:  # each was warned about when it happened
                log.debug("cold tier %s: closing with a failed persist: %s", self.file_path, error)
        finally:
            self.index.close()
            if hasattr(self, "io") and hasattr(self.io, "close"):
                self.io.close()
            os.close(self._fd)
            self._fd = None
