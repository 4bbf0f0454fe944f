"""The connection to the remote server: pipelined gets and sets, timeouts, backoff.

One `RemoteClient` per store, shared by the thread that looks blocks up (a bank's attach) and
the writer thread (redis-py clients are thread safe: each command takes a pooled connection).
`remote.timeout_ms` bounds connecting and every socket read (each reply's bytes must keep
coming), not a whole pipelined trip: fetching 256 blocks of 720 KiB takes ~0.4 s on localhost. A failure (server down, timeout, a reply
that is not what was asked) never raises to the caller: it counts, warns (throttled), marks the
server down for a backoff that doubles from 0.5 s to 30 s, and the caller gets a miss / a
dropped write. While down, calls return at once without touching the network; the first call
after the backoff tries again. Only `connect()` at start raises: a wrong password always
(ConfigError naming remote.url), an unreachable server when `remote.required` is true.
"""

from __future__ import annotations

import logging
import time

from ..config import RemoteConfig
from ..errors import ConfigError
from ..logs import Throttle

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


def _redis():
    try:
        import redis
        import redis.cluster
    except ImportError:
        raise ConfigError("config key 'remote.url' is set but the redis client is not installed; "
                          "allowed: pip install 'tiered_kv[remote]' (redis-py), or remove remote.url") from None
    return redis


class RemoteClient:
    def __init__(self, cfg: RemoteConfig, metrics):
        self.cfg = cfg
        self.metrics = metrics
        self._redis = _redis()
        self._client = None
        self._down_until = 0.0
        self._backoff_s = BACKOFF_FIRST_S
        self._warnings = Throttle(log)
        self.last_error: str | None = None

    # ---- connecting ----------------------------------------------------------------------------
    def _make_client(self):
        redis, cfg = self._redis, self.cfg
        timeout_s = cfg.timeout_ms / 1000
        common = dict(username=cfg.username or None, password=cfg.password(), socket_timeout=timeout_s,
                      socket_connect_timeout=timeout_s, retry_on_timeout=False)
        if cfg.cluster:
            return redis.cluster.RedisCluster.from_url(cfg.url, **common)
        return redis.Redis.from_url(cfg.url, **common)

    def connect(self) -> bool:
        """At store start: PING. True when the server answers. A wrong password raises ConfigError;
        an unreachable server raises it too when `remote.required`, else warns and returns False
        (the store runs on its local tiers; later calls retry after the backoff)."""
        redis = self._redis
        try:
            self._client = self._make_client()
            self._client.ping()
            log.info("remote tier: connected to %s", self.cfg.url)
            return True
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as error:
            self._client = None
            raise ConfigError(f"config key 'remote.url': {self.cfg.url} refused the credentials ({error}); "
                              "allowed: a username (remote.username) and a password (the variable named by "
                              "remote.password_env) the server accepts") from None
        except (redis.RedisError, OSError) as error:
            if self.cfg.required:
                raise ConfigError(f"config key 'remote.url': cannot reach {self.cfg.url} ({error}) and "
                                  "remote.required is true; allowed: a reachable server, or remote.required: "
                                  "false to run on the local tiers") from None
            self._failed("connect", error)
            log.warning("remote tier: cannot reach %s (%s); running on the local tiers, retrying in the "
                        "background", self.cfg.url, error)
            return False

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _ready(self) -> bool:
        if self.is_down:
            return False
        if self._client is None:
            try:
                self._client = self._make_client()
            except (self._redis.RedisError, OSError) as error:
                self._failed("connect", error)
                return False
        return True

    def _failed(self, op: str, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        self.metrics.remote_errors.inc((op,))
        self._down_until = time.monotonic() + self._backoff_s
        self._warnings.warning("remote tier %s: %s failed (%s); local tiers only for %.1f s, then retrying",
                               self.cfg.url, op, self.last_error, self._backoff_s)
        self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)

    def _succeeded(self) -> None:
        if self._backoff_s != BACKOFF_FIRST_S:
            log.info("remote tier %s: reachable again", self.cfg.url)
        self._backoff_s = BACKOFF_FIRST_S

    # ---- round trips ---------------------------------------------------------------------------
    def get_many(self, keys: list[bytes]) -> list[bytes | None] | None:
        """The values of `keys` in one pipelined round trip (None per missing key), or None when
        the server is down or the trip failed."""
        if not keys or not self._ready():
            return None
        seconds = self.metrics.remote_seconds
        start = seconds.start()
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            values = pipe.execute()
        except (self._redis.RedisError, OSError) as error:
            self._failed("get", error)
            return None
        seconds.stop(("get",), start)
        self._succeeded()
        return values

    def set_many(self, items: list[tuple[bytes, bytes]]) -> bool:
        """SET every (key, value) in one pipelined round trip, with the configured TTL. False when
        the server is down or the trip failed (the writes are dropped: blocks stay local)."""
        if not items or not self._ready():
            return False
        seconds = self.metrics.remote_seconds
        start = seconds.start()
        ttl = self.cfg.ttl or None
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=ttl)
            pipe.execute()
        except (self._redis.RedisError, OSError) as error:
            self._failed("set", error)
            return False
        seconds.stop(("set",), start)
        self._succeeded()
        return True

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing anyway
                pass
            self._client = None
