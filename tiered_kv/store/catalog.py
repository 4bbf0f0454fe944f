"""Catalog: the blocks as banks hold them — by reference (retain, release) and by name (publish,
look up) — over the block index, under the store lock.

A block with no reference left is freed, unless it is published: then it stays as reusable cache.
Publishing names a full block by its content's key, so other banks (and with a cold tier, later
processes) reuse it instead of recomputing: one in cold is made durable at once, one above cold
waits for its durable copy (durable_copies.py, written behind by the mover), one computed here is
queued for the remote writer. A corrupt block is never found by key.
"""

from __future__ import annotations

import time

from ..blocks import HOT, WARM
from ..metrics.registry import Metrics
from ..remote import RemoteTier
from .compaction import HotCompaction
from .life import StoreLife
from .lock import StoreLock
from .state import StoreState


class Catalog:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, compaction: HotCompaction,
                 metrics: Metrics, remote: RemoteTier | None, write_behind_s: float):
        self.lock, self.life, self.state, self.compaction, self.metrics = lock, life, state, compaction, metrics
        self.remote = remote  # None: no remote tier
        self.write_behind_s = write_behind_s  # 0: no durable copies of blocks above cold

    # ---- references ----------------------------------------------------------------------------
    def retain(self, block_ids: list[int]) -> None:
        with self.lock:
            for block_id in block_ids:
                self.state.index.incref(block_id)
            self.compaction.note_layout_change()  # another table now holds these blocks

    def release(self, block_ids: list[int], for_good: bool = False) -> None:
        """Drop one reference each. Unreferenced published blocks stay as reusable cache, unless
        `for_good`: blocks that left a sliding window, which nobody reads again (never moved down)."""
        with self.lock:
            if self.life.closed:
                return
            self.state.release(block_ids, keep_published=not for_good)
            self.state.changes.bump()

    # ---- names -----------------------------------------------------------------------------------

    def publish_many(self, items: list[tuple[int, bytes, bytes | None]], local: bool = True) -> list[bool]:
        """Name each (block, key, root); False for a key another block holds already. `local`:
        computed here (False: fetched from another process or the remote tier)."""
        with self.lock:
            out = [self.state.index.publish(block_id, key, root) for block_id, key, root in items]
            self._published([item for item, ok in zip(items, out) if ok], local)
            return out

    def _published(self, items: list[tuple[int, bytes, bytes | None]], local: bool) -> None:
        """Durable now when in cold, due for a durable copy when above it, queued for the remote writer."""
        state, above = self.state, []
        for block_id, key, root in items:
            state.persist_if_published(block_id)
            if root is not None and state.index.get(block_id).tier in (HOT, WARM):
                above.append(block_id)
            if self.remote is not None and root is not None and local:
                self.remote.enqueue(block_id, key, root)  # written behind, by the remote writer
        if above and state.copies is not None and self.write_behind_s:
            state.copies.published(above, local, time.monotonic())

    def lookup_and_retain(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (from the first) that the store holds intact,
        each retained once for the caller."""
        with self.lock:
            index, found = self.state.index, []
            for key in keys:
                block_id = index.lookup(key)
                if block_id is None or index.get(block_id).is_corrupt:
                    self.metrics.misses.inc()
                    break
                found.append(block_id)
            for block_id in found:
                index.incref(block_id)
            if found and self.state.copies is not None:  # another chat reads them (cold.admit: reused)
                self.state.copies.reused(found, time.monotonic())
            if found:
                self.compaction.note_layout_change()  # a table takes up blocks laid out for another
            return found

    def holds(self, keys: list[bytes]) -> list[bool]:
        """Whether the store holds each key's block intact (nothing retained)."""
        with self.lock:
            index = self.state.index
            return [(b := index.lookup(key)) is not None and not index.get(b).is_corrupt for key in keys]


__all__ = ["Catalog"]
