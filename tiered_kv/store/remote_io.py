"""RemoteIO: the store's side of the shared remote tier (tiered_kv/remote/), through the transfers.

- `fetch(keys, root)`: after a local miss (and after `fetch_peers`, the same from the other
  stores' durable records on this cold.path), the server's leading run of the chain becomes new
  blocks of this store: allocated as high as room allows (pinned meanwhile), filled by a write-in
  batch (transfers.py) whose copies must land before the blocks are published;
- `read_block_bytes(block_id, key)`: the remote writer's read of a published block, a read-out
  batch behind the copies queued before it (so it returns the block's landed bytes, never what a
  slot held before), the block pinned while it is copied out.
The network round trips run outside the store lock (remote/tier.py).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..blocks import KVLayout
from ..errors import CapacityError
from ..metrics.registry import BACKGROUND, ON_DEMAND, Metrics
from ..remote import RemoteTier
from ..scheduler.restore import Rates
from ..tiers.cold_peers import PeerFiles
from .allocation import Retry, pseudo_owner
from .demand import DemandMoves
from .life import StoreLife
from .lock import StoreLock
from .state import StoreState
from .transfers import Transfers


IN_FLIGHT_WAIT_S = 5.0  # the remote writer waits this long for a block a move has in flight


class RemoteIO:
    def __init__(self, lock: StoreLock, life: StoreLife, state: StoreState, transfers: Transfers, demand: DemandMoves,
                 allocate_pinned: Callable, publish_many: Callable, metrics: Metrics, rates: Rates, layout: KVLayout,
                 dtype: torch.dtype, pinned: bool, remote: RemoteTier | None, peers: PeerFiles | None):
        self.lock, self.life, self.state = lock, life, state
        self.transfers, self.demand = transfers, demand
        self.allocate_pinned = allocate_pinned  # Allocation.allocate_pinned: room for what comes in
        self.publish_many = publish_many  # Catalog.publish_many: what came in, by key
        self.metrics, self.rates = metrics, rates
        self.layout, self.dtype, self.pinned = layout, dtype, pinned  # a block's record, as the tiers hold it
        self.remote, self.peers = remote, peers  # the remote tier; the other stores' files on cold.path

    def fetch_elsewhere(self, keys: list[bytes], root: bytes) -> list[int]:
        """After a local miss: `fetch_peers`, then `fetch` for the keys the peers lack."""
        found = self.fetch_peers(keys, root)
        return found if len(found) == len(keys) else found + self.fetch(keys[len(found):], root)

    def fetch(self, keys: list[bytes], root: bytes) -> list[int]:
        """The leading run of `keys` the remote server holds intact, as new published blocks, each
        retained once for the caller; [] when there is no remote tier, the server is down or holds
        none of them, the tiers have no room, or their copies failed."""
        remote = self.remote
        if remote is None or not keys:
            return []
        started_s = time.perf_counter()
        blocks = remote.fetch(keys, root)
        self.rates.note_read("remote", len(blocks) * remote.value_bytes, time.perf_counter() - started_s)
        found = self._bring_in(blocks, keys, root, "remote_misses")
        for key in keys[:len(found)]:
            remote.note_known(key)  # it came from there: never written back
        return found

    def fetch_peers(self, keys: list[bytes], root: bytes) -> list[int]:
        """Like `fetch`, from the durable records of the other stores (processes) on this cold.path."""
        peers = self.peers
        if peers is None or not keys:
            return []
        started_s = time.perf_counter()
        blocks = peers.fetch(keys, root)
        self.rates.note_read("peer", len(blocks) * peers.layout.block_bytes, time.perf_counter() - started_s)
        found = self._bring_in(blocks, keys, root, None)
        self.metrics.peer_hits.inc((), len(found))
        return found

    def _bring_in(self, blocks: list, keys: list[bytes], root: bytes, misses: str | None) -> list[int]:
        """New published blocks holding `blocks` (bytes of the leading keys), each retained once."""
        if not blocks:
            return []
        state, owner = self.state, pseudo_owner()
        with self.lock:
            self.life.check_open()
            state.pin(owner, set())
        try:
            try:
                block_ids = self.allocate_pinned(owner, len(blocks))
            except (CapacityError, Retry):
                if misses is not None:
                    getattr(self.metrics, misses).inc(("no_room",))
                return []
            shape = (1, *self.layout.record_shape())
            data = [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(self.dtype).reshape(shape) for b in blocks]
            with self.lock:
                batch = self.transfers.prepare_write_in(list(zip(block_ids, data)), ON_DEMAND)
            self.demand.run_batch(batch)
            if batch.failed_parts:
                with self.lock:  # complete() freed the blocks whose bytes never landed
                    state.release([b for b in block_ids if b in state.index])
                return []
            self.publish_many([(b, key, root) for b, key in zip(block_ids, keys)], local=False)
            return block_ids
        finally:
            with self.lock:
                state.unpin(owner)

    def read_block_bytes(self, block_id: int, key: bytes):
        """The bytes (uint8 numpy) of `block_id` if it still holds `key` and is intact; else None.
        A block a move has in flight is read once it landed (waited for up to IN_FLIGHT_WAIT_S).
        Runs while the store closes too: close() flushes the writer before the transfers stop."""
        state, owner = self.state, pseudo_owner()
        deadline = time.monotonic() + IN_FLIGHT_WAIT_S
        while True:
            version = state.changes.version
            with self.lock:
                if self.life.closed or block_id not in state.index:
                    return None
                entry = state.index.get(block_id)
                if entry.key != key or entry.is_corrupt:
                    return None
                if block_id not in state.in_flight:
                    break
            if not state.changes.wait(version, deadline - time.monotonic()):
                return None
        with self.lock:
            if block_id not in state.index or state.index.get(block_id).key != key or block_id in state.in_flight:
                return None
            state.pin(owner, {block_id})
            out = torch.empty(self.layout.record_shape(), dtype=self.dtype, pin_memory=self.pinned)
            batch = self.transfers.prepare_read_out(block_id, out, BACKGROUND)
        try:
            self.transfers.run(batch)
        finally:
            with self.lock:
                state.unpin(owner)
        if batch.failure is not None or batch.any_corrupt():
            return None
        return out.view(torch.uint8).numpy().reshape(-1)
