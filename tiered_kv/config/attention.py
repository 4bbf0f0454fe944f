"""The attention section of a config: how much of the attention the bank samples, and sparse reads.

    attention:
      sample_steps: 0.05     # share of decode steps whose attention mass per block is measured (0: never)
      sample_layers: 0.25    # share of the layers measured on a sampled step (spread evenly)
      decay: 0.8             # a block's mass statistic keeps this much of its past at each new sample
      sparse:                # opt-in: a decode step reads only the blocks below hot its queries need
        budget: 0.25         # a share in (0, 1] of the blocks below hot, or a block count >= 1; absent: off
        first_blocks: 1      # always read (the attention sink)
        recent_blocks: 2     # always read (the newest tokens)

Measuring needs the hooks (`tiered_kv.hooks.install`): their attention functions see the queries.
A sampled layer costs one extra q.K product over the chat's tokens (bank/attention_stats.py). The
scheduler's `attention_weight` places blocks by the measured mass; sparse reads rank the blocks
below hot by a bound on their attention score from per-block key summaries (bank/sparse.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigError
from .checks import _error, _is_int, _is_share

_SPARSE_KEYS = ("budget", "first_blocks", "recent_blocks")


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """`attention.sparse` (see the module docstring); `budget` None: sparse reads are off."""
    budget: float | int | None = None
    first_blocks: int = 1
    recent_blocks: int = 2

    def __post_init__(self) -> None:
        budget = self.budget
        allowed = ("a share of the blocks below hot in (0, 1] (e.g. 0.25), or a number of blocks >= 1 (e.g. 16); "
                   "remove the key to read every block")
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget != budget or budget <= 0:
                raise _error("attention.sparse.budget", budget, allowed)
            if isinstance(budget, float) and budget > 1:
                raise _error("attention.sparse.budget", budget, allowed + " (a float above 1 is neither)")
        for name in ("first_blocks", "recent_blocks"):
            value = getattr(self, name)
            if not (_is_int(value) and 0 <= value <= 1_000_000):
                raise _error(f"attention.sparse.{name}", value, "an integer >= 0 (blocks always read)")

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    def blocks(self, below_hot: int) -> int:
        """How many blocks a step ranks in, for a chat with `below_hot` blocks below hot."""
        if isinstance(self.budget, float):
            return max(1, int(round(self.budget * below_hot)))
        return int(self.budget)

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "first_blocks": self.first_blocks, "recent_blocks": self.recent_blocks}


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """See the module docstring."""
    sample_steps: float = 0.05
    sample_layers: float = 0.25
    decay: float = 0.8
    sparse: SparseConfig = field(default_factory=SparseConfig)

    SECTION: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        for name in ("sample_steps", "sample_layers"):
            if not _is_share(getattr(self, name)):
                raise _error(f"attention.{name}", getattr(self, name), "a number from 0 to 1 (a share)")
        if not _is_share(self.decay) or self.decay >= 1:
            raise _error("attention.decay", self.decay, "a number from 0 to below 1 (the share of the past kept)")
        sparse = self.sparse
        if isinstance(sparse, dict):
            unknown = [key for key in sparse if key not in _SPARSE_KEYS]
            if unknown:
                raise ConfigError(f"config key 'attention.sparse.{unknown[0]}' is unknown (value "
                                  f"{sparse[unknown[0]]!r}); allowed keys under 'attention.sparse': "
                                  f"{', '.join(map(repr, _SPARSE_KEYS))}")
            object.__setattr__(self, "sparse", SparseConfig(**sparse))
        elif not isinstance(sparse, SparseConfig):
            raise _error("attention.sparse", sparse, "a mapping with keys " + ", ".join(map(repr, _SPARSE_KEYS)))

    def to_dict(self) -> dict[str, Any]:
        return {"sample_steps": self.sample_steps, "sample_layers": self.sample_layers, "decay": self.decay,
                "sparse": self.sparse.to_dict()}


__all__ = ["AttentionConfig", "SparseConfig"]
