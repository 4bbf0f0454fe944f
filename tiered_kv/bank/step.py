"""One forward pass of a bank, made atomic (DESIGN.md invariant 3).

Layer 0 opens a `Step` and asks the store for a lease on everything the pass reads and writes
(`TierStore.open_step`: copy-on-write of a shared tail, new blocks, the history brought up on a
new turn, pins, token runs; store/opening.py). Nothing the bank reports changes yet: its rows,
length and keys are committed only after the last layer. A step that does not reach its last
layer (an exception at any layer, Ctrl-C, a corrupt block) is rolled back: its lease is aborted
(what it allocated is released, its moves undone, its pins dropped) and the bank is exactly as
before.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


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
    forward_seen: bool = False  # the bank's forward hooks saw this pass: they will report its end
    thread_id: int = field(default_factory=threading.get_ident)
    lease: object = None  # the store's StepLease (store/leases.py) once opened
    reads: object = None  # StepReads (hooks/reads.py) when tiered_kv.hooks serve this step's attention
    started_s: float = 0.0  # time.perf_counter() when layer 0 began the step

    def allocated_block_ids(self) -> list[int]:
        return self.lease.allocated_block_ids if self.lease is not None else []
