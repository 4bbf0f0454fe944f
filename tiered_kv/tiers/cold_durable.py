"""Making cold records durable (DESIGN invariant 6): the ColdTier's persist / forget bookkeeping
(`DurableRecords`, mixed into ColdTier) and the thread that writes headers and index rows.

DurableWriter: a thread that makes queued records durable in batches, off the caller's thread. For
one batch, in queue order: the last operation per slot wins (persist, then forget = no row); header
of each record still current (the tier's check), then one fdatasync of the block file, then one
sqlite transaction (inserts, deletes, last-access updates). A row is therefore committed only after
its data and header are on disk: after a crash at any point, rows name records that were durable.

Slots carry a generation, bumped whenever a slot stops being (or about to be) durable: a write to
it, a forget, a newer persist. The writer writes a header only while the generation it was queued
with is current (checked and written under the tier's state lock), so a superseded persist never
reaches the disk, and a withdrawn slot gets its row deleted in queue order.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..hw.block_io import ColdWriteError
from ..logs import error_name
from . import cold_format as fmt
from .cold_format import FormatError
from .cold_index import verified_rows

log = logging.getLogger(__name__)


class DurableRecords:
    """ColdTier's durability methods. Uses the tier's `layout`, `num_slots`, `io`, `index`,
    `file_path`, `valid`, `checksums`, `_durable`, `_generation`, `_state_lock`, `_writer`,
    `_index_usable`, `_header_at(slot)`, `_zero_header` and `_write_warnings` (a logs.Throttle)."""

    metrics = None  # the store's Metrics, set when it binds: write times and failures are counted there

    def durable_records(self) -> list[tuple[int, bytes, bytes]]:
        """(slot, key, root) of the records found durable at open, least recently used first. Their
        slots hold valid, checksummed data; the store imports them as cached blocks and owns them."""
        return list(self._records)

    def _load_durable_records(self) -> list[tuple[int, bytes, bytes]]:
        """Rows of the index whose record header still matches them (cold_index.verified_rows); the
        others are dropped from the index with a warning, so they are never served nor reported again."""
        if not self.index.exists():
            return []
        try:
            self.index.open()
            rows = verified_rows(self.index, self._read_header, self.num_slots, self.file_path)
        except (FormatError, OSError, sqlite3.DatabaseError) as exc:
            log.warning("cold index %s cannot be used (%s): this tier starts empty and persists nothing",
                        self.index.path, exc)
            self.index.close()
            self._index_usable = False
            return []
        for row in rows:
            self.checksums[row.slot] = row.checksums
            self.valid[row.slot] = True
            self._durable[row.slot] = True
        return [(row.slot, row.key, row.root) for row in rows]

    def _read_header(self, slot: int) -> fmt.RecordHeader:
        page = np.empty(fmt.header_bytes(self.layout), dtype=np.uint8)
        self.io.read_into(page, self._header_at(slot))  # ShortReadError where the file was cut
        return fmt.unpack_header(self.layout, slot, page)

    def persist(self, slot: int, key: bytes, root: bytes) -> None:
        """Make the record at `slot` (every layer written) durable under `key` and `root` (16 bytes
        each; root is the model fingerprint). Returns at once; a background thread writes the header,
        fdatasyncs and commits the index row, batching what is queued. `flush()` waits for it."""
        slot = int(slot)
        if not self.valid[slot].all():
            raise ValueError(f"cold tier slot {slot}: cannot persist a record whose layers "
                             f"{np.flatnonzero(~self.valid[slot]).tolist()} were never written")
        fmt.pack_header(self.layout, slot, key, root, self.checksums[slot])  # validates key and root now
        if not self._index_usable:
            return
        with self._state_lock:
            self._generation[slot] += 1
            self._durable[slot] = True
            op = _Op("put", slot, int(self._generation[slot]), bytes(key), bytes(root), self.checksums[slot].copy())
        self._writer.enqueue([op])

    def _withdraw(self, slots, zero_header: bool) -> list[int]:
        """The slots stop being durable records: bump their generation (a queued persist of theirs is
        dropped), queue the deletion of their rows, and zero their headers when asked. Returns the
        slots that were durable."""
        with self._state_lock:
            slots = [int(s) for s in slots if self._durable[s]]
            if not slots:
                return slots
            self._durable[slots] = False
            self._generation[slots] += 1
            ops = [_Op("delete", slot, int(self._generation[slot])) for slot in slots]
        self._writer.enqueue(ops)
        if zero_header:  # best effort: the queued deletion is what counts, the read checks catch the rest
            failed, first = [], None
            for slot in slots:
                try:
                    with self._no_peer_reading(slot, True):  # a peer's read of the record ends first
                        self.io.write_from(self._zero_header, self._header_at(slot))
                except ColdWriteError as exc:
                    failed.append(slot)
                    first = first or exc
            if failed:
                self._write_warnings.warning(
                    "cold tier %s: cannot zero the record header of slot(s) %s (%s: %s); their index rows are "
                    "deleted anyway, so no later process reuses them", self.file_path, _some(failed),
                    error_name(first), first.strerror or first)
        return slots

    def _write_header_if_current(self, op: _Op) -> bool:
        """Writer thread: write `op`'s header unless the slot changed since it was queued."""
        header = fmt.pack_header(self.layout, op.slot, op.key, op.root, op.checksums)
        with self._state_lock:
            if self._generation[op.slot] != op.generation:
                return False
            self.io.write_from(header, self._header_at(op.slot))
            return True

    def _zero_headers_if_current(self, ops: list[_Op]) -> None:
        """Writer thread, after the rows of `ops` (deletions) were committed: zero the headers of the
        forgotten slots no write or persist took since, each once no peer reads its record."""
        failed, first = [], None
        for op in ops:
            if not self._header_live[op.slot]:
                continue
            try:
                with self._no_peer_reading(op.slot, True), self._state_lock:
                    if self._generation[op.slot] == op.generation:
                        self.io.write_from(self._zero_header, self._header_at(op.slot))
                    self._header_live[op.slot] = False
            except ColdWriteError as exc:
                failed.append(op.slot)
                first = first or exc
        if failed:  # best effort: the deleted rows are what counts, the read checks catch the rest
            self._write_warnings.warning(
                "cold tier %s: cannot zero the record header of slot(s) %s (%s: %s); their index rows are "
                "deleted anyway, so no later process reuses them", self.file_path, _some(failed),
                error_name(first), first.strerror or first)

    def _sync_data(self) -> None:
        self.io.sync()

    def _persist_failed(self, slots: list[int], error: BaseException, what: str) -> None:
        """One warning (throttled) for a batch of the writer thread that failed at `what`."""
        if slots:
            consequence = (f"{len(slots)} record(s) (slots {_some(slots)}) did not become durable: they stay "
                           "usable in this process, a later one recomputes them")
        else:
            consequence = "index rows of freed slots may remain; a later process checks them against their headers"
        if self.metrics is not None:
            self.metrics.write_errors.inc(("cold", error_name(error)), max(1, len(slots)))
        self._write_warnings.warning("cold tier %s: %s failed (%s: %s); %s", self.file_path, what,
                                     error_name(error), getattr(error, "strerror", None) or error, consequence)


def _some(slots: list[int], shown: int = 8) -> str:
    """`[1, 2, 3]`, or the first `shown` slots and how many more."""
    slots = sorted(slots)
    return str(slots) if len(slots) <= shown else f"{slots[:shown]} and {len(slots) - shown} more"


@dataclass
class _Op:
    kind: str  # "put" | "delete" | "touch"
    slot: int
    generation: int = 0
    key: bytes = b""
    root: bytes = b""
    checksums: np.ndarray | None = None
    at: float = field(default_factory=time.time)


class DurableWriter:
    """Batches persist / forget / touch operations of one cold tier on a thread of its own.

    `tier` provides `_write_header_if_current(op) -> bool` (writes the header unless the slot changed
    since the persist was queued), `_sync_data()`, `_persist_failed(slots, error, what)` (which warns),
    `_write_warnings`, `fsync` and `index`."""

    def __init__(self, tier):
        self._tier = tier
        self._ops: list[_Op] = []
        self._condition = threading.Condition()
        self._queued = 0
        self._done = 0
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    def enqueue(self, ops: list[_Op]) -> None:
        with self._condition:
            if self._stopping:
                raise ValueError(f"cold tier on {self._tier.file_path} is closed")
            self._ops.extend(ops)
            self._queued += len(ops)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered_kv-cold-writer", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def wait(self) -> list[BaseException]:
        """Block until everything queued so far is applied; the errors met since the last wait."""
        with self._condition:
            target = self._queued
            while self._done < target and self._thread is not None and self._thread.is_alive():
                if sys.is_finalizing():  # daemon threads no longer run: nothing more becomes durable
                    break
                self._condition.wait(0.1)
            errors, self._errors = self._errors, []
            return errors

    def stop(self) -> list[BaseException]:
        errors = self.wait()
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None and not sys.is_finalizing():
            thread.join()
        return errors

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._ops and not self._stopping:
                    self._condition.wait()
                if not self._ops:
                    return
                batch, self._ops = self._ops, []
            metrics = self._tier.metrics
            start = metrics.write_seconds.start() if metrics is not None else None
            try:
                self._apply(batch)
                if metrics is not None:
                    metrics.write_seconds.stop(("cold",), start)
            except BaseException as exc:  # never lose the thread: report at the next flush
                self._tier._write_warnings.warning(
                    "cold tier %s: a batch of %d index operations failed (%s: %s); the records it would have "
                    "made durable are not", self._tier.file_path, len(batch), error_name(exc), exc)
                self._note(exc)
            with self._condition:
                self._done += len(batch)
                self._condition.notify_all()

    def _note(self, error: BaseException) -> None:
        with self._condition:
            self._errors.append(error)

    def _apply(self, batch: list[_Op]) -> None:
        tier = self._tier
        final: dict[int, _Op] = {}
        touches: dict[int, float] = {}
        for op in batch:
            if op.kind == "touch":
                touches[op.slot] = op.at
            else:
                final[op.slot] = op
        puts = [op for op in final.values() if op.kind == "put"]
        deletes = [op.slot for op in final.values() if op.kind == "delete"]
        if puts and not tier.index.is_open:
            tier.index.open()
        if not tier.index.is_open:
            return  # nothing was ever persisted: no row to delete or touch
        written, failed, first = [], [], None
        for op in puts:
            try:
                if tier._write_header_if_current(op):
                    written.append(op)
            except OSError as exc:
                failed.append(op.slot)
                first = first or exc
                self._note(exc)
        if failed:  # one warning for the batch
            tier._persist_failed(failed, first, "writing record headers")
        if written and tier.fsync:
            try:
                tier._sync_data()
            except OSError as exc:
                tier._persist_failed([op.slot for op in written], exc, "fdatasync of the block file")
                self._note(exc)
                written = []
        rows = [(op.slot, op.key, op.root, op.checksums, op.at) for op in written]
        try:
            tier.index.apply(rows, deletes, [(s, t) for s, t in touches.items() if s not in final])
        except (sqlite3.Error, OSError) as exc:
            tier._persist_failed([op.slot for op in written], exc, f"committing to the index {tier.index.path}")
            self._note(exc)  # reported here, once; the next flush raises it
        tier._zero_headers_if_current([op for op in final.values() if op.kind == "delete"])
