"""SlotPool: the free list of one tier's preallocated slab. Ids only, no torch.

Slots are integers 0..num_slots-1. `allocate` hands out LIFO: a slot freed just now is handed
out next, while its memory is still warm in caches. A fresh pool hands out 0, 1, 2, ... so that one
sequence's blocks start out contiguous (the hot tier can then return them as a view, no copy).
`allocate_run` hands out consecutive slots instead, for the hot tier: right after a given slot
(a sequence growing in place), else where a free run leaves room to grow.
Running out is a return value (None); freeing a slot that is not in use raises.

The in-use flags are a bytearray (free runs are found in C: slice compares, numpy). The LIFO
stack is cleaned lazily: `take` and `allocate_run` only flip flags, and `allocate` skips stack
entries whose slot is in use, so every call costs O(slots given), amortized.
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

    def allocate_run(self, num_slots: int, after: int | None = None) -> list[int] | None:
        """Take `num_slots` consecutive slots, all or nothing: right after slot `after` when
        those are free (a sequence growing in place), else placed by `_place_run`. Returns None
        when no free run is long enough (the caller may still `allocate` scattered slots)."""
        if num_slots == 0:
            return []
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
        return list(range(start, start + num_slots))

    def allocate_runs(self, num_slots: int, after: int | None = None) -> list[int] | None:
        """Take `num_slots` slots, all or nothing, in as few runs as the free slots allow (for
        when `allocate_run` finds no run long enough): the free slots right after `after` first,
        then the largest free runs, each from its start. Returns None when fewer are free."""
        if num_slots > self._num_free:
            return None
        slots: list[int] = []
        if after is not None and 0 <= after + 1 < self.num_slots:
            end = self._in_use.find(1, after + 1, after + 1 + num_slots)
            slots = list(range(after + 1, min(self.num_slots, after + 1 + num_slots) if end < 0 else end))
            self._in_use[after + 1:after + 1 + len(slots)] = b"\x01" * len(slots)
        if len(slots) < num_slots:
            starts, lengths = self.free_runs()
            for k in np.lexsort((starts, -lengths)).tolist():
                start, count = int(starts[k]), min(int(lengths[k]), num_slots - len(slots))
                self._in_use[start:start + count] = b"\x01" * count
                slots.extend(range(start, start + count))
                if len(slots) == num_slots:
                    break
        self._num_free -= num_slots
        self.version += 1
        return slots

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
        used = np.frombuffer(bytes(self._in_use), dtype=np.uint8).astype(np.int8)
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

    def take(self, slots: list[int]) -> None:
        """Mark these particular slots used (a store starting from durable records, a compaction
        move reserving its destination)."""
        taken = set(slots)
        for slot in taken:
            if not 0 <= slot < self.num_slots or self._in_use[slot]:
                raise ValueError(f"{self.name}: slot {slot} cannot be taken (out of range or in use)")
        for slot in taken:
            self._in_use[slot] = 1
        self._num_free -= len(taken)
        self.version += 1

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool (the last one given is the first handed out again)."""
        in_use, num_slots = self._in_use, self.num_slots
        for slot in slots:  # validate all first: a bad call frees nothing
            if not 0 <= slot < num_slots:
                raise ValueError(f"{self.name}: slot {slot} is out of range 0..{num_slots - 1}")
            if not in_use[slot]:
                raise ValueError(f"{self.name}: double free of slot {slot}")
        if len(slots) > 1 and len(set(slots)) != len(slots):
            seen: set[int] = set()
            twice = next(slot for slot in slots if slot in seen or seen.add(slot))
            raise ValueError(f"{self.name}: double free of slot {twice}")
        for slot in slots:
            in_use[slot] = 0
        self._free_stack.extend(slots)
        self._num_free += len(slots)
        self.version += 1
        if len(self._free_stack) > 2 * self.num_slots + 64:  # mostly stale entries: rebuild once
            self._free_stack = self.free_order()[::-1]

    def is_used(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    def free_order(self) -> list[int]:
        """Slots in the order `allocate` will hand them out (for tests and debugging)."""
        order, seen, in_use = [], set(), self._in_use
        for slot in reversed(self._free_stack):
            if not in_use[slot] and slot not in seen:
                seen.add(slot)
                order.append(slot)
        return order
