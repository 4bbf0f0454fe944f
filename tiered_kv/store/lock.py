"""The store's one lock (DESIGN.md, invariants 4 and 8), which never leaves the store.

Planning, reserving, committing and pinning run under it; nothing waits inside it: copies, file
I/O, network round trips and waits for events happen between two short critical sections. It is
not re-entrant: taking it again on the thread that holds it is a bug and raises at once (with
the place that holds it in the message) instead of deadlocking.
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
