"""The configuration reference, generated from the schema itself: every key a config may give, its
type, its default, the value `configs/default.yaml` ships, and what is allowed.

Nothing here is written by hand, so nothing can drift: the keys are the ones the loader accepts
(load.py), types and defaults come from the section dataclasses, the shipped values from the
packaged default config, and "allowed" is the validator's own error message for a bad value (the
text a user sees when they get it wrong). The documentation site renders `markdown()` on its
configuration page (docs/hooks.py); tests/test_docs.py checks that every key is in it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import ConfigError
from .attention import SparseConfig
from .load import _AUTO_KEYS, _SECTION_KEYS, _TOP_KEYS, default_config_path, load_config
from .schema import _SECTION_TYPES, BlockSizeAutoConfig, Config

_NOT_A_VALUE = {"?": "?"}  # a value no key accepts: its ConfigError says what is allowed
_FIELD_OF = {"capacity": "capacity_bytes"}  # YAML key -> dataclass field, where they differ
_SIZE_TYPE = "size: bytes (int) or a string with a unit ('64MiB')"


@dataclass(frozen=True)
class ConfigKey:
    """One row of the reference."""
    key: str  # dotted path, e.g. "attention.sparse.budget"
    type: str
    default: Any  # with the key absent
    shipped: Any  # in configs/default.yaml (the same as default when it does not set the key)
    allowed: str


def _config_for(path: list[str], value: Any) -> dict:
    """A config mapping that sets only `path` to `value` (block_size_auto needs block_size: auto)."""
    mapping: Any = value
    for part in reversed(path):
        mapping = {part: mapping}
    if path[0] == BlockSizeAutoConfig.SECTION:
        mapping["block_size"] = "auto"
    return mapping


def _allowed(path: list[str]) -> str:
    try:
        load_config(_config_for(path, _NOT_A_VALUE))
    except ConfigError as error:
        text = str(error)
        return text.split("allowed: ", 1)[1] if "allowed: " in text else text
    return "any value of its type"


def _lookup(tree: dict, path: list[str]) -> Any:
    for part in path:
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _field(owner: type, name: str) -> dataclasses.Field:
    """The dataclass field behind YAML key `name` of `owner`."""
    for field in dataclasses.fields(owner):
        if field.name == _FIELD_OF.get(name, name):
            return field
    raise KeyError(f"{owner.__name__} has no field {name!r}")


def _field_type(owner: type, name: str) -> str:
    return _SIZE_TYPE if name == "capacity" else str(_field(owner, name).type)


def _key_paths() -> list[tuple[list[str], type]]:
    """Every key the loader accepts, with the dataclass that holds it, in the loader's order."""
    paths: list[tuple[list[str], type]] = [(["block_size"], Config)]
    paths += [([BlockSizeAutoConfig.SECTION, key], BlockSizeAutoConfig) for key in _AUTO_KEYS]
    for section in _TOP_KEYS:
        for key in _SECTION_KEYS.get(section, ()):
            if (section, key) == ("attention", "sparse"):
                paths += [(["attention", "sparse", name], SparseConfig)
                          for name in (f.name for f in dataclasses.fields(SparseConfig))]
            else:
                paths.append(([section, key], _SECTION_TYPES[section]))
    return paths


def rows() -> list[ConfigKey]:
    """The reference, one row per key (module docstring)."""
    defaults = Config(block_size="auto").to_dict()  # (auto: so block_size_auto's defaults show too)
    defaults["block_size"] = Config().block_size
    shipped = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))  # as written ("64MiB", "~/...")
    out = []
    for path, owner in _key_paths():
        default = _declared_default(owner, path[-1])
        if default is dataclasses.MISSING:
            default = _lookup(defaults, path)
        given = _lookup(shipped, path)
        out.append(ConfigKey(".".join(path), "int | 'auto'" if path == ["block_size"] else _field_type(owner, path[-1]),
                             default, default if given is None else given, _allowed(path)))
    return out


def _declared_default(owner: type, name: str) -> Any:
    """A str field's default as declared ("~/.cache/..."; the config holds it expanded), else MISSING."""
    default = _field(owner, name).default
    return default if isinstance(default, str) else dataclasses.MISSING


def _shown(value: Any, key: str) -> str:
    if value is None:
        return "none"
    if key.endswith(".capacity") and isinstance(value, int):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value and value % size == 0:
                return f"`{value // size}{unit}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def markdown() -> str:
    """The reference as Markdown tables, one per section."""
    lines: list[str] = []
    section = None
    for row in rows():
        head = row.key.split(".")[0] if "." in row.key else "top level"
        if head != section:
            section = head
            lines += ["", f"### `{head}`" if head != "top level" else "### Top level", "",
                      "| key | type | default | in `configs/default.yaml` | allowed |", "| --- | --- | --- | --- | --- |"]
        allowed = row.allowed.replace("|", "\\|")
        lines.append(f"| `{row.key}` | {row.type.replace('|', chr(92) + '|')} | {_shown(row.default, row.key)} | "
                     f"{_shown(row.shipped, row.key)} | {allowed} |")
    return "\n".join(lines).lstrip("\n") + "\n"


__all__ = ["ConfigKey", "rows", "markdown"]
