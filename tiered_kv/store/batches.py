"""A transfer batch: the block copies of one unit of the copy engine, and what became of them.
`Transfers` (transfers.py) prepares, launches and completes them; this module only holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hw.copy_engine import CopyEvent
from ..scheduler import Move
from .copies import MOVE


@dataclass(eq=False)
class Transfer:
    """One block's copy. A move takes the block to (dst_tier, dst_slot); a copy fills a new block
    (`block_id`, already at its destination) from another block's slot; a read-out copies a block
    into host memory (`out`); a write-in fills a new block from host bytes (`data`)."""

    block_id: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    batch: "TransferBatch"
    kind: str = MOVE
    data: object = None  # write-in: the block's bytes (a host tensor); read-out: the host tensor filled
    cancelled: bool = False  # a step began to use the block where it was, or it was freed
    corrupt: bool = False  # the source failed its checksum on the way
    src_block: int | None = None  # a copy: the block copied from
    move: object = None  # the plan's Move this carries out (reused as the committed Move)


@dataclass(eq=False)
class TransferBatch:
    mode: str  # metrics.registry.ON_DEMAND | BACKGROUND
    transfers: list[Transfer] = field(default_factory=list)
    event: CopyEvent | None = None
    error: BaseException | None = None  # raised by launch (or recorded by the engine on the event)
    frees: list[tuple[int, int]] = field(default_factory=list)  # slots to free once the copies are done
    num_evictions: int = 0
    num_adopted: int = 0  # moves into cold done at prepare by taking a durable copy's slot (nothing copied)
    started_s: float = 0.0
    quiet: bool = False  # the caller reports a failure itself (the moves to cold at close)
    # filled by complete():
    committed: list[Move] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    failed: list[Transfer] = field(default_factory=list)
    completed: bool = False

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


__all__ = ["Transfer", "TransferBatch"]
