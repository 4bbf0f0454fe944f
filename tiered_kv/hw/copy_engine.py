"""Copies between the hot device and host memory.

CudaCopyEngine issues copies on a side stream, ordered against the compute stream by events,
so block moves overlap compute. CpuCopyEngine copies in place. Both have the same methods;
the store picks one at start.
"""

from __future__ import annotations

import contextlib

import torch


class CpuCopyEngine:
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def ordered(self):
        """Where several copies and device ops run as one unit, as `copy` runs one (see
        CudaCopyEngine.ordered)."""
        return contextlib.nullcontext()

    def before_host_read(self) -> None:
        """Called before the CPU reads or writes host memory a side-stream copy may still be using."""

    def before_device_use(self) -> None:
        """Called before compute uses device memory that a copy may still be writing."""

    def after_host_to_device(self) -> None:
        """Called after host memory was handed to an asynchronous copy to the device on the
        compute stream, before the host may overwrite that memory (a staging buffer refilled,
        a warm slot reused)."""

    def stream_context(self):
        """Where a background thread issues its copies (its own stream on GPU)."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait until every copy this engine issued is complete."""


class CudaCopyEngine:
    def __init__(self, device: torch.device):
        self.device = device
        self.side_stream = torch.cuda.Stream(device=device)
        self._pending = torch.cuda.Event()
        self._has_pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        # the copy must see everything compute wrote to src before this point
        self.side_stream.wait_stream(compute)
        with torch.cuda.stream(self.side_stream):
            dst.copy_(src, non_blocking=True)
            for tensor in (dst, src):
                if tensor.is_cuda:
                    tensor.record_stream(self.side_stream)
        self._pending.record(self.side_stream)
        self._has_pending = True

    @contextlib.contextmanager
    def ordered(self):
        """Copies and device ops issued inside run on the side stream after everything the
        current (compute) stream queued before, and count as pending until they are done (the
        same rules as `copy`). Tensors the unit allocates inside belong to the side stream; the
        ones it reads or writes from outside must outlive it (slabs and staging do)."""
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.side_stream):
                yield
        finally:
            self._pending.record(self.side_stream)
            self._has_pending = True

    def before_host_read(self) -> None:
        if self._has_pending:
            self._pending.synchronize()

    def before_device_use(self) -> None:
        if self._has_pending:
            torch.cuda.current_stream(self.device).wait_event(self._pending)

    def stream_context(self):
        # copies issued inside (tier read/write helpers included) run on the side stream, after
        # whatever the default (compute) stream queued before them
        self.side_stream.wait_stream(torch.cuda.default_stream(self.device))
        return torch.cuda.stream(self.side_stream)

    def synchronize(self) -> None:
        self.side_stream.synchronize()

    def after_host_to_device(self) -> None:
        # the compute stream's non_blocking copies out of pinned host memory must finish first
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()


def make_copy_engine(device: torch.device):
    return CudaCopyEngine(device) if device.type == "cuda" else CpuCopyEngine()
