"""The compression section of a config: the quality floor that `compression: auto` and explicit
lossy modes are held to, and the calibration that measures them (tiered_kv/compression/calibration.py).

    compression:
      quality_floor: 0.99        # expected next-token agreement with the uncompressed cache, in (0, 1]
      calibration_text: mixed    # a text shipped in the package (tiered_kv/compression/texts/NAME.txt)
      calibration_tokens: 512    # how much of it the calibration reads at most (256..8192)
      check_explicit: true       # an explicit lossy mode is measured too, and warns below the floor

A tier's `compression: auto` takes the smallest mode whose agreement meets the floor on the model
it first serves; the choice is recorded beside the cold tier's files (a restart reuses it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError
from .checks import _error, _is_int

TEXTS_DIR = Path(__file__).resolve().parent.parent / "compression" / "texts"
# at least 256: the first 64-token chunk is not scored and the last chunk and 2 blocks stay uncompressed
MIN_CALIBRATION_TOKENS, MAX_CALIBRATION_TOKENS = 256, 8192


def shipped_texts() -> tuple[str, ...]:
    """The names of the calibration texts in the package."""
    return tuple(sorted(p.stem for p in TEXTS_DIR.glob("*.txt"))) if TEXTS_DIR.is_dir() else ()


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """See the module docstring."""
    quality_floor: float = 0.99
    calibration_text: str = "mixed"
    calibration_tokens: int = 512
    check_explicit: bool = True

    SECTION: ClassVar[str] = "compression"

    def __post_init__(self) -> None:
        floor = self.quality_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (0.0 < floor <= 1.0):
            raise _error("compression.quality_floor", floor,
                         "a number in (0, 1]: the next-token agreement with the uncompressed cache a mode must be "
                         "expected to keep (e.g. 0.99)")
        object.__setattr__(self, "quality_floor", float(floor))
        texts = shipped_texts()
        if not isinstance(self.calibration_text, str) or self.calibration_text not in texts:
            if not texts:
                raise ConfigError("config key 'compression.calibration_text': the package ships no calibration text "
                                  f"(expected .txt files in {TEXTS_DIR}); reinstall tiered_kv")
            raise _error("compression.calibration_text", self.calibration_text,
                         f"the name of a text shipped in the package: {', '.join(map(repr, texts))}")
        tokens = self.calibration_tokens
        if not (_is_int(tokens) and MIN_CALIBRATION_TOKENS <= tokens <= MAX_CALIBRATION_TOKENS):
            raise _error("compression.calibration_tokens", tokens,
                         f"an integer from {MIN_CALIBRATION_TOKENS} to {MAX_CALIBRATION_TOKENS} (tokens)")
        if not isinstance(self.check_explicit, bool):
            raise _error("compression.check_explicit", self.check_explicit, "true or false")

    def text_path(self) -> Path:
        return TEXTS_DIR / f"{self.calibration_text}.txt"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
