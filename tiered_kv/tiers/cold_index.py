"""The cold tier's durable index and the background writer that fills it (DESIGN invariant 6).

ColdIndex: one sqlite3 database in WAL mode, `kv-v1-<layout>.index` next to the block file, table
`records(slot PRIMARY KEY, key, root, checksums, last_access)`. It is created at the first persist
(a tier that never persists leaves no index behind) through ColdDirectory.open_file, so the file is
made 0600 with O_NOFOLLOW | O_EXCL or, when it exists, accepted only as a regular file of ours; sqlite
then opens it by path, and we check the path still names the inode we checked. sqlite's -wal and -shm
files take the database's mode; the directory is private to us (cold_files.py), so nobody else can
plant a name there between our check and sqlite's open.

DurableWriter: a thread that makes queued records durable in batches, off the caller's thread. For
one batch, in queue order: the last operation per slot wins (persist, then forget = no row); header
of each record still current (the tier's check), then one fdatasync of the block file, then one
sqlite transaction (inserts, deletes, last-access updates). A row is therefore committed only after
its data and header are on disk: after a crash at any point, rows name records that were durable.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .cold_format import FORMAT_VERSION, FormatError

log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS records (slot INTEGER PRIMARY KEY, key BLOB NOT NULL, root BLOB NOT NULL, "
    "checksums BLOB NOT NULL, last_access REAL NOT NULL)",
)


@dataclass(frozen=True)
class IndexRow:
    slot: int
    key: bytes
    root: bytes
    checksums: np.ndarray  # uint64, one per layer
    last_access: float


class ColdIndex:
    """The index file of one block file. `open()` creates it when missing; `exists()` does not."""

    def __init__(self, directory, name: str, layout_text: str, synchronous: bool):
        self._directory = directory
        self.name = name
        self.path = directory.file_path(name)
        self._layout_text = layout_text
        self._synchronous = "FULL" if synchronous else "OFF"
        self._file = None  # the fd we checked, kept open so its inode cannot be reused under us
        self._db: sqlite3.Connection | None = None

    def exists(self) -> bool:
        try:
            os.stat(self.name, dir_fd=self._directory.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def open(self) -> None:
        """Open (creating if missing) and check the schema and format. ConfigError for a file that is
        not ours (symlink, foreign owner); FormatError or sqlite3.DatabaseError for one we cannot use."""
        if self._db is not None:
            return
        self._file = self._directory.open_file(self.name)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                info, ours = os.stat(self.path, follow_symlinks=False), os.fstat(self._file.fd)
                if (info.st_dev, info.st_ino) != (ours.st_dev, ours.st_ino):
                    raise FormatError(f"{self.path!r} was replaced while it was being opened")
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={self._synchronous}")
                for statement in _SCHEMA:
                    db.execute(statement)
                expected = {"format_version": str(FORMAT_VERSION), "layout": self._layout_text}
                found = dict(db.execute("SELECT name, value FROM meta").fetchall())
                if not found:
                    db.executemany("INSERT INTO meta VALUES (?, ?)", expected.items())
                elif found != expected:
                    raise FormatError(f"index {self.path!r} describes {found}, expected {expected}")
            except BaseException:
                db.close()
                raise
        except BaseException:
            os.close(self._file.fd)
            self._file = None
            raise
        self._db = db

    def rows(self) -> list[IndexRow]:
        """All rows, least recently used first."""
        cursor = self._db.execute("SELECT slot, key, root, checksums, last_access FROM records "
                                  "ORDER BY last_access, slot")
        return [IndexRow(slot, bytes(key), bytes(root), np.frombuffer(checksums, dtype="<u8").copy(), last)
                for slot, key, root, checksums, last in cursor]

    def apply(self, puts, deletes, touches) -> None:
        """One transaction: `puts` (slot, key, root, checksums, time) replace rows, `deletes` are slots,
        `touches` (slot, time) update last access of rows that exist."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("DELETE FROM records WHERE slot = ?", [(s,) for s in deletes])
            db.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)",
                           [(s, k, r, np.asarray(c, dtype="<u8").tobytes(), t) for s, k, r, c, t in puts])
            db.executemany("UPDATE records SET last_access = ? WHERE slot = ?", [(t, s) for s, t in touches])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._file is not None:
            os.close(self._file.fd)
            self._file = None


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
    since the persist was queued), `_sync_data()`, `_persist_failed(slots, error)`, `fsync` and `index`."""

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
                self._condition.wait()
            errors, self._errors = self._errors, []
            return errors

    def stop(self) -> list[BaseException]:
        errors = self.wait()
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None:
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
            try:
                self._apply(batch)
            except BaseException as exc:  # never lose the thread: report at the next flush
                log.warning("cold tier %s: a batch of %d index operations failed: %s",
                            self._tier.file_path, len(batch), exc)
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
        written = []
        for op in puts:
            try:
                if tier._write_header_if_current(op):
                    written.append(op)
            except OSError as exc:
                tier._persist_failed([op.slot], exc)
                self._note(exc)
        if written and tier.fsync:
            try:
                tier._sync_data()
            except OSError as exc:
                tier._persist_failed([op.slot for op in written], exc)
                self._note(exc)
                written = []
        rows = [(op.slot, op.key, op.root, op.checksums, op.at) for op in written]
        try:
            tier.index.apply(rows, deletes, [(s, t) for s, t in touches.items() if s not in final])
        except (sqlite3.Error, OSError) as exc:
            tier._persist_failed([op.slot for op in written], exc)
            raise
