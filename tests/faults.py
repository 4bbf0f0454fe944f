"""Fault injection for the tests of the transfer engine: copies that raise, copies held back.

`Faults(store, selects)` wraps `store.transfers.launch` (the public seam, issue 16): every batch
`selects(batch)` picks fails, up to `limit` times, in one of three ways:
  "before"   launch raises before any copy is issued (an allocation that fails, say);
  "after"    the copies are issued, then launch raises (a failure reported after the DMA started);
  "in_unit"  the copy engine's unit raises where the copies run (on the thread engine: on its own
             thread, later), so only the batch's event reports it.
`EngineGate(store)` holds the store's thread copy engine: every unit submitted meanwhile waits
until `open()`, so a test can act while copies are provably in flight.
"""

from __future__ import annotations

import threading

import tiered_kv.store.copies as copies_module
from tiered_kv.metrics.registry import BACKGROUND, ON_DEMAND

WAYS = ("before", "after", "in_unit")


class InjectedFault(RuntimeError):
    """What an injected copy failure raises (a RuntimeError, as a CUDA out-of-memory error is)."""


def on_demand(batch) -> bool:
    return batch.mode == ON_DEMAND and any(t.kind == "move" for t in batch.transfers)


def background(batch) -> bool:
    return batch.mode == BACKGROUND and any(t.kind == "move" and t.src_tier != t.dst_tier for t in batch.transfers)


def compaction(batch) -> bool:
    return batch.mode == BACKGROUND and all(t.kind == "move" and t.src_tier == t.dst_tier for t in batch.transfers)


def remote(batch) -> bool:
    return any(t.kind in ("write_in", "read_out") for t in batch.transfers)


def every_batch(batch) -> bool:
    return True


class Faults:
    def __init__(self, store, selects, way: str = "before", every: int = 1, limit: int | None = None,
                 error: BaseException | None = None, skip: int = 0):
        assert way in WAYS, way
        self.store, self.selects, self.way, self.every, self.limit = store, selects, way, every, limit
        self.skip = skip  # the first `skip` selected batches pass
        self.error = error if error is not None else InjectedFault("injected: CUDA out of memory")
        self.seen = 0  # selected batches
        self.failed = 0  # batches made to fail
        self._lock = threading.Lock()
        self._real_launch = store.transfers.launch
        store.transfers.launch = self._launch
        self._marked: set[int] = set()
        if way == "in_unit":
            self._real_run = copies_module.run
            copies_module.run = self._run

    def _pick(self, batch) -> bool:
        if not batch.transfers or not self.selects(batch):
            return False
        with self._lock:
            self.seen += 1
            if self.seen <= self.skip or (self.seen - self.skip - 1) % self.every \
                    or (self.limit is not None and self.failed >= self.limit):
                return False
            self.failed += 1
            return True

    def _launch(self, batch):
        if not self._pick(batch):
            return self._real_launch(batch)
        if self.way == "before":
            raise self.error
        if self.way == "after":
            self._real_launch(batch)
            raise self.error
        self._marked.add(id(batch))
        return self._real_launch(batch)

    def _run(self, tiers, transfers, *args):
        if transfers and id(transfers[0].batch) in self._marked:
            self._marked.discard(id(transfers[0].batch))
            raise self.error
        return self._real_run(tiers, transfers, *args)

    def remove(self) -> None:
        self.store.transfers.launch = self._real_launch
        if self.way == "in_unit":
            copies_module.run = self._real_run

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class EngineGate:
    """Holds a store's thread copy engine shut: units submitted meanwhile run only after open()."""

    def __init__(self, store):
        assert store.copy_engine.name == "thread", "EngineGate needs copies.engine: thread"
        self._opened = threading.Event()
        self.entered = threading.Event()
        store.copy_engine.submit(self._hold)

    def _hold(self):
        self.entered.set()
        assert self._opened.wait(60), "the test never opened the engine gate"

    def open(self):
        self._opened.set()


def thread_engine(config: dict, delay_us: int = 300) -> dict:
    """`config` with the asynchronous CPU copy engine (copies run later on the engine's thread)."""
    return {**config, "copies": {"engine": "thread", "delay_us": delay_us}}
