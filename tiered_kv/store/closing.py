"""Closing a store (TierStore.close): from any thread, with moves in flight, once; the last of the
banks that own a store (add_owner) closes it as it closes.

In order: refuse new leases and background moves (StoreLife.closing); stop what still needs the
store working (the remote writer, which reads blocks through the transfers; the mover); let the
steps running on other threads end (CLOSE_WAIT_S at most: their reads fail after that); move
published blocks down to cold and wait until durable (durability.py); then let go of every thread
and file the store holds: the copy engine, the link sampler, the tiers, the other stores' files,
the cold directory (a failed start also removes the files it made). At interpreter exit, every
store still open is closed (most programs never call close()), while the modules it needs are
still there.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from ..blocks import TIER_NAMES
from ..remote import RemoteTier
from ..tiers.cold_files import ColdDirectory
from ..tiers.cold_peers import PeerFiles
from .durability import Durability
from .life import StoreLife
from .lock import StoreLock
from .mover import Mover
from .state import StoreState
from .transfers import Transfers

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # how long close() waits for running steps to end

_AT_EXIT: set = set()  # weak references to the close() of each store not collected yet


def close_at_exit(close) -> None:
    """Call `close` (a store's bound close method, held weakly) at interpreter exit, unless its store
    was collected by then."""
    _AT_EXIT.add(weakref.WeakMethod(close, _AT_EXIT.discard))


@atexit.register
def _close_open_stores() -> None:
    for ref in list(_AT_EXIT):
        close = ref()
        if close is None:
            continue
        try:
            close()
        except Exception as error:  # exiting anyway: say so, keep closing the others
            log.warning("closing a store at exit failed: %s", error)


class Closing:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, link_monitor, copy_engine,
                 cold_directory: ColdDirectory | None, remote: RemoteTier | None):
        self.lock, self.life, self.state = lock, life, state
        # what the store opened at start (bind adds the tiers, in the state, and what close() is handed)
        self.link_monitor, self.copy_engine, self.cold_directory, self.remote = \
            link_monitor, copy_engine, cold_directory, remote
        self._close_lock = threading.Lock()
        self._num_owners = 0  # banks that created this store and close it together

    def add_owner(self) -> None:
        with self.lock:
            self._num_owners += 1

    def drop_owner(self) -> bool:
        """One owner less: True when it was the last (the store closes)."""
        with self.lock:
            self._num_owners -= 1
            return self._num_owners <= 0

    def close(self, mover: Mover | None, durability: Durability | None, transfers: Transfers | None,
              peers: PeerFiles | None) -> None:
        """See the module docstring; what bind made is handed over here (None: not made)."""
        if self.lock.held_by_me:
            raise RuntimeError("TierStore.close() was called under the store's own lock; this is a bug in tiered_kv")
        with self._close_lock:
            if self.life.closed:
                return
            with self.lock:
                self.life.closing = True
            if self.remote is not None:
                self.remote.close()  # its writer reads blocks through the transfers: before they stop
            if mover is not None:
                mover.stop()
            self._wait_for_leases(CLOSE_WAIT_S)  # running steps end first
            if durability is not None:
                try:
                    with self.lock:
                        self.state.drain()
                    durability.persist_before_close()
                except Exception as error:
                    log.warning("closing: saving published blocks failed: %s", error)
            with self.lock:
                self.life.closed = True
            self.release(transfers, peers)
            self.state.changes.bump()

    def _wait_for_leases(self, timeout_s: float) -> None:
        """Until the steps running on other threads ended (this thread's own cannot end meanwhile)."""
        state, deadline, me = self.state, time.monotonic() + timeout_s, threading.get_ident()
        while True:
            version = state.changes.version
            with self.lock:
                state.drain()  # leases of banks the collector took end here
                running = sum(1 for lease in state.leases.values() if lease.thread_id != me)
            if not running:
                return
            if not state.changes.wait(version, deadline - time.monotonic()):
                log.warning("closing: %d step(s) still running on other threads after %.0f s; their reads of this "
                            "store now fail", running, timeout_s)
                return

    def release(self, transfers: Transfers | None, peers: PeerFiles | None, failed_start: bool = False) -> None:
        """Stop the engine and the sampler, close the tiers, the other stores' files and the cold
        directory (idempotent); a failed start also removes the files and directories it made."""
        if self.remote is not None:
            self.remote.close(flush=False)
        if transfers is not None:
            transfers.close()
        elif self.copy_engine is not None:
            self.copy_engine.close()
        self.link_monitor.close()
        tiers = self.state.tiers
        for i, tier in enumerate(tiers):
            if tier is not None:
                try:
                    tier.close()
                except Exception as error:  # keep closing the others
                    log.warning("closing the %s tier failed: %s", TIER_NAMES[i], error)
        tiers[:] = [None] * len(tiers)
        if peers is not None:
            peers.close()
        if self.cold_directory is not None:
            if failed_start:
                self.cold_directory.abort()
            else:
                self.cold_directory.close()  # releases its lock; keeps the block files
            self.cold_directory = None


__all__ = ["Closing", "CLOSE_WAIT_S", "close_at_exit"]
