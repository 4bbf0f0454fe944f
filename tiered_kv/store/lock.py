"""The store's one lock (docs/design.md, invariants 4 and 8), which never leaves the store.

Planning, reserving, committing and pinning run under it; nothing waits inside it: copies, file
I/O, network round trips and waits for events happen between two short critical sections. It is
not re-entrant: taking it again on the thread that holds it is a bug and raises at once (with
the place that holds it in the message) instead of deadlocking. `ChangeSignal` is how a thread
outside the lock waits for something the store's state did (a step ended, a transfer completed).
"""

from __future__ import annotations

import threading


class StoreLock:
    def __init__(self, name: str = "TierStore"):
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._name = name
        self.acquisitions = 0  # how often it was taken (tests: layer reads must not take it)

    def __enter__(self) -> "StoreLock":
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(f"{self._name}: its lock was taken again by the thread that holds it (a store call "
                               "made from inside another one); this is a bug in tiered_kv")
        self._lock.acquire()
        self._owner = me
        self.acquisitions += 1
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()

    @property
    def held_by_me(self) -> bool:
        """Whether the calling thread holds the lock (for assertions and close())."""
        return self._owner == threading.get_ident()


class ChangeSignal:
    """Tells threads waiting outside the store lock that something they may wait for happened (a
    step ended, a transfer completed, blocks were released). Its own small lock, never the store's."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.version = 0
        self._waiters = 0

    def bump(self) -> None:
        with self._condition:
            self.version += 1
            if self._waiters:
                self._condition.notify_all()

    def wait(self, since: int, timeout_s: float) -> bool:
        """Until `version` differs from `since` (True) or `timeout_s` passed (False)."""
        with self._condition:
            self._waiters += 1
            try:
                return self._condition.wait_for(lambda: self.version != since, timeout=max(0.0, timeout_s))
            finally:
                self._waiters -= 1
