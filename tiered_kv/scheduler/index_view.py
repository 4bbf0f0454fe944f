"""What the scheduler reads of the store's block index: the one view it plans over. Ids only.

The store passes its BlockIndex (block_index.py), which has these methods; the scheduler never
imports it and never changes it: a plan is a list of moves the store applies. An index that
has a `placement_version` (BlockIndex does) has it recorded in the plans made over it, with the
source slots the planner read (Plan.with_sources): the store trusts them while it is current.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class BlockView(Protocol):
    """One block as the index holds it."""

    tier: int  # blocks.HOT / WARM / COLD, or DROPPED
    ref_count: int  # chats (rows) holding it; 0: cached only, droppable


class IndexView(Protocol):
    """Where blocks are, since when, and in which order each tier last used them."""

    def peek(self, block_id: int) -> BlockView | None:
        """The block, or None when the index no longer has it."""

    def get(self, block_id: int) -> BlockView:
        """The block (KeyError naming it when unknown)."""

    def recency(self, tier: int) -> Iterable[int]:
        """The blocks of `tier`, least recently used first."""

    def unreferenced(self, tier: int) -> Iterable[int]:
        """The blocks of `tier` no chat holds, least recently used first."""

    def count_in(self, tier: int) -> int:
        """How many blocks `tier` holds."""

    def arrival_steps(self, block_ids) -> list[int]:
        """The store step each block entered its current tier."""
