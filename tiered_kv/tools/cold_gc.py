"""`tiered-kv gc`: which records to drop (`choose_drops`, pure policy) and dropping them (`run_gc`).

`run_gc` holds the directory's lock exclusively (ColdDirectory.exclusive_lock) throughout: every
running store holds it shared, so gc runs only while none does, and none starts meanwhile; gc never
drops a record a live process writes or reads. Per
block file, it deletes the dropped rows in one index transaction, then zeroes their headers and
fdatasyncs. That order is safe at every crash point: once the row is gone the record is no longer
durable (a store's slot pools start from the index, and a later write zeroes the header anyway); a
header zeroed under a surviving row could only mean a row dropped at the next open. gc writes only the
index and header bytes of files it named: it never deletes, truncates or grows a file, and never opens
a file of another format version.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..tiers import cold_format as fmt
from ..tiers.cold_files import ColdDirectory
from ..tiers.cold_index import ColdIndex
from .cold_scan import ColdScan, Record, any_block_file_held, open_directory, scan, store_running


class StoreRunning(ValueError):
    """gc needs the directory's writer lock, and a store holds it."""


@dataclass(frozen=True)
class Drop:
    record: Record
    reason: str


def resolve_roots(prefixes: list[str], roots: set[bytes], option: str) -> set[bytes]:
    """The stored roots named by hex prefixes; ValueError for bad hex, no match or an ambiguous one."""
    chosen = set()
    for prefix in prefixes:
        text = prefix.lower()
        if not text or any(c not in "0123456789abcdef" for c in text):
            raise ValueError(f"{option} {prefix!r}: not a hex root key (prefix)")
        matches = {root for root in roots if root.hex().startswith(text)}
        if len(matches) != 1:
            found = "no stored root" if not matches else f"{len(matches)} stored roots"
            raise ValueError(f"{option} {prefix!r} matches {found}; stored: "
                             f"{', '.join(sorted(r.hex()[:16] for r in roots)) or 'none'}")
        chosen |= matches
    return chosen


def choose_drops(records: list[Record], drop_roots: set[bytes] = frozenset(), keep_roots: set[bytes] | None = None,
                 max_bytes: int | None = None, bad: dict[tuple[str, int], str] | None = None) -> list[Drop]:
    """Records to drop: bad ones, those of `drop_roots`, those not of `keep_roots` (when given), then the
    least recently used of the rest until the rest's record bytes fit in `max_bytes`."""
    bad = bad or {}
    drops: dict[tuple[str, int], Drop] = {}
    for record in records:
        where = (record.file, record.slot)
        if where in bad:
            drops[where] = Drop(record, f"bad: {bad[where]}")
        elif record.root in drop_roots:
            drops[where] = Drop(record, "root dropped")
        elif keep_roots is not None and record.root not in keep_roots:
            drops[where] = Drop(record, "root not kept")
    if max_bytes is not None:
        rest = sorted((r for r in records if (r.file, r.slot) not in drops),
                      key=lambda r: (r.last_access, r.file, r.slot))
        total_bytes = sum(r.record_bytes for r in rest)
        for record in rest:
            if total_bytes <= max_bytes:
                break
            drops[(record.file, record.slot)] = Drop(record, "least recently used")
            total_bytes -= record.record_bytes
    return sorted(drops.values(), key=lambda d: (d.record.file, d.record.slot))


def run_gc(path: str, drop_roots=(), keep_roots=(), max_bytes=None, drop_bad=False,
           dry_run=False) -> tuple[ColdScan, list[Drop]]:
    """Scan `path` under its writer lock, choose, and (unless `dry_run`) drop. NotColdDirectory or
    ValueError for bad input, ConfigError when a store holds the lock."""
    dir_fd = open_directory(path)  # a cold directory already: ColdDirectory would create a missing one
    try:
        if store_running(dir_fd):
            raise StoreRunning(f"a store is running on {os.path.abspath(path)!r} (it holds a block file or "
                               "its .lock); stop it before gc")
    finally:
        os.close(dir_fd)
    directory = ColdDirectory(path, shared=False)
    try:
        with directory.exclusive_lock():  # ColdPathInUseError (a ConfigError) should a store start meanwhile
            return _gc_locked(directory, path, drop_roots, keep_roots, max_bytes, drop_bad, dry_run)
    finally:
        directory.close()


def _gc_locked(directory, path, drop_roots, keep_roots, max_bytes, drop_bad, dry_run):
    if any_block_file_held(directory.fd):  # a store of an older tiered_kv holds no shared lock
        raise StoreRunning(f"a store is running on {os.path.abspath(path)!r} (it holds a block file); stop it "
                           "before gc")
    found = scan(path, verify=drop_bad, locked=True)
    roots = {r.root for r in found.records}
    bad = {(f.name, slot): why for f in found.files for slot, why in (f.bad or [])}
    drops = choose_drops(found.records, resolve_roots(list(drop_roots), roots, "--drop-root"),
                         resolve_roots(list(keep_roots), roots, "--keep-root") if keep_roots else None,
                         max_bytes, bad)
    if not dry_run:
        for entry in found.files:
            slots = [d.record.slot for d in drops if d.record.file == entry.name]
            if slots:
                _drop(directory, entry, slots)
    return found, drops


def _drop(directory: ColdDirectory, entry, slots: list[int]) -> None:
    layout = entry.layout
    index = ColdIndex(directory, entry.index_name, fmt.layout_text(layout), synchronous=True)
    index.open()
    try:
        index.apply([], slots, [])  # one transaction; committed (synchronous=FULL) before any header changes
    finally:
        index.close()
    if entry.size_bytes is None:
        return
    file = directory.open_file(entry.name)
    if file.created:  # removed since the scan: leave no file behind
        directory.discard(file)
        return
    try:
        size_bytes, zeros = os.fstat(file.fd).st_size, bytes(fmt.header_bytes(layout))
        for slot in slots:
            at = slot * fmt.record_stride_bytes(layout) + fmt.header_offset_bytes(layout)
            if at + len(zeros) <= size_bytes:  # never grow the file
                os.pwrite(file.fd, zeros, at)
        os.fdatasync(file.fd)
    finally:
        os.close(file.fd)
