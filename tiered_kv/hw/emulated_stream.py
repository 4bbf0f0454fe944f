"""A compute stream on CPU: what lets a test see the GPU's stream-order rules (docs/design.md, invariant 7).

On a GPU a forward pass returns to Python long before its kernels ran: the K/V it writes and the
slots its attention reads are still in use on the stream it ran on. On CPU compute is synchronous,
so nothing is ever in use after a step returned, and a missing fence goes unseen. An
`EmulatedStream` puts the GPU's lag back: a copy engine of the CPU (`SyncCopyEngine`,
`ThreadCopyEngine`) given one for a thread (`engine.use_stream(stream)`, as
`torch.cuda.stream(s)` makes `s` a thread's current stream) records a step's fences on it, and
work "queued" on it (`enqueue`: a late write of a step's K/V, say) happens only later:

- held (`delay_us=None`): nothing queued completes until the test calls `run()` (or `release()`,
  after which it completes at once);
- timed (`delay_us=N`): each piece completes N microseconds after it was queued, in order, on the
  stream's own thread (a compute that lags the host, as a GPU's does).

Its fences are CopyEvents (`done()` never blocks, `wait()` does) and pass in the order recorded,
after the work queued before them. Without a stream a CPU thread's compute counts as done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from .copy_engine import CopyEvent, _ThreadEvent


class EmulatedStream:
    """A CPU stand-in for a CUDA stream a forward runs on (see the module docstring)."""

    def __init__(self, delay_us: int | None = None, name: str = "stream"):
        self.name = name
        self.delay_s = None if delay_us is None else delay_us / 1e6
        self._condition = threading.Condition()
        self._queue: deque[tuple[float, Callable[[], None] | None, _ThreadEvent | None]] = deque()
        self._held = delay_us is None
        self._closed = False
        self.num_fences = 0  # fences recorded on it so far
        self._thread = None
        if not self._held:
            self._thread = threading.Thread(target=self._run_timed, name=f"emulated-stream-{name}", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name!r})"

    # ---- what a step queues -----------------------------------------------------------------------
    def enqueue(self, work: Callable[[], None]) -> None:
        """Work the stream does later (after everything queued before it)."""
        self._append(work, None)

    def record(self) -> CopyEvent:
        """A fence that passes once everything queued on the stream so far completed."""
        with self._condition:
            self.num_fences += 1
        event = _ThreadEvent()
        if not self._append(None, event):
            event.pass_(None)
        return event

    def _append(self, work, event) -> bool:
        """Queue (work, event); False when the stream runs everything at once (released, nothing queued)."""
        with self._condition:
            if not self._held and self.delay_s is None and not self._queue:
                if work is not None:
                    work()
                return False
            self._queue.append((time.monotonic() + (self.delay_s or 0.0), work, event))
            self._condition.notify_all()
        return True

    # ---- held: the test says when compute completes --------------------------------------------------
    def run(self) -> int:
        """Held: complete everything queued so far, in order (work runs, fences pass); how many
        pieces. A timed stream completes its work on its own thread: 0."""
        count = 0
        if self._thread is not None:
            return count
        while True:
            with self._condition:
                if not self._queue:
                    return count
                _, work, event = self._queue.popleft()
            if work is not None:
                work()
            if event is not None:
                event.pass_(None)
            count += 1

    def release(self) -> None:
        """Stop holding: what is queued completes now, what comes later at once."""
        with self._condition:
            self._held = False
        self.run()

    @property
    def num_pending(self) -> int:
        with self._condition:
            return len(self._queue)

    # ---- timed: compute that lags the host ---------------------------------------------------------
    def _run_timed(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                due, work, event = self._queue.popleft()
            wait_s = due - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            if work is not None:
                work()
            if event is not None:
                event.pass_(None)

    def close(self) -> None:
        """Complete what is queued (a timed stream: on its thread, then it stops)."""
        if self._thread is None:
            self.release()
            return
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join()


__all__ = ["EmulatedStream"]
