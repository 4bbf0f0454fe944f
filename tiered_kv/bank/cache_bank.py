"""CacheBank: a transformers `Cache` whose KV lives in a TierStore's blocks.

One bank per chat (or per batch of sequences generated together). Per batch row it keeps a
block table, the token ids it knows and their chain keys (see rows.py); the store decides which
tier each block sits in. The model calls `update(k, v, layer_idx)` once per layer: layer 0 opens
an atomic Step (step.py), every layer writes the new K/V where their blocks live and reads the
layer's whole K/V back on the compute device, and the last layer commits.

Built from a model (`CacheBank(model, cfg)`), the bank sees the input ids of every forward
(forward_watch.py), so the ids of its tokens are verified, and its full blocks are published
under model-fingerprinted keys for other banks to reuse. Built from a config alone
(`CacheBank(model.config, cfg)`), it cannot see ids: it trusts what `attach()` tells it, but
only for itself; it never publishes, and looks blocks up only when given `model_id=`.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..blocks import KVLayout, layout_from_model_config, num_blocks_for
from ..config import Config, load_config
from ..errors import BankClosedError, CapacityError, CorruptBlockError, LayoutError
from ..identity import ModelFingerprint
from ..scheduler import TIER_NAMES
from ..store import TierStore
from . import forward_watch
from .chat_ops import ChatOps
from .rows import Row
from .step import PlacementCache, RowInputs, Step, blocks_needed, reads_host, tier_counts

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_STEP_OWNER_IDS = itertools.count(1)


class _BankLayer(CacheLayerMixin):
    """Per-layer face that transformers' generic Cache code expects; state lives in the bank."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, bank: "CacheBank", layer_idx: int):
        super().__init__()
        self._bank = bank
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:  # state is allocated by the store
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._bank.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._bank.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._bank.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self._bank.batch_size


class CacheBank(ChatOps, Cache):
    def __init__(self, model, config: Config | dict | str | None = None, *, store: TierStore | None = None,
                 model_id: str | None = None):
        if store is not None and config is not None and load_config(config) != store.config:
            raise ValueError("CacheBank: `config` differs from the shared store's config; pass one or make them equal")
        is_model = isinstance(model, torch.nn.Module)
        if is_model and getattr(model, "config", None) is None:
            raise LayoutError("CacheBank(model): the module has no `.config`; pass a transformers model or its config")
        self.store = store if store is not None else TierStore(config)
        self._owns_store = store is None
        if self._owns_store:
            self.store.add_owner()
        self.config = self.store.config
        self._layout_no_dtype = layout_from_model_config(model.config if is_model else model, self.config.block_size)
        self.num_layers = self._layout_no_dtype.num_layers
        self.fingerprint = ModelFingerprint.of(model, self.config.block_size, model_id)
        self._model_ref = weakref.ref(model) if is_model else None
        if is_model:
            forward_watch.watch(model)
        super().__init__(layers=[_BankLayer(self, i) for i in range(self.num_layers)])
        self._rows: list[Row] = []
        self._seq_len = 0
        self._step: Step | None = None
        self._pending_inputs: list[RowInputs] | None = None
        self._step_owner = next(_STEP_OWNER_IDS)
        self._block_set: set[int] = set()  # every block any row references (pinned during a step)
        self._placement_cache = PlacementCache()
        self._touched_order_version = -1
        self._closed = False

    @property
    def verifies_token_ids(self) -> bool:
        """True when the bank sees the ids of the tokens it computes (built from a model)."""
        return self._model_ref is not None

    # ---- transformers Cache contract -------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_open()
        if layer_idx == 0:
            self._begin_step(key_states)
        elif self._step is None:
            raise RuntimeError(f"CacheBank.update: layer {layer_idx} came without layer 0 of the same forward pass "
                               "(the step was rolled back); call the model again")
        step, store = self._step, self.store
        kv_new = torch.stack((key_states, value_states))  # [2, B, H, t, D]
        try:
            with store.lock:
                rows = []
                for r in range(kv_new.shape[1]):
                    store.write_layer(layer_idx, step.write_runs[r], kv_new[:, r])
                    rows.append(store.read_layer(layer_idx, step.read_runs[r], step.num_tokens))
        except CorruptBlockError as error:
            self._rollback_step()
            raise self._corrupt_error(error) from error
        except BaseException:
            self._rollback_step()
            raise
        kv = rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)
        if layer_idx == self.num_layers - 1:
            self._commit_step()
        return kv[0], kv[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_open()
        return self._seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seq_len + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._rows) or -1

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop `-tokens_to_remove` tokens from the end (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"CacheBank.crop({tokens_to_remove}): pass a negative count of tokens to remove (or use truncate(n))")
        if tokens_to_remove < 0:
            self.truncate(max(0, self._seq_len + tokens_to_remove))

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of every row."""
        self._check_open()
        self._abandon_step()
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"truncate({num_tokens}): allowed 0..{self._seq_len}")
        dropped = [b for row in self._rows for b in row.truncate(num_tokens, self.config.block_size)]
        self._seq_len = num_tokens
        if num_tokens == 0:
            self._rows = []
        self._structure_changed()
        self.store.release(dropped)

    def reset(self) -> None:
        self.truncate(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._rows)) for _ in range(repeats)])

    def _select_rows(self, row_indices: list[int]) -> None:
        """New rows are copies of old rows by index; full blocks are shared (ref-counted) and a
        shared partial tail is copied before its next write (copy-on-write)."""
        self._check_open()
        self._abandon_step()
        if not self._rows:
            return
        old_rows = self._rows
        self._rows = [old_rows[r].copy() for r in row_indices]
        self.store.retain([b for row in self._rows for b in row.table])
        self.store.release([b for row in old_rows for b in row.table])
        self._structure_changed()

    def _structure_changed(self) -> None:
        self._block_set = {b for row in self._rows for b in row.table}
        self._placement_cache.invalidate()

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

    def _take_inputs(self, num_rows: int, num_new: int) -> list[RowInputs]:
        pending, self._pending_inputs = self._pending_inputs, None
        if pending is None or len(pending) != num_rows or any(len(p.token_ids) != num_new for p in pending):
            return [RowInputs(None, False) for _ in range(num_rows)]
        return pending

    # ---- one forward pass ------------------------------------------------------------------
    def _begin_step(self, key_states: torch.Tensor) -> None:
        self._abandon_step()  # a previous forward that never reached its last layer
        num_rows, _, num_new, _ = key_states.shape
        self._bind(key_states)
        if self._rows and num_rows != len(self._rows):
            raise LayoutError(
                f"CacheBank holds {len(self._rows)} sequences but the model passed a batch of {num_rows}; "
                "use batch_select_indices / batch_repeat_interleave, or reset() the bank")
        num_tokens = self._seq_len + num_new
        self._check_fits(num_rows, num_tokens)
        inputs = self._take_inputs(num_rows, num_new)
        store, block_size = self.store, self.config.block_size
        with store.lock:
            store.drain_deferred()
            step = Step(num_new, num_tokens, created_rows=not self._rows, inputs=inputs)
            if step.created_rows:
                self._rows = [Row() for _ in range(num_rows)]
            self._step = step
            try:
                self._open_step(step, store, block_size)
            except CorruptBlockError as error:
                self._rollback_step()
                raise self._corrupt_error(error) from error
            except BaseException:
                self._rollback_step()
                raise

    def _open_step(self, step: Step, store: TierStore, block_size: int) -> None:
        if self._seq_len % block_size:  # a partly filled tail is about to change
            for r, row in enumerate(self._rows):
                tail = row.table[-1]
                _, ref_count, key = store.block_info(tail)
                if ref_count > 1 or key is not None:  # shared, or named by a key: keep its content
                    step.tail_copies[r] = (tail, store.copy_block(tail))
                    self._block_set.add(step.tail_copies[r][1])
        needed = [blocks_needed(step.num_tokens, block_size, row.table) for row in self._rows]
        new_ids = store.allocate(sum(needed))  # CapacityError with nothing changed
        for count in needed:
            step.new_blocks.append(new_ids[:count])
            self._block_set.update(new_ids[:count])
            del new_ids[:count]
        tables = [step.block_table(r, row.table) for r, row in enumerate(self._rows)]
        if step.num_new_tokens > 1:  # a new turn: bring this chat's history up before reading it
            self._promote_tables(tables)
        store.begin_step(self._step_owner, self._block_set)
        step.placement_version = store.index.placement_version
        step.placements = [self._placement_cache.lookup(store, r, table) for r, table in enumerate(tables)]
        for tiers, slots in step.placements:
            step.write_runs.append(store.mapper.map_range(tiers, slots, self._seq_len, step.num_tokens))
            step.read_runs.append(store.mapper.map_range(tiers, slots, 0, step.num_tokens))
        step.reads_host_tiers = reads_host(step.read_runs)
        if store.index.order_version != self._touched_order_version:  # else our blocks are still the most recent
            store.touch(self._block_set)
        self._touched_order_version = store.index.order_version
        store.count_hits(tier_counts(step.placements))

    def _commit_step(self) -> None:
        step, store, block_size = self._step, self.store, self.config.block_size
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
            self._placement_cache.remember(step.placement_version, [row.table for row in self._rows], step.placements)
            self._step = None
            store.end_step(self._step_owner, step.reads_host_tiers)
            if replaced:
                store.release(replaced)
                self._block_set = {b for row in self._rows for b in row.table}

    def _publish(self, row: Row) -> None:
        """Publish the row's newly full, verified blocks (O(new blocks) a step)."""
        if not (self.verifies_token_ids and self.fingerprint.is_shareable):
            return
        block_size = self.config.block_size
        row.extend_keys(self.fingerprint.root_key(self.store.layout.dtype_name), block_size)
        for i in range(row.num_published_blocks, row.num_publishable_blocks(block_size)):
            self.store.publish(row.table[i], row.keys[i])
        row.num_published_blocks = max(row.num_published_blocks, row.num_publishable_blocks(block_size))

    def _rollback_step(self) -> None:
        """Undo an open step: release what it allocated, drop its pins; the bank is as before."""
        step, self._step = self._step, None
        if step is None:
            return
        store = self.store
        with store.lock:
            store.end_step(self._step_owner)
            if step.created_rows:
                self._rows = []
            self._structure_changed()
            if not store.is_closed:
                store.release(step.allocated_block_ids())

    def _abandon_step(self) -> None:
        if self._step is not None:
            self._rollback_step()

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
        dtype_name = _DTYPE_NAMES.get(key_states.dtype)
        if dtype_name is None:
            raise LayoutError(f"key_states dtype {key_states.dtype} is not supported; allowed: {list(_DTYPE_NAMES)}")
        base = self._layout_no_dtype
        layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name)
        _, num_heads, _, head_dim = key_states.shape
        if (num_heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise LayoutError(
                f"key_states have {num_heads} heads x {head_dim} dims but the model config says "
                f"num_key_value_heads={layout.num_kv_heads}, head_dim={layout.head_dim}")
        self.store.bind(layout, key_states.dtype)
        if key_states.device != self.store.device:
            raise LayoutError(
                f"the model runs on {key_states.device} but the hot tier is on {self.store.device}; "
                f"set hot.device to '{key_states.device}' or move the model")

    # ---- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BankClosedError("this CacheBank is closed (close() released its blocks); create a new CacheBank")
        if self.store.is_closed:
            raise BankClosedError("this CacheBank's TierStore is closed; create a new store and bank")

    def __deepcopy__(self, memo):
        """An independent bank on the same store sharing this one's blocks (copy-on-write)."""
        self._check_open()
        self._abandon_step()
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        Cache.__init__(other, layers=[_BankLayer(other, i) for i in range(self.num_layers)])
        other._rows = [row.copy() for row in self._rows]
        other._pending_inputs = None
        other._step_owner = next(_STEP_OWNER_IDS)
        other._placement_cache = PlacementCache()
        other._touched_order_version = -1
        other._structure_changed()
        self.store.retain([b for row in other._rows for b in row.table])
        if other._owns_store:
            self.store.add_owner()
        memo[id(self)] = other
        return other

    def close(self) -> None:
        if self._closed:
            return
        if not self.store.is_closed:
            self._abandon_step()
            self.truncate(0)
        self._closed = True
        if self._owns_store:
            self.store.drop_owner()

    def __del__(self):
        # May run inside the cyclic GC at any allocation, even under this thread's store lock:
        # hand the references to the store to release at its next operation, touch nothing here.
        try:
            if not self._closed and not self.store.is_closed:
                self.store.release_later([b for row in self._rows for b in row.table],
                                         self._step.allocated_block_ids() if self._step else [],
                                         self._step_owner)
        except Exception:
            pass

    def block_table(self, row: int = 0) -> list[int]:
        """A copy of one row's logical block ids in token order (for diagnosis and tests)."""
        return list(self._rows[row].table) if row < len(self._rows) else []

    def __repr__(self) -> str:
        return f"CacheBank(rows={len(self._rows)}, tokens={self._seq_len}, block_size={self.config.block_size})"

    def stats(self) -> dict:
        self._check_open()
        out = self.store.stats()
        per_tier = {name: 0 for name in TIER_NAMES}
        with self.store.lock:
            for row in self._rows:
                tiers, _ = self.store.placements(row.table)
                for tier, count in enumerate(np.bincount([t for t in tiers if t >= 0], minlength=3).tolist()):
                    per_tier[TIER_NAMES[tier]] += count
        out["bank_blocks"] = per_tier
        out["seq_tokens"] = self._seq_len
        return out
