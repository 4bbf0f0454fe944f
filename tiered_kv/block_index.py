"""BlockIndex: where every logical block lives, who holds it and what it contains. Ids only, no torch.

A logical block id is stable while the block moves between tiers; (tier, slot) changes. A block
is referenced by the block tables of the banks that hold it (`ref_count`). A full block whose
token ids were verified gets a published key (see identity.py); a published block that no bank
references stays as evictable cache so a later `attach` can reuse it.

Orderings are kept incrementally, so that a placement decision never sorts the whole store:
per tier, every block in recency order (oldest first) and, separately, the unreferenced ones
(the only ones that may be dropped). A block that arrives in a tier, by allocation or by a move,
enters at the recent end; `touch` moves blocks there too. `order_version` changes whenever any
ordering changes and `placement_version` whenever any block changes tier or slot, so a bank can
tell in O(1) that nothing moved since its last step, and `moved_since` which of its blocks did in
O(moves since). A step's recency touch (`touch_later`) is applied lazily, before anything reads or
changes an order: a decode step costs O(1) however many blocks its chat holds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import repeat

from .blocks import DROPPED, HOT, NUM_TIERS

MAX_HOT_CHANGES_KEPT = 4096  # hot placement changes kept for the compactor between two looks
MAX_MOVES_KEPT = 4096  # recent placement changes kept for `moved_since` (older: "maybe")


@dataclass
class BlockEntry:
    tier: int  # HOT/WARM/COLD, or DROPPED while the block is corrupt
    slot: int
    ref_count: int = 1
    key: bytes | None = None  # published key (verified content), or None
    root: bytes | None = None  # the model fingerprint the key chains from (written in durable records)
    arrived_at: int = 0  # the index clock (store steps) when the block entered its current tier

    @property
    def is_corrupt(self) -> bool:
        return self.tier == DROPPED


class BlockIndex:
    def __init__(self) -> None:
        self._entries: dict[int, BlockEntry] = {}
        self._by_key: dict[bytes, int] = {}
        self._recency: list[OrderedDict] = [OrderedDict() for _ in range(NUM_TIERS)]
        self._unreferenced: list[OrderedDict] = [OrderedDict() for _ in range(NUM_TIERS)]
        self._next_id = 0
        self.order_version = 0
        self.placement_version = 0
        self._hot_changes: list[int] | None = []  # see take_hot_changes (None: too many to keep)
        self._moves: deque[tuple[int, int]] = deque(maxlen=MAX_MOVES_KEPT)  # (placement_version, block id)
        self._touches: OrderedDict[int, object] = OrderedDict()  # owner -> block ids, touched last, not applied yet
        self.clock = 0  # store steps so far (the store advances it); stamps `arrived_at`
        self.on_removed = None  # called with each removed block's id (the access log forgets it)

    # ---- lifecycle -------------------------------------------------------------------------
    def add(self, tier: int, slot: int) -> int:
        self._apply_touches()
        block_id = self._next_id
        self._next_id += 1
        self._entries[block_id] = BlockEntry(tier, slot, ref_count=1, arrived_at=self.clock)
        self._recency[tier][block_id] = None
        self.order_version += 1
        return block_id

    def remove(self, block_id: int) -> BlockEntry:
        self._apply_touches()
        entry = self._entry(block_id)
        self.unpublish(block_id)
        self._leave_tier(block_id, entry)
        del self._entries[block_id]
        self._moved(block_id)
        if entry.tier == HOT:
            self._note_hot_change(block_id)
        if self.on_removed is not None:
            self.on_removed(block_id)
        return entry

    def incref(self, block_id: int) -> None:
        entry = self._entry(block_id)
        if entry.ref_count == 0 and entry.tier != DROPPED:
            self._unreferenced[entry.tier].pop(block_id, None)
        entry.ref_count += 1

    def decref(self, block_id: int) -> int:
        entry = self._entry(block_id)
        if entry.ref_count <= 0:
            raise ValueError(f"block {block_id}: released more often than retained (ref_count {entry.ref_count})")
        entry.ref_count -= 1
        if entry.ref_count == 0 and entry.tier != DROPPED:
            self._unreferenced[entry.tier][block_id] = None
        return entry.ref_count

    # ---- placement -------------------------------------------------------------------------
    def touch(self, block_ids) -> None:
        """These blocks were just used: move them to the recent end of their tier's order."""
        self._apply_touches()
        recency = self._recency
        for block_id in block_ids:
            tier = self._entry(block_id).tier  # (an unknown id is a bug: KeyError naming it)
            if tier != DROPPED:
                recency[tier].move_to_end(block_id)
        self.order_version += 1

    def touch_later(self, owner: int, block_ids) -> None:
        """`touch(block_ids)` for a step of chat `owner`, applied lazily: before the next order is
        read or changed, each chat's last touch in the order they came (the same orders as eager
        touches; a chat's earlier touches are covered by its last one). O(1): a decode step of a
        chat of many blocks costs nothing here. `block_ids` must not be mutated afterwards."""
        touches = self._touches
        touches[owner] = block_ids
        touches.move_to_end(owner)
        self.order_version += 1

    def _apply_touches(self) -> None:
        if self._touches:
            touches, self._touches = self._touches, OrderedDict()
            for block_ids in touches.values():
                self._touch_now(block_ids)

    def _touch_now(self, block_ids) -> None:
        """A step's touch applied late: its blocks removed since are skipped."""
        entries, recency = self._entries, self._recency
        for block_id in block_ids:
            entry = entries.get(int(block_id))
            if entry is not None and entry.tier != DROPPED:
                recency[entry.tier].move_to_end(int(block_id))

    def _moved(self, block_id: int) -> None:
        self.placement_version += 1
        self._moves.append((self.placement_version, block_id))

    def moved_since(self, version: int, block_ids) -> bool:
        """Whether any of `block_ids` (a set) changed place (or left) after `placement_version` was
        `version`; True when that is too long ago to tell. O(changes since)."""
        if self.placement_version == version:
            return False
        moves = self._moves
        if not moves or moves[0][0] > version + 1:
            return True
        for changed_at, block_id in reversed(moves):
            if changed_at <= version:
                return False
            if block_id in block_ids:
                return True
        return False

    def move(self, block_id: int, tier: int, slot: int) -> None:
        self._apply_touches()
        entry = self._entry(block_id)
        if HOT in (entry.tier, tier):
            self._note_hot_change(block_id)
        self._leave_tier(block_id, entry)
        entry.tier, entry.slot, entry.arrived_at = tier, slot, self.clock
        if tier != DROPPED:
            self._recency[tier][block_id] = None
            if entry.ref_count == 0:
                self._unreferenced[tier][block_id] = None
        self._moved(block_id)
        self.order_version += 1

    def move_many(self, block_ids: list[int], src_tier: int, tier: int, slots: list[int]) -> None:
        """`move` for a batch from one tier landing in another (block_ids[i], now in `src_tier`,
        to slots[i]; none corrupt), the versions bumped once."""
        self._apply_touches()
        entries, clock = self._entries, self.clock
        leave, leave_cached = self._recency[src_tier], self._unreferenced[src_tier]
        arrive, cached = self._recency[tier], self._unreferenced[tier]
        for block_id, slot in zip(block_ids, slots):
            entry = entries[block_id]
            del leave[block_id]
            if entry.ref_count == 0:
                leave_cached.pop(block_id, None)
                cached[block_id] = None
            entry.tier, entry.slot, entry.arrived_at = tier, slot, clock
            arrive[block_id] = None
        if HOT in (src_tier, tier) and self._hot_changes is not None:
            self._hot_changes.extend(block_ids)
            if len(self._hot_changes) > MAX_HOT_CHANGES_KEPT:
                self._hot_changes = None
        self.placement_version += 1
        version, moves = self.placement_version, self._moves
        if len(block_ids) >= MAX_MOVES_KEPT:
            moves.clear()  # (moved_since answers "maybe" for any version before this one)
            moves.append((version, -1))
        else:
            moves.extend(zip(repeat(version), block_ids))  # (C-level: no Python frame per block)
        self.order_version += 1

    def relocate(self, block_id: int, slot: int) -> None:
        """The block's data moved to another slot of the same tier (compaction): its place in
        every order stays, only placements change."""
        entry = self._entry(block_id)
        entry.slot = slot
        self._moved(block_id)
        if entry.tier == HOT:
            self._note_hot_change(block_id)

    def _note_hot_change(self, block_id: int) -> None:
        changes = self._hot_changes
        if changes is not None:
            changes.append(block_id)
            self._hot_changes = changes if len(changes) <= MAX_HOT_CHANGES_KEPT else None

    def take_hot_changes(self) -> list[int] | None:
        """Blocks that left, entered or moved within hot since the last call (removed, moved,
        relocated), for the compactor; None: more than MAX_HOT_CHANGES_KEPT (any row may have changed)."""
        changes, self._hot_changes = self._hot_changes, []
        return changes

    def arrival_steps(self, block_ids) -> list[int]:
        entries = self._entries
        return [entries[b].arrived_at for b in block_ids]

    def mark_corrupt(self, block_id: int) -> None:
        """The block's data is gone: no key, no tier; banks still list it until they drop it."""
        self.unpublish(block_id)
        self.move(block_id, DROPPED, -1)

    def _leave_tier(self, block_id: int, entry: BlockEntry) -> None:
        if entry.tier != DROPPED:
            del self._recency[entry.tier][block_id]
            self._unreferenced[entry.tier].pop(block_id, None)

    def get(self, block_id: int) -> BlockEntry:
        return self._entry(block_id)

    def peek(self, block_id: int) -> BlockEntry | None:
        """The block's entry, or None when it is not in the index."""
        return self._entries.get(block_id)

    def recency(self, tier: int):
        """Block ids of `tier`, least recently used first (a live view: do not mutate while iterating)."""
        self._apply_touches()
        return self._recency[tier].keys()

    def unreferenced(self, tier: int):
        """Unreferenced (cached) block ids of `tier`, least recently used first."""
        return self._unreferenced[tier].keys()

    def blocks_in(self, tier: int) -> list[int]:
        self._apply_touches()
        return list(self._recency[tier])

    def count_in(self, tier: int) -> int:
        return len(self._recency[tier])

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        return self._entries.items()

    # ---- content addressing ----------------------------------------------------------------
    def publish(self, block_id: int, key: bytes, root: bytes | None = None) -> bool:
        """Name a full, verified block by its key so other banks can reuse it. Returns False (and
        changes nothing) when another block already holds the key: the first one stays shared."""
        entry = self._entry(block_id)
        owner = self._by_key.get(key)
        if owner is not None:
            return owner == block_id
        if entry.is_corrupt:
            return False
        if entry.key is not None:
            self.unpublish(block_id)
        entry.key, entry.root = key, root
        self._by_key[key] = block_id
        return True

    def unpublish(self, block_id: int) -> None:
        entry = self._entry(block_id)
        if entry.key is not None and self._by_key.get(entry.key) == block_id:
            del self._by_key[entry.key]
        entry.key = None

    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def _entry(self, block_id: int) -> BlockEntry:
        try:
            return self._entries[block_id]
        except KeyError:
            raise KeyError(f"block {block_id} is not in the index (freed or never allocated)") from None
