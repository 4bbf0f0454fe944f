"""RemoteIO: the store's side of the shared remote tier (tiered_kv/remote/), through the transfers.

- `fetch(keys, root)`: after a local miss, the server's leading run of the chain becomes new
  blocks of this store: allocated as high as room allows (pinned meanwhile), filled by a write-in
  batch (transfers.py) whose copies must land before the blocks are published;
- `read_block_bytes(block_id, key)`: the remote writer's read of a published block, a read-out
  batch behind the copies queued before it (so it returns the block's landed bytes, never what a
  slot held before), the block pinned while it is copied out.
The network round trips run outside the store lock (remote/tier.py).
"""

from __future__ import annotations

import time

import torch

from ..errors import CapacityError
from ..metrics.registry import BACKGROUND, ON_DEMAND
from .allocation import Retry, pseudo_owner


IN_FLIGHT_WAIT_S = 5.0  # the remote writer waits this long for a block a move has in flight


class RemoteIO:
    def __init__(self, store):
        self.store = store  # the façade: lock, state, allocation, transfers, demand, remote

    def fetch(self, keys: list[bytes], root: bytes) -> list[int]:
        """The leading run of `keys` the remote server holds intact, as new published blocks, each
        retained once for the caller; [] when there is no remote tier, the server is down or holds
        none of them, the tiers have no room, or their copies failed."""
        store = self.store
        if store.remote is None or not keys or not store.is_bound:
            return []
        started_s = time.perf_counter()
        blocks = store.remote.fetch(keys, root)
        store.rates.note_read("remote", len(blocks) * store.remote.value_bytes, time.perf_counter() - started_s)
        found = self._bring_in(blocks, keys, root, "remote_misses")
        for key in keys[:len(found)]:
            store.remote.note_known(key)  # it came from there: never written back
        return found

    def fetch_peers(self, keys: list[bytes], root: bytes) -> list[int]:
        """Like `fetch`, from the durable records of the other stores (processes) on this cold.path."""
        store = self.store
        if store.peers is None or not keys or not store.is_bound:
            return []
        started_s = time.perf_counter()
        blocks = store.peers.fetch(keys, root)
        store.rates.note_read("peer", len(blocks) * store.peers.layout.block_bytes, time.perf_counter() - started_s)
        found = self._bring_in(blocks, keys, root, None)
        store.metrics.peer_hits.inc((), len(found))
        return found

    def _bring_in(self, blocks: list, keys: list[bytes], root: bytes, misses: str | None) -> list[int]:
        """New published blocks holding `blocks` (bytes of the leading keys), each retained once."""
        store = self.store
        if not blocks:
            return []
        owner = pseudo_owner()
        with store.lock:
            store.check_open()
            store.state.pin(owner, set())
        try:
            try:
                block_ids = store.allocation.allocate_pinned(owner, len(blocks))
            except (CapacityError, Retry):
                if misses is not None:
                    getattr(store.metrics, misses).inc(("no_room",))
                return []
            shape = (1, *store.layout.record_shape())
            data = [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(store.dtype).reshape(shape) for b in blocks]
            with store.lock:
                batch = store.transfers.prepare_write_in(list(zip(block_ids, data)), ON_DEMAND)
            store.demand.run_batch(batch)
            if batch.failed_parts:
                with store.lock:  # complete() freed the blocks whose bytes never landed
                    store.state.release([b for b in block_ids if b in store.state.index])
                return []
            store.publish_many([(b, key, root) for b, key in zip(block_ids, keys)], local=False)
            return block_ids
        finally:
            with store.lock:
                store.state.unpin(owner)

    def read_block_bytes(self, block_id: int, key: bytes):
        """The bytes (uint8 numpy) of `block_id` if it still holds `key` and is intact; else None.
        A block a move has in flight is read once it landed (waited for up to IN_FLIGHT_WAIT_S).
        Runs while the store closes too: close() flushes the writer before the transfers stop."""
        store = self.store
        owner = pseudo_owner()
        deadline = time.monotonic() + IN_FLIGHT_WAIT_S
        while True:
            version = store.change_version
            with store.lock:
                state = store.state
                if store.is_closed or block_id not in state.index:
                    return None
                entry = state.index.get(block_id)
                if entry.key != key or entry.is_corrupt:
                    return None
                if block_id not in state.in_flight:
                    break
            if not store.wait_for_change(version, deadline - time.monotonic()):
                return None
        with store.lock:
            if block_id not in state.index or state.index.get(block_id).key != key or block_id in state.in_flight:
                return None
            state.pin(owner, {block_id})
            out = torch.empty(store.layout.record_shape(), dtype=store.dtype, pin_memory=store.pinned)
            batch = store.transfers.prepare_read_out(block_id, out, BACKGROUND)
        try:
            store.transfers.run(batch)
        finally:
            with store.lock:
                store.state.unpin(owner)
        if batch.failure is not None or batch.any_corrupt():
            return None
        return out.view(torch.uint8).numpy().reshape(-1)
