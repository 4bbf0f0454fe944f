"""File I/O for the cold tier: whole records and byte ranges at offsets of one preallocated file.

PosixBlockIO uses os.preadv / os.pwritev straight into caller-owned buffers (the fastest Python
path measured here). KvikioBlockIO (GPU extra; cold.backend kvikio, or auto when CUDA and kvikio
are both present: kvikio needs libcuda even in compat mode) opens the file through kvikio too, but
reads and writes as PosixBlockIO does, into host buffers: the cold tier checks every slice's XXH3
on the host, so a read straight into device memory (GPUDirect Storage) would need a device-side
checksum first (docs/not-yet.md). Same methods either way.

A read that finds fewer bytes than asked (a truncated file) raises ShortReadError, an OSError
like any other read failure; the cold tier turns both into CorruptBlockError for the slot.
A write or sync that fails (ENOSPC, EIO, ...) raises ColdWriteError, an OSError the store catches:
the record it was writing is not whole, so the cold tier never makes it durable.
`preallocate` is the one place file space is reserved, so a test can make it fail like a full disk.
"""

from __future__ import annotations

import errno
import os

import numpy as np

_MAX_IOVECS = 1024  # IOV_MAX on Linux
_MAX_RUN_BYTES = 1 << 30  # below the 2 GiB a single preadv may return


class ShortReadError(OSError):
    """The file ended before the bytes asked for (it was truncated under us)."""


class ColdWriteError(OSError):
    """A cold write or sync failed (full disk, I/O error): `errno` as the OS gave it. The bytes it was
    writing are not whole; the tier marks them unwritten and never makes them durable."""


def _as_bytes(buffer: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))


def preallocate(fd: int, size_bytes: int) -> None:
    """Reserve the first `size_bytes` of the file on disk (OSError ENOSPC/EDQUOT/EFBIG when they
    do not fit); the file grows to at least that size."""
    os.posix_fallocate(fd, 0, size_bytes)


class PosixBlockIO:
    name = "posix"

    def __init__(self, fd: int):
        self.fd = fd

    def read_into(self, buffer: np.ndarray, offset_bytes: int) -> None:
        view = memoryview(buffer.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset_bytes + done)
            if n <= 0:
                raise ShortReadError(f"short read: the file ends before offset {offset_bytes + len(view)} "
                                     f"(got {done} of {len(view)} bytes at offset {offset_bytes}; truncated?)")
            done += n

    def read_strided_into(self, rows: np.ndarray, offset_bytes: int, stride_bytes: int) -> None:
        """rows[i] <- the bytes at offset + i * stride (records of consecutive slots), one preadv per
        run: the gaps between them (padding, headers) land in a scratch buffer. ShortReadError if the
        file ends early (the caller then finds the short record one by one)."""
        row_bytes = rows[0].nbytes
        gap = memoryview(np.empty(stride_bytes - row_bytes, dtype=np.uint8))
        per_run = max(1, min(_MAX_IOVECS // 2, _MAX_RUN_BYTES // stride_bytes))
        for first in range(0, len(rows), per_run):
            chunk = rows[first:first + per_run]
            vectors = []
            for row in chunk:
                vectors += [memoryview(row.reshape(-1).view(np.uint8)), gap]
            vectors.pop()
            wanted = len(chunk) * stride_bytes - len(gap)
            got = os.preadv(self.fd, vectors, offset_bytes + first * stride_bytes)
            if got != wanted:
                raise ShortReadError(f"short read: got {got} of {wanted} bytes at offset "
                                     f"{offset_bytes + first * stride_bytes} (truncated?)")

    def write_from(self, buffer: np.ndarray, offset_bytes: int) -> None:
        self.write_gather([buffer], offset_bytes)

    def write_gather(self, buffers: list[np.ndarray], offset_bytes: int) -> None:
        """The buffers back to back from `offset_bytes` (one pwritev); ColdWriteError on failure."""
        views = [_as_bytes(b) for b in buffers]
        total = sum(len(v) for v in views)
        done = 0
        try:
            while views:
                n = os.pwritev(self.fd, views, offset_bytes + done)
                if n <= 0:
                    raise ColdWriteError(errno.ENOSPC, f"short write at offset {offset_bytes + done}")
                done += n
                while views and n >= len(views[0]):  # drop what was written, keep the rest
                    n -= len(views.pop(0))
                if n:
                    views[0] = views[0][n:]
        except ColdWriteError:
            raise
        except OSError as exc:
            raise ColdWriteError(exc.errno, f"cold write of {total} bytes at offset {offset_bytes} failed: "
                                            f"{exc.strerror or exc}") from exc

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise ColdWriteError(exc.errno, f"fdatasync of the cold file failed: {exc.strerror or exc}") from exc


class KvikioBlockIO(PosixBlockIO):
    """PosixBlockIO with the file also opened as a kvikio CuFile (so a kvikio that cannot open it
    fails at start); every read and write is PosixBlockIO's, into host buffers (module docstring).

    kvikio opens files by path; it is given /proc/self/fd/<fd>, which reopens the very file behind
    our fd, so it never follows a name that may have been replaced since we checked it."""

    name = "kvikio"

    def __init__(self, fd: int):
        super().__init__(fd)
        import kvikio  # noqa: F401  (GPU extra)

        self._kvikio = kvikio
        self._file = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")

    def close(self) -> None:
        self._file.close()


def kvikio_usable() -> bool:
    """kvikio imports without a GPU but cannot do any I/O without libcuda: require both."""
    return kvikio_unusable_reason() is None


def kvikio_unusable_reason() -> str | None:
    """None when kvikio can do I/O here, else why not."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        import kvikio  # noqa: F401
        import cupy

        return None if cupy.cuda.is_available() else "cupy sees no CUDA device"
    except Exception as exc:  # ImportError without the [gpu] extra, or a broken install
        return f"{type(exc).__name__}: {exc}"
