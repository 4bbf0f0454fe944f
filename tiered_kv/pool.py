"""SlotPool: the free list of one tier's preallocated slab. Ids only, no torch.

Slots are integers 0..num_slots-1. `allocate` hands out LIFO: a slot freed just now is handed
out next, while its memory is still warm in caches. A fresh pool hands out 0, 1, 2, ... so that one
sequence's blocks start out contiguous (the hot tier can then return them as a view, no copy).
`allocate_run` hands out consecutive slots instead, for the hot tier: right after a given slot
(a sequence growing in place), else where a free run leaves room to grow.
Running out is a return value (None); freeing a slot that is not in use raises.

The in-use flags are a bytearray, also seen as a numpy array (free runs are found in C: slice
compares, numpy). The LIFO stack is cleaned lazily: `take` and `allocate_run` only flip flags, and
`allocate` skips stack entries whose slot is in use, so every call costs O(slots given), amortized.
The move path takes and gives back slots as int64 arrays (`allocate_array`, `allocate_run_array`,
`allocate_runs_array`, `take_free`, `free`): checks and flag flips are numpy operations, so a batch
of any size costs a fixed handful of Python steps.
"""

from __future__ import annotations

import numpy as np


class SlotPool:
    def __init__(self, num_slots: int, name: str = "pool"):
        if num_slots < 0:
            raise ValueError(f"{name}: num_slots must be >= 0, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        # LIFO free list; may also hold stale entries (slots since taken), skipped when popped.
        # Whenever a slot is free, its newest entry lies above all its stale ones.
        self._free_stack: list[int] = list(range(num_slots - 1, -1, -1))
        self._in_use = bytearray(num_slots)
        self._flags = np.frombuffer(self._in_use, dtype=np.uint8)  # the same bytes (never resized)
        self._num_free = num_slots
        self.version = 0  # changes whenever a slot is handed out or given back
        self._largest_run: tuple[int, int] = (-1, 0)  # (version, largest free run) cache

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def can_allocate(self, num_slots: int) -> bool:
        return num_slots <= self._num_free

    def allocate(self, num_slots: int) -> list[int] | None:
        """Take `num_slots` slots, all or nothing, most recently freed first. Returns None when
        the pool has fewer free."""
        if num_slots > self._num_free:
            return None
        stack, in_use, slots = self._free_stack, self._in_use, []
        while len(slots) < num_slots:
            slot = stack.pop()
            if not in_use[slot]:
                in_use[slot] = 1
                slots.append(slot)
        self._num_free -= num_slots
        self.version += 1
        return slots

    def allocate_array(self, num_slots: int) -> np.ndarray | None:
        """`allocate` as an int64 array (the same slots in the same order, taken in bulk)."""
        if num_slots > self._num_free:
            return None
        stack, flags, parts, got = self._free_stack, self._flags, [], 0
        while got < num_slots:
            take = min(len(stack), max(2 * (num_slots - got), 64))
            if not take:  # (every free slot has an entry: cannot happen)
                raise RuntimeError(f"{self.name}: the free list lost {num_slots - got} free slot(s)")
            popped = np.array(stack[len(stack) - take:], dtype=np.int64)[::-1]  # in pop order
            del stack[len(stack) - take:]
            popped = popped[flags[popped] == 0]  # (stale entries: slots taken since)
            _, first = np.unique(popped, return_index=True)
            popped = popped[np.sort(first)]  # a slot's newest entry comes first
            use = popped[:num_slots - got]
            stack.extend(popped[len(use):][::-1].tolist())  # popped but not needed: back, in order
            flags[use] = 1
            parts.append(use)
            got += len(use)
        self._num_free -= num_slots
        self.version += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def allocate_run(self, num_slots: int, after: int | None = None) -> list[int] | None:
        """Take `num_slots` consecutive slots, all or nothing: right after slot `after` when
        those are free (a sequence growing in place), else placed by `_place_run`. Returns None
        when no free run is long enough (the caller may still `allocate` scattered slots)."""
        slots = self.allocate_run_array(num_slots, after)
        return None if slots is None else slots.tolist()

    def allocate_run_array(self, num_slots: int, after: int | None = None) -> np.ndarray | None:
        """`allocate_run` as an int64 array."""
        if num_slots == 0:
            return np.zeros(0, dtype=np.int64)
        if num_slots > self._num_free:
            return None
        start = None
        if after is not None and 0 <= after + 1 and after + 1 + num_slots <= self.num_slots \
                and self._in_use.find(1, after + 1, after + 1 + num_slots) < 0:
            start = after + 1
        if start is None:
            start = self._place_run(num_slots)
            if start is None:
                return None
        self._in_use[start:start + num_slots] = b"\x01" * num_slots
        self._num_free -= num_slots
        self.version += 1
        return np.arange(start, start + num_slots, dtype=np.int64)

    def allocate_runs(self, num_slots: int, after: int | None = None) -> list[int] | None:
        """Take `num_slots` slots, all or nothing, in as few runs as the free slots allow (for
        when `allocate_run` finds no run long enough): the free slots right after `after` first,
        then the largest free runs, each from its start. Returns None when fewer are free."""
        slots = self.allocate_runs_array(num_slots, after)
        return None if slots is None else slots.tolist()

    def allocate_runs_array(self, num_slots: int, after: int | None = None) -> np.ndarray | None:
        """`allocate_runs` as an int64 array."""
        if num_slots > self._num_free:
            return None
        parts: list[np.ndarray] = []
        got = 0
        if after is not None and 0 <= after + 1 < self.num_slots:
            end = self._in_use.find(1, after + 1, after + 1 + num_slots)
            stop = min(self.num_slots, after + 1 + num_slots) if end < 0 else end
            parts.append(np.arange(after + 1, stop, dtype=np.int64))
            got = stop - after - 1
            self._in_use[after + 1:stop] = b"\x01" * got
        if got < num_slots:
            starts, lengths = self.free_runs()
            for k in np.lexsort((starts, -lengths)).tolist():
                start, count = int(starts[k]), min(int(lengths[k]), num_slots - got)
                self._in_use[start:start + count] = b"\x01" * count
                parts.append(np.arange(start, start + count, dtype=np.int64))
                got += count
                if got == num_slots:
                    break
        self._num_free -= num_slots
        self.version += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _place_run(self, num_slots: int) -> int | None:
        """Where a new run goes so that both it and whatever precedes it can grow in place: in
        the largest free run (the first of equals), at its start when nothing precedes it (slot
        0), else in its middle, splitting the room between the run before and the new one."""
        starts, lengths = self.free_runs()
        if not len(lengths):
            return None
        i = int(np.argmax(lengths))
        start, length = int(starts[i]), int(lengths[i])
        if length < num_slots:
            return None
        return start if start == 0 else start + (length - num_slots) // 2

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the maximal runs of free slots, in slot order (O(slots), in C)."""
        if not self.num_slots:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        used = self._flags.astype(np.int8)
        edges = np.diff(np.concatenate(([1], used, [1])))
        starts, ends = np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)
        return starts, ends - starts

    def largest_free_run(self) -> int:
        """Slots in the longest run of free slots (cached until the pool changes)."""
        version, length = self._largest_run
        if version != self.version:
            _, lengths = self.free_runs()
            length = int(lengths.max()) if len(lengths) else 0
            self._largest_run = (self.version, length)
        return length

    def occupancy(self) -> bytes:
        """A snapshot of the in-use flags, one byte per slot (1: in use)."""
        return bytes(self._in_use)

    def take(self, slots) -> None:
        """Mark these particular slots used (a store starting from durable records, a compaction
        move reserving its destination)."""
        taken = np.unique(np.asarray(slots, dtype=np.int64).reshape(-1))
        bad = (taken < 0) | (taken >= self.num_slots)
        bad[~bad] = self._flags[taken[~bad]] != 0
        if bad.any():
            raise ValueError(f"{self.name}: slot {int(taken[bad][0])} cannot be taken (out of range or in use)")
        self._flags[taken] = 1
        self._num_free -= len(taken)
        self.version += 1

    def take_free(self, slots: np.ndarray) -> np.ndarray:
        """Take those of `slots` that are in range and free (a slot named twice: its first time
        only); returns the mask of the ones taken."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        ok = (slots >= 0) & (slots < self.num_slots)
        ok[ok] = self._flags[slots[ok]] == 0
        if len(slots) > 1:
            _, first = np.unique(slots, return_index=True)
            once = np.zeros(len(slots), dtype=bool)
            once[first] = True
            ok &= once
        if ok.any():
            self._flags[slots[ok]] = 1
            self._num_free -= int(ok.sum())
            self.version += 1
        return ok

    def free(self, slots) -> None:
        """Return slots (a list or an int64 array) to the pool, the last one given being the first
        handed out again. Every slot is checked first: a bad call (out of range, not in use, named
        twice) frees nothing and raises ValueError naming the slot."""
        array = np.asarray(slots, dtype=np.int64).reshape(-1)
        count = len(array)
        if not count:
            return
        flags, num_slots = self._flags, self.num_slots
        out = (array < 0) | (array >= num_slots)
        if out.any():
            raise ValueError(f"{self.name}: slot {int(array[out][0])} is out of range 0..{num_slots - 1}")
        unused = flags[array] == 0
        if unused.any():
            raise ValueError(f"{self.name}: double free of slot {int(array[unused][0])}")
        if count > 1 and not _strictly_monotonic(array):  # (runs, the usual case, cannot repeat a slot)
            _, first = np.unique(array, return_index=True)
            if len(first) != count:
                once = np.zeros(count, dtype=bool)
                once[first] = True
                raise ValueError(f"{self.name}: double free of slot {int(array[~once][0])}")
        flags[array] = 0
        self._free_stack.extend(array.tolist())
        self._num_free += count
        self.version += 1
        if len(self._free_stack) > 2 * self.num_slots + 64:  # mostly stale entries: rebuild once
            self._free_stack = self.free_order()[::-1]

    def is_used(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    def free_order(self) -> list[int]:
        """Slots in the order `allocate` will hand them out (for tests, debugging, and the stack's
        rebuild): the stack from its top, each free slot at its newest entry."""
        popped = np.array(self._free_stack, dtype=np.int64)[::-1]
        popped = popped[self._flags[popped] == 0]
        _, first = np.unique(popped, return_index=True)
        return popped[np.sort(first)].tolist()


def _strictly_monotonic(values: np.ndarray) -> bool:
    steps = np.diff(values)
    return bool((steps > 0).all() or (steps < 0).all())
