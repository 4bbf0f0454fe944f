"""The access log's per-block storage (rows) and its runs of repeated steps (lanes). No torch.

Rows. AccessLog (access_log.py) keeps each block's signals in numpy arrays indexed by a *row*, one
row per live block: one the log saw and the store has not removed (`forget`). A removed block's row
goes to a free list and is handed to the next new block, so the arrays grow with the most blocks
alive at once, never with the ids handed out (ids are never reused). A sorted array of ids (removed
ones stay as tombstones until they are a third of it) maps ids to rows with one searchsorted.

Lanes. A chat's steps read the same blocks again and again (a decode step adds a block every
block_size tokens). A lane holds a chat's block ids (the array its steps pass), their rows, and
its pending *segment*: the steps since it was last folded in, with one turn clock, heat and CS,
kept as counts (how many, the first and the last, whether two were more than a window apart).
`flush` folds a segment into the rows at once; the result is bitwise what recording each step
would have given (`apply_reads`), because a lane *claims* its rows: no other step reads a claimed
row while its segment is pending. A row a second lane reads too becomes *shared*: its pending
reads are folded in first, and from then on every lane that reads it records it at each step, as
before. So a chat costs O(1) a repeated step, plus O(blocks) it shares with other chats' lanes.
Window counts are sums that only signals read: a lane counts its steps in the window and adds
the difference to its rows' counts when signals are read (`apply_window`).
"""

from __future__ import annotations

import numpy as np

MIN_ROWS = 1024
_TWO_53 = 2.0 ** 53


def add_ones(x: np.ndarray, count: int) -> np.ndarray:
    """`x + 1.0`, `count` times, each add rounded as float64 rounds it, in O(log) vector operations:
    adding 1 to a value in [2**e, 2**(e+1)) with e < 53 is exact until the sum crosses 2**(e+1)."""
    x = np.array(x, dtype=np.float64)
    if count <= 0 or not len(x):
        return x
    left = np.full(len(x), count, dtype=np.int64)
    todo = np.arange(len(x))
    while len(todo):
        v, n = x[todo], left[todo]
        top = np.ldexp(1.0, np.frexp(v)[1])  # the next power of two above v
        exact = (v >= 1.0) & (v < _TWO_53)
        j = np.minimum(n, np.ceil(np.where(exact, top - v, 1.0)).astype(np.int64) - 1)
        v, n = v + j, n - j  # (top - v is exact: v >= top / 2)
        more = n > 0
        crossed = v[more] + 1.0  # the one add that may round (or v < 1)
        n[more] = np.where(crossed == v[more], 0, n[more] - 1)  # an add that changed nothing never will
        v[more] = crossed
        x[todo], left[todo] = v, n
        todo = todo[n > 0]
    return x


class Lane:
    """One chat's steps over one array of block ids (module docstring)."""

    __slots__ = ("index", "owner", "ids", "rows", "eager_rows", "eager_ids", "steps", "first", "last", "gap",
                 "turn", "heat_key", "cs", "in_window", "applied")

    def __init__(self, index: int, owner: int, ids: np.ndarray, rows: np.ndarray) -> None:
        self.index, self.owner, self.ids, self.rows = index, owner, ids, rows
        self.eager_rows = self.eager_ids = rows[:0]  # shared rows: recorded at each step
        self.steps = self.first = self.last = 0  # the pending segment: steps, first and last step
        self.gap = False  # two of its steps more than a window apart (CS starts afresh)
        self.turn, self.heat_key, self.cs = 0, float("-inf"), 0.0
        self.in_window = self.applied = 0  # its steps in the window; how many of them its rows count


class BlockRows:
    """The per-row arrays (signals, and which lane claims each row) and the id -> row map."""

    def __init__(self, default_cs: float, window_steps: int, lfu_half_life_turns: float) -> None:
        self.window_steps, self.lfu_half_life_turns = window_steps, lfu_half_life_turns
        i8, f8 = np.int64, np.float64
        self.defaults = {"last_read": (-1, i8), "first_read": (-1, i8), "num_reads": (0.0, f8),
                         "reads_turn": (0.0, f8), "window_reads": (0, i8), "cs": (default_cs, f8),
                         "heat": (-np.inf, f8), "block_id": (-1, i8), "attention": (0.0, f8), "attention_n": (0, i8),
                         "claim": (-1, i8), "shared": (0, i8)}  # claim: a lane's index; shared: lanes reading it
        for name, (default, dtype) in self.defaults.items():
            setattr(self, name, np.full(0, default, dtype=dtype))
        self.num_live = 0
        self._used = 0  # rows handed out at least once
        self._free: list[int] = []
        self._keys = np.zeros(0, dtype=np.int64)  # sorted ids (live, and removed ones as tombstones)
        self._vals = np.zeros(0, dtype=np.int64)  # their rows (-1: a tombstone)
        self._num_keys = self._dead = 0

    def note_attention(self, ids: np.ndarray, masses: np.ndarray, decay: float) -> None:
        """Each block's share of its chat's attention on a sampled step: the mean of its samples
        while it has few, then an average whose past weighs `decay` (a block's first sample is
        taken as it is, not averaged with a zero)."""
        rows = self.rows_for(ids)
        count = self.attention_n[rows] + 1
        weight = np.maximum(1.0 - decay, 1.0 / count)
        self.attention[rows] += (masses - self.attention[rows]) * weight
        self.attention_n[rows] = count

    # ---- id -> row -----------------------------------------------------------------------------
    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each id's position in the sorted ids and whether it is there."""
        n = self._num_keys
        if not n:
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = np.searchsorted(self._keys[:n], ids)
        return pos, self._keys[np.minimum(pos, n - 1)] == ids

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row, -1 for a block the log does not hold."""
        n = self._num_keys
        if not n or not len(ids):
            return np.full(len(ids), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._keys[:n], ids), n - 1)
        return np.where(self._keys[pos] == ids, self._vals[pos], -1)

    def rows_for(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row; a new block gets one (its signals those of a block never read)."""
        rows = self.find(ids)
        missing = rows < 0
        if missing.any():
            new_ids, inverse = np.unique(ids[missing], return_inverse=True)
            new_rows = self._take_rows(len(new_ids))
            self.block_id[new_rows] = new_ids
            self._insert(new_ids, new_rows)
            rows[missing] = new_rows[inverse]
        return rows

    def _take_rows(self, count: int) -> np.ndarray:
        reused = min(count, len(self._free))
        rows = self._free[len(self._free) - reused:]
        del self._free[len(self._free) - reused:]
        fresh = count - reused
        if self._used + fresh > len(self.block_id):
            size = max(self._used + fresh, 2 * len(self.block_id), MIN_ROWS)
            for name, (default, _) in self.defaults.items():
                array = getattr(self, name)
                setattr(self, name, np.concatenate((array, np.full(size - len(array), default, dtype=array.dtype))))
        rows = np.asarray(rows + list(range(self._used, self._used + fresh)), dtype=np.int64)
        self._used += fresh
        for name, (default, _) in self.defaults.items():
            getattr(self, name)[rows] = default
        self.num_live += count
        return rows

    def _insert(self, sorted_ids: np.ndarray, rows: np.ndarray) -> None:
        n = self._num_keys
        if n and sorted_ids[0] <= self._keys[n - 1]:  # not all above the others: revive or insert
            pos, hit = self._locate(sorted_ids)
            self._vals[pos[hit]] = rows[hit]
            self._dead -= int(hit.sum())
            self._keys = np.insert(self._keys[:n], pos[~hit], sorted_ids[~hit])
            self._vals = np.insert(self._vals[:n], pos[~hit], rows[~hit])
            self._num_keys = len(self._keys)
            return
        if n + len(sorted_ids) > len(self._keys):
            size = max(n + len(sorted_ids), 2 * len(self._keys), MIN_ROWS)
            self._keys = np.concatenate((self._keys[:n], np.zeros(size - n, dtype=np.int64)))
            self._vals = np.concatenate((self._vals[:n], np.zeros(size - n, dtype=np.int64)))
        self._keys[n:n + len(sorted_ids)] = sorted_ids
        self._vals[n:n + len(sorted_ids)] = rows
        self._num_keys += len(sorted_ids)

    def forget(self, ids: np.ndarray) -> None:
        """The store removed these blocks: their rows are free (a lane holding them skips them)."""
        pos, hit = self._locate(np.unique(ids))
        pos = pos[hit][self._vals[pos[hit]] >= 0]
        if not len(pos):
            return
        rows = self._vals[pos]
        self.block_id[rows] = -1
        self._vals[pos] = -1
        self._free += rows.tolist()
        self._removed(len(rows))

    def forget_one(self, block_id: int) -> None:
        """`forget` of one block (the store removes them one by one): O(log blocks)."""
        n = self._num_keys
        pos = int(self._keys[:n].searchsorted(block_id)) if n else 0
        if pos < n and self._keys[pos] == block_id and (row := int(self._vals[pos])) >= 0:
            self.block_id[row] = -1
            self._vals[pos] = -1
            self._free.append(row)
            self._removed(1)

    def _removed(self, count: int) -> None:
        self.num_live -= count
        self._dead += count
        if self._dead > max(MIN_ROWS, self._num_keys // 3):  # drop the tombstones
            keep = self._vals[:self._num_keys] >= 0
            self._keys, self._vals = self._keys[:self._num_keys][keep], self._vals[:self._num_keys][keep]
            self._num_keys, self._dead = len(self._keys), 0

    @property
    def capacity(self) -> int:
        """Rows the arrays hold (used or free)."""
        return len(self.block_id)

    # ---- reads -----------------------------------------------------------------------------------
    def apply_reads(self, rows: np.ndarray, first: int, last: int, count: int, gap: bool, heat_key: float,
                    cs: float, turn: int) -> None:
        """`count` steps between `first` and `last` (in turn `turn`, by a chat of heat `heat_key`
        and CS `cs`) read `rows`, and nothing else read them since `first`: each signal exactly as
        `count` single steps leave it (the window counts aside)."""
        self.heat[rows] = np.maximum(self.heat[rows], heat_key)
        if gap:  # a read more than a window after the one before: CS starts afresh
            self.cs[rows] = cs
        else:
            before = self.last_read[rows]
            recent = (before >= 0) & (before >= first - self.window_steps)
            self.cs[rows] = np.where(recent, np.maximum(self.cs[rows], cs), cs)
        self.last_read[rows] = last
        first_read = self.first_read[rows]
        self.first_read[rows] = np.where(first_read < 0, first, first_read)
        age_turns = turn - self.reads_turn[rows]
        reads = self.num_reads[rows] * np.exp2(-age_turns / self.lfu_half_life_turns) + 1.0
        self.num_reads[rows] = add_ones(reads, count - 1)  # later reads of one turn add 1 each
        self.reads_turn[rows] = turn

    def flush(self, lane: Lane, rows: np.ndarray | None = None) -> None:
        """Fold the lane's pending segment into its claimed rows (or into `rows`, some of them)."""
        if rows is None:
            rows = lane.rows[(self.block_id[lane.rows] == lane.ids) & (self.claim[lane.rows] == lane.index)]
            lane_done = True
        else:
            lane_done = False
        if len(rows):
            self.apply_reads(rows, lane.first, lane.last, lane.steps, lane.gap, lane.heat_key, lane.cs, lane.turn)
        if lane_done:
            lane.steps = 0

    def read_shared(self, lane: Lane, now: int) -> None:
        """One step of the lane reads its shared rows (recorded now)."""
        rows = lane.eager_rows[self.block_id[lane.eager_rows] == lane.eager_ids]
        if len(rows):
            self.apply_reads(rows, now, now, 1, False, lane.heat_key, lane.cs, lane.turn)

    def claim_rows(self, lane: Lane, lanes: dict[int, Lane]) -> None:
        """A new lane takes the rows no other lane reads; rows another lane claims become shared
        (that lane's pending reads of them folded in first), as do rows already shared."""
        rows, claim = lane.rows, self.claim[lane.rows]
        taken = claim >= 0
        if taken.any():
            for index in np.unique(claim[taken]).tolist():
                other, theirs = lanes[index], rows[claim == index]
                if other.steps:
                    self.flush(other, theirs)
                other.eager_rows = np.concatenate((other.eager_rows, theirs))
                other.eager_ids = np.concatenate((other.eager_ids, self.block_id[theirs]))
                self.claim[theirs] = -1
                self.shared[theirs] = 1
        common = taken | (self.shared[rows] > 0)
        self.claim[rows[~common]] = lane.index
        lane.eager_rows, lane.eager_ids = rows[common], lane.ids[common]
        self.shared[lane.eager_rows] += 1

    def release(self, lane: Lane) -> None:
        """The lane takes no more steps (its segment folded in already): its rows are free to claim."""
        valid = self.block_id[lane.rows] == lane.ids
        mine = lane.rows[valid & (self.claim[lane.rows] == lane.index)]
        self.claim[mine] = -1
        self.shared[lane.eager_rows[self.block_id[lane.eager_rows] == lane.eager_ids]] -= 1

    def apply_window(self, lane: Lane) -> None:
        """The lane's rows count its steps in the window now."""
        delta = lane.in_window - lane.applied
        if delta:
            self.window_reads[lane.rows[self.block_id[lane.rows] == lane.ids]] += delta
            lane.applied = lane.in_window
