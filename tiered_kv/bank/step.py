"""One forward pass of a bank, made atomic (docs/design.md, invariant 3).

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

import torch


@dataclass
class RowInputs:
    """What the forward hook saw for one row: its token ids, and whether they are verified."""

    token_ids: list[int] | None
    verified: bool


class DeferredInputs:
    """A forward's token ids and per-row verification on a GPU, copied to pinned host memory
    after the forward was enqueued, without a host sync; read (`rows[r]`) when the step commits,
    by which time the copy, queued before any layer, has long landed."""

    def __init__(self, ids_host, ok_host, event):
        self.shape = tuple(ids_host.shape)
        self._ids_host, self._ok_host, self._event = ids_host, ok_host, event
        self._rows: list[RowInputs] | None = None

    @classmethod
    def copy(cls, input_ids: torch.Tensor, ok: torch.Tensor) -> "DeferredInputs":
        with torch.cuda.device(input_ids.device):  # the copies and the event on the ids' stream
            ids_host = torch.empty(input_ids.shape, dtype=input_ids.dtype, pin_memory=True)
            ids_host.copy_(input_ids, non_blocking=True)
            ok_host = torch.empty(ok.shape, dtype=torch.bool, pin_memory=True)
            ok_host.copy_(ok, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(input_ids.device))
        return cls(ids_host, ok_host, event)

    def __len__(self) -> int:
        return self.shape[0]

    def ready(self) -> bool:
        """Whether the copy landed (reading the rows then waits for nothing)."""
        return self._rows is not None or self._event.query()

    def __getitem__(self, row: int) -> RowInputs:
        if self._rows is None:
            if not self._event.query():
                self._event.synchronize()
            self._rows = [RowInputs(ids, v) for ids, v in zip(self._ids_host.tolist(), self._ok_host.tolist())]
        return self._rows[row]


@dataclass
class Turn:
    """What a bank keeps of its chat's turn: when it began (until its first forward ended: the time
    to first token), whether attach() counted it already, and the seconds its own thread spent
    moving blocks (`critical_path`, by direction)."""

    started_s: float | None = None
    counted: bool = False
    critical_path: dict = field(default_factory=lambda: {"demote_s": 0.0, "promote_s": 0.0})

    def charge_moves(self, store, before: dict) -> None:
        """Add the seconds this thread waited for the store's demand moves since `before`
        (`moved_seconds(store)` taken then)."""
        after = moved_seconds(store)
        for direction in ("demote", "promote"):
            self.critical_path[f"{direction}_s"] += after[direction] - before[direction]


def moved_seconds(store) -> dict:
    """Seconds this thread has waited for the store's demand moves so far, by direction."""
    demand = store.demand
    return dict(demand.thread_seconds()) if demand is not None else {"demote": 0.0, "promote": 0.0}


@dataclass
class Step:
    num_new_tokens: int
    num_tokens: int  # the bank's length once committed
    created_rows: bool  # the bank had no rows before this step
    inputs: list[RowInputs] | DeferredInputs
    num_rows: int = 1  # batch rows (sequences) of the forward
    forward_seen: bool = False  # the bank's forward hooks saw this pass: they will report its end
    thread_id: int = field(default_factory=threading.get_ident)
    lease: object = None  # the store's StepLease (store/leases.py) once opened
    layer0_seen: bool = False  # layer 0 of the forward ran (a prepared step is used once)
    layers_done: bool = False  # every layer wrote and read its K/V: the step commits at the forward's end
    expects_paged: bool = False  # attention (hooks merge mode) runs the paged kernel over the plan
    read_kind: str = "staged"  # how its layers read (plan.py KINDS)
    compiled: bool = False  # prepared outside a compiled forward; settled at the bank's next eager call (compiled.py)
    ids_buffer: object = None  # (compiled) the step's token ids, copied in by the graph
    ok_buffer: object = None  # (compiled) per row, whether its positions continued the bank's tokens
    expected_positions: object = None  # (compiled) the positions the step's tokens must have
    started_s: float = 0.0  # time.perf_counter() when layer 0 began the step
    computing_s: float = 0.0  # time.perf_counter() once its lease was open (its moves done): compute from here

    def allocated_block_ids(self) -> list[int]:
        return self.lease.allocated_block_ids if self.lease is not None else []
