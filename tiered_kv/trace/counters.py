"""The store counters a trace reads at every step, in one place.

Only counters that cost nothing to read: the slot pools' used counts and the running totals of
the store's metrics (`store.metrics`, read through the store's and executor's properties; with
`metrics.enabled: false` the moves and hits read 0). Never `store.stats()` (it drains deferred
work and computes layout figures: too costly for every decode step).
"""

from __future__ import annotations

from typing import NamedTuple

from ..scheduler import TIER_NAMES

_NO_MOVES = {"promotions": 0, "demotions": 0, "evictions": 0}


class Counters(NamedTuple):
    used_blocks: tuple[int, ...]  # per tier, in TIER_NAMES order
    capacity_blocks: tuple[int, ...]
    bytes_moved: dict[str, int]  # cumulative, per direction ("hot->warm": bytes)
    num_moves: dict[str, int]  # cumulative promotions, demotions, evictions (blocks)
    bytes_background: int  # cumulative bytes the background mover moved
    turn_hits: dict[str, int]  # blocks turns began needing, by the tier they were found in
    turn_blocks: int


def read_counters(store) -> Counters:
    """A snapshot of `store`'s cheap counters (a few small dicts; takes the re-entrant store lock)."""
    with store.lock:
        pools = store.pools
        executor = store._executor  # None until the store is bound to a layout
        return Counters(
            used_blocks=tuple(pool.num_used for pool in pools) or (0,) * len(TIER_NAMES),
            capacity_blocks=tuple(pool.num_slots for pool in pools) or (0,) * len(TIER_NAMES),
            bytes_moved=dict(store.bytes_moved),
            num_moves=dict(executor.num_moves) if executor is not None else dict(_NO_MOVES),
            bytes_background=executor.bytes_background if executor is not None else 0,
            turn_hits=dict(store.turn_hits),
            turn_blocks=store.turn_blocks,
        )
