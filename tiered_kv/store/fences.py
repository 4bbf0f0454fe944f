"""Step fences: a step's slots are free of compute only once the stream its forward ran on passed
the step's completion fence (docs/design.md, invariants 4, 7, 8; issue 34).

A lease ends when Python returns from the forward (leases.py). On a GPU the forward's kernels
may still be queued then, on whatever stream it ran on (`with torch.cuda.stream(s):
model.generate(...)`), reading the hot and warm slots the step mapped and writing its new
tokens into them. So a lease takes the stream of the thread that opens it (at layer 0, on the
forward's thread: `copy_engine.current_stream()`, no sync), and when it ends a completion fence
is recorded on that stream (a CUDA event; on CPU an EmulatedStream's fence, or none where
compute is synchronous). Until that fence passed, every hot and warm slot of the step's rows is
still in use:

- a free of such a slot waits for the fence in the deferred list (`StoreState.free_slots_after`;
  `drain()` frees it later): no allocation and no move's reservation gets it before;
- a copy that reads or writes such a slot orders after the fence (`Transfers.launch` gives it
  to `engine.submit(unit, after=...)`: a CUDA side stream waits on the event, the thread engine's
  thread waits before the unit): a block moved down right after its step carries what the
  step's compute wrote last, whichever thread submits the copy. Through a warm slot the host
  waits (a HostFence): a unit's host code may read or write pinned warm memory directly.

A step itself waits for nothing: it records an event and returns; the waits happen on the
device (the side stream), in the deferred-free drain, or in a copy of warm slots (which its
caller waits for anyway: the copy could not run before the step's compute). Cold slots are not fenced: a step's
cold reads and writes are host I/O, done when the forward returned.

Cost per step: one event recorded. A chat's decode steps over the same blocks on one stream
share a record (the newest fence covers the older ones: one stream runs in order); a record's
slots are gathered only when a free or a copy asks while its fence is pending; passed records
are dropped whenever one is added or a free asks.
"""

from __future__ import annotations

import numpy as np

from ..blocks import HOT, WARM
from ..hw.copy_engine import CopyEvent, HostFence

FENCED_TIERS = (HOT, WARM)  # the tiers compute reads and writes in place


class StepFence:
    """An ended step's completion fence, and the hot and warm slots its rows mapped."""

    __slots__ = ("owner", "stream", "fence", "rows", "_slots")

    def __init__(self, owner: int, stream, fence: CopyEvent, rows: list):
        self.owner, self.stream, self.fence, self.rows = owner, stream, fence, rows
        self._slots: dict[int, set[int]] | None = None

    def slots(self, tier: int) -> set[int]:
        """The slots of `tier` the step used (gathered once; a race gathers the same twice)."""
        slots = self._slots
        if slots is None:
            slots = self._slots = {t: set(np.concatenate([row.slots[row.tiers == t] for row in self.rows]
                                                         or [np.empty(0, np.int64)]).tolist())
                                   for t in FENCED_TIERS}
        return slots[tier]

    def covers(self, owner: int, stream, rows: list) -> bool:
        """A later step of the same chat over the same placements, on the same stream: its fence
        passes after this one's, so it can stand for both."""
        return owner == self.owner and stream == self.stream and len(rows) == len(self.rows) and \
            all(a.tiers is b.tiers and a.slots is b.slots for a, b in zip(rows, self.rows))


class StepFences:
    """The fences of ended steps still pending. Added and asked about slots under the store lock;
    `for_transfers` reads a snapshot without it (launch runs without the lock)."""

    def __init__(self) -> None:
        self.engine = None  # the store's copy engine: it records fences on streams (set at start)
        self._records: tuple[StepFence, ...] = ()

    def __len__(self) -> int:
        return len(self._records)

    def current_stream(self):
        """The stream this thread's compute runs on now (a lease takes it when it is opened)."""
        return None if self.engine is None else self.engine.current_stream()

    def record(self, lease) -> CopyEvent | None:
        """A fence after the lease's compute on its stream (None: nothing of it can be queued).
        Takes no lock: an event recorded, no wait."""
        if lease.stream is None or self.engine is None:
            return None
        return self.engine.record_fence(lease.stream)

    def add(self, lease, fence: CopyEvent | None) -> None:
        """The lease ended (lock held, before it is unpinned): its slots wait for `fence`."""
        if fence is None or fence.done():
            return
        records = [r for r in self._records if not r.fence.done()]
        for record in records:
            if record.covers(lease.owner, lease.stream, lease.rows):
                record.fence = fence  # (a reader without the lock sees the older or this one)
                break
        else:
            records.append(StepFence(lease.owner, lease.stream, fence, lease.rows))
        self._records = tuple(records)

    def for_slots(self, tier: int, slots) -> tuple[CopyEvent, ...]:
        """The pending fences of steps that used any of `slots` (a list or an int64 array) of
        `tier` (lock held)."""
        if not self._records or tier not in FENCED_TIERS:
            return ()
        live = tuple(r for r in self._records if not r.fence.done())
        self._records = live
        if not live:
            return ()
        slots = slots.tolist() if isinstance(slots, np.ndarray) else slots
        return tuple(r.fence for r in live if not r.slots(tier).isdisjoint(slots))

    def for_transfers(self, transfers) -> tuple[CopyEvent, ...]:
        """The pending fences of steps that used a slot the transfers read or write (no lock):
        `transfers` are a batch's TransferGroups (`src_slots`, `dst_slots`: int64 arrays) or
        single copies (`src_slot`, `dst_slot`). One met through a warm slot is a HostFence: copies
        of pinned host memory may run as host code (a gather into cold's staging), which only a
        host wait orders."""
        records = self._records
        if not records or all(r.fence.done() for r in records):
            return ()
        wanted: dict[int, list] = {tier: [] for tier in FENCED_TIERS}
        for t in transfers:
            group = getattr(t, "src_slots", None) is not None
            if t.src_tier in wanted:
                wanted[t.src_tier].append(t.src_slots if group else np.array([t.src_slot], dtype=np.int64))
            if t.dst_tier in wanted:
                wanted[t.dst_tier].append(t.dst_slots if group else np.array([t.dst_slot], dtype=np.int64))
        hot, warm = (np.concatenate(wanted[tier]).tolist() if wanted[tier] else [] for tier in (HOT, WARM))
        fences = []
        for r in records:
            if r.fence.done():
                continue
            if warm and not r.slots(WARM).isdisjoint(warm):
                fences.append(HostFence(r.fence))
            elif hot and not r.slots(HOT).isdisjoint(hot):
                fences.append(r.fence)
        return tuple(fences)


__all__ = ["StepFences", "StepFence", "FENCED_TIERS"]
