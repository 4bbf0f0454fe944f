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
from ..hooks.attention import clear_expected
from ..store import PIN_WAIT_S, StepRequest
from .rows import Row
from .step import DeferredInputs, RowInputs, Step

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


class Stepping:
    """Forward-pass machinery of a CacheBank (uses its rows, store, fingerprint and config)."""

    # ---- forward hooks ---------------------------------------------------------------------
    def _note_forward_inputs(self, module, input_ids, attention_mask, position_ids) -> None:
        """Called before each forward of a watched model that uses this bank (forward_watch)."""
        self._pending_inputs = None
        model = self._model_ref() if self._model_ref is not None else None
        if self._closed or model is None or module is not model or not isinstance(input_ids, torch.Tensor) \
                or input_ids.dim() != 2:
            return  # another model computes through this bank: its ids prove nothing about our KV
        ok = self._rows_ok(input_ids, attention_mask, position_ids)
        if ok is None:
            return  # the mask or the positions cover fewer rows: the ids prove nothing
        if input_ids.is_cuda:  # no host sync before the forward: the ids are read at commit
            self._pending_inputs = DeferredInputs.copy(input_ids, ok)
            return
        self._pending_inputs = [RowInputs(ids, v) for ids, v in zip(input_ids.tolist(), ok.tolist())]

    def _rows_ok(self, input_ids, attention_mask, position_ids):
        """Per row, whether the mask and the positions say these ids continue the bank's tokens:
        a bool tensor on the ids' device, computed without a sync; None when the mask or the
        positions cover fewer rows than the ids (a one-row position tensor counts for all). A
        mask or positions of another rank or length leave every row unverified."""
        num_rows, num_new = input_ids.shape
        device = input_ids.device
        ok, length = torch.ones(num_rows, dtype=torch.bool, device=device), num_rows
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                ok, length = torch.zeros(num_rows, dtype=torch.bool, device=device), num_rows
            else:
                length = min(length, attention_mask.shape[0])
                ok = ok[:length] & attention_mask[:length].bool().all(dim=1).to(device)
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
        self._pending_inputs = None
        if failed and self._step is not None:
            self._rollback_step()
        self._end_forward_lease()

    def _end_forward_lease(self) -> None:
        """End a committed step's lease once its forward pass is over. The last layer's K/V may
        be views of hot blocks that its attention reads after update() returned, so a step seen
        by the forward hooks keeps its pins until the model's forward ends."""
        if self._forward_lease is not None:
            lease, self._forward_lease = self._forward_lease, None
            lease.commit()
        self._release_left_window()

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
    def _begin_step(self, key_states: torch.Tensor) -> None:
        started_s = time.perf_counter()  # the step's duration (step observers), a turn's start (TTFT)
        self._abandon_step()  # a previous forward that never reached its last layer
        num_rows, _, num_new, _ = key_states.shape
        self._bind(key_states)
        if self._rows and num_rows != self.batch_size:
            raise LayoutError(
                f"CacheBank holds {self.batch_size} sequences but the model passed a batch of {num_rows}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank")
        num_tokens = self._seq_len + num_new
        if num_new > 1 and self._turn_started_s is None:  # a turn without attach() starts here
            self._turn_started_s = started_s
            self.store.metrics.turns.inc()
        self._check_fits(num_rows, num_tokens, self._seq_len)
        inputs = self._take_inputs(num_rows, num_new)
        step = Step(num_new, num_tokens, created_rows=not self._rows, inputs=inputs,
                    forward_seen=isinstance(inputs, DeferredInputs) or inputs[0].token_ids is not None,
                    started_s=started_s)
        if step.created_rows:
            self._rows = [Row() for _ in range(num_rows * self._num_groups)]
        self._step = step
        with self._rolled_back_on_error():
            step.lease = self._open_lease(self._step_request(step))
        step.computing_s = time.perf_counter()

    def _step_request(self, step: Step) -> StepRequest:
        new_turn = step.num_new_tokens > 1
        tables = [list(row.table) for row in self._rows]
        has_history = any(tables)
        request = StepRequest(
            self._step_owner, tables, self._block_set, self._seq_len, step.num_new_tokens, new_turn=new_turn,
            promotion_order=self._promotion_order(self._rows) if new_turn and has_history else [],
            verify_cold=new_turn and not self._reads_in_place,  # hooked steps check each cold slice as they read it
            count_turn_start=new_turn and has_history and not self._turn_counted,
            cost_sensitivity=self.cost_sensitivity,
            first_blocks=[row.first_block for row in self._rows] if self.layer_groups.any_sliding else None,
            new_first_blocks=self._gaps(step) if self.layer_groups.any_sliding else None)
        self._turn_counted = False
        return request

    def _open_lease(self, request: StepRequest):
        """The store's lease for this step; waits (without any lock) while the room it needs is
        held by other chats' running steps, up to PIN_WAIT_S."""
        store = self.store
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

    @property
    def _reads_in_place(self) -> bool:
        """Whether hooked attention reads this bank's blocks itself (StepReads: one full group)."""
        return self.hooks_mode is not None and self.layer_groups.is_single_full

    def _commit_step(self) -> None:
        step, store = self._step, self.store
        lease = step.lease
        replaced, published, left_window = [], [], []
        num_groups, block_size = self._num_groups, self.config.block_size
        for s, (row, group) in enumerate(self._rows_and_groups()):
            leased = lease.rows[s]
            if leased.tail_copy is not None:
                old_tail, row.table[-1] = leased.tail_copy
                replaced.append(old_tail)
            if leased.skipped_new_tokens:  # gapped (see _gaps): what it held is out of the window
                left_window += row.restart_at((self._seq_len + leased.skipped_new_tokens) // block_size)
            row.table.extend(leased.new_blocks)
            inputs = step.inputs[s // num_groups]
            if inputs.token_ids is not None and len(row.token_ids) == self._seq_len:
                row.token_ids.extend(inputs.token_ids)
                if inputs.verified and row.num_verified_tokens == self._seq_len:
                    row.num_verified_tokens = step.num_tokens
            if group.is_sliding:  # what the window left is never read again: not published, freed
                left_window += row.drop_before(group.first_needed_block(step.num_tokens, block_size))
            published += self._publishable(row, s % num_groups)
        if published:
            store.publish_many(published)
        self._seq_len = step.num_tokens
        self._count_step(step)
        self._step = None
        if replaced or left_window:
            self._block_set = {b for row in self._rows for b in row.table}
        else:
            self._block_set.update(lease.allocated_block_ids)
        self._left_window += left_window
        if step.forward_seen:
            self._forward_lease = lease  # the last layer's K/V may be read after update(): ended at forward end
        else:
            lease.commit()
            self._release_left_window()
        if replaced:
            store.release(replaced)
        observer = self.step_observer
        if observer is not None:  # e.g. a TraceRecorder (tiered_kv/trace); None costs one check
            observer.step_committed(self, step.num_new_tokens, step.num_tokens, time.perf_counter() - step.started_s)

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
        if step is None:
            return
        clear_expected()
        if step.reads is not None:
            step.reads.finish()  # no fetch may still read blocks about to be released
        if step.created_rows:
            self._rows = []
        self._structure_changed()
        if step.lease is not None:
            step.lease.abort()

    def _abandon_step(self) -> None:
        """Before any new step or public operation: roll back a step that never finished, and
        end the lease of a forward whose end the hooks did not see (e.g. KeyboardInterrupt)."""
        if self._step is not None:
            self._rollback_step()
        self._end_forward_lease()

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
