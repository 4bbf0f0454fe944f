"""How a bank runs one forward pass: forward-hook inputs, then an atomic Step per pass.

Mixed into CacheBank. Layer 0 calls `_begin_step`, which opens a Step (step.py) under the store
lock; the last layer calls `_commit_step`; anything that stops the pass in between calls
`_rollback_step` (directly, from the forward hook that runs even when the model raised, or
lazily at the bank's next use). Tokens are published here, a few new blocks per step.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..blocks import KVLayout, num_blocks_for
from ..errors import CapacityError, CorruptBlockError, LayoutError
from ..store import TierStore
from .rows import Row
from .step import RowInputs, Step, blocks_needed, reads_host, tier_counts

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
        num_rows, num_new = input_ids.shape
        verified = [True] * num_rows
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                verified = [False] * num_rows
            else:
                verified = [a and b for a, b in zip(verified, attention_mask.bool().all(dim=1).tolist())]
        if position_ids is not None:
            expected = torch.arange(self._seq_len, self._seq_len + num_new, device=position_ids.device)
            if position_ids.dim() != 2 or position_ids.shape[-1] != num_new:
                verified = [False] * num_rows
            else:
                rows_ok = (position_ids == expected).all(dim=1).tolist()
                verified = [a and b for a, b in zip(verified, rows_ok * (num_rows if len(rows_ok) == 1 else 1))]
        self._pending_inputs = [RowInputs(ids, ok) for ids, ok in zip(input_ids.tolist(), verified)]

    def _note_forward_end(self, failed: bool) -> None:
        self._pending_inputs = None
        if failed and self._step is not None:
            self._rollback_step()
        self._release_forward_pins()

    def _release_forward_pins(self) -> None:
        """Unpin a committed step's blocks once its forward pass is over. The last layer's K/V
        may be views of hot blocks that its attention reads after update() returned, so a step
        seen by the forward hooks keeps its pins until the model's forward ends."""
        if self._forward_pins is not None:
            reads_host_tiers, self._forward_pins = self._forward_pins, None
            self.store.end_step(self._step_owner, reads_host_tiers)

    def _take_inputs(self, num_rows: int, num_new: int) -> list[RowInputs]:
        pending, self._pending_inputs = self._pending_inputs, None
        if pending is None or len(pending) != num_rows or any(len(p.token_ids) != num_new for p in pending):
            return [RowInputs(None, False) for _ in range(num_rows)]
        return pending

    # ---- one forward pass ------------------------------------------------------------------
    def _begin_step(self, key_states: torch.Tensor) -> None:
        started_s = time.perf_counter()  # the step's duration (step observers), a turn's start (TTFT)
        self._abandon_step()  # a previous forward that never reached its last layer
        num_rows, _, num_new, _ = key_states.shape
        self._bind(key_states)
        if self._rows and num_rows != len(self._rows):
            raise LayoutError(
                f"CacheBank holds {len(self._rows)} sequences but the model passed a batch of {num_rows}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank")
        num_tokens = self._seq_len + num_new
        if num_new > 1 and self._turn_started_s is None:  # a turn without attach() starts here
            self._turn_started_s = started_s
            self.store.metrics.turns.inc()
        self._check_fits(num_rows, num_tokens)
        inputs = self._take_inputs(num_rows, num_new)
        store, block_size = self.store, self.config.block_size
        with store.lock:
            store.drain_deferred()
            step = Step(num_new, num_tokens, created_rows=not self._rows, inputs=inputs,
                        hooked=inputs[0].token_ids is not None, started_s=started_s)
            if step.created_rows:
                self._rows = [Row() for _ in range(num_rows)]
            self._step = step
            with self._rolled_back_on_error():
                self._open_step(step, store, block_size)

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

    def _open_step(self, step: Step, store: TierStore, block_size: int) -> None:
        store.start_journal()  # the moves made for this step, undone if it is rolled back
        try:
            self._make_room(step, store, block_size)
        finally:
            step.moves = store.stop_journal()
        tables = [step.block_table(r, row.table) for r, row in enumerate(self._rows)]
        store.begin_step(self._step_owner, self._block_set, tables, self.cost_sensitivity)
        step.placement_version = store.placement_version
        step.placements = [self._placement_cache.lookup(store, r, table) for r, table in enumerate(tables)]
        for tiers, slots in step.placements:
            step.write_runs.append(store.map_range(tiers, slots, self._seq_len, step.num_tokens))
            step.read_runs.append(store.map_range(tiers, slots, 0, step.num_tokens))
        step.reads_host_tiers = reads_host(step.read_runs)
        if store.order_version != self._touched_order_version:  # else our blocks are still the most recent
            store.touch(self._block_set)
        self._touched_order_version = store.order_version
        store.count_hits(tier_counts(step.placements))

    def _make_room(self, step: Step, store: TierStore, block_size: int) -> None:
        """Copy-on-write of a shared tail, blocks for the new tokens, history up on a new turn."""
        new_turn = step.num_new_tokens > 1
        if new_turn and not self._turn_counted and self._rows:  # a turn without attach(): count it here
            history = [row.table for row in self._rows]
            order = self._promotion_order(history)
            store.count_turn_start(tier_counts([store.placements(order)]))
        self._turn_counted = False
        before = store.thread_move_seconds()
        try:
            self._make_room_now(step, store, block_size, new_turn)
        finally:
            self._add_critical_path(before)

    def _make_room_now(self, step: Step, store: TierStore, block_size: int, new_turn: bool) -> None:
        if self._seq_len % block_size:  # a partly filled tail is about to change
            for r, row in enumerate(self._rows):
                tail = row.table[-1]
                _, ref_count, key = store.block_info(tail)
                if ref_count > 1 or key is not None:  # shared, or named by a key: keep its content
                    step.tail_copies[r] = (tail, store.copy_block(tail))
                    self._block_set.add(step.tail_copies[r][1])
        needed = [blocks_needed(step.num_tokens, block_size, row.table) for row in self._rows]
        # each row's new blocks continue its last block in the hot slab when they can (one slice)
        tails = [step.tail_copies[r][1] if r in step.tail_copies else (row.table[-1] if row.table else None)
                 for r, row in enumerate(self._rows)]
        new_ids = store.allocate(sum(needed), follow=list(zip(needed, tails)))  # CapacityError with nothing changed
        for count in needed:
            step.new_blocks.append(new_ids[:count])
            self._block_set.update(new_ids[:count])
            del new_ids[:count]
        if new_turn:  # bring this chat's history up before reading it
            self._promote_tables([step.block_table(r, row.table) for r, row in enumerate(self._rows)])

    def _commit_step(self) -> None:
        step, store = self._step, self.store
        replaced = []
        with store.lock:
            for r, row in enumerate(self._rows):
                if r in step.tail_copies:
                    old_tail, row.table[-1] = step.tail_copies[r]
                    replaced.append(old_tail)
                row.table.extend(step.new_blocks[r])
                inputs = step.inputs[r]
                if inputs.token_ids is not None and len(row.token_ids) == self._seq_len:
                    row.token_ids.extend(inputs.token_ids)
                    if inputs.verified and row.num_verified_tokens == self._seq_len:
                        row.num_verified_tokens = step.num_tokens
                self._publish(row)
            self._seq_len = step.num_tokens
            self._count_step(step)
            self._placement_cache.remember(step.placement_version, [row.table for row in self._rows], step.placements)
            self._step = None
            if step.hooked:
                self._forward_pins = step.reads_host_tiers  # unpinned by _note_forward_end
            else:
                store.end_step(self._step_owner, step.reads_host_tiers)
            if replaced:
                store.release(replaced)
                self._block_set = {b for row in self._rows for b in row.table}
            observer = self.step_observer
            if observer is not None:  # e.g. a TraceRecorder (tiered_kv/trace); None costs one check
                observer.step_committed(self, step.num_new_tokens, step.num_tokens,
                                        time.perf_counter() - step.started_s)

    def _count_step(self, step: Step) -> None:
        """Tokens computed by kind; the turn's time to first token at the end of its first forward."""
        metrics = self.store.metrics
        metrics.tokens_computed.inc(("prefill" if step.num_new_tokens > 1 else "decode",),
                                    step.num_new_tokens * len(self._rows))
        if self._turn_started_s is not None:
            metrics.ttft.observe((), time.perf_counter() - self._turn_started_s)
            self._turn_started_s = None

    def _publish(self, row: Row) -> None:
        """Publish the row's newly full, verified blocks (O(new blocks) a step)."""
        if not (self.verifies_token_ids and self.fingerprint.is_shareable):
            return
        block_size = self.config.block_size
        root = self.fingerprint.root_key(self.store.layout.dtype_name)
        row.extend_keys(root, block_size)
        for i in range(row.num_published_blocks, row.num_publishable_blocks(block_size)):
            self.store.publish(row.table[i], row.keys[i], root)
        row.num_published_blocks = max(row.num_published_blocks, row.num_publishable_blocks(block_size))

    def _rollback_step(self) -> None:
        """Undo an open step: release what it allocated, drop its pins; the bank is as before."""
        step, self._step = self._step, None
        if step is None:
            return
        if step.reads is not None:
            step.reads.finish()  # no fetch may still read blocks about to be released
        store = self.store
        with store.lock:
            store.end_step(self._step_owner)
            if step.created_rows:
                self._rows = []
            self._structure_changed()
            if not store.is_closed:
                store.release(step.allocated_block_ids())
                store.undo_moves(step.moves)

    def _abandon_step(self) -> None:
        """Before any new step or public operation: roll back a step that never finished, and
        drop the pins of a forward whose end the hooks did not see (e.g. KeyboardInterrupt)."""
        if self._step is not None:
            self._rollback_step()
        self._release_forward_pins()

    def _corrupt_error(self, error: CorruptBlockError) -> CorruptBlockError:
        first_bad = self._drop_from_first_corrupt()
        where = f"; the bank dropped everything from token {first_bad} on" if first_bad is not None else ""
        return CorruptBlockError(f"{error}{where}. Call generate again with the whole conversation to recompute it")

    def _check_fits(self, num_rows: int, num_tokens: int) -> None:
        """CapacityError when `num_rows` sequences of `num_tokens` cannot fit in all tiers at once."""
        if not self.store.is_bound:
            return
        block_size = self.config.block_size
        total_blocks = num_rows * num_blocks_for(num_tokens, block_size)
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
        self.store.bind(KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name), dtype)
