"""Read-only view of a cold directory: its layout files, index rows and, on request, every record checked.

Never writes, never holds a lock, never follows a link: the directory is opened O_RDONLY and every file
inside relative to it with O_RDONLY | O_NOFOLLOW; records are read with os.pread. Each block file is
written by at most one store (process), which holds an exclusive flock on it: a non-blocking shared
flock, released at once, tells whether a store is attached, and /proc/locks which process it is. An
index (sqlite3, WAL) is opened `mode=ro` only while its store runs (its -wal and -shm exist then);
otherwise a clean index (no -wal left) is opened `immutable=1`, which creates nothing, and one a
crashed store left with a -wal is read from a private copy, so its -shm is never created here.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import sqlite3
import stat
import tempfile
import urllib.parse
from dataclasses import dataclass, field

import numpy as np

from ..blocks import KVLayout
from ..errors import LayoutError
from ..tiers import cold_format as fmt
from ..compression.record import RECORD_NAME
from ..tiers.cold_files import LOCK_NAME

log = logging.getLogger(__name__)
_OURS = fmt.FILE_NAME
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotColdDirectory(ValueError):
    """The path is missing, not a directory, unreadable, or holds no cold tier files."""


@dataclass(frozen=True)
class Record:
    file: str  # block file name
    slot: int
    key: bytes
    root: bytes  # the model fingerprint
    checksums: tuple[int, ...]
    last_access: float
    record_bytes: int  # on-disk footprint: the record stride


@dataclass
class LayoutFile:
    name: str  # kv-v1-<16 hex>[-<n>].blocks
    size_bytes: int | None = None  # None: no block file
    attached: bool = False  # a running store holds (writes) this block file
    owner_pid: int | None = None  # that store's process, when /proc/locks names it
    index_name: str | None = None
    layout: KVLayout | None = None
    records: list[Record] = field(default_factory=list)
    problem: str | None = None  # why the records could not be listed
    bad: list[tuple[int, str]] | None = None  # (slot, reason) when verified

    @property
    def stride_bytes(self) -> int | None:
        return fmt.record_stride_bytes(self.layout) if self.layout else None

    @property
    def capacity_slots(self) -> int | None:
        return self.size_bytes // self.stride_bytes if self.layout and self.size_bytes is not None else None


@dataclass
class ColdScan:
    path: str
    store_running: bool
    free_disk_bytes: int
    files: list[LayoutFile]
    ignored: list[tuple[str, str]]  # (name, why)

    @property
    def attached(self) -> list[tuple[str, int | None]]:
        """(block file, process id or None) of every store attached to the directory."""
        return [(f.name, f.owner_pid) for f in self.files if f.attached]

    @property
    def records(self) -> list[Record]:
        return [r for f in self.files for r in f.records]


def open_directory(path: str) -> int:
    """An O_RDONLY fd of a cold directory; NotColdDirectory otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NotColdDirectory(f"{path!r} cannot be opened as a directory ({exc.strerror})") from None
    names = os.listdir(fd)
    if LOCK_NAME not in names and not any(n.startswith("kv-") for n in names):
        os.close(fd)
        raise NotColdDirectory(f"{path!r} is not a cold directory (no {LOCK_NAME} and no kv-* files in it)")
    return fd


def store_running(dir_fd: int) -> bool:
    """Whether a store runs on the directory (holds its lock file, shared, or a block file): non-blocking
    flocks, each released at once, that create nothing."""
    return _held(dir_fd, LOCK_NAME, fcntl.LOCK_EX) or any_block_file_held(dir_fd)


def any_block_file_held(dir_fd: int) -> bool:
    """Whether a store is attached: it holds one of the block files."""
    return any(_held(dir_fd, name) for name in os.listdir(dir_fd)
               if (fmt.file_number(name) or ("", 0, ""))[2] == "blocks")


def _held(dir_fd: int, name: str, probe: int = fcntl.LOCK_SH) -> bool:
    """Whether some process holds a flock on `name` that `probe` (LOCK_SH: an exclusive one; LOCK_EX:
    any) conflicts with."""
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, probe | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # releases the probe's lock, if taken
    return False


def scan(path: str, verify: bool = False, locked: bool = False) -> ColdScan:
    """Everything `inspect` reports. `locked`: the caller holds the writer lock (gc), so no store runs."""
    path = os.path.abspath(path)
    dir_fd = open_directory(path)
    try:
        running = False if locked else store_running(dir_fd)
        log.debug("scanning %s (a store runs on it: %s)", path, "yes" if running else "no")
        disk = os.fstatvfs(dir_fd)
        files: dict[str, LayoutFile] = {}
        ignored = []
        names = sorted(os.listdir(dir_fd))
        for name in names:
            match = _OURS.fullmatch(name)
            if name in (LOCK_NAME, RECORD_NAME) or (match and match.group(3).startswith("index-")):
                continue
            if not match:
                ignored.append((name, "another format version" if re.match(r"kv-v\d+-", name) else "not ours"))
                continue
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                ignored.append((name, "not a regular file"))
                continue
            signature, number, kind = fmt.file_number(name)
            entry = files.setdefault((signature, number), LayoutFile(
                f"kv-{signature}{f'-{number}' if number else ''}.blocks"))
            if kind == "blocks":
                entry.size_bytes = info.st_size
                entry.attached = not locked and _held(dir_fd, name)
                entry.owner_pid = _flock_holders().get((info.st_dev, info.st_ino)) if entry.attached else None
            else:
                entry.index_name = name
        for (signature, _), entry in sorted(files.items()):
            _load(dir_fd, path, signature, entry, running and (entry.attached or entry.size_bytes is None), names,
                  verify)
        return ColdScan(path, running, disk.f_bavail * disk.f_frsize, list(files.values()), ignored)
    finally:
        os.close(dir_fd)


def _flock_holders() -> dict[tuple[int, int], int]:
    """(st_dev, st_ino) -> pid of each exclusive flock on this machine (Linux /proc/locks; {} elsewhere)."""
    holders = {}
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()  # 1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE":
                    major, minor, inode = parts[5].split(":")
                    holders[(os.makedev(int(major, 16), int(minor, 16)), int(inode))] = int(parts[4])
    except (OSError, ValueError):
        return {}
    return holders


def _load(dir_fd, path, signature, entry: LayoutFile, running, names, verify) -> None:
    if entry.index_name is None:
        entry.problem = "no index: nothing was ever persisted here, no durable record"
        return
    try:
        meta, rows = _read_index(dir_fd, path, entry.index_name, running, names)
    except (OSError, sqlite3.Error) as exc:
        hint = "" if os.access(path, os.W_OK) else " (the directory is not writable: a running store's index " \
                                                 "may need its -shm created)"
        entry.problem = f"index cannot be read read-only: {exc}{hint}"
        return
    try:
        layout = fmt.layout_from_text(meta["layout"])
    except (KeyError, ValueError, IndexError, TypeError, LayoutError):
        entry.problem = f"index meta {meta!r} names no layout"
        return
    if meta != fmt.index_meta(layout) or fmt.layout_signature(layout) != signature:
        entry.problem = f"index meta {meta!r} does not match the file name"
        return
    entry.layout = layout
    stride = fmt.record_stride_bytes(layout)
    entry.records = [Record(entry.name, s, bytes(k), bytes(r), tuple(np.frombuffer(c, dtype="<u8").tolist()), t,
                            stride) for s, k, r, c, t in rows]
    if verify and entry.size_bytes is not None:
        fd = os.open(entry.name, _OPEN, dir_fd=dir_fd)
        try:
            entry.bad = [(r.slot, why) for r in entry.records if (why := check_record(fd, layout, r))]
        finally:
            os.close(fd)
    elif verify:
        entry.bad = [(r.slot, "no block file") for r in entry.records]


def _read_index(dir_fd, path, name, running, names):
    """(meta dict, rows least recently used first) of one index, without writing anything in `path`."""
    fd = os.open(name, _OPEN, dir_fd=dir_fd)  # refuses a symlink at the index name
    os.close(fd)
    full = urllib.parse.quote(os.path.join(path, name))
    if running:
        uri, copy_dir = f"file:{full}?mode=ro", None
    elif name + "-wal" not in names:
        uri, copy_dir = f"file:{full}?mode=ro&immutable=1", None
    else:  # a crashed store's WAL: recover it in a private copy
        copy_dir = tempfile.mkdtemp(prefix="tiered-kv-inspect-")
        log.debug("%s has a WAL a crashed store left: reading a private copy in %s", name, copy_dir)
        for suffix in ("", "-wal"):
            with open(os.open(name + suffix, _OPEN, dir_fd=dir_fd), "rb") as src, \
                    open(os.path.join(copy_dir, "index" + suffix), "wb") as dst:
                shutil.copyfileobj(src, dst)
        uri = f"file:{urllib.parse.quote(os.path.join(copy_dir, 'index'))}"
    try:
        db = sqlite3.connect(uri, uri=True)
        try:
            meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
            rows = db.execute("SELECT slot, key, root, checksums, last_access FROM records "
                              "ORDER BY last_access, slot").fetchall()
        finally:
            db.close()
    finally:
        if copy_dir:
            shutil.rmtree(copy_dir, ignore_errors=True)
    log.debug("index %s (%s): %d row(s)", name, "read-only beside a running store" if running else
              "immutable" if copy_dir is None else "private copy", len(rows))
    return meta, rows


def check_record(fd: int, layout: KVLayout, record: Record) -> str | None:
    """Why the record at `record.slot` is not the one its index row names, or None when it is intact."""
    stride = fmt.record_stride_bytes(layout)
    return fmt.record_problem(layout, record.slot, os.pread(fd, stride, record.slot * stride), record.key,
                              record.root, record.checksums)
