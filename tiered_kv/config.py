"""Typed, validated configuration for tiered_kv (policy code: no torch here).

A `Config` is a tree of frozen dataclasses. Every value is checked when an object is built
(`__post_init__`), so code holding a `Config` never re-validates; `load_config` builds one from
a YAML file, a dict or an existing `Config`. Anything wrong raises `ConfigError` naming the key
path, the value and what is allowed; errors from a file are prefixed with its path.

`block_size` is an int, or "auto": then `block_size_auto` picks it from the expected context length
by class thresholds, once, when the config is built (a store's slab layout serves all its chats, so
the size cannot follow each chat). Downstream `config.block_size` is always the resolved int;
`config.block_size_spec` keeps what was asked (16, or "auto").

Capacities are sizes ("256MiB") or block counts (`capacity_blocks`). A block's byte size depends
on the model, which the config does not know, so each tier turns its capacity into a block count
with `resolve_blocks(block_bytes)` once the caller knows it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
import re
import urllib.parse
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Mapping

import yaml

from .compression import MODES
from .errors import ConfigError

__all__ = ["ALLOWED_BACKENDS", "ALLOWED_COPY_ENGINES", "ALLOWED_POLICIES", "BlockSizeAutoConfig", "ColdConfig",
           "Config", "CopiesConfig", "HotConfig", "MetricsConfig", "RemoteConfig", "SchedulerConfig", "WarmConfig", "load_config", "parse_size"]

ALLOWED_BACKENDS = ("auto", "posix", "kvikio")
ALLOWED_ADMIT = ("published", "reused", "all")  # cold.admit: which blocks get a durable copy
ALLOWED_POLICIES = ("lru", "lfu", "fifo", "ali")
RESTORE_MODES = ("auto", "always")  # scheduler.restore (scheduler/restore.py)
ALLOWED_PINNED = ("auto", "true", "false")
ALLOWED_WARM_LAYOUTS = ("auto", "records", "paged")
ALLOWED_COPY_ENGINES = ("auto", "sync", "thread")
ALLOWED_COMPRESSION = MODES  # warm/cold/remote.compression (compression/)
MAX_COPY_DELAY_US = 1_000_000
MAX_BLOCK_SIZE_TOKENS = 1024
BLOCK_SIZE_AUTO = "auto"
_BLOCK_SIZE_ALLOWED = f"a power of two from 1 to {MAX_BLOCK_SIZE_TOKENS} (tokens)"

_UNIT_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")
_SIZE_ALLOWED = ("a byte count >= 0 or a size like '64MiB', '1.5GiB', '100MB' "
                 "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)")
_CUDA_INDEX_RE = re.compile(r"cuda:[0-9]+")


def _error(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key {key!r}: got {value!r}; allowed: {allowed}")


def _check_compression(section: str, value: Any) -> None:
    if not isinstance(value, str) or value not in ALLOWED_COMPRESSION:
        raise _error(f"{section}.compression", value,
                     _choices(ALLOWED_COMPRESSION) + " ('none' keeps the model's dtype, bitwise exact; the others "
                     "store a block in fewer bytes, with scales: see tiered-kv quality)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML `true` is not a count


def _is_share(value: Any) -> bool:
    """A number in [0, 1] (YAML booleans are not numbers here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and 0.0 <= value <= 1.0)


def _is_block_size(value: Any) -> bool:
    return _is_int(value) and 1 <= value <= MAX_BLOCK_SIZE_TOKENS and value & (value - 1) == 0


def _choices(options: tuple[str, ...]) -> str:
    quoted = [repr(option) for option in options]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def parse_size(text: int | str, key: str = "size") -> int:
    """Return the byte count of `text`: an int, or a string like "64MiB", "64 mib", "1.5GiB", "4096".

    Units are case-insensitive; KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.
    The result must be a whole number of bytes >= 0. Raises ConfigError naming `key` otherwise.
    """
    if _is_int(text) and text >= 0:
        return text
    if isinstance(text, str):
        match = _SIZE_RE.fullmatch(text.strip().lower())
        if match and match.group(2) in _UNIT_BYTES:
            num_bytes = Fraction(match.group(1)) * _UNIT_BYTES[match.group(2)]  # exact: no float rounding
            if num_bytes.denominator == 1:
                return int(num_bytes)
    raise _error(key, text, _SIZE_ALLOWED)


@dataclass(frozen=True, kw_only=True)
class _TierConfig:
    """Capacity of one tier: exactly one of `capacity_bytes` / `capacity_blocks` is set after init.

    Giving neither selects the tier's DEFAULT_CAPACITY_BYTES; giving both is an error.
    """
    capacity_bytes: int | None = None
    capacity_blocks: int | None = None
    # the background mover demotes by policy once the tier is fuller than `high_watermark`
    # (a share of its capacity), down to `low_watermark`; 1.0 and 1.0 switch it off for the tier
    high_watermark: float | None = None
    low_watermark: float | None = None

    SECTION: ClassVar[str] = ""
    DEFAULT_WATERMARKS: ClassVar[tuple[float, float]] = (1.0, 1.0)
    DEFAULT_CAPACITY_BYTES: ClassVar[int] = 0
    MIN_BLOCKS: ClassVar[int] = 0  # hot must hold a block; warm/cold may be 0 (tier disabled)

    def __post_init__(self) -> None:
        section = self.SECTION
        if self.capacity_bytes is None and self.capacity_blocks is None:
            object.__setattr__(self, "capacity_bytes", self.DEFAULT_CAPACITY_BYTES)
        elif self.capacity_bytes is not None and self.capacity_blocks is not None:
            raise ConfigError(
                f"config keys '{section}.capacity' and '{section}.capacity_blocks': got both "
                f"({self.capacity_bytes!r} bytes and {self.capacity_blocks!r} blocks); allowed: one of them")
        if self.capacity_blocks is not None:
            if not (_is_int(self.capacity_blocks) and self.capacity_blocks >= self.MIN_BLOCKS):
                raise _error(f"{section}.capacity_blocks", self.capacity_blocks,
                             f"an integer >= {self.MIN_BLOCKS}")
        else:
            min_bytes = 1 if self.MIN_BLOCKS else 0  # whole blocks are checked by resolve_blocks
            if not (_is_int(self.capacity_bytes) and self.capacity_bytes >= min_bytes):
                allowed = "a size > 0 (the hot tier cannot be disabled)" if min_bytes else \
                    "a size >= 0 (0 disables the tier)"
                raise _error(f"{section}.capacity", self.capacity_bytes, allowed)
        high, low = self.DEFAULT_WATERMARKS
        for name, default in (("high_watermark", high), ("low_watermark", low)):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not _is_share(value):
                raise _error(f"{section}.{name}", value, "a number from 0 to 1 (a share of the tier's capacity)")
        if self.low_watermark > self.high_watermark:
            raise ConfigError(
                f"config key '{section}.low_watermark': got {self.low_watermark!r}, above "
                f"'{section}.high_watermark' {self.high_watermark!r}; allowed: low_watermark <= high_watermark")

    def resolve_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` bytes this tier holds: capacity_blocks if set, else
        capacity_bytes // block_bytes. Raises ConfigError if that leaves hot with no block."""
        if not (_is_int(block_bytes) and block_bytes > 0):
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        num_blocks = self.capacity_bytes // block_bytes
        if num_blocks < self.MIN_BLOCKS:
            raise _error(f"{self.SECTION}.capacity", self.capacity_bytes,
                         f"at least one block ({block_bytes} bytes for this model)")
        return num_blocks

    def to_dict(self) -> dict[str, Any]:
        """The YAML form of this section (capacity as an exact byte count)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["capacity"] = out.pop("capacity_bytes")
        return {key: value for key, value in out.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class HotConfig(_TierConfig):
    """Hot tier: paged blocks on the compute device. `device` "auto" means cuda if present, else cpu."""
    device: str = "auto"

    SECTION: ClassVar[str] = "hot"
    DEFAULT_CAPACITY_BYTES: ClassVar[int] = 512 * 2**20
    DEFAULT_WATERMARKS: ClassVar[tuple[float, float]] = (0.9, 0.8)
    MIN_BLOCKS: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.device, str) and
                (self.device in ("auto", "cpu", "cuda") or _CUDA_INDEX_RE.fullmatch(self.device))):
            raise _error("hot.device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")


@dataclass(frozen=True, kw_only=True)
class WarmConfig(_TierConfig):
    """Warm tier: a host-RAM slab. `pinned` "auto" page-locks it only when CUDA exists.
    `layout`: "records" keeps each block one contiguous record (what DMA to a GPU and the cold
    tier's files want); "paged" lays it out as the hot tier is (`[L, 2, H, slots * bs, D]`), so
    attention on the CPU reads a run of warm blocks in place, as a view; "auto": paged when the
    hot tier is on the CPU, records otherwise.

    YAML booleans for `pinned` are normalized to the strings "true" / "false".
    """
    pinned: str = "auto"
    layout: str = "auto"
    compression: str = "none"

    SECTION: ClassVar[str] = "warm"
    DEFAULT_CAPACITY_BYTES: ClassVar[int] = 2 * 2**30
    DEFAULT_WATERMARKS: ClassVar[tuple[float, float]] = (0.95, 0.85)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.pinned, bool):
            object.__setattr__(self, "pinned", "true" if self.pinned else "false")
        if self.pinned not in ALLOWED_PINNED:
            raise _error("warm.pinned", self.pinned, _choices(ALLOWED_PINNED) + " (or a YAML boolean)")
        if self.layout not in ALLOWED_WARM_LAYOUTS:
            raise _error("warm.layout", self.layout, _choices(ALLOWED_WARM_LAYOUTS))
        _check_compression("warm", self.compression)
        if self.compression != "none" and self.layout == "paged":
            raise ConfigError(f"config keys 'warm.layout' and 'warm.compression': got 'paged' with "
                              f"{self.compression!r}; allowed: 'records' or 'auto' with a compressed warm tier "
                              "(attention reads a paged slab in place, which compressed blocks cannot be)")


@dataclass(frozen=True, kw_only=True)
class ColdConfig(_TierConfig):
    """Cold tier: preallocated file(s) of block slots under `path` (after ~ and $VAR expansion).

    The path is neither created nor checked here; the store does that when it starts.
    `fsync` makes writes durable before the index records them. `write_behind_s`: a published block
    in hot or warm gets a durable copy in cold within this many seconds (0: off; a crash then loses
    what was above cold). `admit`: which blocks get one: "published" (every block this process
    computed and verified), "reused" (only once a second turn or chat read it: spares the drive),
    "all" (also blocks that came from another process or the remote tier).
    """
    path: str = "~/.cache/tiered_kv/cold"
    backend: str = "auto"
    fsync: bool = True
    write_behind_s: float = 1.0
    admit: str = "published"
    compression: str = "none"

    SECTION: ClassVar[str] = "cold"
    DEFAULT_CAPACITY_BYTES: ClassVar[int] = 8 * 2**30

    def __post_init__(self) -> None:
        super().__post_init__()
        path = os.fspath(self.path) if isinstance(self.path, os.PathLike) else self.path
        if not (isinstance(path, str) and path.strip()):
            raise _error("cold.path", self.path, "a non-empty directory path (~ and $VARS are expanded)")
        object.__setattr__(self, "path", os.path.expanduser(os.path.expandvars(path)))
        if self.backend not in ALLOWED_BACKENDS:
            raise _error("cold.backend", self.backend, _choices(ALLOWED_BACKENDS))
        if not isinstance(self.fsync, bool):
            raise _error("cold.fsync", self.fsync, "true or false")
        if isinstance(self.write_behind_s, bool) or not isinstance(self.write_behind_s, (int, float)) \
                or not 0 <= self.write_behind_s <= 3600:
            raise _error("cold.write_behind_s", self.write_behind_s,
                         "a number of seconds from 0 (off) to 3600")
        object.__setattr__(self, "write_behind_s", float(self.write_behind_s))
        if self.admit not in ALLOWED_ADMIT:
            raise _error("cold.admit", self.admit, _choices(ALLOWED_ADMIT))
        _check_compression("cold", self.compression)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the MemScheduler places blocks (policy code: see tiered_kv/scheduler/).

    Signals: ALI (access locality index) = the share of the last `ali_window` store steps that
    read a block; a block belongs hot above `ali_hot`, warm above `ali_warm`, cold otherwise.
    BS (link saturation, 0..1): above `bs_threshold`, optional background moves wait. CS (cost
    sensitivity, 0..1, per chat: `CacheBank(..., cost_sensitivity=)`, else
    `default_cost_sensitivity`) adds `cs_weight * CS` to a block's value under every policy (in
    the policy's unit: times `ali_window` for the step-valued ones; log2 turn heat under `ali`,
    where 0.5 is worth 8 turns of decay at the default half-life), so high-CS chats stay hot
    longer and are the last victims. `lfu` (the default) ages its counts and `ali` ranks chats
    by turn heat: see tiered_kv/scheduler/access_log.py.
    """
    policy: str = "lfu"
    ali_window: int = 100  # store steps
    ali_hot: float = 0.7
    ali_warm: float = 0.3
    bs_threshold: float = 0.8
    cs_weight: float = 0.5
    default_cost_sensitivity: float = 0.5
    idle_steps: int = 1000  # a chat unread this many store steps has its hot blocks demoted; 0: never
    half_life_turns: float = 16.0  # `ali`: a chat's turn heat halves every this many turns of the store
    lfu_half_life_turns: float = 16.0  # `lfu`: a read counts half after this many turns of the store
    ali_promote: bool = False  # `ali`: the mover also brings up blocks read lately whose ALI says hot
    restore: str = "always"  # auto: a turn restores only the stored prefix that loads faster than it recomputes
    background: bool = True  # run the background mover (prefetch, watermark demotion, compaction)
    mover_interval_s: float = 0.02  # how often the mover looks for work when nobody wakes it
    max_fragmentation: float = 0.5  # hot pool: 1 - largest free run / free slots, above which it repacks
    min_contiguity: float = 0.9  # per chat: share of its hot blocks in one run, below which it repacks

    _SHARES: ClassVar[tuple[str, ...]] = ("ali_hot", "ali_warm", "bs_threshold", "cs_weight",
                                          "default_cost_sensitivity", "max_fragmentation", "min_contiguity")

    def __post_init__(self) -> None:
        if self.policy not in ALLOWED_POLICIES:
            raise _error("scheduler.policy", self.policy, _choices(ALLOWED_POLICIES))
        if not (_is_int(self.ali_window) and self.ali_window >= 1):
            raise _error("scheduler.ali_window", self.ali_window, "an integer >= 1 (store steps)")
        for name in self._SHARES:
            if not _is_share(getattr(self, name)):
                raise _error(f"scheduler.{name}", getattr(self, name), "a number from 0 to 1")
        if self.ali_warm > self.ali_hot:
            raise ConfigError(f"config key 'scheduler.ali_warm': got {self.ali_warm!r}, above 'scheduler.ali_hot' "
                              f"{self.ali_hot!r}; allowed: ali_warm <= ali_hot")
        if not (isinstance(self.half_life_turns, (int, float)) and not isinstance(self.half_life_turns, bool)
                and 0.5 <= self.half_life_turns <= 1e6):
            raise _error("scheduler.half_life_turns", self.half_life_turns, "a number of turns from 0.5 to 1000000")
        if not (isinstance(self.lfu_half_life_turns, (int, float)) and not isinstance(self.lfu_half_life_turns, bool)
                and 1 <= self.lfu_half_life_turns <= 1e9):
            raise _error("scheduler.lfu_half_life_turns", self.lfu_half_life_turns,
                         "a number of turns from 1 to 1000000000")
        if not isinstance(self.ali_promote, bool):
            raise _error("scheduler.ali_promote", self.ali_promote, "true or false")
        if self.restore not in RESTORE_MODES:
            raise _error("scheduler.restore", self.restore, _choices(RESTORE_MODES) + " (auto: restore only what loads "
                         "faster than recomputing it, from measured rates; always: every stored token)")
        if not (_is_int(self.idle_steps) and self.idle_steps >= 0):
            raise _error("scheduler.idle_steps", self.idle_steps, "an integer >= 0 (store steps; 0 never demotes idle chats)")
        if not isinstance(self.background, bool):
            raise _error("scheduler.background", self.background, "true or false")
        if not (isinstance(self.mover_interval_s, (int, float)) and not isinstance(self.mover_interval_s, bool)
                and 0.001 <= self.mover_interval_s <= 60):
            raise _error("scheduler.mover_interval_s", self.mover_interval_s, "a number of seconds from 0.001 to 60")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The store's in-process metrics (tiered_kv/metrics/): counters and histograms per tier,
    in `stats()["metrics"]` and exported to Prometheus by `tiered_kv.metrics.serve(port)`.
    `enabled: false` records nothing (the move and hit counters in stats() then stay 0)."""
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise _error("metrics.enabled", self.enabled, "true or false")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class CopiesConfig:
    """Where block copies between tiers run (hw/copy_engine.py).

    `engine`: auto (a CUDA side stream on a GPU, sync on CPU), sync (each copy runs at once on the
    thread that asks for it) or thread (copies run later, in order, on a thread of their own, and
    signal completion as CUDA events do: how the GPU's ordering rules are exercised on a CPU).
    `delay_us`: the thread engine waits this long before each batch of copies (tests widen the
    window in which a copy is still in flight with it); 0..1,000,000, only with engine thread."""
    engine: str = "auto"
    delay_us: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ALLOWED_COPY_ENGINES:
            raise _error("copies.engine", self.engine, " | ".join(ALLOWED_COPY_ENGINES))
        if isinstance(self.delay_us, bool) or not isinstance(self.delay_us, int) \
                or not 0 <= self.delay_us <= MAX_COPY_DELAY_US:
            raise _error("copies.delay_us", self.delay_us, f"an integer from 0 to {MAX_COPY_DELAY_US:,} (microseconds)")
        if self.delay_us and self.engine != "thread":
            raise ConfigError(f"config key 'copies.delay_us': got {self.delay_us!r} with engine {self.engine!r}; "
                              "allowed: a delay only with engine 'thread' (the other engines do not wait)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


@dataclass(frozen=True, kw_only=True)
class BlockSizeAutoConfig:
    """How `block_size: auto` picks the block size: the first class whose `max_context_tokens`
    is >= `expected_context_tokens` (None: the open-ended last class, any longer context).

    `classes` is a tuple of (max_context_tokens, block_size) pairs, thresholds strictly increasing,
    exactly one None threshold and it comes last, sizes powers of two; YAML lists become tuples.
    Defaults: up to 512 tokens -> 8, up to 2,048 -> 16, longer -> 32; expected context 2,048 -> 16.
    Why per class and not per chat: one store serves many chats through one slab layout, and a
    block's key includes the block size, so the size is chosen once for the store's expected load.
    """
    expected_context_tokens: int = 2048
    classes: tuple[tuple[int | None, int], ...] = ((512, 8), (2048, 16), (None, 32))

    SECTION: ClassVar[str] = "block_size_auto"

    def __post_init__(self) -> None:
        section = self.SECTION
        if not (_is_int(self.expected_context_tokens) and self.expected_context_tokens >= 1):
            raise _error(f"{section}.expected_context_tokens", self.expected_context_tokens,
                         "an integer >= 1 (tokens a chat is expected to reach)")
        pairs_text = ("a non-empty list of [max_context_tokens, block_size] pairs, e.g. "
                      "[[512, 8], [2048, 16], [null, 32]]")
        if not (isinstance(self.classes, (list, tuple)) and self.classes):
            raise _error(f"{section}.classes", self.classes, pairs_text)
        classes = []
        previous = 0
        last = len(self.classes) - 1
        for i, pair in enumerate(self.classes):
            where = f"{section}.classes[{i}]"
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
                raise _error(where, pair, "a pair [max_context_tokens, block_size]")
            max_tokens, size = pair
            if i == last:
                if max_tokens is not None:
                    raise _error(f"{where}[0]", max_tokens,
                                 "null in the last class (it takes every longer context)")
            elif max_tokens is None:
                raise _error(f"{where}[0]", max_tokens,
                             "null only in the last class; here an integer above the previous threshold")
            elif not (_is_int(max_tokens) and max_tokens > previous):
                raise _error(f"{where}[0]", max_tokens,
                             f"an integer > {previous} (thresholds strictly increase)")
            if not _is_block_size(size):
                raise _error(f"{where}[1]", size, _BLOCK_SIZE_ALLOWED)
            classes.append((max_tokens, size))
            previous = max_tokens if max_tokens is not None else previous
        object.__setattr__(self, "classes", tuple(classes))

    def pick(self, context_tokens: int | None = None) -> int:
        """The block size of the class holding `context_tokens` (default: expected_context_tokens)."""
        tokens = self.expected_context_tokens if context_tokens is None else context_tokens
        for max_tokens, size in self.classes:
            if max_tokens is None or tokens <= max_tokens:
                return size
        raise AssertionError("unreachable: the last class is open-ended")  # checked in __post_init__

    def to_dict(self) -> dict[str, Any]:
        return {"expected_context_tokens": self.expected_context_tokens,
                "classes": [list(pair) for pair in self.classes]}


_SECTION_TYPES: dict[str, type] = {"hot": HotConfig, "warm": WarmConfig, "cold": ColdConfig,
                                   "scheduler": SchedulerConfig, "metrics": MetricsConfig, "remote": RemoteConfig,
                                   "copies": CopiesConfig}


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. `Config()` equals `load_config({})` (all defaults).

    `block_size` may be given as "auto"; after init it is always the int in use, picked by
    `block_size_auto` (its defaults when not given), and `block_size_spec` is what was given.
    `block_size_auto` with an int `block_size` is an error, not ignored: the user meant auto.
    """
    block_size: int = 16  # tokens per block; "auto" on input
    block_size_auto: BlockSizeAutoConfig | None = None  # only with block_size "auto"
    hot: HotConfig = field(default_factory=HotConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    cold: ColdConfig = field(default_factory=ColdConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    copies: CopiesConfig = field(default_factory=CopiesConfig)
    block_size_spec: int | str = field(init=False)  # 16 or "auto": what the config asked for

    def __post_init__(self) -> None:
        spec = self.block_size
        auto = self.block_size_auto
        if auto is not None and not isinstance(auto, BlockSizeAutoConfig):
            raise _error("block_size_auto", auto, "a BlockSizeAutoConfig")
        if spec == BLOCK_SIZE_AUTO:
            if auto is None:
                auto = BlockSizeAutoConfig()
                object.__setattr__(self, "block_size_auto", auto)
            object.__setattr__(self, "block_size", auto.pick())
        elif not _is_block_size(spec):
            raise _error("block_size", spec, f"{_BLOCK_SIZE_ALLOWED} or 'auto' (picked by block_size_auto)")
        elif auto is not None:
            raise ConfigError(f"config key 'block_size_auto': given while 'block_size' is {spec!r}; allowed: "
                              "only with block_size: auto (set block_size: auto, or remove block_size_auto)")
        object.__setattr__(self, "block_size_spec", spec)
        for name, section_type in _SECTION_TYPES.items():
            if not isinstance(getattr(self, name), section_type):
                raise _error(name, getattr(self, name), f"a {section_type.__name__}")

    @property
    def block_size_is_auto(self) -> bool:
        return self.block_size_spec == BLOCK_SIZE_AUTO

    def to_dict(self) -> dict[str, Any]:
        """A plain dict in YAML form; `load_config(cfg.to_dict()) == cfg` (auto stays auto)."""
        auto = {"block_size_auto": self.block_size_auto.to_dict()} if self.block_size_is_auto else {}
        return {"block_size": self.block_size_spec, **auto,
                **{name: getattr(self, name).to_dict() for name in _SECTION_TYPES}}

    def replace(self, **changes: Any) -> Config:
        """A copy with top-level fields changed (e.g. `hot=HotConfig(capacity_blocks=4)`), validated.

        An auto block size stays auto (re-picked if `block_size_auto` changes); an int
        `block_size` drops the auto classes unless `block_size_auto` is given too."""
        if "block_size" not in changes:
            changes["block_size"] = self.block_size_spec
        elif changes["block_size"] != BLOCK_SIZE_AUTO:
            changes.setdefault("block_size_auto", None)
        return dataclasses.replace(self, **changes)


_WATERMARK_KEYS = ("high_watermark", "low_watermark")
_SECTION_KEYS = {"hot": ("device", "capacity", "capacity_blocks", *_WATERMARK_KEYS),
                 "warm": ("capacity", "capacity_blocks", "pinned", "layout", "compression", *_WATERMARK_KEYS),
                 "cold": ("path", "capacity", "capacity_blocks", "backend", "fsync", "write_behind_s", "admit",
                          "compression", *_WATERMARK_KEYS),
                 "scheduler": tuple(f.name for f in dataclasses.fields(SchedulerConfig)),
                 "metrics": tuple(f.name for f in dataclasses.fields(MetricsConfig)),
                 "remote": tuple(f.name for f in dataclasses.fields(RemoteConfig)),
                 "copies": tuple(f.name for f in dataclasses.fields(CopiesConfig))}
_AUTO_KEYS = tuple(f.name for f in dataclasses.fields(BlockSizeAutoConfig))
_TOP_KEYS = ("block_size", *_SECTION_TYPES, BlockSizeAutoConfig.SECTION)


def _check_mapping(where: str | None, value: Any, allowed_keys: tuple[str, ...]) -> Mapping:
    keys_text = ", ".join(map(repr, allowed_keys))
    if not isinstance(value, Mapping):
        raise ConfigError(f"config {'top level' if where is None else f'key {where!r}'}: got {value!r}; "
                          f"allowed: a mapping with keys {keys_text}")
    for key in value:
        if key not in allowed_keys:
            path = str(key) if where is None else f"{where}.{key}"
            raise ConfigError(f"config key {path!r} is unknown (value {value[key]!r}); allowed keys"
                              f"{'' if where is None else f' under {where!r}'}: {keys_text}")
    return value


def _section_from_mapping(name: str, raw: Any) -> Any:
    body = _check_mapping(name, {} if raw is None else raw, _SECTION_KEYS[name])  # `warm:` alone = defaults
    kwargs: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            raise _error(f"{name}.{key}", value, "a value (remove the key to use its default)")
        if key == "capacity":
            kwargs["capacity_bytes"] = parse_size(value, f"{name}.capacity")
        else:
            kwargs[key] = value
    return _SECTION_TYPES[name](**kwargs)


def _auto_from_mapping(raw: Any) -> BlockSizeAutoConfig:
    body = _check_mapping(BlockSizeAutoConfig.SECTION, {} if raw is None else raw, _AUTO_KEYS)
    for key, value in body.items():
        if value is None:
            raise _error(f"{BlockSizeAutoConfig.SECTION}.{key}", value, "a value (remove the key to use its default)")
    return BlockSizeAutoConfig(**body)


def _config_from_mapping(data: Any) -> Config:
    data = _check_mapping(None, data, _TOP_KEYS)
    kwargs = {}
    for key, value in data.items():
        if key in _SECTION_TYPES:
            kwargs[key] = _section_from_mapping(key, value)
        elif key == BlockSizeAutoConfig.SECTION:
            kwargs[key] = _auto_from_mapping(value)
        else:
            kwargs[key] = value
    return Config(**kwargs)


def default_config_path() -> Path:
    """The default config packaged with tiered_kv (configs/default.yaml in a checkout links to it):
    what `tiered-kv chat` and `tiered-kv diagnose` load without --config, from any folder."""
    return Path(__file__).resolve().parent / "configs" / "default.yaml"


def load_config(source: str | os.PathLike | Mapping[str, Any] | Config) -> Config:
    """Build a validated Config from a YAML file path, a dict (YAML form) or a Config (returned as is).

    Missing sections and keys take their defaults. Raises ConfigError for a missing or unreadable
    file, invalid YAML, a top level that is not a mapping, unknown keys and bad values.
    """
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        return _config_from_mapping(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config source: got {source!r}; allowed: a YAML file path, a dict or a Config")
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return _config_from_mapping(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
