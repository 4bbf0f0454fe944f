"""The metrics and copies sections of a config: what the store records, and where its copies run."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .checks import _error

ALLOWED_COPY_ENGINES = ("auto", "sync", "thread")
MAX_COPY_DELAY_US = 1_000_000


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
