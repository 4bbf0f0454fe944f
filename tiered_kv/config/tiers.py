"""The tier sections of a config: hot, warm and cold (capacity, watermarks, each tier's own keys).

Capacities are sizes ("256MiB") or block counts (`capacity_blocks`). A block's byte size depends
on the model, which the config does not know, so each tier turns its capacity into a block count
with `resolve_blocks(block_bytes)` once the caller knows it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from .checks import _check_compression, _choices, _error, _is_int, _is_share

ALLOWED_BACKENDS = ("auto", "posix", "kvikio")
ALLOWED_ADMIT = ("published", "reused", "all")  # cold.admit: which blocks get a durable copy
ALLOWED_PINNED = ("auto", "true", "false")
ALLOWED_WARM_LAYOUTS = ("auto", "records", "paged")
_CUDA_INDEX_RE = re.compile(r"cuda:[0-9]+")


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
                              "('auto' compression included: it may pick one) (attention reads a paged slab in "
                              "place, which compressed blocks cannot be)")


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
