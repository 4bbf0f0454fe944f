"""The cold tier's directory and the files in it: ours alone (DESIGN invariant 5).

`open_cold_directory(path)` creates what is missing of `path` (mode 0700, remembering what it
made), opens it and keeps its fd, and refuses a directory that another user could write into.
Many stores (processes) share one directory. Each holds a shared flock on LOCK_NAME for its life
(gc takes it exclusively, so it runs only while no store does; a store of an older tiered_kv, which
held it exclusively, and one of this version never run on one directory together), claims a block
file of its own (`claim_block_file`: the first one no live store holds an exclusive flock on, kept
for the store's life) and reads the others' read-only (cold_peers.py). Every file inside is opened
relative to that fd with
O_NOFOLLOW, so a symlink planted at one of our names is refused, never followed: its target is
neither written, truncated nor chmod'ed. New files are created 0600 with O_EXCL; an existing file
is reused only when it is a regular file of ours that no other user can read or write.

Nothing we did not create is chmod'ed or deleted (the checks and modes: cold_owned.py). `close()` keeps what we made (cold blocks are
durable); `abort()`, for a start that failed, removes exactly what this start created.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time

from ..errors import ColdPathInUseError, ConfigError
from .cold_owned import DIRECTORY_MODE, FILE_MODE, OwnedFile, not_ours_alone, preallocate, undo_umask

LOCK_NAME = ".lock"
_NO_FOLLOW = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_ATTEMPTS = 3
_CLAIM_ATTEMPTS = 4  # exclusive flock tries on a block file before it counts as held (~20 ms)
LOCK_WAIT_S = 10.0  # a store waits this long for the directory's lock (gc, or an older tiered_kv, holding it)


def open_cold_directory(path: str, lock_wait_s: float | None = None) -> "ColdDirectory":
    """The store's cold directory, created, checked and locked (shared; waited for up to
    `lock_wait_s`, by default LOCK_WAIT_S); ConfigError otherwise."""
    return ColdDirectory(path, lock_wait_s=LOCK_WAIT_S if lock_wait_s is None else lock_wait_s)


class ColdDirectory:
    """One store's cold directory, held from start to close (see the module docstring).

    A symlink at `path` itself is followed (it is the user's config); names inside never are.
    """

    def __init__(self, path: str, shared: bool = True, lock_wait_s: float = LOCK_WAIT_S):
        """`shared`: hold the directory's lock shared, as a store (False: gc, which takes it with
        `exclusive_lock`)."""
        self.path = os.path.abspath(path)
        self.fd: int | None = None
        self.created_directories: list[str] = []  # outermost first
        self._created_files: dict[str, tuple[int, int]] = {}  # name -> (st_dev, st_ino) we made
        self._lock: OwnedFile | None = None
        try:
            self._make_missing_directories()
            self.fd = self._open_directory()
            if shared:
                self._lock = self._take_lock(fcntl.LOCK_SH, lock_wait_s)
        except BaseException:
            self.abort()
            raise

    # ---- start -----------------------------------------------------------------------------
    def _make_missing_directories(self) -> None:
        missing = []
        at = self.path
        while not os.path.lexists(at):  # a dangling symlink counts as present: never created through
            missing.append(at)
            parent = os.path.dirname(at)
            if parent == at:
                break
            at = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory, DIRECTORY_MODE)
            except FileExistsError:
                continue  # made by someone else meanwhile: not ours, checked below like any other
            except OSError as exc:
                raise self._path_error(f"which is not a writable directory (cannot create {directory!r}: "
                                       f"{exc.strerror})") from None
            self.created_directories.append(directory)
            try:
                undo_umask(directory)
            except OSError as exc:
                raise self._path_error(f"where the directory {directory!r} it created cannot be opened "
                                       f"({exc.strerror})") from None

    def _open_directory(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise self._path_error(f"which is not a writable directory ({exc.strerror})") from None
        info = os.fstat(fd)
        euid = os.geteuid()
        if self.path in self.created_directories:
            return fd
        problem = None
        if info.st_uid != euid:
            problem = f"a directory owned by uid {info.st_uid}, not by this process's uid {euid}"
        elif info.st_mode & 0o022:
            problem = f"a directory writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
        if problem:
            os.close(fd)
            raise self._path_error(f"which is {problem}; it is left as it is")
        return fd

    def _take_lock(self, mode: int, wait_s: float) -> OwnedFile:
        """A flock (`mode`: LOCK_SH for a store, LOCK_EX for gc) on LOCK_NAME, waited for up to
        `wait_s` (polling): ColdPathInUseError when another process holds it the other way longer."""
        deadline = time.monotonic() + wait_s
        for _ in range(_LOCK_ATTEMPTS):
            lock = self.open_file(LOCK_NAME)
            while True:
                try:
                    fcntl.flock(lock.fd, mode | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        os.close(lock.fd)
                        raise self._path_error(f"whose lock file cannot be locked ({exc.strerror})") from None
                    if time.monotonic() >= deadline:
                        os.close(lock.fd)
                        held = "stores run on it" if mode == fcntl.LOCK_EX else \
                            "another process holds it exclusively (tiered-kv gc, or a store of an older tiered_kv)"
                        raise ColdPathInUseError(
                            f"config key 'cold.path': {self.path!r} is in use: {held}, for over {wait_s:.0f} s; "
                            "allowed: a cold.path no such process holds") from None
                    time.sleep(0.01)
            # a store whose start failed may have removed the name after we opened it: lock the live one
            if self._is_live(LOCK_NAME, lock.fd):
                return lock
            os.close(lock.fd)
        raise self._path_error(f"whose lock file {LOCK_NAME!r} keeps being replaced while we lock it")

    @contextlib.contextmanager
    def exclusive_lock(self, wait_s: float = 0.0):
        """The directory's lock, exclusively (gc): no store runs on it meanwhile, none starts."""
        lock = self._take_lock(fcntl.LOCK_EX, wait_s)
        try:
            yield
        finally:
            os.close(lock.fd)

    def claim_block_file(self, name_of, size_bytes: int, max_files: int) -> tuple[OwnedFile, int]:
        """(the file, its number): the first of `name_of(0..max_files-1)` no live store holds,
        created if missing, flock'ed exclusively until it is closed, preallocated to `size_bytes`
        (see open_preallocated). ColdPathInUseError when every one is held. Two stores claiming at
        once never get one file: the flock decides, and a name that a failed start removed after we
        opened it is never kept."""
        for number in range(max_files):
            name = name_of(number)
            file = self.open_file(name)
            if not self._flock_briefly(file.fd, name) or not self._is_live(name, file.fd):
                # a live store writes this one, or a start that failed removed the name meanwhile
                os.close(file.fd)
                self._created_files.pop(name, None)  # (if we made it, it is another store's now)
                continue
            try:
                preallocate(file, size_bytes)
            except BaseException:
                self.discard(file)
                raise
            return file, number
        raise ColdPathInUseError(
            f"config key 'cold.path': {self.path!r}: all {max_files} block files of this layout are held by running "
            "stores; allowed: fewer stores at once on one cold.path")

    # ---- files -----------------------------------------------------------------------------
    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open_file(self, name: str) -> OwnedFile:
        """Open `name` read-write, creating it 0600 when absent; ConfigError for a symlink or a
        file that is not ours alone."""
        if self.fd is None:
            raise ValueError(f"cold directory {self.path!r} is closed")
        path = self.file_path(name)
        try:
            fd = os.open(name, _NO_FOLLOW | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=self.fd)
        except FileExistsError:
            fd = None
        except OSError as exc:
            raise self._path_error(f"where {name!r} cannot be created ({exc.strerror})") from None
        if fd is not None:
            info = os.fstat(fd)
            self._created_files[name] = (info.st_dev, info.st_ino)
            if stat.S_IMODE(info.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)  # ours: undo a umask that took the owner's bits
            return OwnedFile(name, path, fd, created=True, original_size_bytes=0)
        try:
            fd = os.open(name, _NO_FOLLOW, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(
                    f"config key 'cold.path': {path!r} is a symbolic link; the store never follows links inside "
                    "its directory and left it and its target untouched; allowed: no file of that name (the "
                    "store creates its own) or a regular file it created earlier"
                ) from None
            why = "it is a directory" if exc.errno == errno.EISDIR else exc.strerror
            raise self._foreign_file_error(path, why) from None
        info = os.fstat(fd)
        why = not_ours_alone(info)
        if why:
            os.close(fd)
            raise self._foreign_file_error(path, why)
        return OwnedFile(name, path, fd, created=False, original_size_bytes=info.st_size)

    def open_read_only(self, name: str) -> int:
        """An O_RDONLY fd of `name` (another store's file, read as a peer): a regular file of ours
        alone, never through a link; ConfigError otherwise. Creates nothing."""
        if self.fd is None:
            raise ValueError(f"cold directory {self.path!r} is closed")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise self._foreign_file_error(self.file_path(name), exc.strerror) from None
        why = not_ours_alone(os.fstat(fd))
        if why:
            os.close(fd)
            raise self._foreign_file_error(self.file_path(name), why)
        return fd

    def open_preallocated(self, name: str, size_bytes: int) -> OwnedFile:
        """`open_file(name)` with at least `size_bytes` allocated on disk, so a full disk fails
        now and not mid-chat. When it does not fit: ConfigError naming 'cold.capacity', and the
        file is removed (made now) or cut back to its original size (made earlier)."""
        file = self.open_file(name)
        try:
            preallocate(file, size_bytes)
        except BaseException:
            self.discard(file)
            raise
        return file

    def _flock_briefly(self, fd: int, name: str) -> bool:
        """An exclusive flock on `fd`: True when had. A probe (tiered-kv inspect) holds a shared one
        for microseconds, so a refusal is retried a few times before the file counts as held."""
        for attempt in range(_CLAIM_ATTEMPTS):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise self._path_error(f"where {name!r} cannot be locked ({exc.strerror})") from None
                time.sleep(0.002 * (attempt + 1))
        return False

    def discard(self, file: OwnedFile) -> None:
        """Undo opening `file` in a failed start: remove it if this start made it (while we still
        hold its flock, so no other store can have claimed it meanwhile), else cut it back to the
        size it had (only growth we made is undone); then close it."""
        try:
            if file.created:
                self._remove_created(file.name, held_fd=file.fd)
            elif os.fstat(file.fd).st_size != file.original_size_bytes:
                os.ftruncate(file.fd, file.original_size_bytes)
        finally:
            os.close(file.fd)

    def _remove_created(self, name: str, held_fd: int | None = None) -> None:
        """Unlink `name` if this start made it and it still names that file, and no other process
        holds it (its flock; `held_fd`: ours already holds it): a file another store claimed, or
        the lock file stores hold, stays."""
        identity = self._created_files.pop(name, None)
        if identity is None or self.fd is None or not self._is_live(name, identity):
            return
        if held_fd is not None:
            os.unlink(name, dir_fd=self.fd)
            return
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if self._is_live(name, identity):
                os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass  # held by another process: it is theirs now
        finally:
            os.close(fd)

    def _is_live(self, name: str, fd_or_identity) -> bool:
        """Whether `name` still names the file behind an fd (or a (st_dev, st_ino) pair)."""
        if isinstance(fd_or_identity, int):
            info = os.fstat(fd_or_identity)
            fd_or_identity = (info.st_dev, info.st_ino)
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (info.st_dev, info.st_ino) == fd_or_identity

    # ---- end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the lock file and the directory fd; keep every file (the blocks are durable)."""
        if self._lock is not None:
            os.close(self._lock.fd)  # closing the fd releases the flock
            self._lock = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def abort(self) -> None:
        """For a start that failed: remove the files and directories this start created (files
        first, then directories innermost first, each only while empty), then close. Files other
        tiers still hold open stay readable through their fds until those close."""
        if self.fd is not None:
            for name in [n for n in self._created_files if n != LOCK_NAME]:
                self._remove_created(name)
            if self._lock is not None:  # our shared flock first, or the exclusive test below fails on it
                os.close(self._lock.fd)
                self._lock = None
            self._remove_created(LOCK_NAME)  # only while no other store holds it
        self.close()
        for directory in reversed(self.created_directories):
            try:
                os.rmdir(directory)
            except OSError:
                break  # not empty (someone else's files): it and its parents stay
        self.created_directories = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- messages --------------------------------------------------------------------------
    def _path_error(self, what: str) -> ConfigError:
        return ConfigError(
            f"config key 'cold.path': got {self.path!r}, {what}; allowed: a directory owned by uid {os.geteuid()} "
            "that only its owner can write (chmod go-w), or a path that does not exist yet (it is then created "
            "with mode 0700)"
        )

    def _foreign_file_error(self, path: str, why: str) -> ConfigError:
        return ConfigError(
            f"config key 'cold.path': {path!r} exists but is not a file this store may use ({why}); it is left as "
            f"it is; allowed: no file of that name (the store creates it) or a regular file owned by uid "
            f"{os.geteuid()}, with one link and mode 0600"
        )
