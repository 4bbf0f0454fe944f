"""The one object that crosses the scheduler -> store boundary: a plan of block moves. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..blocks import COLD, DROPPED, HOT, TIER_NAMES, WARM  # noqa: F401  (tier ids live in blocks.py)


class Move(NamedTuple):  # (a tuple: made for every moved block, twice; a frozen dataclass costs 2x)
    block_id: int
    src_tier: int
    dst_tier: int  # a tier index, or DROPPED
    dst_slot: int | None = None  # a particular free slot of dst_tier (compaction), else any

    @property
    def is_eviction(self) -> bool:
        return self.dst_tier == DROPPED

    def __str__(self) -> str:
        dst = "dropped" if self.is_eviction else TIER_NAMES[self.dst_tier]
        if self.dst_slot is not None:
            dst += f" slot {self.dst_slot}"
        return f"block {self.block_id}: {TIER_NAMES[self.src_tier]} -> {dst}"


@dataclass
class Plan:
    """Moves to apply in order, then where each of `num_new_blocks` new blocks goes.

    The store applies `moves` first (each one frees a slot in its source tier before the next
    needs it), then allocates `new_block_tiers[i]` for the i-th new block.
    """

    moves: list[Move] = field(default_factory=list)
    new_block_tiers: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.moves and not self.new_block_tiers

    def count(self, src_tier: int, dst_tier: int) -> int:
        return sum(1 for m in self.moves if m.src_tier == src_tier and m.dst_tier == dst_tier)
