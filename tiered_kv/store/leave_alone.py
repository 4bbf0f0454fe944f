"""The predicate a plan gets of the blocks it must leave alone (StoreState.is_pinned, leave_alone_for,
the mover's), answering one block at a time or, by `mask`, a whole array of ids at once."""

from __future__ import annotations

import numpy as np

from ..scheduler.arrays import contains_mask


class LeaveAlone:
    """A plan's predicate of blocks it must leave alone (True: do not move or drop it): blocks in
    flight, pinned by a running step other than `except_owner`'s, in `protect`, or in any of the
    `extra` containers (sets, dicts). Callable per block, as every plan predicate is, and
    `mask(ids)` answers for an int64 array at once (the move path asks that way: arrays.py)."""

    __slots__ = ("state", "except_owner", "protect", "extra")

    def __init__(self, state, except_owner: int | None = None, protect=frozenset(), extra=()):
        self.state, self.except_owner, self.protect, self.extra = state, except_owner, protect, tuple(extra)

    def __call__(self, block_id: int) -> bool:
        if block_id in self.state.in_flight or block_id in self.protect or any(block_id in c for c in self.extra):
            return True
        return self.state.is_pinned_by_step(block_id, self.except_owner)

    def mask(self, block_ids: np.ndarray) -> np.ndarray:
        ids = block_ids.tolist()
        mask = self.state.in_flight.contains_mask(ids)
        for container in (self.protect, *self.extra):
            if container:
                mask |= contains_mask(container, ids)
        if self.state.has_pins:
            mask |= self.state.pinned_mask(ids, self.except_owner)
        return mask


__all__ = ["LeaveAlone"]
