"""Other processes' durable records on the same cold.path, read-only (issue 19).

Every store on a cold directory writes one block file of its own and that file's index
(cold_files.py `claim_block_file`); the others are its peers. After a local miss, `PeerFiles.fetch`
looks the chain of keys up in the peers' indexes (sqlite WAL readers see every committed row, live)
and reads each record from the peer's block file, opened read-only. A record is served only when its
header names the row's key, root and checksums and every layer slice matches its checksum: a record
its owner replaced meanwhile, a torn or corrupt one, is a miss (recomputed), never served.

Reads and overwrites of a record are ordered by record locks on its byte range (Linux open file
description locks, so two stores in one process are ordered too; POSIX record locks elsewhere): a reader holds
a shared lock while it preads a record; the owner takes the exclusive lock before it overwrites a
slot that held a durable record (or zeroes its header), so eviction never drops a record while a
peer reads it. Both wait PEER_READ_WAIT_S at most (a reader stopped under a debugger must not stall
the owner's writes); after that the checksums still decide. Peers hold no lock besides.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import struct
import sys
import threading
import time
import urllib.parse

import numpy as np

from ..blocks import KVLayout
from ..compression import codec
from ..errors import ConfigError
from . import cold_format as fmt

log = logging.getLogger(__name__)

PEER_READ_WAIT_S = 0.5  # the longest a read waits for an overwrite of its record, and an overwrite for reads
_KEYS_PER_QUERY = 500  # sqlite's bound parameters per statement stay well under its limit


# Linux's open-file-description locks: they conflict between two fds of one process too (two stores
# in one process), and closing one fd never drops a lock taken through another; classic POSIX
# record locks (per process) elsewhere
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None) if sys.platform.startswith("linux") else None


def _set_lock(fd: int, kind: int, start: int, length: int) -> None:
    if _OFD_SETLK is not None:
        fcntl.fcntl(fd, _OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, start, length, 0))  # struct flock
    else:
        command = {fcntl.F_RDLCK: fcntl.LOCK_SH | fcntl.LOCK_NB, fcntl.F_WRLCK: fcntl.LOCK_EX | fcntl.LOCK_NB,
                   fcntl.F_UNLCK: fcntl.LOCK_UN}[kind]
        fcntl.lockf(fd, command, length, start, os.SEEK_SET)


def record_lock(fd: int, slot: int, stride_bytes: int, exclusive: bool, wait_s: float) -> bool:
    """A record lock on slot `slot`'s record (shared or exclusive); False when not had within `wait_s`."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    deadline = time.monotonic() + wait_s
    while True:
        try:
            _set_lock(fd, kind, slot * stride_bytes, stride_bytes)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)


def record_unlock(fd: int, slot: int, stride_bytes: int) -> None:
    _set_lock(fd, fcntl.F_UNLCK, slot * stride_bytes, stride_bytes)


class PeerFiles:
    """The peers of the block file numbered `own_number` (None: this store writes none) in
    `directory`, for one layout. Thread-safe; never writes a byte."""

    def __init__(self, directory, layout: KVLayout, own_number: int | None):
        self._directory = directory
        self.layout = layout
        self._own = own_number
        self._signature = fmt.layout_signature(layout)
        self._peers: dict[int, _Peer] = {}
        self._refused: set[int] = set()  # peers whose files cannot be used (said once)
        self._lock = threading.Lock()

    def fetch(self, keys: list[bytes], root: bytes) -> list[bytes]:
        """The bytes of the leading run of `keys` that peers hold intact under `root` ([] for none)."""
        if not keys:
            return []
        with self._lock:
            self._refresh()
            found: dict[bytes, tuple[_Peer, int, tuple[int, ...]]] = {}
            for number, peer in list(self._peers.items()):
                try:
                    for slot, key, row_root, checksums in peer.lookup(keys):
                        if row_root == root:
                            found.setdefault(key, (peer, slot, checksums))
                except (sqlite3.Error, OSError) as exc:
                    log.debug("cold peer %s: its index cannot be read now (%s)", peer.name, exc)
                    self._drop(number)
            out = []
            for key in keys:
                hit = found.get(key)
                data = hit[0].read(hit[1], key, root, hit[2]) if hit is not None else None
                if data is None:
                    break
                out.append(data)
            return out

    def numbers(self) -> list[int]:
        """The peers' file numbers seen at the last fetch."""
        with self._lock:
            return sorted(self._peers)

    def _refresh(self) -> None:
        """Open the peers that appeared (a block file with an index), drop those that vanished."""
        directory = self._directory
        try:
            names = os.listdir(directory.fd) if directory.fd is not None else None
        except OSError:  # the store is closing: its directory fd went
            names = None
        if names is None:
            return
        present = set()
        for name in names:
            parsed = fmt.file_number(name)
            if parsed is None or parsed[0] != self._signature or parsed[2] != "blocks" or parsed[1] == self._own:
                continue
            number = parsed[1]
            index_name = fmt.index_file_name(self.layout, number)
            if index_name not in names:
                continue  # nothing persisted there yet
            present.add(number)
            live = index_name + "-wal" in names  # a store writes it (or crashed while it did)
            if number in self._peers and self._peers[number].immutable and live:
                self._drop(number)  # opened while nobody wrote it: read it as a live one now
            if number not in self._peers and number not in self._refused:
                try:
                    self._peers[number] = _Peer(directory, self.layout, number, live)
                except (ConfigError, fmt.FormatError, sqlite3.Error, OSError) as exc:
                    self._refused.add(number)
                    log.warning("cold directory %s: the peer block file %s is not read (%s)", directory.path,
                                fmt.block_file_name(self.layout, number), exc)
        for number in [n for n in self._peers if n not in present]:
            self._drop(number)

    def _drop(self, number: int) -> None:
        peer = self._peers.pop(number, None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        with self._lock:
            for number in list(self._peers):
                self._drop(number)


class _Peer:
    """One peer's block file (read-only fd) and index (a sqlite reader that never writes)."""

    def __init__(self, directory, layout: KVLayout, number: int, live: bool):
        self.layout = layout
        self.name = fmt.block_file_name(layout, number)
        self.stride_bytes = fmt.record_stride_bytes(layout)
        self.fd = directory.open_read_only(self.name)
        try:
            index_name = fmt.index_file_name(layout, number)
            os.close(directory.open_read_only(index_name))  # a regular file of ours alone, not a link
            # read-only: no checkpoint into the peer's database, no second writer of its index; one
            # nobody writes (no -wal) is read immutable, which creates no -wal or -shm beside it
            self.immutable = not live
            uri = f"file:{urllib.parse.quote(directory.file_path(index_name))}?mode=ro" + \
                ("&immutable=1" if self.immutable else "")
            self.db = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=1.0)
            try:
                meta = dict(self.db.execute("SELECT name, value FROM meta").fetchall())
                expected = fmt.index_meta(layout)
                if meta != expected:
                    raise fmt.FormatError(f"its index describes {meta}, expected {expected}")
            except BaseException:
                self.db.close()
                raise
        except BaseException:
            os.close(self.fd)
            raise

    def lookup(self, keys: list[bytes]):
        """(slot, key, root, checksums) of the rows naming any of `keys`."""
        for start in range(0, len(keys), _KEYS_PER_QUERY):
            chunk = keys[start:start + _KEYS_PER_QUERY]
            cursor = self.db.execute("SELECT slot, key, root, checksums FROM records WHERE key IN "
                                     f"({','.join('?' * len(chunk))})", chunk)
            for slot, key, root, checksums in cursor:
                yield slot, bytes(key), bytes(root), tuple(np.frombuffer(checksums, dtype="<u8").tolist())

    def read(self, slot: int, key: bytes, root: bytes, checksums: tuple[int, ...]) -> bytes | None:
        """The block bytes of the record at `slot` when it is the one the row names, intact; else None."""
        layout = self.layout
        locked = record_lock(self.fd, slot, self.stride_bytes, exclusive=False, wait_s=PEER_READ_WAIT_S)
        try:
            data = os.pread(self.fd, self.stride_bytes, slot * self.stride_bytes)
        except OSError:
            return None
        finally:
            if locked:
                record_unlock(self.fd, slot, self.stride_bytes)
        if fmt.record_problem(layout, slot, data, key, root, checksums) is not None:
            return None
        if layout.is_compressed:  # checked packed bytes (and finite scales); the store takes the model's dtype
            packed = np.frombuffer(data, dtype=np.uint8)[:layout.block_bytes]
            if not codec.scales_finite(layout, packed.reshape(layout.num_layers, -1)):
                return None
            return codec.unpack_block_bytes(layout, packed).tobytes()
        return data[:layout.block_bytes]

    def close(self) -> None:
        self.db.close()
        os.close(self.fd)
