"""The in-process metrics of one TierStore: counters and histograms, kept cheaply.

One `Metrics` object is owned by each store (`store.metrics`); the transfers, the mover, the
tiers' reads and writes and the banks count into it, `store.stats()["metrics"]` returns a
snapshot, and tiered_kv/metrics/export.py turns every live store's metrics into Prometheus
text at scrape time. Nothing here imports torch or prometheus_client: an increment is one dict
update under one lock (~0.2 us), and nothing is formatted until someone asks.

Names follow Prometheus conventions without the `tiered_kv_` prefix (export adds it): counters
end in `_total`, units are in the name (`_bytes_`, `_seconds`). Labels are fixed per family
and given as a tuple in the family's label order: `metrics.blocks_moved.inc(("cold", "hot"))`.

`Metrics(enabled=False)` (config `metrics.enabled: false`) records nothing: every `inc`,
`observe` and `start` returns at once, and stats() reports zeros for these counters.
"""

from __future__ import annotations

import bisect
import threading
import time

from ..blocks import TIER_NAMES

# seconds: 10 us (a warm block read) .. 30 s (a turn's TTFT over a long cold history)
SECONDS_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


ON_DEMAND = "on_demand"  # a caller waited for the bytes (the critical path)
BACKGROUND = "background"  # the background mover moved them


class _Family:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...], metrics: "Metrics"):
        self.name = name
        self.help = help_text
        self.labelnames = labelnames
        self._metrics = metrics
        self._lock = metrics.lock

    def _check(self, labels: tuple) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"metric {self.name}: labels {labels!r} do not match {self.labelnames!r}")


class Counter(_Family):
    """A monotonically increasing number per label set."""

    kind = "counter"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.values: dict[tuple, float] = {}

    def inc(self, labels: tuple = (), amount: float = 1) -> None:
        if not self._metrics.enabled:
            return
        with self._lock:
            self.values[labels] = self.values.get(labels, 0) + amount

    def value(self, labels: tuple = ()) -> float:
        return self.values.get(labels, 0)

    def total(self) -> float:
        with self._lock:
            return sum(self.values.values())

    def snapshot(self) -> dict | float:
        """{label key: value}; a family without labels gives its number."""
        with self._lock:
            if not self.labelnames:
                return self.values.get((), 0)
            return {_label_key(self.labelnames, labels): value for labels, value in self.values.items()}

    def snapshot_values(self) -> list[tuple[tuple, float]]:
        with self._lock:
            return list(self.values.items())


class Histogram(_Family):
    """Observations (seconds) counted into fixed buckets per label set, with their sum and max."""

    kind = "histogram"

    def __init__(self, *args, buckets: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        super().__init__(*args)
        self.buckets = buckets
        self.series: dict[tuple, _Series] = {}

    def start(self) -> float | None:
        """A start time for `stop`, or None when metrics are off (no clock read)."""
        return time.perf_counter() if self._metrics.enabled else None

    def stop(self, labels: tuple, start: float | None) -> None:
        if start is not None:
            self.observe(labels, time.perf_counter() - start)

    def observe(self, labels: tuple, value: float) -> None:
        if not self._metrics.enabled:
            return
        with self._lock:
            series = self.series.get(labels)
            if series is None:
                series = self.series[labels] = _Series(len(self.buckets))
            series.counts[bisect.bisect_left(self.buckets, value)] += 1
            series.sum += value
            series.count += 1
            if value > series.max:
                series.max = value

    def count(self, labels: tuple = ()) -> int:
        series = self.series.get(labels)
        return series.count if series is not None else 0

    def snapshot(self) -> dict:
        """{label key: {count, sum, max, mean, p50, p99}}; a family without labels gives its summary."""
        with self._lock:
            if not self.labelnames:
                return self.series.get((), _Series(len(self.buckets))).summary(self.buckets)
            return {_label_key(self.labelnames, labels): s.summary(self.buckets) for labels, s in self.series.items()}

    def snapshot_series(self) -> list[tuple[tuple, list[int], float]]:
        """(labels, per-bucket counts with +Inf last, sum) of each series."""
        with self._lock:
            return [(labels, list(s.counts), s.sum) for labels, s in self.series.items()]


class _Series:
    __slots__ = ("counts", "sum", "count", "max")

    def __init__(self, num_buckets: int) -> None:
        self.counts = [0] * (num_buckets + 1)  # the last one: above every bucket (+Inf)
        self.sum = 0.0
        self.count = 0
        self.max = 0.0

    def cumulative(self) -> list[int]:
        out, running = [], 0
        for n in self.counts:
            running += n
            out.append(running)
        return out

    def summary(self, buckets: tuple[float, ...]) -> dict:
        cumulative = self.cumulative()
        return {"count": self.count, "sum": self.sum, "max": self.max,
                "mean": self.sum / self.count if self.count else None,
                "p50": _quantile(buckets, cumulative, 0.5), "p99": _quantile(buckets, cumulative, 0.99)}


def _quantile(buckets: tuple[float, ...], cumulative: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile (what Prometheus' histogram_quantile
    would bound it by); None before any observation, inf when it lies above every bucket."""
    total = cumulative[-1]
    if not total:
        return None
    rank = q * total
    for bound, running in zip(buckets, cumulative):
        if running >= rank:
            return bound
    return float("inf")


def _label_key(labelnames: tuple[str, ...], labels: tuple) -> str:
    """"" for no labels, "hot" for one, "cold->hot" for src/dst, "a=x,b=y" otherwise."""
    if not labels:
        return ""
    if len(labels) == 1:
        return str(labels[0])
    if labelnames[:2] == ("src", "dst"):
        head = f"{labels[0]}->{labels[1]}"
        return head if len(labels) == 2 else head + "," + ",".join(map(str, labels[2:]))
    return ",".join(f"{n}={v}" for n, v in zip(labelnames, labels))


class Metrics:
    """Every counter and histogram of one store. Families are attributes; see their help texts."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.lock = threading.Lock()
        self.families: list[_Family] = []
        c, h = self._counter, self._histogram
        # lookups and turns
        self.hits = c("hits_total", "Blocks found by a bank's step, by the tier each was in", ("tier",))
        self.misses = c("misses_total", "Lookups of stored prefixes that stopped at a block the store does not hold")
        self.turn_blocks = c("turn_blocks_total",
                             "Blocks of history a turn needed, by the tier each was in when the turn began", ("tier",))
        self.turns = c("turns_total", "Turns begun (attach() or a multi-token step)")
        self.tokens_reused = c("tokens_reused_total", "Prompt tokens whose stored KV a turn reused")
        self.restore_choice = c("restore_choice_tokens_total", "Stored prompt tokens a turn could reuse, by what "
                                "scheduler.restore chose: restored, or recomputed (loading them was slower); "
                                "not_fetched: a chain's rest not looked for on other processes' files or the "
                                "remote server (fetching it was estimated slower)", ("choice",))
        self.tokens_computed = c("tokens_computed_total", "Tokens whose KV a forward pass computed, by step kind",
                                 ("kind",))
        self.ttft = h("time_to_first_token_seconds",
                      "Per turn: attach() (or the turn's first forward) to the end of its first forward pass", ())
        # moves between tiers
        self.blocks_moved = c("blocks_moved_total", "Blocks moved between tiers", ("src", "dst"))
        self.bytes_moved = c("bytes_moved_total", "Bytes moved between tiers, on demand (a caller waited) "
                             "or by the background mover", ("src", "dst", "mode"))
        self.promotions = c("promotions_total", "Blocks moved to a faster tier")
        self.demotions = c("demotions_total", "Blocks moved to a slower tier")
        self.evictions = c("evictions_total", "Cached blocks dropped from the store")
        self.relocations = c("relocations_total", "Blocks moved within the hot tier by compaction")
        self.move_seconds = c("on_demand_move_seconds_total",
                              "Seconds callers waited for moves, by direction", ("direction",))
        self.failed_moves = c("failed_moves_total", "Moves that did not happen because their batch's copy raised "
                              "(the blocks stayed where they were), by mode and error", ("mode", "error"))
        self.copy_seconds = h("copy_seconds", "Duration of one copy between tiers (one block or one batch)",
                              ("src", "dst"))
        # the tiers' own reads and writes
        self.read_seconds = h("read_seconds", "Duration of one read of KV out of a tier onto the compute "
                              "device or into staging (a layer's history or a batch of blocks)", ("tier",))
        self.write_seconds = h("write_seconds", "Duration of one durable cold record write", ("tier",))
        self.checksum_failures = c("checksum_failures_total", "Blocks that failed their checksum (recomputed, "
                                   "never served), by tier", ("tier",))
        self.dropped_blocks = c("dropped_blocks_total", "Published blocks lost when the store closed, by reason "
                                "(close_no_room: cold had no slot; close_write_failed: moving them there failed)",
                                ("reason",))
        self.write_errors = c("write_errors_total", "Failed durable writes, by errno name", ("tier", "error"))
        # durable copies in cold of blocks above it (write-behind; store/durable_copies.py)
        self.copies_written = c("durable_copies_written_total", "Durable copies written into cold behind blocks "
                                "that stay in hot or warm")
        self.copies_failed = c("durable_copies_failed_total", "Durable copies that could not be written (the block "
                               "stayed where it was), by errno name", ("error",))
        self.adopted_copies = c("adopted_copies_total", "Blocks that went down into cold by taking their durable "
                                "copy's slot (nothing written)")
        self.cold_bytes_written = c("cold_bytes_written_total", "Bytes of block data written into cold (moves and "
                                    "durable copies): divide by tokens_computed_total for the drive's wear per token")
        self.peer_hits = c("peer_hits_total", "Blocks a local miss found in another process's cold file on the same "
                           "cold.path (checked, brought in)")
        # the shared remote tier (tiered_kv/remote/)
        self.remote_hits = c("remote_hits_total", "Blocks a local miss found on the remote server (checked, brought in)")
        self.remote_misses = c("remote_misses_total", "Remote lookups that stopped at a block, by why "
                               "(missing, bad: failed its checks, down: server unreachable, no_room)", ("reason",))
        self.remote_bytes = c("remote_bytes_total", "Bytes of block values to and from the remote server",
                              ("direction",))
        self.remote_writes = c("remote_writes_total", "Blocks written to the remote server")
        self.remote_writes_dropped = c("remote_writes_dropped_total", "Blocks not written to the remote server, "
                                       "by why (down, queue_full, gone: freed before the writer got to it)",
                                       ("reason",))
        self.remote_errors = c("remote_errors_total", "Failed remote round trips, by operation", ("op",))
        self.remote_seconds = h("remote_seconds", "Duration of one pipelined remote round trip", ("op",))

    def _counter(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> Counter:
        family = Counter(name, help_text, labelnames, self)
        if labelnames == ("tier",):  # every tier shows, 0 until counted
            family.values.update({(tier,): 0 for tier in TIER_NAMES})
        elif not labelnames:
            family.values[()] = 0
        self.families.append(family)
        return family

    def _histogram(self, name: str, help_text: str, labelnames: tuple[str, ...]) -> Histogram:
        family = Histogram(name, help_text, labelnames, self)
        self.families.append(family)
        return family

    def snapshot(self) -> dict:
        """{"enabled": bool, "<family name>": {label key: value or histogram summary}} (plain data)."""
        out: dict = {"enabled": self.enabled}
        for family in self.families:
            out[family.name] = family.snapshot()
        return out
