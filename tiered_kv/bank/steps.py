"""The step machine: how a bank runs one forward pass, begin to commit (docs/design.md, invariants 3 and 9).

Layer 0 opens a Step (step.py) and the store's lease for it (store/leases.py: the bank never
takes the store's lock), and prepares its plan (plan.py): what every layer writes and reads. The
last layer marks the step done; a step the model's forward hooks see commits when the forward
ends (a failure anywhere before rolls it back), any other at once. Anything that stops the pass
rolls it back (directly, from the forward hook that runs even when the model raised, or lazily at
the bank's next use). A compiled decode step is prepared and settled outside its graph
(compiled.py). Committed tokens are published here, a few new blocks per step.

The machine owns the open step, its plan and what carries from step to step (the last lease a
decode step extends, the gather buffer, ids on their way from a GPU); the rows it commits to are
the bank's Sequence (sequence.py).
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..errors import CapacityError, CorruptBlockError, LayoutError
from ..store import PIN_WAIT_S, StepRequest
from . import compiled
from .attention_steps import AttentionSteps
from .inputs import mask_starts, seen_inputs, take_inputs
from .plan import KINDS, GatherBuffer, StepPlan, clear_expected, expect_paged, paged_kernels, prepare
from .rows import Row
from .step import DeferredInputs, Step, moved_seconds


class StepMachine:
    def __init__(self, bank):
        self.bank = bank  # the seam: its store, sequence, identity (root keys), turn and hooks mode
        self.store, self.seq, self.turn = bank.store, bank.seq, bank.turn
        self.step: Step | None = None
        self.plan: StepPlan | None = None
        self.last_lease = None  # the last committed step's lease, which a decode step may extend
        self.gather_buffer = GatherBuffer()  # where gathered reads land, reused by every step
        self.counts = dict.fromkeys(KINDS, 0)  # committed steps by how their layers read
        self.pending_inputs = None  # what the forward pre-hook saw (inputs.seen_inputs)
        self.pending_mask = None  # the attention mask it saw (paged steps' start offsets)
        self.in_forward = False  # between the watched model's forward hooks (eager forwards)
        self.forced_eager = False  # compiled.py made the coming forward run eagerly
        self.generate_compiles = False  # the generate() running now compiles its decode steps (compiled.py)
        self.unsettled_inputs: list = []  # committed steps whose token ids are still on their way (GPU)
        self.attention = AttentionSteps(bank)  # sampled attention mass, key summaries, sparse steps

    # ---- the forward hooks (forward_watch.py) ----------------------------------------------------
    def note_forward_inputs(self, module, input_ids, attention_mask, position_ids) -> None:
        self.pending_inputs = None
        model = self.bank.model
        self.in_forward = model is not None and module is model
        if not self.in_forward or self.bank.closed or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return  # another model computes through this bank: its ids prove nothing about our KV
        self.pending_inputs = seen_inputs(input_ids, attention_mask, position_ids, self.seq.num_tokens)
        self.pending_mask = attention_mask

    def note_forward_end(self, failed: bool) -> None:
        """The watched model's forward ended (also when it raised): its step commits once every
        layer is done and nothing after them failed, else it is rolled back (a failure in the last
        layer's attention, or in the head, changes nothing either)."""
        self.pending_inputs = self.pending_mask = None
        self.in_forward = False
        step = self.step
        if step is not None and step.forward_seen:
            if failed or not step.layers_done:
                self.rollback()
            else:
                self.commit()

    # ---- one forward pass ------------------------------------------------------------------------
    def layer0(self, key_states: torch.Tensor) -> StepPlan:
        """Layer 0 of a forward pass, before it writes or reads anything: the step is opened and
        its plan prepared for every row (its lease, the new tokens' slots, the index tensors)."""
        step = self.step
        num_rows, _, num_new, _ = key_states.shape
        if step is not None and step.compiled and not step.layer0_seen:  # prepared for a graph, run eagerly
            if step.num_rows == num_rows and step.num_new_tokens == num_new:
                step.compiled = False
                step.inputs = take_inputs(self.pending_inputs, num_rows, num_new)
                step.forward_seen = isinstance(step.inputs, DeferredInputs) or step.inputs[0].token_ids is not None
                self.plan.clone_last = not step.forward_seen
            else:
                self.rollback()
            step = self.step
        if step is None or step.layer0_seen or step.num_rows != num_rows or step.num_new_tokens != num_new:
            self.begin(num_rows, num_new, self.pending_mask)
            step = self.step
        step.layer0_seen = True
        store = self.store
        if store.layout is None or key_states.dtype != store.dtype or key_states.device != store.device or \
                key_states.shape[1] != store.layout.num_kv_heads or key_states.shape[3] != store.layout.head_dim:
            with self.rolled_back_on_error():
                self.bank.bind(key_states)
        if self.plan is None:  # (a config-only bank's first step: opened once bound)
            self.open(step, None)
        return self.plan

    def begin(self, num_rows: int, num_new: int, attention_mask=None, compiled: bool = False) -> None:
        started_s = time.perf_counter()  # the step's duration (step observers), a turn's start (TTFT)
        self.abandon()  # a previous forward that never reached its last layer
        seq = self.seq
        if seq.rows and num_rows != seq.batch_size:
            raise LayoutError(
                f"CacheBank holds {seq.batch_size} sequences but the model passed a batch of {num_rows}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank")
        num_tokens = seq.num_tokens + num_new
        if num_new > 1 and self.turn.started_s is None:  # a turn without attach() starts here
            self.turn.started_s = started_s
            self.store.metrics.turns.inc()
        self.bank.check_fits(num_rows, num_tokens, seq.num_tokens)
        inputs = take_inputs(self.pending_inputs, num_rows, num_new)  # (a compiled step's come from its graph)
        self.pending_inputs = None
        step = Step(num_new, num_tokens, created_rows=not seq.rows, inputs=inputs, num_rows=num_rows,
                    forward_seen=compiled or isinstance(inputs, DeferredInputs) or inputs[0].token_ids is not None,
                    compiled=compiled, started_s=started_s)
        if step.created_rows:
            seq.rows = [Row() for _ in range(num_rows * seq.num_groups)]
        self.step = step
        if self.store.is_bound:  # (else a config-only bank's first step: bound at layer 0, from the K/V's dtype)
            self.open(step, attention_mask)

    def open(self, step: Step, attention_mask) -> None:
        """The step's lease and plan (the step is rolled back if either fails)."""
        with self.rolled_back_on_error():
            step.lease = self.open_lease(step)
            self.plan = self.make_plan(step, attention_mask)
        step.computing_s = time.perf_counter()

    def make_plan(self, step: Step, attention_mask) -> StepPlan:
        """The step's plan (plan.py): how each layer writes and reads, from where its blocks lie."""
        bank, store = self.bank, self.store
        plan = StepPlan(step.lease, bank.num_layers, self.layers_done, self.rolled_back_on_error)
        plan.clone_last = not step.forward_seen  # nobody tells us when the last layer's views are read
        plan.is_grouped = not self.seq.layer_groups.is_single_full
        if not plan.is_grouped:
            mode = bank.hooks_mode if step.forward_seen else None
            kernels = paged_kernels() if mode == "merge" and not step.compiled else None
            prepare(plan, store.device_slab, self.gather_buffer, store.dtype,
                    allow_views=store.device.type != "cuda" or mode == "merge", paged_kernels=kernels,
                    mask_starts=mask_starts(attention_mask, step.num_tokens) if kernels is not None else None,
                    split=mode == "merge" and kernels is None and store.device.type == "cpu",
                    traced=compiled.prepare_traced if step.compiled else None)
            if plan.read_kind == "paged":
                expect_paged(plan)  # attention without the plan would see only the new tokens: it raises
                step.expects_paged = True
        self.attention.prepare(step, plan, bank.hooks_mode if step.forward_seen else None)
        step.read_kind = plan.read_kind
        return plan

    def open_lease(self, step: Step):
        """The store's lease for this step: for a decode step whose tokens land in the tail blocks
        it holds, the last step's extended (O(rows): store/opening.py open_decode) when none of its
        blocks moved since; else a new one. Waits (without any lock) while the room it needs is
        held by other chats' running steps, up to PIN_WAIT_S."""
        store, previous, seq = self.store, self.last_lease, self.seq
        if previous is not None and step.num_new_tokens == 1 and seq.rows and seq.num_tokens % seq.block_size:
            lease = store.opening.open_decode(previous, seq.block_set, step.num_new_tokens, self.bank.cost_sensitivity,
                                              [row.table[-1] for row in seq.rows])
            if lease is not None:
                self.turn.counted = False
                return lease
        request = self.request(step)
        before = moved_seconds(store)
        deadline = time.monotonic() + PIN_WAIT_S
        try:
            while True:
                version = store.change_version
                lease = store.open_step(request)
                if lease is not None:
                    return lease
                # short waits: room held by a copy's fence (GPU) frees without anyone signalling it
                store.wait_for_change(version, min(0.05, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    raise CapacityError(
                        f"this step needs room that other chats' running steps held for {PIN_WAIT_S:.0f} s; "
                        "nothing was written. Raise a tier's capacity or run fewer chats at once")
        finally:
            self.turn.charge_moves(store, before)

    def request(self, step: Step) -> StepRequest:
        seq, groups = self.seq, self.seq.layer_groups
        new_turn = step.num_new_tokens > 1
        tables = [list(row.table) for row in seq.rows]
        has_history = any(tables)
        request = StepRequest(
            self.bank.owner, tables, seq.block_set, seq.num_tokens, step.num_new_tokens, new_turn=new_turn,
            promotion_order=seq.promotion_order() if new_turn and has_history else [],
            verify_cold=new_turn,  # cold history is checked before the step, not found bad mid-forward
            count_turn_start=new_turn and has_history and not self.turn.counted,
            cost_sensitivity=self.bank.cost_sensitivity,
            first_blocks=[row.first_block for row in seq.rows] if groups.any_sliding else None,
            new_first_blocks=self.gaps(step) if groups.any_sliding else None)
        self.turn.counted = False
        return request

    def gaps(self, step: Step) -> list[int | None]:
        """Per row, where a sliding row's new blocks start when its window after this step begins
        past what it holds (a long prefill): only those are stored (the tokens before are attended
        from the model's own K/V, and left the window by the step's end), so a prefill holds about
        two windows of a sliding group, not all of its tokens. Else None."""
        gaps, block_size = [], self.seq.block_size
        for row, group in self.seq.rows_and_groups():
            kept_from = group.first_needed_block(step.num_tokens, block_size) if group.is_sliding else 0
            gaps.append(kept_from if kept_from > row.end_block else None)
        return gaps

    @contextlib.contextmanager
    def rolled_back_on_error(self):
        """Whatever stops a step partway rolls it back; a corrupt block also truncates the bank
        before it, so the next call recomputes it."""
        try:
            yield
        except CorruptBlockError as error:
            self.rollback()
            raise self.bank.corrupt_error(error) from error
        except BaseException:
            self.rollback()
            raise

    # ---- the end of a step --------------------------------------------------------------------------
    def layers_done(self) -> None:
        """Every layer of the step wrote and read its K/V (a paged step: its last attention ran).
        A step the forward hooks see commits at the forward's end; any other commits now."""
        if self.step.forward_seen:
            self.step.layers_done = True
        else:
            self.commit()

    def commit(self) -> None:
        step, store, seq = self.step, self.store, self.seq
        lease, num_tokens_before = step.lease, seq.num_tokens
        replaced, _ = seq.apply_lease(lease, step.num_tokens)
        self.counts[step.read_kind] += 1
        self.step = self.plan = None
        if step.expects_paged:
            clear_expected()
        self.attention.committed()
        self.unsettled_inputs.append((step.inputs, num_tokens_before, step.num_tokens))
        self.settle_inputs(wait=False)
        self.count(step)
        # the next decode step extends this lease while its tokens land in these blocks (opening.open_decode)
        self.last_lease = lease if seq.layer_groups.is_single_full and not replaced else None
        lease.commit()  # (a forward's attention has read its views by now: a step of it commits at its end)
        self.release_left_window()
        if replaced:
            store.release(replaced)
        observer = self.bank.step_observer
        if observer is not None:  # e.g. a TraceRecorder (tiered_kv/trace); None costs one check
            observer.step_committed(self.bank, step.num_new_tokens, step.num_tokens,
                                    time.perf_counter() - step.started_s)

    def settle_inputs(self, wait: bool = True) -> None:
        """Record the token ids of committed steps, oldest first, and publish the blocks they made
        full and verified. On a GPU a step's ids reach the host after it was queued, with no host
        sync: they are recorded once their copy is done (`wait`: now, for whatever reads ids next)."""
        pending, seq, settled = self.unsettled_inputs, self.seq, False
        while pending:
            inputs, before, after = pending[0]
            if not wait and isinstance(inputs, DeferredInputs) and not inputs.ready():
                break
            pending.pop(0)
            seq.record_inputs(inputs, before, after)
            settled = True
        if settled and self.bank.publishes:
            published = seq.publishable(self.bank.root_key)
            if published:
                self.store.publish_many(published)

    def count(self, step: Step) -> None:
        """Tokens computed by kind; the turn's time to first token at the end of its first forward;
        a prefill's seconds per token (what recomputing costs: scheduler/restore.py)."""
        metrics, rows = self.store.metrics, len(self.seq.rows)
        if step.computing_s:
            self.store.rates.note_step(step.num_new_tokens * rows // self.seq.num_groups,
                                       time.perf_counter() - step.computing_s)
        metrics.tokens_computed.inc(("prefill" if step.num_new_tokens > 1 else "decode",), step.num_new_tokens * rows)
        if self.turn.started_s is not None:
            metrics.ttft.observe((), time.perf_counter() - self.turn.started_s)
            self.turn.started_s = None

    def release_left_window(self) -> None:
        """Free, for good, the blocks sliding rows left at committed steps (once the step that last
        read them has ended: its attention may have read them as views)."""
        if self.seq.left_window:
            blocks, self.seq.left_window = self.seq.left_window, []
            self.store.release(blocks, for_good=True)

    def rollback(self) -> None:
        """Undo an open step: its lease is aborted (allocations released, moves undone, pins
        dropped); the bank is as before."""
        step, self.step, self.plan = self.step, None, None
        if step is None:
            return
        if step.expects_paged:
            clear_expected()
        self.attention.rolled_back()
        if step.created_rows:
            self.seq.rows = []
        self.rows_changed()
        if step.lease is not None:
            step.lease.abort()

    def abandon(self) -> None:
        """Before any new step or public operation: roll back a step that never finished (its
        forward's end was not seen: e.g. KeyboardInterrupt), settle a compiled one, and record the
        ids still on their way."""
        if not self.in_forward:  # (torch checks the stance as a forced-eager compiled call returns)
            compiled.end_forced_eager(self)
        if self.step is not None:
            if self.step.compiled:  # a compiled forward ran it (or not): commit or roll back now
                compiled.settle(self)
            else:
                self.rollback()
        if self.unsettled_inputs:
            self.settle_inputs()

    def rows_changed(self) -> None:
        """The rows changed outside a step: pins follow, and the next step opens a lease of its own."""
        self.seq.changed()
        self.last_lease = None


__all__ = ["StepMachine"]
