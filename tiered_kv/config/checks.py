"""What a config value may be: the checks every section shares, and sizes like "256MiB".

Each check names the key path, the value and what is allowed (`_error`), so every section's
messages read alike. No torch here.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from ..compression import MODES
from ..errors import ConfigError

COMPRESSION_AUTO = "auto"  # the smallest mode that meets compression.quality_floor on the model (compression/auto.py)
ALLOWED_COMPRESSION = (*MODES, COMPRESSION_AUTO)  # warm/cold/remote.compression (compression/)
MAX_BLOCK_SIZE_TOKENS = 1024
_BLOCK_SIZE_ALLOWED = f"a power of two from 1 to {MAX_BLOCK_SIZE_TOKENS} (tokens)"

_UNIT_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")
_SIZE_ALLOWED = ("a byte count >= 0 or a size like '64MiB', '1.5GiB', '100MB' "
                 "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)")


def _error(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key {key!r}: got {value!r}; allowed: {allowed}")


def _check_compression(section: str, value: Any) -> None:
    if not isinstance(value, str) or value not in ALLOWED_COMPRESSION:
        raise _error(f"{section}.compression", value,
                     _choices(ALLOWED_COMPRESSION) + " ('none' keeps the model's dtype, bitwise exact; fp8, int8 "
                     "and int4 store a block in fewer bytes, with scales: see tiered-kv quality; 'auto' takes the "
                     "smallest that meets compression.quality_floor on the model)")


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

