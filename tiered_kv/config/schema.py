"""The whole configuration: `Config`, a tree of frozen, validated sections, and `block_size: auto`.

`block_size` is an int, or "auto": then `block_size_auto` picks it from the expected context length
by class thresholds, once, when the config is built (a store's slab layout serves all its chats, so
the size cannot follow each chat). Downstream `config.block_size` is always the resolved int;
`config.block_size_spec` keeps what was asked (16, or "auto").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigError
from .checks import _BLOCK_SIZE_ALLOWED, _error, _is_block_size, _is_int
from .attention import AttentionConfig
from .compression import CompressionConfig
from .placement import SchedulerConfig
from .remote import RemoteConfig
from .runtime import CopiesConfig, MetricsConfig
from .tiers import ColdConfig, HotConfig, WarmConfig

BLOCK_SIZE_AUTO = "auto"


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
                                   "copies": CopiesConfig, "compression": CompressionConfig,
                                   "attention": AttentionConfig}


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
    compression: CompressionConfig = field(default_factory=CompressionConfig)  # the quality floor (auto, checks)
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # sampled attention mass, sparse reads
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
