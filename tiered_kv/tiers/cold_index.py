"""The cold tier's durable index (DESIGN invariant 6); cold_durable.py fills it.

ColdIndex: one sqlite3 database in WAL mode, `kv-v1-<layout>.index` next to the block file, table
`records(slot PRIMARY KEY, key, root, checksums, last_access)`. It is created at the first persist
(a tier that never persists leaves no index behind) through ColdDirectory.open_file, so the file is
made 0600 with O_NOFOLLOW | O_EXCL or, when it exists, accepted only as a regular file of ours; sqlite
then opens it by path, and we check the path still names the inode we checked. sqlite's -wal and -shm
files take the database's mode; the directory is private to us (cold_files.py), so nobody else can
plant a name there between our check and sqlite's open.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from dataclasses import dataclass

import numpy as np

from .cold_format import FormatError, index_meta, layout_from_text

log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS records (slot INTEGER PRIMARY KEY, key BLOB NOT NULL, root BLOB NOT NULL, "
    "checksums BLOB NOT NULL, last_access REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS records_by_key ON records(key)",  # peers look records up by key
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
                expected = index_meta(layout_from_text(self._layout_text))
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
            if db.in_transaction:  # on SQLITE_FULL sqlite has rolled back already: keep its error
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._file is not None:
            os.close(self._file.fd)
            self._file = None


def verified_rows(index: ColdIndex, read_header, num_slots: int, what: str) -> list[IndexRow]:
    """The index rows (least recently used first) whose slot exists and whose record header
    (`read_header(slot)`, raising FormatError or OSError) names the same key, root and checksums.
    Rows that fail are deleted from the index: one warning says how many and why (each row at DEBUG)."""
    kept, dropped, problems = [], [], []
    for row in index.rows():
        problem = None
        if not 0 <= row.slot < num_slots:
            problem = f"beyond this tier's {num_slots} slots"
        else:
            try:
                found = read_header(row.slot)
                if (found.key, found.root, found.checksums) != (row.key, row.root, tuple(row.checksums.tolist())):
                    problem = "its header names another record"
            except (FormatError, OSError) as exc:
                problem = f"bad header: {exc}"
        if problem:
            log.debug("cold tier %s: dropping the index row of slot %d (%s)", what, row.slot, problem)
            dropped.append(row.slot)
            problems.append(f"slot {row.slot}: {problem}")
        else:
            kept.append(row)
    if dropped:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        log.warning("cold tier %s: dropped %d of %d durable record(s) that no longer match their index rows "
                    "(%s); those blocks are gone and will be recomputed", what, len(dropped),
                    len(dropped) + len(kept), shown)
        index.apply([], dropped, [])
    return kept
