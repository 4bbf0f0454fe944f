"""The remote section of a config: a shared tier on Redis / Valkey below cold (tiered_kv/remote/)."""
from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .checks import _check_compression, _choices, _error, _is_int

REMOTE_SCHEMES = ("redis", "rediss", "unix")
REMOTE_WRITE_MODES = ("through", "off")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9_.:/-]{0,64}")


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """A shared remote tier below cold on Redis or Valkey (tiered_kv/remote/); off while `url` is "".

    `url`: redis://host:port/db, rediss://host:port/db (TLS) or unix:///path/to/socket; it may
    not carry a password. `cluster`: a Redis Cluster / Valkey cluster (the url names one node).
    `username` and `password_env` (the NAME of an environment variable holding the password,
    never the password itself): AUTH. `key_prefix` starts every key. `ttl` seconds (0: keys never
    expire). `write`: through (full verified blocks are written behind, off the decode path) or
    off (read only). `timeout_ms` bounds connecting and each socket read (not a whole pipelined
    trip, which may carry hundreds of blocks). `required`: fail at start when the
    server cannot be reached (else warn and run on the local tiers, retrying with backoff)."""
    url: str = ""
    cluster: bool = False
    username: str = ""
    password_env: str = ""
    key_prefix: str = "tkv:"
    ttl: int = 0
    write: str = "through"
    timeout_ms: int = 500
    required: bool = False
    compression: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise _error("remote.url", self.url, "a redis://, rediss:// or unix:// URL, or '' (off)")
        if self.url:
            _check_remote_url(self.url, self.cluster)
        for name in ("cluster", "required"):
            if not isinstance(getattr(self, name), bool):
                raise _error(f"remote.{name}", getattr(self, name), "true or false")
        if not isinstance(self.username, str):
            raise _error("remote.username", self.username, "a string ('' for none)")
        if not isinstance(self.password_env, str) or (self.password_env and not _ENV_NAME.fullmatch(self.password_env)):
            raise _error("remote.password_env", self.password_env,
                         "the name of an environment variable holding the password (e.g. REDIS_PASSWORD), or ''")
        if self.password_env and self.password_env not in os.environ:
            raise ConfigError(f"config key 'remote.password_env': names {self.password_env!r}, which is not set in "
                              "the environment; allowed: the name of a set variable holding the password, or ''")
        if not isinstance(self.key_prefix, str) or not _KEY_PREFIX.fullmatch(self.key_prefix):
            raise _error("remote.key_prefix", self.key_prefix, "up to 64 of A-Z a-z 0-9 _ . : / -")
        if not (_is_int(self.ttl) and self.ttl >= 0):
            raise _error("remote.ttl", self.ttl, "an integer >= 0 (seconds; 0: keys never expire)")
        if self.write not in REMOTE_WRITE_MODES:
            raise _error("remote.write", self.write, _choices(REMOTE_WRITE_MODES))
        if not (_is_int(self.timeout_ms) and 1 <= self.timeout_ms <= 60_000):
            raise _error("remote.timeout_ms", self.timeout_ms, "an integer from 1 to 60000 (milliseconds)")
        _check_compression("remote", self.compression)

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def password(self) -> str | None:
        """The password, read from the environment now (never stored in the config)."""
        return os.environ.get(self.password_env) if self.password_env else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_remote_url(url: str, cluster: bool) -> None:
    allowed = "redis://host:port/db, rediss://host:port/db (TLS) or unix:///path/to/socket"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ConfigError(f"config key 'remote.url': got {url!r}, malformed ({error}); allowed: {allowed}") from None
    if parts.scheme not in REMOTE_SCHEMES:
        raise ConfigError(f"config key 'remote.url': got {url!r}, unknown scheme {parts.scheme!r}; allowed: {allowed}")
    if parts.password is not None:
        raise ConfigError("config key 'remote.url': carries a password; allowed: a URL without one (put the password "
                          "in an environment variable and name it in remote.password_env)")
    if parts.scheme == "unix":
        if parts.netloc.rpartition("@")[2] or not parts.path:
            raise ConfigError(f"config key 'remote.url': got {url!r}; allowed: unix:///absolute/path/to/socket")
        if cluster:
            raise ConfigError("config key 'remote.cluster': true with a unix:// URL; allowed: a cluster is reached "
                              "over redis:// or rediss://")
        return
    if not parts.hostname:
        raise ConfigError(f"config key 'remote.url': got {url!r}, no host; allowed: {allowed}")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise ConfigError(f"config key 'remote.url': got {url!r}, database {database!r}; allowed: a number "
                          f"after the port (redis://host:6379/0)")
    if port == 0:
        raise ConfigError(f"config key 'remote.url': got {url!r}, port 0; allowed: a port from 1 to 65535")
