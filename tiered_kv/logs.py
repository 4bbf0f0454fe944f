"""Logging helpers shared by the library's modules; each module logs to `logging.getLogger(__name__)`,
under the "tiered_kv" logger (which has a NullHandler: an application, or `tiered-kv`'s
--verbose / --quiet, decides what is shown).

`log_once`: a choice made at start (no CUDA, no NVML, no kvikio) is logged once per process, not
once per store. `Throttle`: an event that may repeat every batch (a full disk, a full cache) warns
at most once per interval; the repeats in between go to DEBUG and the next warning counts them.
`error_name`: "ENOSPC" for an OSError, sqlite's name (e.g. "SQLITE_FULL") for a sqlite3 error.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

THROTTLE_INTERVAL_S = 60.0

_once_lock = threading.Lock()
_logged_once: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, level: int, msg: str, *args) -> bool:
    """Log `msg % args` unless this logger already logged that very text in this process.
    True when it was logged now."""
    key = (logger.name, msg % args if args else msg)
    with _once_lock:
        if key in _logged_once:
            return False
        _logged_once.add(key)
    logger.log(level, msg, *args, stacklevel=2)
    return True


def forget_logged_once() -> None:
    """Let every `log_once` message be logged again (tests)."""
    with _once_lock:
        _logged_once.clear()


def error_name(error: BaseException) -> str:
    """A short name for what failed: the errno's symbol of an OSError ("ENOSPC"), sqlite's error
    name for a sqlite3 error ("SQLITE_FULL"), else the exception's type."""
    number = getattr(error, "errno", None)
    if isinstance(error, OSError) and number:
        return errno.errorcode.get(number, f"errno {number}")
    return getattr(error, "sqlite_errorname", None) or type(error).__name__


class Throttle:
    """At most one WARNING per `interval_s` for one kind of event; repeats in between are logged at
    DEBUG, and the next warning says how many there were."""

    def __init__(self, logger: logging.Logger, interval_s: float = THROTTLE_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._next_s = 0.0  # monotonic time from which the next event warns again
        self._quiet = 0  # events logged at DEBUG since the last warning

    def warning(self, msg: str, *args) -> bool:
        """True when this event was logged as a warning."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_s:
                self._quiet += 1
                quiet = None
            else:
                quiet, self._quiet = self._quiet, 0
                self._next_s = now + self.interval_s
        if quiet is None:
            self.logger.debug(msg, *args, stacklevel=2)
            return False
        if quiet:
            msg += " (and %d more like it since the last warning, logged at DEBUG)"
            args = (*args, quiet)
        self.logger.warning(msg, *args, stacklevel=2)
        return True
