"""File I/O for the cold tier: whole records and byte ranges at offsets of one preallocated file.

PosixBlockIO uses os.preadv / os.pwritev straight into caller-owned buffers (the fastest Python
path measured here). KvikioBlockIO (GPU extra) reads and writes device buffers through
GPUDirect Storage; it needs libcuda even in compat mode, so it is chosen only when CUDA and
kvikio are both present. Same methods either way.

A read that finds fewer bytes than asked (a truncated file) raises ShortReadError, an OSError
like any other read failure; the cold tier turns both into CorruptBlockError for the slot.
`preallocate` is the one place file space is reserved, so a test can make it fail like a full disk.
"""

from __future__ import annotations

import os

import numpy as np


class ShortReadError(OSError):
    """The file ended before the bytes asked for (it was truncated under us)."""


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

    def write_from(self, buffer: np.ndarray, offset_bytes: int) -> None:
        view = memoryview(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.pwritev(self.fd, [view[done:]], offset_bytes + done)
            if n <= 0:
                raise OSError(f"short write at offset {offset_bytes + done}")
            done += n

    def sync(self) -> None:
        os.fdatasync(self.fd)


class KvikioBlockIO(PosixBlockIO):
    """Host buffers go through POSIX as above; device (torch cuda) buffers through kvikio.

    kvikio opens files by path; it is given /proc/self/fd/<fd>, which reopens the very file behind
    our fd, so it never follows a name that may have been replaced since we checked it."""

    name = "kvikio"

    def __init__(self, fd: int):
        super().__init__(fd)
        import kvikio  # noqa: F401  (GPU extra)

        self._kvikio = kvikio
        self._file = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")

    def read_into_device(self, tensor, offset_bytes: int) -> None:
        import cupy

        array = cupy.asarray(tensor.view(-1).view(dtype=__import__("torch").uint8))
        nbytes = self._file.pread(array, array.nbytes, offset_bytes).get()
        if nbytes != array.nbytes:
            raise OSError(f"kvikio short read at offset {offset_bytes}: {nbytes} of {array.nbytes} bytes")

    def write_from_device(self, tensor, offset_bytes: int) -> None:
        import cupy

        array = cupy.asarray(tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8))
        nbytes = self._file.pwrite(array, array.nbytes, offset_bytes).get()
        if nbytes != array.nbytes:
            raise OSError(f"kvikio short write at offset {offset_bytes}: {nbytes} of {array.nbytes} bytes")

    def close(self) -> None:
        self._file.close()


def kvikio_usable() -> bool:
    """kvikio imports without a GPU but cannot do any I/O without libcuda: require both."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import kvikio  # noqa: F401
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False
