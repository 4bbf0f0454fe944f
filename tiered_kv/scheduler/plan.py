"""The one object that crosses the scheduler -> store boundary: a plan of block moves, as arrays.
No torch.

A plan's moves are four int64 arrays of one length, in the order they are to be applied: block ids,
source tiers, destination tiers (a tier index, or DROPPED: an eviction) and destination slots
(ANY_SLOT: any free slot of the destination; else that particular slot, as compaction asks). A
planner may add what it read of the sources: `src_slots` (UNKNOWN_SLOT where it did not look) and
the index's `placement_version` then; while that version is current, the store need not look the
blocks up again (nothing changed tier or slot since). The store reserves, copies and commits them by arrays too (store/transfers.py): nothing on the move
path makes a Python object per block. `Move` remains the one-move value that tests, logs and
hand-built plans use; `Plan.moves` and iterating a `MoveList` build them on demand only.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

from ..blocks import COLD, DROPPED, HOT, TIER_NAMES, WARM  # noqa: F401  (tier ids live in blocks.py)

ANY_SLOT = -1  # a move's destination slot: any free one of its tier
UNKNOWN_SLOT = -1  # a move's source slot the planner did not read
_EMPTY = np.zeros(0, dtype=np.int64)


class Move(NamedTuple):
    block_id: int
    src_tier: int
    dst_tier: int  # a tier index, or DROPPED
    dst_slot: int | None = None  # a particular free slot of dst_tier (compaction), else any

    @property
    def is_eviction(self) -> bool:
        return self.dst_tier == DROPPED

    def __str__(self) -> str:
        dst = "dropped" if self.is_eviction else TIER_NAMES[self.dst_tier]
        if self.dst_slot is not None:
            dst += f" slot {self.dst_slot}"
        return f"block {self.block_id}: {TIER_NAMES[self.src_tier]} -> {dst}"


def _ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1) if values is not None else _EMPTY


class Plan:
    """Moves to apply in order, then where each of `num_new_blocks` new blocks goes.

    The store applies the moves first (each one frees a slot in its source tier before the next
    needs it), then allocates `new_block_tiers[i]` for the i-th new block. Built from arrays
    (`Plan.of_arrays`, the scheduler's way) or from a list of `Move` (`Plan(moves=[...])`).
    """

    __slots__ = ("block_ids", "src_tiers", "dst_tiers", "dst_slots", "new_block_tiers", "src_slots",
                 "placement_version", "_moves")

    def __init__(self, moves: Iterable[Move] = (), new_block_tiers: Iterable[int] = ()):
        moves = list(moves)
        self.block_ids = np.fromiter((m[0] for m in moves), dtype=np.int64, count=len(moves))
        self.src_tiers = np.fromiter((m[1] for m in moves), dtype=np.int64, count=len(moves))
        self.dst_tiers = np.fromiter((m[2] for m in moves), dtype=np.int64, count=len(moves))
        self.dst_slots = np.fromiter((ANY_SLOT if len(m) < 4 or m[3] is None else m[3] for m in moves),
                                     dtype=np.int64, count=len(moves))
        self.new_block_tiers = list(new_block_tiers)
        self.src_slots, self.placement_version = None, None
        self._moves = None

    @classmethod
    def of_arrays(cls, block_ids, src_tiers, dst_tiers, dst_slots=None, new_block_tiers: Iterable[int] = ()) -> "Plan":
        """A plan of the moves (block_ids[i], src_tiers[i] -> dst_tiers[i], at dst_slots[i] or any
        slot when dst_slots is None); the arrays are used as given (not copied)."""
        plan = cls.__new__(cls)
        plan.block_ids = _ints(block_ids)
        count = len(plan.block_ids)
        plan.src_tiers = _ints(src_tiers)
        plan.dst_tiers = _ints(dst_tiers)
        plan.dst_slots = _ints(dst_slots) if dst_slots is not None else np.full(count, ANY_SLOT, dtype=np.int64)
        if not len(plan.src_tiers) == len(plan.dst_tiers) == len(plan.dst_slots) == count:
            raise ValueError(f"a plan's arrays differ in length: {count} blocks, {len(plan.src_tiers)} sources, "
                             f"{len(plan.dst_tiers)} destinations, {len(plan.dst_slots)} slots")
        plan.new_block_tiers = list(new_block_tiers)
        plan.src_slots, plan.placement_version = None, None
        plan._moves = None
        return plan

    def with_sources(self, src_slots: np.ndarray, placement_version) -> "Plan":
        """Record the source slots the planner read (UNKNOWN_SLOT where it did not) at the index's
        `placement_version`; returns the plan."""
        if len(src_slots) != self.num_moves:
            raise ValueError(f"{len(src_slots)} source slots for {self.num_moves} moves")
        self.src_slots, self.placement_version = _ints(src_slots), placement_version
        return self

    @property
    def num_moves(self) -> int:
        return len(self.block_ids)

    @property
    def moves(self) -> list[Move]:
        """The moves as `Move` values (built on first use: for tests, logs and hand-made plans)."""
        if self._moves is None:
            self._moves = [Move(b, s, d, None if slot == ANY_SLOT else slot) for b, s, d, slot in
                           zip(self.block_ids.tolist(), self.src_tiers.tolist(), self.dst_tiers.tolist(),
                               self.dst_slots.tolist())]
        return self._moves

    def take(self, index) -> "Plan":
        """The moves at `index` (a slice, a boolean mask or positions), in that order; no new blocks."""
        plan = Plan.of_arrays(self.block_ids[index], self.src_tiers[index], self.dst_tiers[index],
                              self.dst_slots[index])
        if self.src_slots is not None:
            plan.with_sources(self.src_slots[index], self.placement_version)
        return plan

    def head(self, count: int) -> "Plan":
        """The first `count` moves (and the new blocks)."""
        plan = self.take(slice(0, count))
        plan.new_block_tiers = list(self.new_block_tiers)
        return plan

    def is_empty(self) -> bool:
        return not self.num_moves and not self.new_block_tiers

    def count(self, src_tier: int, dst_tier: int) -> int:
        return int(np.count_nonzero((self.src_tiers == src_tier) & (self.dst_tiers == dst_tier)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.new_block_tiers == other.new_block_tiers and np.array_equal(self.block_ids, other.block_ids)
                and np.array_equal(self.src_tiers, other.src_tiers) and np.array_equal(self.dst_tiers, other.dst_tiers)
                and np.array_equal(self.dst_slots, other.dst_slots))

    __hash__ = None  # mutable arrays

    def __repr__(self) -> str:
        return f"Plan(moves={self.moves!r}, new_block_tiers={self.new_block_tiers!r})"


class MoveList:
    """Moves that happened, in the order they landed, as chunks of arrays (block ids, source tier,
    destination tier): one chunk per committed group, not an object per block. Iterating yields
    `Move` values, built on demand (for callers that still read moves one by one)."""

    __slots__ = ("_chunks", "_len")

    def __init__(self, moves: Iterable[Move] = ()):
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._len = 0
        moves = list(moves)
        if moves:
            plan = Plan(moves)
            self.add_arrays(plan.block_ids, plan.src_tiers, plan.dst_tiers)

    def add(self, block_ids: np.ndarray, src_tier: int, dst_tier: int) -> None:
        """Moves of `block_ids` from one tier to another (a committed group)."""
        count = len(block_ids)
        if count:
            self._chunks.append((block_ids, np.full(count, src_tier, dtype=np.int64),
                                 np.full(count, dst_tier, dtype=np.int64)))
            self._len += count

    def add_arrays(self, block_ids: np.ndarray, src_tiers: np.ndarray, dst_tiers: np.ndarray) -> None:
        if len(block_ids):
            self._chunks.append((_ints(block_ids), _ints(src_tiers), _ints(dst_tiers)))
            self._len += len(block_ids)

    def extend(self, other: "MoveList") -> None:
        self._chunks += other._chunks
        self._len += other._len

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block ids, source tiers, destination tiers), in landing order."""
        if not self._chunks:
            return _EMPTY, _EMPTY, _EMPTY
        if len(self._chunks) > 1:
            self._chunks = [tuple(np.concatenate(parts) for parts in zip(*self._chunks))]
        return self._chunks[0]

    def block_ids(self) -> np.ndarray:
        return self.arrays()[0]

    def counts(self) -> dict[tuple[int, int], int]:
        """Moves per (source tier, destination tier)."""
        out: dict[tuple[int, int], int] = {}
        for _, src, dst in self._chunks:
            if (src == src[0]).all() and (dst == dst[0]).all():
                key = (int(src[0]), int(dst[0]))
                out[key] = out.get(key, 0) + len(src)
                continue
            pairs, counts = np.unique(np.stack((src, dst)), axis=1, return_counts=True)
            for (s, d), n in zip(pairs.T.tolist(), counts.tolist()):
                out[(s, d)] = out.get((s, d), 0) + n
        return out

    def any_down(self) -> bool:
        """Some move went down a tier (room made for a step, a demotion)."""
        return any(bool((dst > src).any()) for _, src, dst in self._chunks)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self):
        for ids, src, dst in self._chunks:
            yield from map(Move, ids.tolist(), src.tolist(), dst.tolist())

    def __reversed__(self):
        ids, src, dst = self.arrays()
        return map(Move, ids[::-1].tolist(), src[::-1].tolist(), dst[::-1].tolist())

    def __getitem__(self, i: int) -> Move:
        ids, src, dst = self.arrays()
        return Move(int(ids[i]), int(src[i]), int(dst[i]))

    def __eq__(self, other) -> bool:
        if isinstance(other, (MoveList, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"MoveList({list(self)!r})"


__all__ = ["Move", "Plan", "MoveList", "ANY_SLOT", "UNKNOWN_SLOT", "HOT", "WARM", "COLD", "DROPPED", "TIER_NAMES"]
