"""Blocks as arrays: where a batch of blocks lies, and which of them a plan must leave alone. No torch.

The move path (plans, transfer batches) works on int64 arrays of block ids. These helpers ask the
index (any object with `peek(block_id) -> entry | None`, the entry having `tier` and `slot`) and
the leave-alone predicates once per array, in C-level loops: no Python frame per block of our own.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable

import numpy as np

ABSENT = -2  # the tier (and slot) `placements_of` gives a block that is not in the index

_TIER, _SLOT = attrgetter("tier"), attrgetter("slot")


def as_ids(block_ids) -> np.ndarray:
    """Block ids as a one-dimensional int64 array (not copied when it is one already)."""
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)


def placements_of(index, block_ids) -> tuple[np.ndarray, np.ndarray]:
    """(tier, slot) of each block as two int64 arrays; ABSENT for a block not in the index (a
    corrupt block's tier is DROPPED, as its entry says)."""
    ids = as_ids(block_ids)
    count = len(ids)
    entries = list(map(index.peek, ids.tolist()))
    try:
        return (np.fromiter(map(_TIER, entries), dtype=np.int64, count=count),
                np.fromiter(map(_SLOT, entries), dtype=np.int64, count=count))
    except AttributeError:  # some block is not in the index (its entry is None)
        pass
    present = np.fromiter((e is not None for e in entries), dtype=bool, count=count)
    found = [e for e in entries if e is not None]
    tiers = np.full(count, ABSENT, dtype=np.int64)
    slots = np.full(count, ABSENT, dtype=np.int64)
    tiers[present] = np.fromiter(map(_TIER, found), dtype=np.int64, count=len(found))
    slots[present] = np.fromiter(map(_SLOT, found), dtype=np.int64, count=len(found))
    return tiers, slots


def contains_mask(container, block_ids: list[int]) -> np.ndarray:
    """Which of `block_ids` (a list of ints) are in `container` (a set or dict), as a bool array."""
    if not container:
        return np.zeros(len(block_ids), dtype=bool)
    return np.fromiter(map(container.__contains__, block_ids), dtype=bool, count=len(block_ids))


def leave_alone_mask(leave_alone: Callable[[int], bool] | None, block_ids) -> np.ndarray:
    """Which blocks the predicate `leave_alone` names (True: a plan must not move it). A predicate
    with a `mask(ids)` method (state.LeaveAlone) answers for the whole array at once; any other
    callable is asked block by block."""
    ids = as_ids(block_ids)
    if leave_alone is None or not len(ids):
        return np.zeros(len(ids), dtype=bool)
    mask = getattr(leave_alone, "mask", None)
    if mask is not None:
        return mask(ids)
    return np.fromiter(map(leave_alone, ids.tolist()), dtype=bool, count=len(ids))


def first_occurrences(block_ids: np.ndarray) -> np.ndarray:
    """A bool mask of the first occurrence of each id (a repeated move of one block is left out)."""
    if len(block_ids) < 2 or (np.diff(block_ids) > 0).all():  # ascending ids (a chat's, usually) repeat none
        return np.ones(len(block_ids), dtype=bool)
    keep = np.zeros(len(block_ids), dtype=bool)
    _, first = np.unique(block_ids, return_index=True)
    keep[first] = True
    return keep


__all__ = ["ABSENT", "as_ids", "placements_of", "contains_mask", "leave_alone_mask", "first_occurrences"]
