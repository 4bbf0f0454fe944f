"""The calibration record: `<cold.path>/compression.json`, what `compression: auto` measured on each
model on this machine, so a restart (a new process, a new store on the same cold.path) reuses it.

JSON only, never pickle: `{"format": 1, "entries": {key: entry}}`, one entry per model fingerprint,
calibration text, token count, block size and codec version (`entry_key`). An entry holds the
measured agreement and perplexity ratio per mode, the floor and the mode chosen last, the seconds
the calibration took and when it ran (`time`, seconds since the epoch).

The file lives in the store's cold directory (created 0700 by the store, tiers/cold_files.py) and is
ours alone (DESIGN invariant 5): opened relative to the directory with O_NOFOLLOW, written whole to
a temporary file of ours (0600, O_EXCL), fsynced, then renamed over the old one (`os.replace`), the
directory fsynced; writers on one machine take an flock on the directory around read-modify-write.
A file that is not JSON, not ours alone, or holds a value out of range is never trusted: `read`
says why (the caller warns once and calibrates again), and the next write replaces it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import stat
import threading
import time
from typing import Any

from ..tiers.cold_owned import FILE_MODE, not_ours_alone
from . import CALIBRATION_METHOD

RECORD_NAME = "compression.json"
RECORD_FORMAT = 1
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def entry_key(root_hex: str, text: str, tokens: int, block_size: int, codec_version: int) -> str:
    """The key of one model's entry: everything its figures depend on (the fingerprint's root names
    the weights, config, block size and KV dtype; the text and token count what was read)."""
    return (f"{root_hex}|text={text}|tokens={tokens}|block_size={block_size}|codec=v{codec_version}"
            f"|method={CALIBRATION_METHOD}")


def _is_share(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0


def _is_ratio(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value) and value > 0)


def entry_problem(entry: Any, modes: tuple[str, ...]) -> str | None:
    """Why `entry` (read from the file) cannot be trusted, or None."""
    if not isinstance(entry, dict):
        return "an entry is not a mapping"
    agreement, ppl = entry.get("agreement"), entry.get("ppl_ratio")
    if not isinstance(agreement, dict) or not isinstance(ppl, dict):
        return "an entry has no 'agreement' and 'ppl_ratio' mappings"
    for mode, value in agreement.items():
        if mode not in modes:
            return f"agreement of an unknown mode {mode!r}"
        if not _is_share(value):
            return f"agreement {value!r} of {mode!r} is not a number in [0, 1]"
        if not _is_ratio(ppl.get(mode)):
            return f"perplexity ratio {ppl.get(mode)!r} of {mode!r} is not a positive number"
    tokens = entry.get("tokens_used", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return f"tokens_used {tokens!r} is not a count"
    seconds = entry.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        return f"seconds {seconds!r} is not a number >= 0"
    return None


class Record:
    """The record file of one cold directory (`dir_fd`, the store's open directory; its path for
    messages). Read and written whole; never raises for what the file holds or for a directory it
    cannot write: `read` and `write` return why not (a sentence) instead."""

    def __init__(self, dir_fd: int, dir_path: str):
        self.dir_fd, self.path = dir_fd, os.path.join(dir_path, RECORD_NAME)

    def read(self, modes: tuple[str, ...]) -> tuple[dict[str, dict], str | None]:
        """(the entries, why the file was not trusted or None). A missing file is no entries, no problem."""
        entries, problem, _ = self._read(modes)
        return entries, problem

    def _read(self, modes: tuple[str, ...]) -> tuple[dict[str, dict], str | None, bool]:
        """(entries, problem, whether a write may replace the file: it is ours, or absent)."""
        try:
            fd = os.open(RECORD_NAME, _OPEN_READ, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return {}, None, True
        except OSError as exc:
            return {}, f"cannot open it ({exc.strerror})", False
        try:
            why = not_ours_alone(os.fstat(fd))
            if why:
                return {}, why, False
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            data = json.loads(b"".join(chunks).decode("utf-8"))
        except OSError as exc:
            return {}, f"cannot read it ({exc.strerror})", False
        except (UnicodeDecodeError, ValueError) as exc:
            return {}, f"it is not JSON ({exc})", True
        finally:
            os.close(fd)
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or not isinstance(data.get("entries"), dict):
            return {}, f"it is not a record of format {RECORD_FORMAT}", True
        for key, entry in data["entries"].items():
            why = entry_problem(entry, modes)
            if why:
                return {}, f"entry {key!r}: {why}", True
        return data["entries"], None, True

    def write(self, key: str, entry: dict, modes: tuple[str, ...]) -> str | None:
        """Add or replace `key`'s entry (the others kept when the file is sound; a file not trusted
        is replaced); None, or why it could not be written."""
        try:
            lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError as exc:
            return f"cannot open the directory ({exc.strerror})"
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # writers on this machine, one at a time (released at close)
            entries, problem, replaceable = self._read(modes)
            if not replaceable:
                return f"the file there is left as it is: {problem}"
            text = json.dumps({"format": RECORD_FORMAT, "entries": {**entries, key: entry}}, indent=1,
                              sort_keys=True, allow_nan=False)
            return self._replace(text.encode("utf-8"))
        except (OSError, ValueError) as exc:
            return f"cannot write it ({getattr(exc, 'strerror', None) or exc})"
        finally:
            os.close(lock_fd)

    def _replace(self, data: bytes) -> str | None:
        temp = f".{RECORD_NAME}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        try:
            fd = os.open(temp, _OPEN_NEW, FILE_MODE, dir_fd=self.dir_fd)
        except OSError as exc:
            return f"cannot create a file there ({exc.strerror})"
        try:
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
                    os.fchmod(fd, FILE_MODE)  # ours, just made: undo what a umask took
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, RECORD_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            temp = None
            os.fsync(self.dir_fd)  # the rename is durable too
        except OSError as exc:
            return f"cannot write it ({exc.strerror})"
        finally:
            if temp is not None:
                try:
                    os.unlink(temp, dir_fd=self.dir_fd)  # ours: made above
                except OSError:
                    pass
        return None

