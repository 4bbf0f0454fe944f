"""A transfer batch: the block copies of one unit of the copy engine, and what became of them, as
arrays. `Transfers` (transfers.py) prepares, launches and completes them; this module only holds them.

A batch is a few `TransferGroup`s, one per kind and direction (source tier, destination tier):
int64 arrays of block ids, source slots and destination slots, one entry per block, plus per-block
flags (cancelled, corrupt) as bool arrays. Nothing here is an object per block: `Transfer` is a
read-only view of one entry, built only when asked for (`batch.transfers`, `batch.failed`: tests,
logs, the rare paths that look at one block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..hw.copy_engine import CopyEvent
from ..scheduler.plan import MoveList
from .copies import MOVE


class TransferGroup:
    """The copies of one batch sharing a kind (copies.MOVE, COPY, BACKUP, READ_OUT, WRITE_IN) and a
    direction, in copy order. `block_ids[i]` goes from (src_tier, src_slots[i]) to (dst_tier,
    dst_slots[i]): a move takes the block there; a copy fills the new block `block_ids[i]` (at its
    destination already) from block `src_blocks[i]`; a write-in fills it from host bytes
    (`data[i]`); a read-out copies it into host memory (`data[i]`); a backup writes a durable
    copy into cold. `cancelled[i]`: a step began to use the block where it was, or it was freed or
    found corrupt meanwhile (then also `gone[i]`: no longer in flight); `corrupt[i]`: the source
    failed its checksum on the way."""

    __slots__ = ("batch", "kind", "src_tier", "dst_tier", "block_ids", "src_slots", "dst_slots", "cancelled",
                 "gone", "corrupt", "src_blocks", "data", "_positions")

    def __init__(self, batch: "TransferBatch", kind: str, src_tier: int, dst_tier: int, block_ids: np.ndarray,
                 src_slots: np.ndarray, dst_slots: np.ndarray, src_blocks: np.ndarray | None = None,
                 data: list | None = None):
        count = len(block_ids)
        self.batch, self.kind, self.src_tier, self.dst_tier = batch, kind, src_tier, dst_tier
        self.block_ids, self.src_slots, self.dst_slots = block_ids, src_slots, dst_slots
        self.cancelled = np.zeros(count, dtype=bool)
        self.gone = np.zeros(count, dtype=bool)
        self.corrupt = np.zeros(count, dtype=bool)
        self.src_blocks = src_blocks
        self.data = data
        self._positions: dict[int, int] | None = None

    def __len__(self) -> int:
        return len(self.block_ids)

    def position(self, block_id: int) -> int:
        """Where `block_id` is in this group (built once, on the rare paths that ask: a cancel)."""
        if self._positions is None:
            self._positions = dict(zip(self.block_ids.tolist(), range(len(self.block_ids))))
        return self._positions[block_id]

    def view(self, i: int) -> "Transfer":
        return Transfer(int(self.block_ids[i]), self.src_tier, int(self.src_slots[i]), self.dst_tier,
                        int(self.dst_slots[i]), self.batch, self.kind,
                        self.data[i] if self.data is not None else None, bool(self.cancelled[i]),
                        bool(self.corrupt[i]), int(self.src_blocks[i]) if self.src_blocks is not None else None)

    def __repr__(self) -> str:
        return (f"TransferGroup({self.kind} {self.src_tier}->{self.dst_tier}, {len(self)} block(s), "
                f"mode {self.batch.mode})")


class Transfer(NamedTuple):
    """A read-only view of one block's copy in a group (see TransferGroup)."""

    block_id: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    batch: "TransferBatch"
    kind: str = MOVE
    data: object = None
    cancelled: bool = False
    corrupt: bool = False
    src_block: int | None = None


@dataclass(eq=False)
class TransferBatch:
    mode: str  # metrics.registry.ON_DEMAND | BACKGROUND
    groups: list[TransferGroup] = field(default_factory=list)
    event: CopyEvent | None = None
    error: BaseException | None = None  # raised by launch (or recorded by the engine on the event)
    frees: list[tuple[int, int]] = field(default_factory=list)  # slots to free once the copies are done
    num_evictions: int = 0
    num_adopted: int = 0  # moves into cold done at prepare by taking a durable copy's slot (nothing copied)
    num_left_out: int = 0  # moves of the plan prepare left for a later batch (in flight, no room, stale)
    started_s: float = 0.0
    quiet: bool = False  # the caller reports a failure itself (the moves to cold at close)
    # filled by complete():
    committed: MoveList = field(default_factory=MoveList)
    corrupt: list[int] = field(default_factory=list)
    failed_parts: list[tuple[TransferGroup, np.ndarray]] = field(default_factory=list)  # (group, positions)
    completed: bool = False

    @property
    def num_copies(self) -> int:
        """Blocks this batch copies (every group's entries)."""
        return sum(len(g) for g in self.groups)

    @property
    def transfers(self) -> list[Transfer]:
        """Every copy as a Transfer view (built on each call: tests and reports, not the move path)."""
        return [g.view(i) for g in self.groups for i in range(len(g))]

    @property
    def failed(self) -> list[Transfer]:
        """The copies that failed, as Transfer views (see `failed_block_ids` for the ids alone)."""
        return [g.view(i) for g, positions in self.failed_parts for i in positions.tolist()]

    @property
    def num_failed(self) -> int:
        return sum(len(positions) for _, positions in self.failed_parts)

    def failed_block_ids(self) -> np.ndarray:
        parts = [g.block_ids[positions] for g, positions in self.failed_parts]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def any_corrupt(self) -> bool:
        """A source failed its checksum on the way (in any group)."""
        return bool(self.corrupt) or any(bool(g.corrupt.any()) for g in self.groups)

    @property
    def settled_at_prepare(self) -> int:
        """Moves of the plan done without a copy (evictions, adopted copies)."""
        return self.num_evictions + self.num_adopted

    @property
    def failure(self) -> BaseException | None:
        if self.error is not None:
            return self.error
        return self.event.error if self.event is not None else None

    def wait(self) -> None:
        """Until the batch's copies are done (no store lock may be held)."""
        if self.event is not None:
            self.event.wait()


__all__ = ["Transfer", "TransferGroup", "TransferBatch"]
