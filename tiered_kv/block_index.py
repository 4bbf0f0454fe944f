"""BlockIndex: where every logical block lives, who holds it and what it contains. Ids only, no torch.

A logical block id is stable while the block moves between tiers; (tier, slot) changes. A block
is referenced by the block tables of the banks that hold it (`ref_count`). A full block whose
tokens are known gets a content hash (a chain over its prefix); a hashed block that no bank
references stays as evictable cache so a later `attach` can reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_TIER = -1  # the tier of a corrupt block: it keeps its id but holds no slot and no data


@dataclass
class BlockEntry:
    tier: int  # HOT/WARM/COLD, or NO_TIER while the block is corrupt
    slot: int
    ref_count: int = 1
    last_access: int = 0
    content_hash: bytes | None = None


class BlockIndex:
    def __init__(self) -> None:
        self._entries: dict[int, BlockEntry] = {}
        self._by_hash: dict[bytes, int] = {}
        self._next_id = 0
        self._clock = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def add(self, tier: int, slot: int) -> int:
        block_id = self._next_id
        self._next_id += 1
        self._entries[block_id] = BlockEntry(tier, slot, ref_count=1, last_access=self.tick())
        return block_id

    def remove(self, block_id: int) -> BlockEntry:
        entry = self._entry(block_id)
        if entry.content_hash is not None and self._by_hash.get(entry.content_hash) == block_id:
            del self._by_hash[entry.content_hash]
        del self._entries[block_id]
        return entry

    def incref(self, block_id: int) -> None:
        self._entry(block_id).ref_count += 1

    def decref(self, block_id: int) -> int:
        entry = self._entry(block_id)
        if entry.ref_count <= 0:
            raise ValueError(f"block {block_id}: decref below zero")
        entry.ref_count -= 1
        return entry.ref_count

    # ---- placement -------------------------------------------------------------------------
    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def touch(self, block_ids, now: int | None = None) -> None:
        now = self.tick() if now is None else now
        for block_id in block_ids:
            self._entry(block_id).last_access = now

    def move(self, block_id: int, tier: int, slot: int) -> None:
        entry = self._entry(block_id)
        entry.tier, entry.slot = tier, slot

    def get(self, block_id: int) -> BlockEntry:
        return self._entry(block_id)

    def blocks_in(self, tier: int) -> list[int]:
        return [b for b, e in self._entries.items() if e.tier == tier]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):
        return self._entries.items()

    # ---- content addressing ----------------------------------------------------------------
    def set_hash(self, block_id: int, content_hash: bytes) -> int:
        """Register a full block's content hash. Returns the block that now owns the hash
        (an older block with the same content keeps it)."""
        entry = self._entry(block_id)
        owner = self._by_hash.get(content_hash)
        if owner is not None and owner != block_id:
            return owner
        if entry.content_hash is not None and entry.content_hash != content_hash:
            self.clear_hash(block_id)
        entry.content_hash = content_hash
        self._by_hash[content_hash] = block_id
        return block_id

    def clear_hash(self, block_id: int) -> None:
        entry = self._entry(block_id)
        if entry.content_hash is not None and self._by_hash.get(entry.content_hash) == block_id:
            del self._by_hash[entry.content_hash]
        entry.content_hash = None

    def lookup(self, content_hash: bytes) -> int | None:
        return self._by_hash.get(content_hash)

    def _entry(self, block_id: int) -> BlockEntry:
        try:
            return self._entries[block_id]
        except KeyError:
            raise KeyError(f"block {block_id} is not in the index (freed or never allocated)") from None
