"""Load or recompute: what a turn restores from the tiers, decided per turn. No torch.

`Rates` keeps rolling estimates the store measures from its own work: each source's read
throughput (bytes/s; warm, cold, the other processes' cold files, the remote tier) and the
model's prefill cost per token beyond a step's fixed cost (a 16-token prefill costs about a decode
step; what more tokens add is what recomputing a prefix costs). `restore_blocks` then picks, for a stored prefix whose
blocks lie in various tiers, how many leading blocks to restore: loading block i costs its bytes
over its source's rate (nothing when it is hot already), recomputing costs the prefix's tokens
from there on at the prefill rate; the best cut minimizes the sum. A prefix on a fast tier is
restored whole (loads are ~20x cheaper than prefill on local disks); on a slow remote or a cold disk
under contention, the expensive tail is recomputed instead.

Until a source's rate and the prefill rate have both been measured, nothing is recomputed by
choice (`scheduler.restore: auto` then behaves as `always`); nor when recomputing would save less
than MIN_GAIN_S and MIN_GAIN_SHARE of the load (a tiny model's sub-millisecond prefill against a
local disk: the estimates' noise would decide, and a restored prefix is what a user expects).
"""

from __future__ import annotations

import threading

SOURCES = ("warm", "cold", "peer", "remote")
EWMA_WEIGHT = 0.3  # of a new measurement: a few reads make a rate, a disk that slows shows within ~3
MIN_SAMPLE_BYTES = 4096  # smaller reads time mostly their fixed costs (a round trip): not a rate
MIN_PREFILL_TOKENS = 8  # shorter steps (decode) are not a prefill rate
FIT_FORGET = 0.8  # each prefill's weight in the prefill-cost fit shrinks by this at every later one
MIN_GAIN_S = 0.005  # recomputing by choice must save at least this much of a turn's time
MIN_GAIN_SHARE = 0.1  # ... and this share of what loading everything would take: below both, the
#                      estimates' noise decides, and a restored prefix is the result users expect


class Rates:
    """Rolling read rates per source and the prefill cost; thread-safe (steps and movers feed it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes_per_s: dict[str, float] = {}
        self._latency_s: dict[str, float] = {}  # per fetch (a round trip), for sources that have one
        self._prefill_s_per_token: float | None = None  # marginal: beyond a step's fixed cost
        self._fit = [0.0] * 5  # weighted sums over prefills: 1, n, n^2, seconds, n * seconds
        self._step_s: float | None = None  # a one-token (decode) step: the fixed cost of any step

    def note_read(self, source: str, num_bytes: int, seconds: float, fixed_s: float | None = None) -> None:
        """A read of `num_bytes` from `source` took `seconds` (`fixed_s`: the part of it that does
        not grow with the bytes, e.g. a network round trip, when known)."""
        if seconds <= 0:
            return
        with self._lock:
            if num_bytes < MIN_SAMPLE_BYTES:  # a small read times its fixed costs: a round trip
                if fixed_s is None and source in ("remote", "peer"):
                    self._latency_s[source] = _ewma(self._latency_s.get(source), seconds)
                return
            if fixed_s is None:
                fixed_s = self._latency_s.get(source)
            variable_s = max(seconds - (fixed_s or 0.0), seconds * 0.05)
            self._bytes_per_s[source] = _ewma(self._bytes_per_s.get(source), num_bytes / variable_s)

    def note_step(self, num_tokens: int, seconds: float) -> None:
        """A forward step computed `num_tokens` new tokens (per row) in `seconds`. A step costs a
        fixed part plus a part per token, and only the per-token part is what recomputing more
        tokens in a turn's prefill adds: it is the slope of a line fitted to the recent prefills
        (weighted least squares, older ones fading), or, while they all had one length, what is
        left of a prefill after a decode step's time, per token."""
        if seconds <= 0:
            return
        with self._lock:
            if num_tokens == 1:
                self._step_s = _ewma(self._step_s, seconds)
                return
            if num_tokens < MIN_PREFILL_TOKENS:
                return
            fit = [FIT_FORGET * v for v in self._fit]
            for k, value in enumerate((1.0, num_tokens, num_tokens ** 2, seconds, num_tokens * seconds)):
                fit[k] += value
            self._fit = fit
            s0, s1, s2, sy, sny = fit
            average = sy / s1  # seconds per token over the recent prefills, all costs included
            det = s0 * s2 - s1 * s1
            slope = (s0 * sny - s1 * sy) / det if det > 1e-9 * s0 * s2 else None
            if slope is None:  # one length so far: take a decode step's time off
                slope = (seconds - (self._step_s or 0.0)) / num_tokens
            self._prefill_s_per_token = min(max(slope, 0.1 * average), average)

    def load_seconds(self, source: str, num_bytes: int, num_fetches: int = 1) -> float | None:
        """Estimated seconds to read `num_bytes` from `source`; None while unmeasured."""
        with self._lock:
            rate = self._bytes_per_s.get(source)
            latency = self._latency_s.get(source, 0.0)
        return None if rate is None else num_fetches * latency + num_bytes / rate

    def recompute_seconds(self, num_tokens: int) -> float | None:
        with self._lock:
            per_token = self._prefill_s_per_token
        return None if per_token is None else num_tokens * per_token

    def snapshot(self) -> dict:
        """For stats(): each source's MB/s and round trip (ms), and the prefill's ms per token."""
        with self._lock:
            return {"read_mb_per_s": {s: r / 1e6 for s, r in self._bytes_per_s.items()},
                    "round_trip_ms": {s: v * 1e3 for s, v in self._latency_s.items()},
                    "prefill_ms_per_token": None if self._prefill_s_per_token is None
                    else self._prefill_s_per_token * 1e3}


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new


def restore_blocks(load_seconds: list[float | None], recompute_s_per_block: float | None) -> int:
    """How many leading blocks of a stored prefix to restore (the rest is recomputed).

    `load_seconds[i]`: what bringing block i to where the step reads it costs (0 when it is there
    already; None when unknown: counted as free, so an unmeasured source is always restored).
    Restoring blocks 0..k-1 and recomputing k.. costs sum(load[:k]) + (n - k) * recompute; the
    smallest such k wins ties (fewer bytes moved for the same time). The whole prefix is restored
    unless the best cut saves what `is_worth_recomputing` asks."""
    if recompute_s_per_block is None or not load_seconds:
        return len(load_seconds)
    best_k, best_cost = 0, len(load_seconds) * recompute_s_per_block
    cost = best_cost
    for i, load in enumerate(load_seconds):
        cost += (load or 0.0) - recompute_s_per_block
        if cost < best_cost - 1e-12:
            best_k, best_cost = i + 1, cost
    return best_k if is_worth_recomputing(cost, best_cost) else len(load_seconds)


def is_worth_recomputing(restore_all_s: float, instead_s: float) -> bool:
    """Whether a plan that recomputes some stored tokens (`instead_s`) beats restoring them all
    (`restore_all_s`) by enough: MIN_GAIN_S and MIN_GAIN_SHARE of the restore."""
    gain_s = restore_all_s - instead_s
    return gain_s >= MIN_GAIN_S and gain_s >= MIN_GAIN_SHARE * restore_all_s
