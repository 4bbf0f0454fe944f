"""Per-sequence state of a bank: block table, known token ids, chain keys. Ids only, no torch.

For each batch row and layer group (layer_groups.py; one group for a full-attention model) a
bank keeps one Row:
- `table`: logical block ids in token order (the store says where each one lives), from block
  `first_block` of the sequence on (0, except for a sliding-window group, whose row releases the
  blocks its window left);
- `token_ids`: the ids of the leading tokens whose KV the row holds, as far as they are known
  (with a model, every computed token; from a config alone, only what attach() was told);
- `num_verified_tokens`: how many leading ids were seen computed by the bank's own model with
  standard positions (no padding, no custom position ids). Only blocks wholly inside this
  verified prefix may be published to the store's shared index (docs/design.md, invariant 2);
- `keys`: the chain key of each full block of the known prefix (identity.chain_keys), extended
  incrementally so a decode step hashes only blocks that just became full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..identity import chain_keys


@dataclass
class Row:
    table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_verified_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0  # leading blocks already offered to the store's index
    first_block: int = 0  # the sequence position of table[0], in blocks

    def copy(self) -> "Row":
        return Row(list(self.table), list(self.token_ids), self.num_verified_tokens, list(self.keys),
                   self.num_published_blocks, self.first_block)

    @property
    def end_block(self) -> int:
        """One past the sequence position of the table's last block."""
        return self.first_block + len(self.table)

    def block_at(self, position: int) -> int:
        """The block id at sequence position `position` (in blocks); it must be held."""
        return self.table[position - self.first_block]

    def drop_before(self, position: int) -> list[int]:
        """Release from the table every block before sequence position `position` (in blocks);
        returns their ids."""
        count = min(max(0, position - self.first_block), len(self.table))
        dropped = self.table[:count]
        del self.table[:count]
        self.first_block += count
        return dropped

    def restart_at(self, position: int) -> list[int]:
        """Release every block and let the table start again at sequence position `position` (in
        blocks): a sliding row whose whole table left its window. Returns the released ids."""
        dropped = self.drop_before(self.end_block)
        self.first_block = position
        return dropped

    def truncate(self, num_tokens: int, block_size: int) -> list[int]:
        """Keep the first `num_tokens` tokens; returns the block ids no longer in the table."""
        num_blocks = max(0, -(-num_tokens // block_size) - self.first_block)
        dropped = self.table[num_blocks:]
        del self.table[num_blocks:]
        del self.token_ids[num_tokens:]
        del self.keys[num_tokens // block_size:]
        if num_tokens == 0:
            self.first_block = 0
        self.num_verified_tokens = min(self.num_verified_tokens, num_tokens)
        self.num_published_blocks = min(self.num_published_blocks, num_tokens // block_size)
        return dropped

    def extend_keys(self, root_key: bytes, block_size: int) -> None:
        """Chain keys for every full block of the known prefix not keyed yet."""
        num_full = len(self.token_ids) // block_size
        if len(self.keys) < num_full:
            previous = self.keys[-1] if self.keys else root_key
            self.keys += chain_keys(previous, self.token_ids, block_size, len(self.keys), num_full - len(self.keys))

    def num_publishable_blocks(self, block_size: int) -> int:
        """Full blocks whose every token id, and every id before them, was verified."""
        return min(self.num_verified_tokens // block_size, len(self.keys), self.end_block)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
