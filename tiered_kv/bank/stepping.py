"""How a bank runs one forward pass: forward-hook inputs, then an atomic Step per pass.

Mixed into CacheBank. Layer 0 calls `_begin_step`, which opens a Step (step.py) and the store's
lease for it (store/leases.py; the bank never takes the store's lock); every layer reads and
writes through the lease; the last layer calls `_commit_step`; anything that stops the pass in
between calls `_rollback_step` (directly, from the forward hook that runs even when the model
raised, or lazily at the bank's next use). Tokens are published here, a few new blocks per step.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..blocks import KVLayout
from ..errors import CapacityError, CorruptBlockError, LayoutError
from ..store import PIN_WAIT_S, StepRequest
from . import compiled
from .plan import StepPlan, clear_expected, expect_paged, paged_kernels, prepare
from .rows import Row
from .step import DeferredInputs, RowInputs, Step

def _is_causal_mask(mask: torch.Tensor, num_tokens_before: int) -> torch.Tensor:
    """Per row of a 4D mask `[B, 1, q, kv]` (bool: True attends; float: 0 attends), whether each
    query sees exactly the keys up to its own position (no padding): a bool tensor, no host sync."""
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    q, kv = allowed.shape[-2:]
    positions = torch.arange(kv, device=mask.device)
    causal = positions[None, :] <= (num_tokens_before + torch.arange(q, device=mask.device))[:, None]
    return (allowed == causal).flatten(1).all(dim=1)


def _mask_starts(attention_mask, num_tokens: int):
    """Per row, where its attention mask's ones begin among the step's `num_tokens` keys (left
    padding), as the paged kernel takes it: an int32 tensor on the mask's device, no host sync.
    None without a 2D or 4D mask (every row starts at 0)."""
    if isinstance(attention_mask, dict):
        attention_mask = attention_mask.get("full_attention")
    if attention_mask is None or attention_mask.dim() not in (2, 4):
        return None
    if attention_mask.dim() == 4:  # [B, 1, q, kv] (generate() builds it): the keys the last query sees
        last = attention_mask[:, 0, -1, -num_tokens:]
        allowed = last if last.dtype == torch.bool else last == 0
    else:
        allowed = attention_mask[:, -num_tokens:] != 0
    return allowed.int().argmax(dim=1).to(torch.int32)


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


class Stepping:
    """Forward-pass machinery of a CacheBank (uses its rows, store, fingerprint and config)."""

    # ---- forward hooks ---------------------------------------------------------------------
    def _note_forward_inputs(self, module, input_ids, attention_mask, position_ids) -> None:
        """Called before each forward of a watched model that uses this bank (forward_watch)."""
        self._pending_inputs = None
        model = self._model_ref() if self._model_ref is not None else None
        self._in_forward = model is not None and module is model
        if self._closed or model is None or module is not model or not isinstance(input_ids, torch.Tensor) \
                or input_ids.dim() != 2:
            return  # another model computes through this bank: its ids prove nothing about our KV
        ok = self._rows_ok(input_ids, attention_mask, position_ids)
        if ok is not None:  # (else the mask or the positions cover fewer rows: the ids prove nothing)
            if input_ids.is_cuda:  # no host sync: the ids are read once the step is long done
                self._pending_inputs = DeferredInputs.copy(input_ids, ok)
            else:
                self._pending_inputs = [RowInputs(ids, v) for ids, v in zip(input_ids.tolist(), ok.tolist())]
        self._pending_mask = attention_mask  # (where each row's mask begins: the paged kernel's start offsets)

    def _rows_ok(self, input_ids, attention_mask, position_ids):
        """Per row, whether the mask and the positions say these ids continue the bank's tokens:
        a bool tensor on the ids' device, computed without a sync; None when the mask or the
        positions cover fewer rows than the ids (a one-row position tensor counts for all). A
        mask or positions of another rank or length leave every row unverified."""
        num_rows, num_new = input_ids.shape
        device = input_ids.device
        if isinstance(attention_mask, dict):  # (generate() built one 4D mask per layer kind)
            attention_mask = attention_mask.get("full_attention", next(iter(attention_mask.values()), None))
        ok, length = torch.ones(num_rows, dtype=torch.bool, device=device), num_rows
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                length = min(length, attention_mask.shape[0])
                ok = ok[:length] & attention_mask[:length].bool().all(dim=1).to(device)
            elif attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == num_new \
                    and attention_mask.shape[3] == self._seq_len + num_new:
                length = min(length, attention_mask.shape[0])  # (generate() builds it for a compileable cache)
                ok = ok[:length] & _is_causal_mask(attention_mask[:length], self._seq_len).to(device)
            else:
                ok, length = torch.zeros(num_rows, dtype=torch.bool, device=device), num_rows
        if position_ids is not None:
            if position_ids.dim() != 2 or position_ids.shape[-1] != num_new:
                ok, length = torch.zeros(num_rows, dtype=torch.bool, device=device), num_rows
            else:
                expected = torch.arange(self._seq_len, self._seq_len + num_new, device=position_ids.device)
                rows_ok = (position_ids == expected).all(dim=1).to(device)
                if len(rows_ok) == 1:
                    rows_ok = rows_ok.expand(num_rows)
                length = min(length, len(rows_ok))
                ok = ok[:length] & rows_ok[:length]
        return ok if length == num_rows else None

    def _note_forward_end(self, failed: bool) -> None:
        """The watched model's forward ended (also when it raised): its step commits once every
        layer is done and nothing after them failed, else it is rolled back (DESIGN.md invariant 3:
        a failure in the last layer's attention, or in the head, changes nothing either)."""
        self._pending_inputs = self._pending_mask = None
        self._in_forward = False
        step = self._step
        if step is not None and step.forward_seen:
            if failed or not step.layers_done:
                self._rollback_step()
            else:
                self._commit_step()

    def _release_left_window(self) -> None:
        """Free, for good, the blocks sliding-window rows left at committed steps (once the step
        that last read them has ended: its attention may have read them as views)."""
        if self._left_window:
            blocks, self._left_window = self._left_window, []
            self.store.release(blocks, for_good=True)

    def _take_inputs(self, num_rows: int, num_new: int) -> list[RowInputs]:
        pending, self._pending_inputs = self._pending_inputs, None
        if isinstance(pending, DeferredInputs):
            return pending if pending.shape == (num_rows, num_new) else [RowInputs(None, False)] * num_rows
        if pending is None or len(pending) != num_rows or any(len(p.token_ids) != num_new for p in pending):
            return [RowInputs(None, False) for _ in range(num_rows)]
        return pending

    # ---- one forward pass ------------------------------------------------------------------
    def _layer0(self, key_states: torch.Tensor) -> StepPlan:
        """Layer 0 of a forward pass, before it writes or reads anything: the step is opened and
        its plan prepared for every row (its lease, the new tokens' slots, the index tensors)."""
        step = self._step
        num_rows, _, num_new, _ = key_states.shape
        if step is not None and step.compiled and not step.layer0_seen:  # prepared for a graph, run eagerly
            if step.num_rows == num_rows and step.num_new_tokens == num_new:
                step.compiled = False
                step.inputs = self._take_inputs(num_rows, num_new)
                step.forward_seen = isinstance(step.inputs, DeferredInputs) or step.inputs[0].token_ids is not None
                self._plan.clone_last = not step.forward_seen
            else:
                self._rollback_step()
            step = self._step
        if step is None or step.layer0_seen or step.num_rows != num_rows or step.num_new_tokens != num_new:
            self._begin_step(num_rows, num_new, self._pending_mask)
            step = self._step
        step.layer0_seen = True
        store = self.store
        if store.layout is None or key_states.dtype != store.dtype or key_states.device != store.device or \
                key_states.shape[1] != store.layout.num_kv_heads or key_states.shape[3] != store.layout.head_dim:
            with self._rolled_back_on_error():
                self._bind(key_states)
        if self._plan is None:  # (a config-only bank's first step: opened once bound)
            self._open(step, None)
        return self._plan

    def _begin_step(self, num_rows: int, num_new: int, attention_mask=None, compiled: bool = False) -> None:
        started_s = time.perf_counter()  # the step's duration (step observers), a turn's start (TTFT)
        self._abandon_step()  # a previous forward that never reached its last layer
        if self._rows and num_rows != self.batch_size:
            raise LayoutError(
                f"CacheBank holds {self.batch_size} sequences but the model passed a batch of {num_rows}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank")
        num_tokens = self._seq_len + num_new
        if num_new > 1 and self._turn_started_s is None:  # a turn without attach() starts here
            self._turn_started_s = started_s
            self.store.metrics.turns.inc()
        self._check_fits(num_rows, num_tokens, self._seq_len)
        inputs = self._take_inputs(num_rows, num_new)  # (a compiled step's come from its graph, at settle)
        step = Step(num_new, num_tokens, created_rows=not self._rows, inputs=inputs, num_rows=num_rows,
                    forward_seen=compiled or isinstance(inputs, DeferredInputs) or inputs[0].token_ids is not None,
                    compiled=compiled, started_s=started_s)
        if step.created_rows:
            self._rows = [Row() for _ in range(num_rows * self._num_groups)]
        self._step = step
        if self.store.is_bound:  # (else a config-only bank's first step: bound at layer 0, from the K/V's dtype)
            self._open(step, attention_mask)

    def _open(self, step: Step, attention_mask) -> None:
        """The step's lease and plan (the step is rolled back if either fails)."""
        with self._rolled_back_on_error():
            step.lease = self._open_lease(step)
            self._plan = self._make_plan(step, attention_mask)
        step.computing_s = time.perf_counter()

    def _make_plan(self, step: Step, attention_mask) -> StepPlan:
        """The step's plan (plan.py): how each layer writes and reads, from where its blocks lie."""
        plan = StepPlan(step.lease, self.num_layers, self._layers_done, self._rolled_back_on_error)
        plan.clone_last = not step.forward_seen  # nobody tells us when the last layer's views are read
        plan.is_grouped = not self.layer_groups.is_single_full
        if not plan.is_grouped:
            store = self.store
            mode = self.hooks_mode if step.forward_seen else None
            kernels = paged_kernels() if mode == "merge" and not step.compiled else None
            prepare(plan, store.device_slab, self._gather_buffer, store.dtype,
                    allow_views=store.device.type != "cuda" or mode == "merge", paged_kernels=kernels,
                    mask_starts=_mask_starts(attention_mask, step.num_tokens) if kernels is not None else None,
                    split=mode == "merge" and kernels is None and store.device.type == "cpu",
                    traced=compiled.prepare_traced if step.compiled else None)
            if plan.read_kind == "paged":
                expect_paged(plan)  # attention without the plan would see only the new tokens: it raises
                step.expects_paged = True
        step.read_kind = plan.read_kind
        return plan

    def _step_request(self, step: Step) -> StepRequest:
        new_turn = step.num_new_tokens > 1
        tables = [list(row.table) for row in self._rows]
        has_history = any(tables)
        request = StepRequest(
            self._step_owner, tables, self._block_set, self._seq_len, step.num_new_tokens, new_turn=new_turn,
            promotion_order=self._promotion_order(self._rows) if new_turn and has_history else [],
            verify_cold=new_turn,  # cold history is checked before the step, not found bad mid-forward
            count_turn_start=new_turn and has_history and not self._turn_counted,
            cost_sensitivity=self.cost_sensitivity,
            first_blocks=[row.first_block for row in self._rows] if self.layer_groups.any_sliding else None,
            new_first_blocks=self._gaps(step) if self.layer_groups.any_sliding else None)
        self._turn_counted = False
        return request

    def _open_lease(self, step: Step):
        """The store's lease for this step: for a decode step whose tokens land in the tail
        blocks it holds, the last step's extended (O(1): store/opening.py open_decode) when none
        of its blocks moved since; else a new one. Waits (without any lock) while the room it
        needs is held by other chats' running steps, up to PIN_WAIT_S."""
        store, previous = self.store, self._last_lease
        if previous is not None and step.num_new_tokens == 1 and self._room_in_tails():
            lease = store.opening.open_decode(previous, self._block_set, step.num_new_tokens, self.cost_sensitivity,
                                              [row.table[-1] for row in self._rows])
            if lease is not None:
                self._turn_counted = False
                return lease
        request = self._step_request(step)
        before = self._thread_move_seconds()
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
            self._add_critical_path(before)

    @contextlib.contextmanager
    def _rolled_back_on_error(self):
        """Whatever stops a step partway rolls it back; a corrupt block also truncates the bank
        before it, so the next call recomputes it."""
        try:
            yield
        except CorruptBlockError as error:
            self._rollback_step()
            raise self._corrupt_error(error) from error
        except BaseException:
            self._rollback_step()
            raise

    def _gaps(self, step: Step) -> list[int | None]:
        """Per store row, where a sliding row's new blocks start when its window after this step
        begins past what it holds (a long prefill): only those are stored (the tokens before
        are attended from the model's own K/V, and left the window by the step's end), so a
        prefill holds about two windows of a sliding group, not all of its tokens. Else None."""
        gaps, block_size = [], self.config.block_size
        for row, group in self._rows_and_groups():
            kept_from = group.first_needed_block(step.num_tokens, block_size) if group.is_sliding else 0
            gaps.append(kept_from if kept_from > row.end_block else None)
        return gaps

    def _room_in_tails(self) -> bool:
        """Whether one more token of every row lands in the row's last block (no block to add)."""
        return bool(self._rows) and self._seq_len % self.config.block_size != 0

    def _layers_done(self) -> None:
        """Every layer of the step wrote and read its K/V (a paged step: its last attention ran).
        A step the forward hooks see commits at the forward's end; any other commits now."""
        step = self._step
        if step.forward_seen:
            step.layers_done = True
        else:
            self._commit_step()

    def _commit_step(self) -> None:
        step, store = self._step, self.store
        lease = step.lease
        replaced, left_window = [], []
        block_size, num_tokens_before = self.config.block_size, self._seq_len
        for s, (row, group) in enumerate(self._rows_and_groups()):
            leased = lease.rows[s]
            if leased.tail_copy is not None:
                old_tail, row.table[-1] = leased.tail_copy
                replaced.append(old_tail)
            if leased.skipped_new_tokens:  # gapped (see _gaps): what it held is out of the window
                left_window += row.restart_at((num_tokens_before + leased.skipped_new_tokens) // block_size)
            if leased.new_blocks:
                row.table.extend(leased.new_blocks)
            if group.is_sliding:  # what the window left is never read again: not published, freed
                left_window += row.drop_before(group.first_needed_block(step.num_tokens, block_size))
        self._seq_len = step.num_tokens
        self._plan_counts[step.read_kind] += 1
        self._step = self._plan = None
        if step.expects_paged:
            clear_expected()
        self._unsettled_inputs.append((step.inputs, num_tokens_before, step.num_tokens))
        self._settle_inputs(wait=False)
        self._count_step(step)
        if replaced or left_window:
            self._block_set = {b for row in self._rows for b in row.table}
        else:
            self._block_set.update(lease.allocated_block_ids)
        # the next decode step extends this lease while its tokens land in these blocks (opening.open_decode)
        self._last_lease = lease if self.layer_groups.is_single_full and not replaced else None
        self._left_window += left_window
        lease.commit()  # (a forward's attention has read its views by now: a step of it commits at its end)
        self._release_left_window()
        if replaced:
            store.release(replaced)
        observer = self.step_observer
        if observer is not None:  # e.g. a TraceRecorder (tiered_kv/trace); None costs one check
            observer.step_committed(self, step.num_new_tokens, step.num_tokens, time.perf_counter() - step.started_s)

    def _settle_inputs(self, wait: bool = True) -> None:
        """Record the token ids of committed steps, oldest first, and publish the blocks they made
        full and verified. On a GPU a step's ids reach the host after it was queued, with no host
        sync: they are recorded once their copy is done (`wait`: now, for whatever reads ids next)."""
        pending = self._unsettled_inputs
        published, num_groups = [], self._num_groups
        while pending:
            inputs, before, after = pending[0]
            if not wait and isinstance(inputs, DeferredInputs) and not inputs.ready():
                break
            pending.pop(0)
            for s, (row, group) in enumerate(self._rows_and_groups()):
                given = inputs[s // num_groups]
                if given.token_ids is not None and len(row.token_ids) == before:
                    row.token_ids.extend(given.token_ids)
                    if given.verified and row.num_verified_tokens == before:
                        row.num_verified_tokens = after
                published += self._publishable(row, s % num_groups)
        if published:
            self.store.publish_many(published)

    def _count_step(self, step: Step) -> None:
        """Tokens computed by kind; the turn's time to first token at the end of its first forward;
        a prefill's seconds per token (what recomputing costs: scheduler/restore.py)."""
        metrics = self.store.metrics
        if step.computing_s:
            self.store.rates.note_step(step.num_new_tokens * len(self._rows) // self._num_groups,
                                       time.perf_counter() - step.computing_s)
        metrics.tokens_computed.inc(("prefill" if step.num_new_tokens > 1 else "decode",),
                                    step.num_new_tokens * len(self._rows))
        if self._turn_started_s is not None:
            metrics.ttft.observe((), time.perf_counter() - self._turn_started_s)
            self._turn_started_s = None

    def _root_key(self, group: int) -> bytes:
        """The key root of one layer group's blocks (the fingerprint's, tagged by the group when
        the model has several groups or sliding layers: its blocks hold other layers' bytes)."""
        root = self.fingerprint.root_key(self.store.layout.dtype_name)
        if self.layer_groups.is_single_full:
            return root
        return self.fingerprint.group_root(root, self.layer_groups.groups[group].key_tag)

    def _publishable(self, row: Row, group: int = 0) -> list[tuple[int, bytes, bytes]]:
        """The row's newly full, verified blocks with their keys (O(new blocks) a step)."""
        if not (self.verifies_token_ids and self.fingerprint.is_shareable):
            return []
        block_size = self.config.block_size
        root = self._root_key(group)
        row.extend_keys(root, block_size)
        items = [(row.block_at(i), row.keys[i], root)
                 for i in range(max(row.num_published_blocks, row.first_block), row.num_publishable_blocks(block_size))]
        row.num_published_blocks = max(row.num_published_blocks, row.num_publishable_blocks(block_size))
        return items

    def _rollback_step(self) -> None:
        """Undo an open step: its lease is aborted (allocations released, moves undone, pins
        dropped); the bank is as before."""
        step, self._step = self._step, None
        self._plan = None
        if step is None:
            return
        if step.expects_paged:
            clear_expected()
        if step.created_rows:
            self._rows = []
        self._structure_changed()
        if step.lease is not None:
            step.lease.abort()

    def _abandon_step(self) -> None:
        """Before any new step or public operation: roll back a step that never finished (its
        forward's end was not seen: e.g. KeyboardInterrupt), and record the ids still on their way."""
        if not self._in_forward:  # (torch checks the stance as a forced-eager compiled call returns)
            compiled.end_forced_eager(self)
        if self._step is not None:
            if self._step.compiled:  # a compiled forward ran it (or not): commit or roll back now
                compiled.settle(self)
            else:
                self._rollback_step()
        if self._unsettled_inputs:
            self._settle_inputs()

    def _corrupt_error(self, error: CorruptBlockError) -> CorruptBlockError:
        first_bad = self._drop_from_first_corrupt()
        where = f"; the bank dropped everything from token {first_bad} on" if first_bad is not None else ""
        return CorruptBlockError(f"{error}{where}. Call generate again with the whole conversation to recompute it")

    def _check_fits(self, num_rows: int, num_tokens: int, num_tokens_before: int | None = None) -> None:
        """CapacityError when `num_rows` sequences of `num_tokens` cannot fit in all tiers at once.
        A sliding group holds its window once a step ended; during a step, its window before the
        step (`num_tokens_before`; None: what it keeps afterwards) and the new blocks it keeps."""
        if not self.store.is_bound:
            return
        block_size = self.config.block_size
        total_blocks = num_rows * self.layer_groups.blocks_held(num_tokens, num_tokens_before, block_size)
        if total_blocks > self.store.total_capacity_blocks:
            hot, warm, cold = self.store.capacities
            raise CapacityError(
                f"this conversation needs {total_blocks} blocks ({num_rows} x {num_tokens} tokens, "
                f"{block_size} tokens per block) but hot+warm+cold hold {self.store.total_capacity_blocks} blocks "
                f"(hot {hot}, warm {warm}, cold {cold}); nothing was written. "
                "Raise a tier's capacity or shorten the conversation")

    def _bind(self, key_states: torch.Tensor) -> None:
        _, num_heads, _, head_dim = key_states.shape
        base = self._layout_no_dtype
        if (num_heads, head_dim) != (base.num_kv_heads, base.head_dim):
            raise LayoutError(
                f"key_states have {num_heads} heads x {head_dim} dims but the model config says "
                f"num_key_value_heads={base.num_kv_heads}, head_dim={base.head_dim}")
        self._bind_store(key_states.dtype)
        if key_states.device != self.store.device:
            raise LayoutError(
                f"the model runs on {key_states.device} but the hot tier is on {self.store.device}; "
                f"set hot.device to '{key_states.device}' or move the model")

    def _bind_store(self, dtype: torch.dtype) -> None:
        """Bind the store to this model's KV layout in `dtype` (a no-op once bound to the same)."""
        dtype_name = _DTYPE_NAMES.get(dtype)
        if dtype_name is None:
            raise LayoutError(f"KV dtype {dtype} is not supported; allowed: {list(_DTYPE_NAMES)}")
        base = self._layout_no_dtype
        layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name)
        store = self.store
        if store.layout == layout and store.dtype == dtype:  # bound already (every step after the first)
            return
        store.bind(layout, dtype)
