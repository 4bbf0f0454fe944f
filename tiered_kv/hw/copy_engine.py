"""Copy engines: where copies between tiers run, and how a caller learns that they are done.

A *unit* is a callable that copies (a batch of block moves, a read of a block for the remote
tier). `engine.submit(unit, after=fences)` runs it once the `fences` passed (the completion
fences of the steps whose compute used the slots it copies: store/fences.py) and returns a
`CopyEvent` that passes once the unit, and every unit submitted to the engine before it, is
complete:

- `SyncCopyEngine`: runs the unit at once on the caller's thread (after waiting for the fences);
  its event has passed on return.
- `ThreadCopyEngine`: queues the unit; the engine's own thread runs units later, in submission
  order (waiting for the unit's fences, then `delay_us`). Its events behave as CUDA events do:
  `done()` is False until the unit ran. This is how a CPU run exercises the GPU's rules
  (docs/design.md, invariant 7): memory a copy still reads or writes is in use until its event
  passed, whatever the submitting thread did meanwhile.
- `CudaCopyEngine`: runs the unit on the caller's thread with the engine's side stream current;
  the side stream first waits on the fences' events (on the device: the host does not wait), so
  the copies order after the compute that used their slots on whatever stream it ran, not after
  the submitting thread's current stream. A `HostFence` (the unit's host code touches pinned
  memory the compute used: a warm slot) is waited for by the host. Device copies are queued on
  the side stream, and the event is recorded after them. Host code in the unit (file reads and
  writes, checksums) runs at once; `host_wait()` inside a unit waits for its copies so far.

An exception a unit raises never escapes `submit`: it is kept on the event (`event.error`), which
then counts as passed. The caller fails the unit's whole batch (store/transfers.py). An interrupt
(KeyboardInterrupt, SystemExit) raised where the caller runs the unit (sync, CUDA) is kept on the
event too, and then raised from `submit`: the batch fails and the interrupt still reaches the user.

Compute streams: `current_stream()` is the stream the calling thread's compute runs on now (a
step takes it at layer 0), `record_fence(stream)` a fence after the work queued on it so far
(None: nothing can be queued). On CUDA these are torch's current stream and an event recorded on
it; on CPU an `EmulatedStream` given to the engine for a thread (`use_stream`: hw/emulated_stream.py)
or none, where compute is synchronous and done when it returned. `use_stream(s)` is
`torch.cuda.stream(s)` on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable

import torch

Unit = Callable[[], None]


class CopyEvent:
    """Completion of a unit of copies. `done()` never blocks; `wait()` blocks until it passed."""

    error: BaseException | None = None

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError


class PassedEvent(CopyEvent):
    """A unit that already ran (sync engine), with the error it raised, if any."""

    def __init__(self, error: BaseException | None = None):
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class _ThreadEvent(CopyEvent):
    def __init__(self) -> None:
        self._passed = threading.Event()

    def done(self) -> bool:
        return self._passed.is_set()

    def wait(self) -> None:
        self._passed.wait()

    def pass_(self, error: BaseException | None) -> None:
        self.error = error
        self._passed.set()


class _CudaEvent(CopyEvent):
    def __init__(self, event, error: BaseException | None):
        self._event = event
        self.error = error

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is None:
            return
        try:
            self._event.synchronize()
        except RuntimeError as error:  # an asynchronous device error surfaces here
            if self.error is None:
                self.error = error


class HostFence(CopyEvent):
    """A fence the host must see passed before the unit runs, not only its stream: the unit's host
    code (a memcpy out of pinned warm memory, a file write from it) touches memory the fenced
    compute used, and no stream orders host code."""

    def __init__(self, fence: CopyEvent):
        self.fence = fence

    def done(self) -> bool:
        return self.fence.done()

    def wait(self) -> None:
        self.fence.wait()


class _HostStreams:
    """The compute stream of each thread, on CPU: an EmulatedStream given by `use_stream`, else
    none (compute is synchronous: done when it returned). On a CUDA device, CUDA's streams."""

    _cuda, _device = False, None

    def _init_streams(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def use_stream(self, stream):
        """Within the block, this thread's compute runs on `stream` (as `torch.cuda.stream(s)`)."""
        if self._cuda:
            with torch.cuda.stream(stream):
                yield stream
            return
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def current_stream(self):
        if self._cuda:
            return torch.cuda.current_stream(self._device)
        return getattr(self._local, "stream", None)

    def record_fence(self, stream) -> CopyEvent | None:
        """A fence after the work queued so far on `stream` (None: nothing can still be queued)."""
        if stream is None:
            return None
        return _record_cuda(stream) if self._cuda else stream.record()


class SyncCopyEngine(_HostStreams):
    """Each unit runs at once, on the thread that submits it (on a CUDA device, on the current
    stream, which is synchronized before submit returns)."""

    name = "sync"

    def __init__(self, device: torch.device | None = None):
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._device = device if self._cuda else None
        self._init_streams()

    def submit(self, unit: Unit, after: tuple[CopyEvent, ...] = ()) -> CopyEvent:
        try:
            for fence in after:  # (CUDA: the current stream waits, the host for a HostFence; CPU: this thread)
                if self._cuda and isinstance(fence, _CudaEvent):
                    torch.cuda.current_stream(self._device).wait_event(fence._event)
                else:
                    fence.wait()
            unit()
            self.host_wait()
        except Exception as error:  # noqa: BLE001 - kept on the event: the batch fails
            return PassedEvent(error)
        return PassedEvent()

    def host_wait(self) -> None:
        """Inside a unit: wait for the copies it issued so far (on CPU they already ran)."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()

    def queue_depth(self) -> int:
        """Units submitted and not done yet: none (each ran before submit returned)."""
        return 0

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadCopyEngine(_HostStreams):
    """Units run later, in submission order, on the engine's own thread (see the module docstring)."""

    name = "thread"

    def __init__(self, delay_us: int = 0):
        self.delay_s = delay_us / 1e6
        self._init_streams()
        self._queue: deque[tuple[Unit, _ThreadEvent, tuple[CopyEvent, ...]]] = deque()
        self._condition = threading.Condition()
        self._closed = False
        self._last: CopyEvent = PassedEvent()
        self._running = 0  # a unit the thread took from the queue and has not finished
        self._thread = threading.Thread(target=self._run, name="tiered_kv-copy-engine", daemon=True)
        self._thread.start()

    def submit(self, unit: Unit, after: tuple[CopyEvent, ...] = ()) -> CopyEvent:
        event = _ThreadEvent()
        with self._condition:
            if self._closed:
                event.pass_(RuntimeError("the copy engine is closed; the copy did not run"))
                return event
            self._queue.append((unit, event, after))
            self._last = event
            self._condition.notify()
        return event

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                unit, event, after = self._queue.popleft()
                self._running = 1
            for fence in after:  # as a side stream waits on events: later units wait behind it
                fence.wait()
            if self.delay_s:
                time.sleep(self.delay_s)
            error = None
            try:
                unit()
            except BaseException as caught:  # noqa: BLE001 - kept on the event: the batch fails
                error = caught
            with self._condition:
                self._running = 0
            event.pass_(error)

    def host_wait(self) -> None:
        """Inside a unit (on the engine's thread): its copies so far are done (they ran in line)."""

    def queue_depth(self) -> int:
        """Units submitted and not done yet (queued, or running now)."""
        with self._condition:
            return len(self._queue) + self._running

    def synchronize(self) -> None:
        with self._condition:
            last = self._last
        last.wait()

    def close(self) -> None:
        """Run what is queued, then stop the thread (joined; a unit running now finishes first)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


class CudaCopyEngine:
    """Units issue their device copies on a side stream (see the module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.side_stream = torch.cuda.Stream(device=device)
        self._outstanding: deque[CopyEvent] = deque()  # events of submitted units, oldest first
        self._outstanding_lock = threading.Lock()  # (submitters and the mover's queue_depth, on several threads)

    def submit(self, unit: Unit, after: tuple[CopyEvent, ...] = ()) -> CopyEvent:
        # the copies must see what the steps that used their slots wrote, and must not overwrite
        # what those steps still read: the side stream waits on their fences, recorded on the
        # streams their forwards ran on (not on this thread's current stream: the mover's is its own)
        for fence in after:
            if isinstance(fence, _CudaEvent):
                self.side_stream.wait_event(fence._event)
            else:  # a HostFence: host code of the unit reads or writes what the compute used
                fence.wait()
        error, interrupt = None, None
        with torch.cuda.stream(self.side_stream):
            try:
                unit()
            except Exception as caught:  # noqa: BLE001 - kept on the event: the batch fails
                error = caught
            except BaseException as caught:  # an interrupt: the event still records what was issued
                error = interrupt = caught
            event = torch.cuda.Event()
            event.record(self.side_stream)
        if interrupt is not None:
            interrupt.copy_event = _CudaEvent(event, interrupt)  # what was issued is still covered
            raise interrupt
        done = _CudaEvent(event, error)
        with self._outstanding_lock:
            self._outstanding.append(done)
        return done

    def queue_depth(self) -> int:
        """Units whose device copies have not all run yet (the side stream runs them in order)."""
        with self._outstanding_lock:
            while self._outstanding and self._outstanding[0].done():
                self._outstanding.popleft()
            return len(self._outstanding)

    def host_wait(self) -> None:
        """Inside a unit: the host waits for the unit's device copies so far (before it reads or
        overwrites host memory they use)."""
        self.side_stream.synchronize()

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def record_fence(self, stream) -> CopyEvent | None:
        return None if stream is None else _record_cuda(stream)

    def synchronize(self) -> None:
        self.side_stream.synchronize()

    def close(self) -> None:
        self.side_stream.synchronize()


def _record_cuda(stream) -> CopyEvent:
    """An event after the work queued so far on a CUDA stream (no host sync)."""
    event = torch.cuda.Event()
    event.record(stream)
    return _CudaEvent(event, None)


def make_copy_engine(device: torch.device, engine: str = "auto", delay_us: int = 0):
    """The engine config `copies.engine` names: auto = the CUDA engine on a CUDA device, else sync."""
    if engine == "thread":
        return ThreadCopyEngine(delay_us)
    if engine == "sync":
        return SyncCopyEngine(device)
    return CudaCopyEngine(device) if torch.device(device).type == "cuda" else SyncCopyEngine(device)
