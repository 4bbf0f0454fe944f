"""Step leases: what a forward pass holds instead of the store's lock (docs/design.md, invariant 8).

`TierStore.open_step(request)` (opening.py) returns a `StepLease` once every block the step
reads or writes is pinned, in place and mapped to tiers and slots. The lease's reads and writes
of those blocks run without the store lock: pinned blocks cannot move or be freed, and per-call
scratch comes from the tiers' pools. It ends once, in `commit()` (the step happened: unpin) or
`abort()` (the step is rolled back: release what it allocated, put back what its moves
displaced as far as room allows, unpin). A read that finds a block corrupt marks it (never
served) before the error goes up to the bank, which truncates before it and recomputes.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..blocks import HOT
from ..errors import CorruptBlockError
from ..scheduler.plan import MoveList
from .token_map import TierRun

_NO_MOVES = MoveList()  # a decode step's extended lease moved nothing (shared: never added to)


@dataclass
class StepRequest:
    """What a bank's forward pass needs from the store (one per step)."""

    owner: int  # the bank's step owner id
    tables: list[list[int]]  # per row, the committed block ids in token order
    block_set: set[int]  # every block the rows reference (unchanged by the bank until the step ends)
    num_tokens_before: int  # committed tokens per row
    num_new_tokens: int
    new_turn: bool = False  # bring the history up (hot first) before the step reads it
    promotion_order: list[int] = field(default_factory=list)  # history, most recent first (new turns)
    verify_cold: bool = False  # check the history left in cold against its checksums before the step
    count_turn_start: bool = False  # count where the history is as this turn begins (hit rates)
    cost_sensitivity: float = 0.5
    # per row, the sequence position (in blocks) of its table's first block: a sliding-window
    # group's row has released the blocks before it (bank/cache_bank.py); None: all rows start at 0
    first_blocks: list[int] | None = None
    # per row, the sequence position (in blocks) where its new blocks start, when later than its
    # table's end: a sliding group's long prefill stores only what its window keeps (None: at the end)
    new_first_blocks: list[int | None] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_tokens_before + self.num_new_tokens

    def first_token(self, row: int, block_size: int) -> int:
        """The sequence position of the first token row `row`'s table holds."""
        return 0 if self.first_blocks is None else self.first_blocks[row] * block_size

    def new_first_block(self, row: int) -> int | None:
        """Where row `row`'s new blocks start when a gap separates them from its table, else None."""
        return None if self.new_first_blocks is None else self.new_first_blocks[row]


@dataclass
class LeaseRow:
    """One row (sequence) of a leased step: its block table as it is once the step commits.

    Token positions below count from the table's first block. The token runs a staged layer
    reads and writes through (token_map.py) are mapped on first use only: a prepared step
    (bank/plan.py) addresses the blocks with index tensors instead and never needs them."""

    table: list[int]
    new_blocks: list[int]
    tail_copy: tuple[int, int] | None  # (old tail, its private copy) when the tail was copied on write
    tiers: np.ndarray  # tier of each block of `table`
    slots: np.ndarray
    write_start: int  # the new tokens stored: [write_start, write_end)
    write_end: int
    num_tokens: int  # tokens read_layer returns: [0, num_tokens) (before the gap, if any)
    skipped_new_tokens: int = 0  # leading new tokens not stored (they fall in the gap; write_layer skips them)
    _runs: tuple | None = None  # (write runs, read runs) once mapped

    def runs(self, mapper) -> tuple[list[TierRun], list[TierRun]]:
        if self._runs is None:
            write = mapper.map_range(self.tiers, self.slots, self.write_start, self.write_end) \
                if self.write_end > self.write_start else []
            read = mapper.map_range(self.tiers, self.slots, 0, self.num_tokens) if self.num_tokens > 0 else []
            self._runs = (write, read)
        return self._runs

    def extended(self, num_new_tokens: int) -> "LeaseRow":
        """This row one decode step later: the same blocks, `num_new_tokens` more in the tail."""
        return LeaseRow(self.table, [], None, self.tiers, self.slots, self.num_tokens,
                        self.num_tokens + num_new_tokens, self.num_tokens + num_new_tokens)


class StepLease:
    def __init__(self, host, owner: int, num_tokens: int, num_new_tokens: int, rows: list[LeaseRow], moves: MoveList,
                 reads_host_tiers: bool, placement_version: int, block_ids: np.ndarray):
        self._host = host  # the store's Opening: mapper, device, mark_corrupt, end_lease
        self.owner = owner
        self.num_tokens = num_tokens
        self.num_new_tokens = num_new_tokens
        self.rows = rows
        self.moves = moves  # the moves opening made, as a MoveList (undone by abort)
        self.reads_host_tiers = reads_host_tiers
        self.placement_version = placement_version  # the index's when the rows were placed
        self.block_ids = block_ids  # every block the step reads or writes, once (not mutated: logs keep it)
        self.thread_id = threading.get_ident()
        self.stream = None  # the stream its forward's compute runs on (taken at layer 0: opening.py)
        self.ended = False
        self._corrupt: CorruptBlockError | None = None  # once a read found a bad block, every read fails

    def extended(self, num_new_tokens: int) -> "StepLease":
        """The lease of the chat's next decode step over the same blocks (opening.open_decode)."""
        return StepLease(self._host, self.owner, self.num_tokens + num_new_tokens, num_new_tokens,
                         [row.extended(num_new_tokens) for row in self.rows], _NO_MOVES, self.reads_host_tiers,
                         self.placement_version, self.block_ids)

    @property
    def allocated_block_ids(self) -> list[int]:
        return [b for row in self.rows for b in row.new_blocks] + \
            [row.tail_copy[1] for row in self.rows if row.tail_copy is not None]

    @property
    def device(self) -> torch.device:
        return self._host.device

    # ---- one layer's K/V, without the store lock ----------------------------------------------
    def write_layer(self, layer: int, row: int, kv: torch.Tensor) -> None:
        """Store the new tokens' `[2, H, t, D]` of one layer and row, wherever their blocks live
        (a gapped row's: those after its gap)."""
        lease_row = self.rows[row]
        if lease_row.skipped_new_tokens:
            kv = kv[:, :, lease_row.skipped_new_tokens:]
        mapper = self._host.mapper
        mapper.write_layer(layer, lease_row.runs(mapper)[0], kv)

    def read_layer(self, layer: int, row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[2, H, n, D]` of one layer and row on the compute device, n the tokens the row holds
        (all of them unless its table starts later: a sliding-window group; a gapped row's its
        old tokens only, without the new ones); a view of the hot slab when the row's blocks are
        consecutive hot slots."""
        with self._marking_corrupt():
            lease_row, mapper = self.rows[row], self._host.mapper
            return mapper.read_layer(layer, lease_row.runs(mapper)[1], lease_row.num_tokens, out)

    def read_runs(self, layer: int, runs, num_tokens: int) -> torch.Tensor:
        """`[2, H, num_tokens, D]` of tokens mapped by the caller (a sparse step's chosen blocks:
        bank/sparse.py), through the same checks as read_layer."""
        with self._marking_corrupt():
            return self._host.mapper.read_layer(layer, runs, num_tokens)

    # ---- the end ----------------------------------------------------------------------------------
    def commit(self) -> None:
        """The step happened: its blocks stay with their bank, and are unpinned."""
        self._host.end_lease(self, aborted=False)

    def abort(self) -> None:
        """Roll the step back: what it allocated is released, its moves are undone as far as room
        allows, its blocks are unpinned."""
        self._host.end_lease(self, aborted=True)

    @contextlib.contextmanager
    def _marking_corrupt(self):
        if self._corrupt is not None:  # the step is failing: no later layer is read as if it were fine
            raise CorruptBlockError(str(self._corrupt))
        try:
            yield
        except CorruptBlockError as error:
            self._corrupt = error
            block_id = self._block_at(getattr(error, "tier", None), getattr(error, "slot", None))
            self._host.mark_corrupt(block_id, getattr(error, "tier", None), getattr(error, "slot", None))
            if block_id is not None:
                error.block_id = block_id
            raise

    def _block_at(self, tier, slot) -> int | None:
        if tier is None or slot is None:
            return None
        for row in self.rows:
            hit = np.nonzero((row.tiers == tier) & (row.slots == slot))[0]
            if len(hit):
                return row.table[int(hit[0])]
        return None


def reads_host(rows: list[LeaseRow], block_size: int) -> bool:
    """Whether the step reads any block outside hot (on a GPU: host memory, behind a fence)."""
    return any(bool((row.tiers[:-(-row.num_tokens // block_size)] != HOT).any()) for row in rows if row.num_tokens)


__all__ = ["StepRequest", "StepLease", "LeaseRow", "reads_host"]
