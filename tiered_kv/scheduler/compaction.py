"""Compaction of the hot pool: moves within the hot tier that lay each sequence's hot blocks out
in consecutive slots, in token order. Ids and ints only, no torch.

Why: the hot slab is `[L, 2, H, num_slots * block_size, D]`; a sequence whose blocks sit in
consecutive slots is read by attention as one slice of it (no copy); any other is gathered with
an index_select per layer per step. Allocation keeps growing sequences contiguous when it can
(SlotPool.allocate_run); this repairs what it could not.

When. A sequence (one row of a live chat) needs repair when its contiguity, the share of its hot
blocks in its longest run of consecutive slots, is below `min_contiguity`, or is below 1 while the
pool's fragmentation (1 - largest free run / free slots) is above `max_fragmentation`. Free
space split into gaps between sequences is not repaired for its own sake: those gaps are where
the sequences grow in place (allocation spreads them out on purpose).

How. One sequence per call (the one repaired last time while it still needs it, else the least
contiguous): it goes to the window of its own length whose cost is least: one per block that
must move in, plus, per other block in the way, 1 for a block of no live sequence, 1 + that
sequence's length for a block of a *smaller* sequence (it will be relocated in turn), and never
a pinned or shared block, nor a block of an equal or larger sequence (so two sequences can
never take slots from each other in turn). When no window is left, room is opened: the
sequence's window is chosen as if it could take any unpinned slot, and the longest larger
sequence in it is moved aside, whole, to a window of its own (elsewhere, or shifted into free
slots beside it; opening room for that one first the same way, a few levels deep). Among
windows of least cost it prefers those followed by free headroom (a quarter of its length, at
least one block, to grow into), then the middle of the longest run of such windows (its start
when that is slot 0). Blocks in the way move out to free slots beyond the window and headroom,
smallest gaps first, at a gap's end (leaving the room after the sequence before the gap).
Every move goes to a slot free now; moves that must wait for a slot to empty are planned by a
later call, afresh.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from .plan import HOT, Move

HEADROOM_SHARE = 0.25  # free slots wanted after a relocated sequence, as a share of its length
MAX_OPEN_DEPTH = 3  # sequences moved aside, one for the next, to open a window for one in need
NO_BLOCK = -1  # block_at of a free slot
RESERVED = -2  # block_at of a slot in use by nothing the compactor may move


@dataclass(frozen=True)
class RowLayout:
    """One sequence: a chat's row, its hot blocks in token order and the slot of each."""

    owner: int
    row: int
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def key(self) -> tuple[int, int]:
        return self.owner, self.row

    def longest_run(self) -> int:
        run = self.__dict__.get("_longest_run")  # computed once (the row never changes)
        if run is None:
            run = self.__dict__["_longest_run"] = longest_run(self.slots)
        return run

    def contiguity(self) -> float:
        return self.longest_run() / self.num_blocks if self.block_ids else 1.0


@dataclass
class Compaction:
    """What one call found: the moves (possibly none), the sequence they repair, and whether a
    sequence that needs repair was skipped because a running step pins its blocks (ask again
    once it ends)."""

    moves: list[Move] = field(default_factory=list)
    repairing: tuple[int, int] | None = None
    waiting: bool = False


def longest_run(slots: Sequence[int]) -> int:
    """Length of the longest stretch of `slots` where each slot is the one before plus one."""
    if len(slots) < 2:
        return len(slots)
    first = slots[0]
    if slots[-1] - first == len(slots) - 1 and list(slots) == list(range(first, first + len(slots))):
        return len(slots)  # one run (the common case: checked at C speed)
    if len(slots) <= 32:  # short rows: a plain loop beats numpy's call overhead
        best = run = 1
        for before, after in zip(slots, slots[1:]):
            run = run + 1 if after == before + 1 else 1
            best = max(best, run)
        return best
    breaks = np.flatnonzero(np.diff(np.asarray(slots, dtype=np.int64)) != 1)
    edges = np.concatenate(([-1], breaks, [len(slots) - 1]))
    return int(np.diff(edges).max())


def chat_contiguity(rows: Sequence[RowLayout]) -> float | None:
    """A chat's contiguity: its rows' longest runs over its hot blocks (None: no hot block)."""
    num_blocks = sum(row.num_blocks for row in rows)
    return sum(row.longest_run() for row in rows) / num_blocks if num_blocks else None


def fragmentation(num_free: int, largest_free_run: int) -> float:
    """1 - largest free run / free slots; 0.0 when nothing is free."""
    return 1.0 - largest_free_run / num_free if num_free else 0.0


def needs_repair(row: RowLayout, pool_fragmentation: float, max_fragmentation: float, min_contiguity: float) -> bool:
    contiguity = row.contiguity()
    return contiguity < min_contiguity or (contiguity < 1.0 and pool_fragmentation > max_fragmentation)


def plan_compaction(
    block_at: Sequence[int],
    rows: Sequence[RowLayout],
    pinned: Collection[int],
    shared: Collection[int],
    *,
    pool_fragmentation: float,
    max_fragmentation: float,
    min_contiguity: float,
    max_moves: int,
    prefer: tuple[int, int] | None = None,
    skip: Collection[tuple[int, int]] = frozenset(),
) -> Compaction:
    """Moves (at most `max_moves`, each to a slot free now) toward laying out one sequence that
    needs repair in consecutive slots.

    `block_at[s]`: the block in hot slot s, NO_BLOCK when it is free, RESERVED when it is in use
    by nothing that may move. `rows`: every live sequence's hot blocks in token order. `pinned`:
    blocks a running step (or a move in flight) uses now; `shared`: blocks held by more than one
    sequence. Neither kind is moved. `prefer`: the sequence the previous call repaired (its
    repair goes on first, so two half-done repairs never undo each other); `skip`: sequences
    not to repair (the caller gave up on them)."""
    needy = [i for i, row in enumerate(rows) if row.num_blocks and row.key not in skip
             and needs_repair(row, pool_fragmentation, max_fragmentation, min_contiguity)]
    if not needy or max_moves < 1:
        return Compaction()
    needy.sort(key=lambda i: (rows[i].key != prefer, rows[i].contiguity(), -rows[i].num_blocks, rows[i].key))
    pool = _Pool(block_at, rows, pinned, shared)
    result = Compaction()
    for i in needy:
        if any(b in pool.pinned for b in rows[i].block_ids):
            result.waiting = True  # its chat is running a step now
            if rows[i].key == prefer:
                return result  # a repair under way goes on first, once that step ends
            continue
        moves = pool.moves_for(i, max_moves)
        if moves:
            result.moves, result.repairing = moves, rows[i].key
            return result
    return result


class _Pool:
    """The hot pool as arrays, shared by the candidate sequences of one call."""

    def __init__(self, block_at: Sequence[int], rows: Sequence[RowLayout], pinned, shared):
        self.rows = rows
        self.block_at = np.asarray(block_at, dtype=np.int64)
        self.num_slots = len(self.block_at)
        self.used = self.block_at != NO_BLOCK
        self.num_free = int(self.num_slots - self.used.sum())
        self.pinned = pinned if isinstance(pinned, (set, frozenset)) else frozenset(pinned)
        fixed = list(set(self.pinned) | set(shared))
        self.fixed = self.block_at == RESERVED
        if fixed:
            self.fixed |= self.used & np.isin(self.block_at, np.asarray(fixed, dtype=np.int64))
        self.row_at = np.full(self.num_slots, -1, dtype=np.int64)  # the sequence owning each slot
        for i, row in enumerate(rows):
            if row.slots:
                self.row_at[np.asarray(row.slots, dtype=np.int64)] = i
        # a sequence may only displace smaller ones (by length, then owner and row)
        order = sorted(range(len(rows)), key=lambda i: (rows[i].num_blocks, rows[i].key))
        self.rank = np.empty(len(rows), dtype=np.int64)
        self.rank[order] = np.arange(len(rows))
        self.sizes = np.asarray([row.num_blocks for row in rows], dtype=np.int64)

    def moves_for(self, i: int, max_moves: int) -> list[Move]:
        headroom = _headroom(self.rows[i].num_blocks)
        start = self._best_window(i, headroom)
        moves = self._moves_into(i, start, headroom) if start is not None else self._moves_to_open(i, headroom)
        return moves[:max_moves]

    def _moves_to_open(self, i: int, headroom: int, keep_out: np.ndarray | None = None, depth: int = 0) -> list[Move]:
        """No window holds sequence i without taking slots of a sequence at least as long: pick
        the window it would take if it could and move the longest such sequence in it, whole, to
        a window of its own beyond: elsewhere, or shifted into free slots beside it, opening
        room for it first the same way when it has none (up to MAX_OPEN_DEPTH deep). The next
        calls carry on (this one stays the sequence under repair), then move sequence i in."""
        start = self._best_window(i, headroom, displace_any=True, keep_out=keep_out)
        if start is None:
            return []
        n = self.rows[i].num_blocks
        owners = self.row_at[start:start + n]
        in_window = [j for j in np.unique(owners[owners >= 0]).tolist() if j != i and self.rank[j] > self.rank[i]]
        if not in_window:
            return []
        j = max(in_window, key=lambda k: self.rank[k])
        inner_keep_out = np.zeros(self.num_slots, dtype=bool) if keep_out is None else keep_out.copy()
        inner_keep_out[start:start + n] = True  # (i's blocks elsewhere may be moved out of the way)
        own_headroom = _headroom(self.rows[j].num_blocks)
        destination = self._best_window(j, own_headroom, keep_out=inner_keep_out)
        if destination is not None:
            return self._moves_into(j, destination, own_headroom, inner_keep_out)
        if depth + 1 < MAX_OPEN_DEPTH:
            return self._moves_to_open(j, own_headroom, inner_keep_out, depth + 1)
        return []

    def _best_window(self, i: int, headroom: int, displace_any: bool = False,
                     keep_out: np.ndarray | None = None) -> int | None:
        """Where sequence i should lie (the start slot), None when it cannot move or is in place.
        `displace_any`: blocks of longer sequences may be moved too; `keep_out`: slots it may not use."""
        row, num_slots = self.rows[i], self.num_slots
        n = row.num_blocks
        if n > num_slots:
            return None
        slots = np.asarray(row.slots, dtype=np.int64)
        mine = np.zeros(num_slots, dtype=bool)
        mine[slots] = True
        others = self.used & ~mine
        # what each slot costs to empty, and whether it can be emptied at all
        owner = self.row_at
        blocked = self.fixed & ~mine
        if keep_out is not None:
            blocked |= keep_out
        cost = np.zeros(num_slots, dtype=np.int64)
        cost[others & (owner < 0)] = 1
        of_rows = others & (owner >= 0)
        if of_rows.any():
            owners = owner[of_rows]
            displaceable = (self.rank[owners] < self.rank[i]) | displace_any
            cost[of_rows] = np.where(displaceable, 1 + self.sizes[owners], 0)
            blocked[of_rows] |= ~displaceable
        num_windows = num_slots - n + 1

        def window_sums(values: np.ndarray, width: int) -> np.ndarray:
            sums = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
            return sums[width:width + num_windows] - sums[:num_windows]

        feasible = window_sums(blocked, n) == 0
        num_in_way = window_sums(others, n)
        free_in_window = n - window_sums(self.used, n)
        feasible &= num_in_way <= self.num_free - free_in_window  # room to put them elsewhere
        offsets = slots - np.arange(n)
        in_range = (offsets >= 0) & (offsets < num_windows)
        matches = np.bincount(offsets[in_range], minlength=num_windows)[:num_windows]
        my_fixed = self.fixed[slots]
        if my_fixed.any():  # shared blocks of this sequence stay: the window must keep them in place
            allowed = np.unique(offsets[my_fixed])
            if len(allowed) != 1 or not 0 <= allowed[0] < num_windows:
                return None
            only = np.zeros(num_windows, dtype=bool)
            only[allowed[0]] = True
            feasible &= only
        total = (n - matches) + window_sums(cost, n)
        # headroom after the window: slots of others there (beyond the pool counts as taken)
        crowded = self._headroom_taken(others, n, headroom, num_windows)
        score = total * (headroom + 1) + crowded
        if not feasible.any():
            return None
        best = score[feasible].min()
        candidates = np.flatnonzero(feasible & (score == best))
        if total[candidates[0]] == 0:
            return None  # already in place
        breaks = np.flatnonzero(np.diff(candidates) != 1)
        run_starts = np.concatenate(([0], breaks + 1))
        run_ends = np.concatenate((breaks + 1, [len(candidates)]))
        k = int(np.argmax(run_ends - run_starts))
        first, last = int(candidates[run_starts[k]]), int(candidates[run_ends[k] - 1])
        return first if first == 0 else first + (last - first) // 2

    @staticmethod
    def _headroom_taken(others: np.ndarray, n: int, headroom: int, num_windows: int) -> np.ndarray:
        """Per window start w: slots in [w + n, w + n + headroom) held by others or past the end."""
        padded = np.concatenate((others.astype(np.int64), np.ones(headroom, dtype=np.int64)))
        sums = np.concatenate(([0], np.cumsum(padded)))
        starts = np.arange(num_windows) + n
        return sums[starts + headroom] - sums[starts]

    def _moves_into(self, i: int, start: int, headroom: int, keep_out: np.ndarray | None = None) -> list[Move]:
        row = self.rows[i]
        n = row.num_blocks
        targets = np.arange(start, start + n)
        occupants = self.block_at[targets]
        position = {block_id: k for k, block_id in enumerate(row.block_ids)}
        in_way = [b for b in occupants.tolist() if b != NO_BLOCK and b not in position]
        # free slots the blocks in the way may go to: not the window, headroom last
        spare = ~self.used
        if keep_out is not None:
            spare &= ~keep_out
        spare[start:start + n] = False
        headroom_end = min(self.num_slots, start + n + headroom)
        wanted_room = spare[start + n:headroom_end].copy()
        spare[start + n:headroom_end] = False
        wanted = max(1, len(in_way))  # with none in the way, one spare slot may break a cycle
        destinations = _best_fit(spare, wanted)
        destinations += _best_fit(wanted_room, wanted - len(destinations), offset=start + n)
        moves = [Move(block_id, HOT, HOT, dst_slot=dst) for block_id, dst in zip(in_way, destinations)]
        for block_id, slot, target, occupant in zip(row.block_ids, row.slots, targets.tolist(), occupants.tolist()):
            if slot != target and occupant == NO_BLOCK:
                moves.append(Move(block_id, HOT, HOT, dst_slot=target))
        if not moves and destinations:  # the window holds only this sequence's blocks, out of order
            misplaced = next(b for k, b in enumerate(occupants.tolist()) if b != NO_BLOCK and position[b] != k)
            moves.append(Move(misplaced, HOT, HOT, dst_slot=destinations[0]))  # out of the way, back next time
        return moves


def _headroom(num_blocks: int) -> int:
    return max(1, math.ceil(num_blocks * HEADROOM_SHARE))


def _best_fit(free: np.ndarray, count: int, offset: int = 0) -> list[int]:
    """Up to `count` free slots in the order blocks should fill them: the smallest gaps first,
    from each the slots at its end (its start is the room of whatever precedes the gap), in
    ascending order (blocks moved out together stay in order)."""
    if count <= 0 or not free.any():
        return []
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    slots: list[int] = []
    for k in np.lexsort((starts, ends - starts)).tolist():
        take = min(int(ends[k] - starts[k]), count - len(slots))
        slots.extend(range(offset + int(ends[k]) - take, offset + int(ends[k])))  # ascending: blocks keep their order
        if len(slots) == count:
            break
    return slots
