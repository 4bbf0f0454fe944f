"""The store counters a trace reads at every step, in one place.

Only counters that cost nothing to read: the slot pools' used counts and the running totals of
the store's metrics (store/reporting.py; with `metrics.enabled: false` the moves and hits read
0). Never `store.stats()` (it drains deferred work and computes layout figures: too costly for
every decode step).
"""

from __future__ import annotations

from ..store.reporting import Counters


def read_counters(store) -> Counters:
    """A snapshot of `store`'s cheap counters (a few small dicts)."""
    return store.reporting.counters()


__all__ = ["Counters", "read_counters"]
