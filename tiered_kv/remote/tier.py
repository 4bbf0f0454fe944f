"""The shared remote tier: a level below cold on Redis / Valkey that many processes share.

Writes: when a store publishes a full, verified block (TierStore.publish) and `remote.write` is
`through`, the block's id and key are queued here; that is all the decode path does. A writer
thread takes batches off the queue, reads each block's bytes through the store (under the
store's lock, only if the block still holds that key), encodes them (codec.py) and SETs the batch
in one pipelined round trip. A full queue or a down server drops writes (counted): the blocks
stay in the local tiers, and nothing waits.

Reads: on attach, after the local tiers miss, `fetch` GETs the rest of the chain in one pipelined
round trip and returns the leading run of values that decode intact (header, model fingerprint,
checksums); the chain stops at the first missing or bad value. The store then places those
blocks in its tiers and publishes them (TierStore.fetch_remote).

Keys already on the server (written or fetched by this process) are remembered (a bounded LRU
set), so a block is not written twice.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

from ..blocks import KVLayout
from ..config import RemoteConfig
from . import codec
from .client import RemoteClient

log = logging.getLogger(__name__)

QUEUE_MAX_BLOCKS = 4096  # queued writes beyond this are dropped (counted)
BATCH_MAX_BLOCKS = 32  # blocks per pipelined SET round trip
KNOWN_KEYS_MAX = 1 << 17
CLOSE_FLUSH_S = 10.0  # close() waits this long at most for queued writes


class RemoteTier:
    def __init__(self, cfg: RemoteConfig, metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.client = RemoteClient(cfg, metrics)
        self.layout: KVLayout | None = None
        self._read_block = None  # (block id, key) -> uint8 numpy bytes of the block, or None
        self._queue: deque = deque()
        self._condition = threading.Condition()
        self._busy = 0  # blocks taken off the queue and not yet written
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._known: OrderedDict[bytes, None] = OrderedDict()
        # remote.write: through; a plain flag, so a running store can stop or resume writing
        self.write_through = cfg.write == "through"
        self.reachable_at_start = self.client.connect()  # ConfigError: wrong password, or required and down

    def bind(self, layout: KVLayout, read_block) -> None:
        """The store knows its layout: values can be encoded, decoded, and read out of it."""
        self.layout = layout
        self._read_block = read_block

    def key_of(self, root: bytes, key: bytes) -> bytes:
        return codec.remote_key(self.cfg.key_prefix, self.layout, root, key)

    # ---- known keys ----------------------------------------------------------------------------
    def note_known(self, key: bytes) -> None:
        with self._condition:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_KEYS_MAX:
                self._known.popitem(last=False)

    # ---- writing -------------------------------------------------------------------------------
    def enqueue(self, block_id: int, key: bytes, root: bytes) -> None:
        """Queue a just-published block for the server (returns at once)."""
        if not self.write_through or self.layout is None:
            return
        with self._condition:
            if key in self._known or self._stopping:
                return
            if len(self._queue) >= QUEUE_MAX_BLOCKS:
                self.metrics.remote_writes_dropped.inc(("queue_full",))
                return
            self._queue.append((block_id, key, root))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered_kv-remote-writer", daemon=True)
                self._thread.start()
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._stopping:
                    self._condition.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH_MAX_BLOCKS, len(self._queue)))]
                self._busy = len(batch)
            try:
                self._write(batch)
            except Exception as error:  # never lose the thread; the blocks stay local
                log.warning("remote tier %s: a batch of %d writes failed: %s", self.cfg.url, len(batch), error)
                self.metrics.remote_writes_dropped.inc(("error",), len(batch))
            with self._condition:
                self._busy = 0
                self._condition.notify_all()

    def _write(self, batch: list) -> None:
        if self.client.is_down:
            self.metrics.remote_writes_dropped.inc(("down",), len(batch))
            return
        items, keys = [], []
        for block_id, key, root in batch:
            data = self._read_block(block_id, key)
            if data is None:  # freed, replaced or corrupt since it was queued
                self.metrics.remote_writes_dropped.inc(("gone",))
                continue
            items.append((self.key_of(root, key), codec.encode(self.layout, key, root, data)))
            keys.append(key)
        if not items:
            return
        if self.client.set_many(items):
            self.metrics.remote_writes.inc((), len(items))
            self.metrics.remote_bytes.inc(("out",), sum(len(value) for _, value in items))
            for key in keys:
                self.note_known(key)
        else:
            self.metrics.remote_writes_dropped.inc(("down",), len(items))

    def flush(self, timeout_s: float = CLOSE_FLUSH_S) -> bool:
        """Wait until every queued write was tried; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._queue and not self._busy, timeout=timeout_s)

    # ---- reading -------------------------------------------------------------------------------
    @property
    def value_bytes(self) -> int:
        """Bytes of one value on the wire (header and the block as this tier stores it)."""
        return codec.value_bytes(self.layout)

    def fetch(self, keys: list[bytes], root: bytes) -> list:
        """The blocks' bytes (uint8 numpy) of the leading run of `keys` the server holds intact."""
        if not keys or self.layout is None:
            return []
        values = self.client.get_many([self.key_of(root, key) for key in keys])
        if values is None:
            self.metrics.remote_misses.inc(("down",))
            return []
        blocks = []
        for key, value in zip(keys, values):
            data, why = codec.decode(self.layout, key, root, value)
            if data is None:
                self.metrics.remote_misses.inc(("missing" if value is None else "bad",))
                if value is not None:
                    log.warning("remote tier %s: the value of block %s is not usable (%s); the chain stops here "
                                "and the rest is recomputed", self.cfg.url, key.hex(), why)
                break
            blocks.append(data)
        self.metrics.remote_hits.inc((), len(blocks))
        self.metrics.remote_bytes.inc(("in",), len(blocks) * codec.value_bytes(self.layout))
        return blocks

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self, flush: bool = True) -> None:
        """Try the queued writes (up to CLOSE_FLUSH_S; not with flush=False), stop the writer,
        close the connection. Closing twice is harmless."""
        if flush and self._thread is not None and not self.flush():
            log.warning("remote tier %s: %d queued block write(s) not sent at close", self.cfg.url, len(self._queue))
        with self._condition:
            self._stopping = True
            self._queue.clear()
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.client.close()

    def stats(self) -> dict:
        m = self.metrics
        return {"url": self.cfg.url, "cluster": self.cfg.cluster, "write": "through" if self.write_through else "off",
                "down": self.client.is_down, "last_error": self.client.last_error,
                "hits": int(m.remote_hits.value()), "misses": {k[0]: int(v) for k, v in m.remote_misses.snapshot_values()},
                "bytes_in": int(m.remote_bytes.value(("in",))), "bytes_out": int(m.remote_bytes.value(("out",))),
                "writes": int(m.remote_writes.value()),
                "writes_dropped": {k[0]: int(v) for k, v in m.remote_writes_dropped.snapshot_values()},
                "errors": {k[0]: int(v) for k, v in m.remote_errors.snapshot_values()},
                "queued": len(self._queue), "latency": m.remote_seconds.snapshot()}
