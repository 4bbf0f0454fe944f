"""Building a Config from YAML, a dict or a Config: unknown keys and bad values raise ConfigError
naming the key path (errors from a file are prefixed with its path)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import ConfigError
from .checks import _error, parse_size
from .attention import AttentionConfig
from .compression import CompressionConfig
from .placement import SchedulerConfig
from .remote import RemoteConfig
from .runtime import CopiesConfig, MetricsConfig
from .schema import _SECTION_TYPES, BlockSizeAutoConfig, Config

_WATERMARK_KEYS = ("high_watermark", "low_watermark")
_SECTION_KEYS = {"hot": ("device", "capacity", "capacity_blocks", *_WATERMARK_KEYS),
                 "warm": ("capacity", "capacity_blocks", "pinned", "layout", "compression", *_WATERMARK_KEYS),
                 "cold": ("path", "capacity", "capacity_blocks", "backend", "fsync", "write_behind_s", "admit",
                          "compression", *_WATERMARK_KEYS),
                 "scheduler": tuple(f.name for f in dataclasses.fields(SchedulerConfig)),
                 "metrics": tuple(f.name for f in dataclasses.fields(MetricsConfig)),
                 "remote": tuple(f.name for f in dataclasses.fields(RemoteConfig)),
                 "copies": tuple(f.name for f in dataclasses.fields(CopiesConfig)),
                 "compression": tuple(f.name for f in dataclasses.fields(CompressionConfig)),
                 "attention": tuple(f.name for f in dataclasses.fields(AttentionConfig))}
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a mapping key given twice (YAML parsers keep the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                where = ".".join(self._path(key_node) + [str(key)])
                raise ConfigError(f"config key '{where}': given twice (again at line {key_node.start_mark.line + 1}); "
                                  "allowed: each key once per mapping (remove one of them)")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def _path(self, key_node) -> list[str]:
        """The keys of the mappings enclosing `key_node` (for the error message)."""
        path, at = [], key_node.start_mark.index
        node = self._root
        while isinstance(node, yaml.MappingNode):
            inner = [(k, v) for k, v in node.value
                     if isinstance(v, yaml.MappingNode) and v.start_mark.index <= at < v.end_mark.index]
            if not inner:
                break
            k, node = inner[-1]
            path.append(str(k.value))
        return path

    def get_single_data(self):
        self._root = self.get_single_node()
        return None if self._root is None else self.construct_document(self._root)


def default_config_path() -> Path:
    """The default config packaged with tiered_kv (configs/default.yaml in a checkout links to it):
    what `tiered-kv chat` and `tiered-kv diagnose` load without --config, from any folder."""
    return Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


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
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return _config_from_mapping(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
