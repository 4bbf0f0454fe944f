"""SlotPool: the free list of one tier's preallocated slab. Ids only, no torch.

Slots are integers 0..num_slots-1. The free list is LIFO: a slot freed just now is handed out
next, while its memory is still warm in caches. A fresh pool hands out 0, 1, 2, ... so that one
sequence's blocks start out contiguous (the hot tier can then return them as a view, no copy).
Running out is a return value (None); freeing a slot that is not in use raises.
"""

from __future__ import annotations


class SlotPool:
    def __init__(self, num_slots: int, name: str = "pool"):
        if num_slots < 0:
            raise ValueError(f"{name}: num_slots must be >= 0, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self._free_stack: list[int] = list(range(num_slots - 1, -1, -1))
        self._in_use = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free_stack)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_stack)

    def can_allocate(self, num_slots: int) -> bool:
        return num_slots <= len(self._free_stack)

    def allocate(self, num_slots: int) -> list[int] | None:
        """Take `num_slots` slots, all or nothing. Returns None when the pool has fewer free."""
        if num_slots > len(self._free_stack):
            return None
        slots = [self._free_stack.pop() for _ in range(num_slots)]
        for slot in slots:
            self._in_use[slot] = 1
        return slots

    def take(self, slots: list[int]) -> None:
        """Mark these particular slots used (a store starting from durable records)."""
        taken = set(slots)
        for slot in taken:
            if not 0 <= slot < self.num_slots or self._in_use[slot]:
                raise ValueError(f"{self.name}: slot {slot} cannot be taken (out of range or in use)")
            self._in_use[slot] = 1
        self._free_stack = [s for s in self._free_stack if s not in taken]

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool (the last one given is the first handed out again)."""
        seen = set()
        for slot in slots:  # validate all first: a bad call frees nothing
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"{self.name}: slot {slot} is out of range 0..{self.num_slots - 1}")
            if not self._in_use[slot] or slot in seen:
                raise ValueError(f"{self.name}: double free of slot {slot}")
            seen.add(slot)
        for slot in slots:
            self._in_use[slot] = 0
            self._free_stack.append(slot)

    def is_used(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    def free_order(self) -> list[int]:
        """Slots in the order they will be handed out (for tests and debugging)."""
        return list(reversed(self._free_stack))
