"""What lets several threads use one tier's file at once: an I/O guard and a pool of scratch buffers.

Steps read and write their pinned blocks without the store's lock (docs/design.md, invariant 8), the
copy engine moves other blocks meanwhile and the durable writer writes headers: a tier whose
file several threads use needs

- `IoGuard`: every read or write runs inside `with guard:`; `close_when_idle()` refuses new I/O
  (TierClosedError) and waits for the running ones, so a descriptor is closed only once nobody
  uses it (never a read through a closed, or worse reused, descriptor number);
- `ScratchPool`: per-call scratch (a layer buffer, a batch of slices) taken from a pool and given
  back, instead of one buffer per tier that two threads would share.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Generic, TypeVar

from ..errors import BankClosedError

T = TypeVar("T")


class TierClosedError(BankClosedError):
    """I/O on a tier whose store closed (a step that outlived its store's close)."""


class IoGuard:
    def __init__(self, what: str):
        self.what = what
        self._condition = threading.Condition()
        self._running = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._condition:
            if self._closed:
                raise TierClosedError(f"{self.what} is closed (its store closed); create a new store and bank")
            self._running += 1

    def __exit__(self, *exc) -> None:
        with self._condition:
            self._running -= 1
            if not self._running:
                self._condition.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def close_when_idle(self, timeout_s: float | None = None) -> bool:
        """Refuse new I/O and wait until none runs. False when some still ran after `timeout_s`."""
        with self._condition:
            self._closed = True
            return self._condition.wait_for(lambda: self._running == 0, timeout=timeout_s)


class ScratchPool(Generic[T]):
    """Scratch objects made by `factory`, one per concurrent user, reused across calls."""

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._free: list[T] = []
        self._lock = threading.Lock()

    @contextmanager
    def take(self):
        with self._lock:
            scratch = self._free.pop() if self._free else None
        if scratch is None:
            scratch = self._factory()
        try:
            yield scratch
        finally:
            with self._lock:
                self._free.append(scratch)
