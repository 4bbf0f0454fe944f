"""The blocks a transfer copies now (StoreState.in_flight): block id -> the TransferGroup copying it.

Registered per group when a batch is prepared and settled per group when it completes, each in
a few C-level dict operations over the group's ids (no Python step per block). Between those, a
block leaves early only by `pop` (it was freed or found corrupt: its copy is cancelled) and a
step cancels a background move by `cancel` (the block stays in flight until its batch completes,
so nothing else moves it meanwhile). A block in flight moves only by its own transfer: that is
why `complete` may trust a group's source slots for every block still registered.

Reading it: `block_id in in_flight`, `len`, iteration over ids, `contains_mask(ids)` for a whole
array, `groups()` for the live groups (kind, direction, batch mode), `in_flight[block_id]` or
`get(block_id)` for a `Flight` (one block's view, whose `cancelled` can be set). For the callers
written against the per-block map, `items()` yields (block id, its group): a group has `batch`
and `kind` as the old per-block transfer had; `any_moving(ids, mode)` and `cancel_moves(ids, mode)`
answer a step's two questions (its blocks in another caller's move; cancel background moves of
them) per group instead.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .batches import TransferGroup
from .copies import BACKUP


class Flight:
    """One block of a group in flight (made on demand: a cancel, a look at one block)."""

    __slots__ = ("group", "position")

    def __init__(self, group: TransferGroup, position: int):
        self.group, self.position = group, position

    @property
    def block_id(self) -> int:
        return int(self.group.block_ids[self.position])

    @property
    def batch(self):
        return self.group.batch

    @property
    def kind(self) -> str:
        return self.group.kind

    @property
    def src_tier(self) -> int:
        return self.group.src_tier

    @property
    def dst_tier(self) -> int:
        return self.group.dst_tier

    @property
    def src_slot(self) -> int:
        return int(self.group.src_slots[self.position])

    @property
    def dst_slot(self) -> int:
        return int(self.group.dst_slots[self.position])

    @property
    def cancelled(self) -> bool:
        return bool(self.group.cancelled[self.position])

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        self.group.cancelled[self.position] = bool(value)


class InFlight:
    """See the module docstring. Runs under the store's lock (its callers hold it)."""

    def __init__(self) -> None:
        self._group_of: dict[int, TransferGroup] = {}
        # the same dict, for reading only: `if in_flight.blocks:` asks "anything in flight?" without a
        # Python call (a decode step asks it twice: opening.open_decode)
        self.blocks = self._group_of
        self._groups: dict[TransferGroup, bool] = {}  # live groups, in the order they were added

    # ---- changes ---------------------------------------------------------------------------------
    def add(self, group: TransferGroup) -> None:
        """Every block of `group` is in flight from now on (none of them may be in flight already)."""
        if len(group):
            self._group_of.update(dict.fromkeys(group.block_ids.tolist(), group))
            self._groups[group] = True

    def settle(self, group: TransferGroup) -> None:
        """`group`'s batch completed: its blocks still registered are in flight no more."""
        if not self._groups.pop(group, False):
            return
        if not self._groups:  # it was the only group in flight: every entry is one of its blocks
            self._group_of.clear()
            return
        ids = group.block_ids[~group.gone] if group.gone.any() else group.block_ids
        deque(map(self._group_of.__delitem__, ids.tolist()), maxlen=0)

    def pop(self, block_id: int, default=None) -> Flight | None:
        """Take the block out of flight early (it is being freed or marked corrupt): its copy is
        cancelled. Returns its Flight, or `default` when it was not in flight."""
        group = self._group_of.pop(block_id, None)
        if group is None:
            return default
        position = group.position(block_id)
        group.gone[position] = True
        group.cancelled[position] = True
        return Flight(group, position)

    def cancel(self, block_id: int) -> bool:
        """Cancel the block's move (it stays in flight until its batch completes); False when it
        is not in flight."""
        group = self._group_of.get(block_id)
        if group is None:
            return False
        group.cancelled[group.position(block_id)] = True
        return True

    def cancel_moves(self, block_ids, mode: str) -> int:
        """Cancel the moves (not backups: they do not move their block) that batches of `mode` have
        in flight of any of `block_ids` (a set); returns how many (a step starts using them)."""
        cancelled = 0
        for group in self._moving_groups(mode):
            hit = np.fromiter(map(block_ids.__contains__, group.block_ids.tolist()), dtype=bool, count=len(group))
            hit &= ~group.gone & ~group.cancelled
            if hit.any():
                group.cancelled |= hit
                cancelled += int(hit.sum())
        return cancelled

    # ---- reading ---------------------------------------------------------------------------------
    def any_moving(self, block_ids, mode: str) -> bool:
        """Whether a batch of `mode` has a move (not a backup) of any of `block_ids` (a set) in flight."""
        group_of = self._group_of
        if not group_of:
            return False
        if len(block_ids) <= len(group_of):
            groups = (group_of.get(b) for b in block_ids)
            return any(g is not None and g.batch.mode == mode and g.kind != BACKUP for g in groups)
        return any(bool((np.fromiter(map(block_ids.__contains__, g.block_ids.tolist()), dtype=bool, count=len(g))
                         & ~g.gone).any()) for g in self._moving_groups(mode))

    def _moving_groups(self, mode: str) -> list[TransferGroup]:
        return [g for g in self._groups if g.batch.mode == mode and g.kind != BACKUP]

    def __contains__(self, block_id) -> bool:
        return block_id in self._group_of

    def contains_mask(self, block_ids: list[int]) -> np.ndarray:
        """Which of `block_ids` (a list of ints) are in flight, as a bool array."""
        group_of = self._group_of
        if not group_of:
            return np.zeros(len(block_ids), dtype=bool)
        return np.fromiter(map(group_of.__contains__, block_ids), dtype=bool, count=len(block_ids))

    def __len__(self) -> int:
        return len(self._group_of)

    def __bool__(self) -> bool:
        return bool(self._group_of)

    def __iter__(self):
        return iter(self._group_of)

    def keys(self):
        return self._group_of.keys()

    def items(self):
        """(block id, the TransferGroup copying it) for every block in flight."""
        return self._group_of.items()

    def groups(self) -> list[TransferGroup]:
        """The groups with blocks in flight (their batches not completed yet)."""
        return list(self._groups)

    def get(self, block_id: int, default=None) -> Flight | None:
        group = self._group_of.get(block_id)
        return default if group is None else Flight(group, group.position(block_id))

    def __getitem__(self, block_id: int) -> Flight:
        flight = self.get(block_id)
        if flight is None:
            raise KeyError(block_id)
        return flight


__all__ = ["InFlight", "Flight"]
