"""One forward pass of a bank, made atomic (DESIGN.md invariant 3).

Layer 0 opens a `Step`: under the store lock it copies shared or published partial tails
(copy-on-write), allocates blocks for the new tokens, brings the history up on a new turn, pins
every block the step touches, and maps the step's tokens to tiers and slots once for all layers.
Nothing the bank reports changes yet: its rows, length and keys are committed only after the
last layer (`commit`). A step that does not reach its last layer (an exception at any layer,
Ctrl-C, a corrupt block) is rolled back: its new blocks and copies are released, its pins
dropped, and the bank is exactly as before. Bookkeeping is O(new blocks) when nothing moved
since the bank's previous step (placements are cached against the store's placement_version).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from ..blocks import num_blocks_for
from ..scheduler import HOT
from ..store import TierRun


@dataclass
class RowInputs:
    """What the forward hook saw for one row: its token ids, and whether they are verified."""

    token_ids: list[int] | None
    verified: bool


@dataclass
class Step:
    num_new_tokens: int
    num_tokens: int  # the bank's length once committed
    created_rows: bool  # the bank had no rows before this step
    inputs: list[RowInputs]
    hooked: bool = False  # the forward hooks saw this pass: they will report its end
    thread_id: int = field(default_factory=threading.get_ident)
    tail_copies: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (old tail, its copy)
    new_blocks: list[list[int]] = field(default_factory=list)  # per row
    placements: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per row: tiers, slots
    moves: list = field(default_factory=list)  # moves applied to make room, undone on rollback
    placement_version: int = -1
    write_runs: list[list[TierRun]] = field(default_factory=list)
    read_runs: list[list[TierRun]] = field(default_factory=list)
    reads_host_tiers: bool = False
    reads: object = None  # StepReads (layer_reads.py) when tiered_kv.hooks serve this step's attention
    started_s: float = 0.0  # time.perf_counter() when layer 0 began the step

    def block_table(self, row_index: int, committed: list[int]) -> list[int]:
        """The row's block table as it will be once this step commits."""
        table = committed
        if row_index in self.tail_copies:
            table = committed[:-1] + [self.tail_copies[row_index][1]]
        return table + self.new_blocks[row_index]

    def allocated_block_ids(self) -> list[int]:
        return [b for blocks in self.new_blocks for b in blocks] + [new for _, new in self.tail_copies.values()]


class PlacementCache:
    """Per row, the (tier, slot) arrays of a committed block table, valid while the store's
    placement_version is unchanged: a decode step then looks up only its new blocks."""

    def __init__(self) -> None:
        self.version = -1
        self.rows: list[tuple[list[int], np.ndarray, np.ndarray]] = []

    def invalidate(self) -> None:
        self.version = -1
        self.rows = []

    def lookup(self, store, row_index: int, table: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Tiers and slots of `table`'s blocks (store lock held by the caller)."""
        if self.version == store.placement_version and row_index < len(self.rows):
            cached_table, tiers, slots = self.rows[row_index]
            n = len(cached_table)
            if n <= len(table) and table[:n] == cached_table:
                if n == len(table):
                    return tiers, slots
                extra_tiers, extra_slots = store.placements(table[n:])
                return np.concatenate((tiers, extra_tiers)), np.concatenate((slots, extra_slots))
        return store.placements(table)

    def remember(self, version: int, tables: list[list[int]], placements) -> None:
        self.version = version
        self.rows = [(list(table), tiers, slots) for table, (tiers, slots) in zip(tables, placements)]


def blocks_needed(num_tokens: int, block_size: int, table: list[int]) -> int:
    return num_blocks_for(num_tokens, block_size) - len(table)


def tier_counts(placements) -> dict[int, int]:
    """Blocks per tier read by a step (a block shared by rows counts once per row)."""
    counts: dict[int, int] = {}
    for tiers, _ in placements:
        for tier, count in enumerate(np.bincount(tiers[tiers >= 0], minlength=3).tolist()):
            if count:
                counts[tier] = counts.get(tier, 0) + count
    return counts


def reads_host(runs_per_row: list[list[TierRun]]) -> bool:
    return any(run.tier != HOT for runs in runs_per_row for run in runs)
