"""StoreState: where every block lives and what holds it — the block index, the tiers and their
slot pools, the steps' pins, the blocks in flight, and the slots waiting to be freed.

Everything here runs under the store's lock (the caller holds it) and never waits. The rules it
keeps (docs/design.md):

- a slot is handed out again only once nothing can still read or write it: a slot freed while a
  copy may use it waits in the deferred list for that copy's event, and a hot or warm slot an
  ended step used for the step's completion fence on its stream (fences.py); `drain()` frees
  what passed;
- a pinned block (a running step reads or writes it) is never moved or dropped; a block whose
  data fails its checksum while pinned keeps its slot (quarantined) until the step ends, so the
  step reads the bad bytes and fails, never another block's;
- a block in flight (a transfer copies it) is neither moved again nor freed under the copy: freeing
  it cancels the transfer and its source slot waits for the transfer's event.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from ..block_index import BlockIndex
from ..blocks import COLD, TIER_NAMES
from ..hw.copy_engine import CopyEvent
from ..logs import Throttle
from ..metrics.registry import Metrics
from ..pool import SlotPool
from ..scheduler.arrays import ABSENT, contains_mask, placements_of
from .durable_copies import DurableCopies
from .fences import StepFences
from .in_flight import InFlight
from .leave_alone import LeaveAlone
from .lock import ChangeSignal

log = logging.getLogger(__name__)


class StoreState:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.index = BlockIndex()
        self.tiers: list = []
        self.pools: list[SlotPool] = []
        self.changes = ChangeSignal()
        self._pins: dict[int, tuple[set[int], set[int]]] = {}  # owner -> (its block set, blocks added since)
        self.leases: dict[int, object] = {}  # owner -> its StepLease while the step runs (leases.py)
        self.in_flight = InFlight()  # block id -> the TransferGroup copying it (in_flight.py)
        self._deferred_frees: list[tuple[int, object, tuple[CopyEvent, ...]]] = []  # (tier, slots, fences)
        self.step_fences = StepFences()  # ended steps whose compute may still use their slots (fences.py)
        self._quarantined: list[tuple[int, int, int]] = []  # (block, tier, slot) of pinned corrupt blocks
        self._released_later: deque = deque()  # (block ids, step owner) of banks the collector took
        self._drop_warnings = Throttle(log)
        self.on_collected = None  # called with a collected bank's owner at drain (the store forgets the chat)
        self.copies: DurableCopies | None = None  # durable copies in cold of blocks above it (with a cold tier)
        # a running step uses the block or a transfer copies it: no plan may move or drop it
        self.is_pinned = LeaveAlone(self)

    def bind(self, tiers: list, pools: list[SlotPool]) -> None:
        self.tiers, self.pools = tiers, pools

    # ---- tier use ------------------------------------------------------------------------------
    @property
    def capacities(self) -> list[int]:
        return [pool.num_slots for pool in self.pools]

    def free_slots(self) -> list[int]:
        """Free slots per tier; a cold slot holding only a durable copy counts as free (it goes first)."""
        free = [pool.num_free for pool in self.pools]
        if self.copies:
            free[COLD] += len(self.copies)
        return free

    def cold_room(self, num_slots: int) -> int:
        """Make `num_slots` cold slots free by dropping copies (coldest first) where the pool lacks
        them; how many are free now."""
        pool, copies = self.pools[COLD], self.copies
        if copies and pool.num_free < num_slots:
            for block_id in copies.coldest(self.index, num_slots - pool.num_free):
                self.free_slot(COLD, copies.pop(block_id))
        return pool.num_free

    def adopt_copy(self, block_id: int) -> None:
        """The block goes down into cold by taking its durable copy's slot: nothing is written."""
        entry = self.index.get(block_id)
        src_tier, src_slot = entry.tier, entry.slot
        self.index.move(block_id, COLD, self.copies.pop(block_id))
        self.free_slot(src_tier, src_slot)
        self.metrics.adopted_copies.inc()

    def placements(self, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """(tier, slot) of each block, as two int64 arrays (DROPPED for a corrupt block); KeyError
        for a block not in the index."""
        tiers, slots = placements_of(self.index, block_ids if isinstance(block_ids, np.ndarray) else list(block_ids))
        if len(tiers) and tiers.min() == ABSENT:
            self.index.get(int(np.asarray(block_ids).reshape(-1)[np.argmax(tiers == ABSENT)]))  # raises KeyError
        return tiers, slots

    # ---- pins ------------------------------------------------------------------------------------
    def pin(self, owner: int, block_ids: set[int]) -> None:
        """`owner`'s step uses `block_ids` (a set its bank keeps unchanged until the step ends)."""
        self._pins[owner] = (block_ids, set())

    def pin_more(self, owner: int, block_ids) -> None:
        self._pins[owner][1].update(block_ids)

    def unpin(self, owner: int) -> bool:
        """The step ended. False when `owner` pinned nothing."""
        if self._pins.pop(owner, None) is None:
            return False
        self._free_quarantined()
        return True

    @property
    def has_pins(self) -> bool:
        return bool(self._pins)

    def pinned_by_others(self, owner: int | None) -> bool:
        """Some step other than `owner`'s pins blocks (room it holds frees up when that step ends)."""
        return any(other != owner for other in self._pins)

    def is_pinned_by_step(self, block_id: int, except_owner: int | None = None) -> bool:
        if not self._pins:
            return False
        return any(block_id in blocks or block_id in extra for owner, (blocks, extra) in self._pins.items()
                   if owner != except_owner)

    def pinned_mask(self, block_ids: list[int], except_owner: int | None = None) -> np.ndarray:
        """Which of `block_ids` (a list of ints) a step other than `except_owner`'s pins, as a bool array."""
        mask = np.zeros(len(block_ids), dtype=bool)
        for owner, (blocks, extra) in self._pins.items():
            if owner != except_owner:
                mask |= contains_mask(blocks, block_ids)
                mask |= contains_mask(extra, block_ids)
        return mask

    def leave_alone_for(self, owner: int | None, protect: frozenset[int] = frozenset()) -> "LeaveAlone":
        """The predicate of blocks a plan made for `owner`'s step must leave alone (True: do not
        move or drop it): blocks in flight, pinned by any other step, or in `protect`."""
        if owner is None and not protect:
            return self.is_pinned
        return LeaveAlone(self, owner, protect)

    def pinned_now(self) -> set[int]:
        pinned = set(self.in_flight.keys())
        for blocks, extra in self._pins.values():
            pinned.update(blocks)
            pinned.update(extra)
        return pinned

    # ---- freeing ---------------------------------------------------------------------------------
    def free_slot(self, tier: int, slot: int, after: CopyEvent | None = None) -> None:
        """Give a slot back, once `after` (a copy that may still use it) has passed."""
        self.free_slots_after(tier, [slot], after)

    def free_slots_after(self, tier: int, slots, after: CopyEvent | None = None) -> None:
        """Give slots of one tier (a list or an int64 array) back together, once `after` has passed
        (a batch's sources)."""
        if not len(slots):
            return
        fences = (after,) if after is not None else ()
        if self.step_fences:
            fences += self.step_fences.for_slots(tier, slots)
        if all(f.done() for f in fences):
            self._free_now(tier, slots)
        else:
            self._deferred_frees.append((tier, slots if isinstance(slots, np.ndarray) else list(slots), fences))

    def _free_now(self, tier: int, slots) -> None:
        self.pools[tier].free(slots)
        if (forget := getattr(self.tiers[tier], "forget", None)) is not None:  # (a cold record; a block being filled)
            forget(slots.tolist() if isinstance(slots, np.ndarray) else slots)

    def drain(self) -> None:
        """Free the deferred slots whose copies passed; release what collected banks left."""
        if self._deferred_frees:
            waiting = []
            for tier, slots, fences in self._deferred_frees:
                if all(f.done() for f in fences):
                    self._free_now(tier, slots)
                else:
                    waiting.append((tier, slots, fences))
            if len(waiting) < len(self._deferred_frees):
                self.changes.bump()  # room came free: a step waiting for it tries again
            self._deferred_frees = waiting
        while self._released_later:
            block_ids, owner = self._released_later.popleft()
            lease = self.leases.pop(owner, None)
            if lease is not None:
                lease.ended = True  # its bank is gone: nobody can end it any more
                self.step_fences.add(lease, self.step_fences.record(lease))
            self.unpin(owner)
            self.release(block_ids)
            if self.on_collected is not None:
                self.on_collected(owner)
            self.changes.bump()

    @property
    def num_deferred_frees(self) -> int:
        return sum(len(slots) for _, slots, _ in self._deferred_frees)

    def release_later(self, block_ids: list[int], owner: int) -> None:
        """For a bank the garbage collector took (maybe while this very thread holds the store
        lock): its references and its step's pins go at the next drain. Takes no lock."""
        self._released_later.append((list(block_ids), owner))

    def release(self, block_ids, keep_published: bool = True) -> None:
        """One reference less each; an unreferenced block without a key (or corrupt) is freed, and
        with `keep_published=False` a published one too (no chat will read it again)."""
        for block_id in block_ids:
            entry = self.index.get(block_id)
            if self.index.decref(block_id) == 0 and (entry.key is None or entry.is_corrupt or not keep_published):
                self.free_block(block_id)

    def free_block(self, block_id: int) -> None:
        """Remove a block. One a transfer copies is cancelled; its slot waits for that copy."""
        transfer = self.in_flight.pop(block_id, None)
        entry = self.index.remove(block_id)
        if self.copies is not None and (slot := self.copies.pop(block_id)) is not None:
            self.free_slot(COLD, slot)
        if entry.is_corrupt:  # its slot went back (or into quarantine) when it was marked
            return
        if transfer is not None:  # (popping it cancelled its copy, which may still read the slot: freed after it)
            transfer.batch.frees.append((entry.tier, entry.slot))
        else:
            self.free_slot(entry.tier, entry.slot)

    def evict(self, block_id: int) -> bool:
        """Drop an unreferenced cached block (its data is discarded): True. One with a durable copy
        goes down to it instead (it stays cached, in cold): False."""
        if self.copies and block_id in self.copies and block_id not in self.in_flight:
            self.adopt_copy(block_id)
            return False
        self.free_block(block_id)
        self.metrics.evictions.inc()
        return True

    def report_evictions(self, count: int, by: str) -> None:
        """One warning (throttled: a full cache drops some at every step) for blocks just dropped."""
        if count:
            self._drop_warnings.warning(
                "cache full: %s dropped %d cached block(s) (published, used by no chat), least valuable first; a "
                "chat that needs them again recomputes them (%d dropped so far)", by, count,
                int(self.metrics.evictions.value()))

    # ---- corruption ------------------------------------------------------------------------------
    def mark_corrupt(self, block_id: int) -> None:
        """A corrupt block keeps its id (banks still list it) but no key, no data and no slot. A
        pinned one's slot is quarantined until its step ends; a transfer copying it is cancelled."""
        entry = self.index.get(block_id)
        if entry.is_corrupt:
            return
        cold = self.tiers[COLD] if len(self.tiers) > COLD else None
        where = f" of {cold.file_path}" if entry.tier == COLD and cold is not None else ""
        log.warning("block %d (%s slot %d%s) failed its checksum: it is never served; it is dropped and its "
                    "tokens must be recomputed", block_id, TIER_NAMES[entry.tier], entry.slot, where)
        self.metrics.checksum_failures.inc((TIER_NAMES[entry.tier],))
        transfer = self.in_flight.pop(block_id, None)  # (cancelled: its copy may still read the slot)
        if self.copies is not None and (slot := self.copies.pop(block_id)) is not None:
            self.free_slot(COLD, slot)
        if self.is_pinned_by_step(block_id):
            self._quarantined.append((block_id, entry.tier, entry.slot))
        elif transfer is not None:
            transfer.batch.frees.append((entry.tier, entry.slot))
        else:
            self.free_slot(entry.tier, entry.slot)
        self.index.mark_corrupt(block_id)

    def block_at(self, tier: int, slot: int) -> int | None:
        """The block at (tier, slot): a scan, on the rare path of a failed read only."""
        return next((b for b, e in self.index.items() if e.tier == tier and e.slot == slot), None)

    def _free_quarantined(self) -> None:
        keep = []
        for block_id, tier, slot in self._quarantined:
            if self.is_pinned_by_step(block_id):
                keep.append((block_id, tier, slot))
            else:
                self.free_slot(tier, slot)
        self._quarantined = keep

    def quarantined_slots(self) -> set[tuple[int, int]]:
        return {(tier, slot) for _, tier, slot in self._quarantined}

    # ---- durability --------------------------------------------------------------------------------
    def persist_if_published(self, block_id: int) -> None:
        """A published block whose whole data is in the cold tier gets a durable record there
        (written behind by the cold tier's writer thread), so a later process can reuse it."""
        entry = self.index.get(block_id)
        if entry.tier == COLD and entry.key is not None and entry.root is not None and self.tiers[COLD] is not None:
            try:
                self.tiers[COLD].persist(entry.slot, entry.key, entry.root)
            except ValueError as error:  # not whole yet: it stays a cold block, just not durable
                log.warning("block %d not made durable (it stays in the cold tier for this process): %s",
                            block_id, error)
