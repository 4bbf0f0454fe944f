"""Files of ours alone (DESIGN invariant 5): what ColdDirectory checks before it uses a file or a
directory, and how it sizes one.

A directory we create gets exactly DIRECTORY_MODE and a file FILE_MODE, whatever the umask took
away; a file we did not create is used only when it is a regular file of this uid, with one link,
that no other user can read or write (`not_ours_alone` says why not). `preallocate` reserves a
file's bytes on disk at start, so a full disk fails then (ConfigError naming 'cold.capacity'),
never mid-chat.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from ..errors import ConfigError
from ..hw import block_io

DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_CAPACITY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class OwnedFile:
    """An open file inside a ColdDirectory. `created`: this start made it (and may remove it);
    `original_size_bytes`: its size when opened, restored if sizing it fails."""

    name: str
    path: str
    fd: int
    created: bool
    original_size_bytes: int


def undo_umask(directory: str) -> None:
    """A directory we just made gets exactly DIRECTORY_MODE, whatever the umask took away."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != DIRECTORY_MODE:
            os.fchmod(fd, DIRECTORY_MODE)
    finally:
        os.close(fd)


def not_ours_alone(info: os.stat_result) -> str | None:
    """Why the file `info` describes is not ours alone (so it may not be used), or None."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    if info.st_mode & 0o077:
        return f"group or others may access it (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} hard links, so writing it would change another file"
    return None


def preallocate(file: OwnedFile, size_bytes: int) -> None:
    if size_bytes <= 0:
        return
    info = os.fstat(file.fd)
    needed_bytes = max(0, size_bytes - info.st_blocks * 512)  # a reused file may already hold some
    disk = os.fstatvfs(file.fd)
    free_bytes = disk.f_bavail * disk.f_frsize
    if needed_bytes > free_bytes:
        raise _capacity_error(file, size_bytes, free_bytes, f"{needed_bytes} more bytes needed")
    try:
        block_io.preallocate(file.fd, size_bytes)
    except OSError as exc:
        if exc.errno in _CAPACITY_ERRNOS:
            raise _capacity_error(file, size_bytes, free_bytes, exc.strerror) from None
        raise ConfigError(
            f"config key 'cold.path': cannot preallocate {size_bytes} bytes for {file.path!r} ({exc.strerror}); "
            "allowed: a directory on a local file system that supports posix_fallocate"
        ) from None


def _capacity_error(file: OwnedFile, size_bytes: int, free_bytes: int, why: str) -> ConfigError:
    return ConfigError(
        f"config key 'cold.capacity': {size_bytes} bytes do not fit on the disk of {file.path!r} "
        f"({free_bytes} bytes free there; {why}); allowed: at most the free space there"
    )
