"""Typed, validated configuration for tiered_kv (policy code: no torch here).

A `Config` is a tree of frozen dataclasses. Every value is checked when an object is built
(`__post_init__`), so code holding a `Config` never re-validates; `load_config` builds one from
a YAML file, a dict or an existing `Config`. Anything wrong raises `ConfigError` naming the key
path, the value and what is allowed; errors from a file are prefixed with its path.

Capacities are sizes ("256MiB") or block counts (`capacity_blocks`). A block's byte size depends
on the model, which the config does not know, so each tier turns its capacity into a block count
with `resolve_blocks(block_bytes)` once the caller knows it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Mapping

import yaml

from .errors import ConfigError

__all__ = ["ALLOWED_BACKENDS", "ALLOWED_POLICIES", "ColdConfig", "Config", "HotConfig",
           "SchedulerConfig", "WarmConfig", "load_config", "parse_size"]

ALLOWED_BACKENDS = ("auto", "posix", "kvikio")
ALLOWED_POLICIES = ("lru", "lfu", "fifo", "ali")
ALLOWED_PINNED = ("auto", "true", "false")
MAX_BLOCK_SIZE_TOKENS = 1024

_UNIT_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")
_SIZE_ALLOWED = ("a byte count >= 0 or a size like '64MiB', '1.5GiB', '100MB' "
                 "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)")
_CUDA_INDEX_RE = re.compile(r"cuda:[0-9]+")


def _error(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key {key!r}: got {value!r}; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML `true` is not a count


def _is_share(value: Any) -> bool:
    """A number in [0, 1] (YAML booleans are not numbers here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and 0.0 <= value <= 1.0)


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

    YAML booleans for `pinned` are normalized to the strings "true" / "false".
    """
    pinned: str = "auto"

    SECTION: ClassVar[str] = "warm"
    DEFAULT_CAPACITY_BYTES: ClassVar[int] = 2 * 2**30
    DEFAULT_WATERMARKS: ClassVar[tuple[float, float]] = (0.95, 0.85)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.pinned, bool):
            object.__setattr__(self, "pinned", "true" if self.pinned else "false")
        if self.pinned not in ALLOWED_PINNED:
            raise _error("warm.pinned", self.pinned, _choices(ALLOWED_PINNED) + " (or a YAML boolean)")


@dataclass(frozen=True, kw_only=True)
class ColdConfig(_TierConfig):
    """Cold tier: preallocated file(s) of block slots under `path` (after ~ and $VAR expansion).

    The path is neither created nor checked here; the store does that when it starts.
    `fsync` makes writes durable before the index records them.
    """
    path: str = "~/.cache/tiered_kv/cold"
    backend: str = "auto"
    fsync: bool = True

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


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the MemScheduler places blocks (policy code: see tiered_kv/scheduler/).

    Signals: ALI (access locality index) = the share of the last `ali_window` store steps that
    read a block; a block belongs hot above `ali_hot`, warm above `ali_warm`, cold otherwise.
    BS (link saturation, 0..1): above `bs_threshold`, optional background moves wait. CS (cost
    sensitivity, 0..1, per chat: `CacheBank(..., cost_sensitivity=)`, else
    `default_cost_sensitivity`) adds `cs_weight * CS` to a block's ALI-scale value under every
    policy, so high-CS chats stay hot longer and are the last victims.
    """
    policy: str = "lru"
    ali_window: int = 100  # store steps
    ali_hot: float = 0.7
    ali_warm: float = 0.3
    bs_threshold: float = 0.8
    cs_weight: float = 0.5
    default_cost_sensitivity: float = 0.5
    idle_steps: int = 1000  # a chat unread this many store steps has its hot blocks demoted; 0: never
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
        if not (_is_int(self.idle_steps) and self.idle_steps >= 0):
            raise _error("scheduler.idle_steps", self.idle_steps, "an integer >= 0 (store steps; 0 never demotes idle chats)")
        if not isinstance(self.background, bool):
            raise _error("scheduler.background", self.background, "true or false")
        if not (isinstance(self.mover_interval_s, (int, float)) and not isinstance(self.mover_interval_s, bool)
                and 0.001 <= self.mover_interval_s <= 60):
            raise _error("scheduler.mover_interval_s", self.mover_interval_s, "a number of seconds from 0.001 to 60")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES: dict[str, type] = {"hot": HotConfig, "warm": WarmConfig, "cold": ColdConfig,
                                   "scheduler": SchedulerConfig}


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. `Config()` equals `load_config({})` (all defaults)."""
    block_size: int = 16  # tokens per block
    hot: HotConfig = field(default_factory=HotConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    cold: ColdConfig = field(default_factory=ColdConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        size = self.block_size
        if not (_is_int(size) and 1 <= size <= MAX_BLOCK_SIZE_TOKENS and size & (size - 1) == 0):
            raise _error("block_size", size, f"a power of two from 1 to {MAX_BLOCK_SIZE_TOKENS} (tokens)")
        for name, section_type in _SECTION_TYPES.items():
            if not isinstance(getattr(self, name), section_type):
                raise _error(name, getattr(self, name), f"a {section_type.__name__}")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict in YAML form; `load_config(cfg.to_dict()) == cfg`."""
        return {"block_size": self.block_size,
                **{name: getattr(self, name).to_dict() for name in _SECTION_TYPES}}

    def replace(self, **changes: Any) -> Config:
        """A copy with top-level fields changed (e.g. `hot=HotConfig(capacity_blocks=4)`), validated."""
        return dataclasses.replace(self, **changes)


_WATERMARK_KEYS = ("high_watermark", "low_watermark")
_SECTION_KEYS = {"hot": ("device", "capacity", "capacity_blocks", *_WATERMARK_KEYS),
                 "warm": ("capacity", "capacity_blocks", "pinned", *_WATERMARK_KEYS),
                 "cold": ("path", "capacity", "capacity_blocks", "backend", "fsync", *_WATERMARK_KEYS),
                 "scheduler": tuple(f.name for f in dataclasses.fields(SchedulerConfig))}
_TOP_KEYS = ("block_size", *_SECTION_TYPES)


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


def _config_from_mapping(data: Any) -> Config:
    data = _check_mapping(None, data, _TOP_KEYS)
    return Config(**{key: _section_from_mapping(key, value) if key in _SECTION_TYPES else value
                     for key, value in data.items()})


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
