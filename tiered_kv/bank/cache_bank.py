"""CacheBank: a transformers `Cache` whose KV lives in a TierStore's blocks.

One bank per chat (or per batch of sequences generated together). Per batch row and layer group
(layer_groups.py: one group for a full-attention model; a hybrid model's sliding-window and
full layers in groups of their own) it keeps a block table, the token ids it knows and their
chain keys (see rows.py); the store decides which tier each block sits in. The model calls
`update(k, v, layer_idx)` once per layer: layer 0 opens an atomic Step (step.py), every layer
writes the new K/V where their blocks live and reads the layer's K/V back on the compute device
(a full layer every token, a sliding layer what DynamicSlidingWindowLayer returns: its window's
last `window - 1` tokens and the new ones), and the last layer commits. A sliding group's row then
releases the blocks its window left (for good: they are never moved down the tiers).

Built from a model (`CacheBank(model, cfg)`), the bank sees the input ids of every forward
(forward_watch.py), so the ids of its tokens are verified, and its full blocks are published
under model-fingerprinted keys for other banks to reuse. Built from a config alone
(`CacheBank(model.config, cfg)`), it cannot see ids: it trusts what `attach()` tells it, but
only for itself; it never publishes, and looks blocks up only when given `model_id=`.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..adapters import runtime_model
from ..blocks import TIER_NAMES, layout_from_model_config, model_layer_groups, tier_counts
from ..config import Config, load_config
from ..errors import BankClosedError, LayoutError
from ..identity import ModelFingerprint
from ..store import TierStore
from . import forward_watch
from . import compiled
from .chat_ops import ChatOps
from .plan import HOOKS_MODES, KINDS, GatherBuffer
from .rows import Row
from .step import DeferredInputs, RowInputs, Step
from .stepping import Stepping

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
        group = bank.layer_groups.groups[bank.layer_groups.group_of_layer[layer_idx]]
        self.is_sliding = group.is_sliding  # transformers sizes the sliding masks on such a layer

    def lazy_initialization(self, key_states, value_states) -> None:  # state is allocated by the store
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._bank.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._bank.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._bank.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self._bank.batch_size


def _check_cost_sensitivity(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"CacheBank(cost_sensitivity={value!r}): allowed: a number from 0 (send this chat's "
                         "blocks down first) to 1 (keep them hot longest), or None for scheduler.default_cost_sensitivity")


class CacheBank(Stepping, ChatOps, Cache):
    def __init__(self, model, config: Config | dict | str | None = None, *, store: TierStore | None = None,
                 model_id: str | None = None, cost_sensitivity: float | None = None):
        if store is not None and config is not None and load_config(config) != store.config:
            raise ValueError("CacheBank: `config` differs from the shared store's config; pass one or make them equal")
        is_model = isinstance(model, torch.nn.Module)
        if is_model and getattr(model, "config", None) is None:
            raise LayoutError("CacheBank(model): the module has no `.config`; pass a transformers model or its config")
        _check_cost_sensitivity(cost_sensitivity)
        model_config = model.config if is_model else model
        # the model's attention layout first: a model the bank cannot serve allocates nothing
        self.layer_groups = model_layer_groups(model_config)
        self.store = store if store is not None else TierStore(config)
        self._owns_store = store is None
        if self._owns_store:
            self.store.add_owner()
        self.config = self.store.config
        # this chat's SLA, 0..1: high keeps its blocks hot longer and makes them the last victims
        self.cost_sensitivity = (self.config.scheduler.default_cost_sensitivity if cost_sensitivity is None
                                 else float(cost_sensitivity))
        self._critical_path = {"demote_s": 0.0, "promote_s": 0.0}
        self._turn_counted = False
        self._turn_started_s: float | None = None  # when the current turn began, until its first forward ends
        self._layout_no_dtype = layout_from_model_config(model_config, self.config.block_size)
        self.num_layers = self.layer_groups.num_layers
        self._num_groups = len(self.layer_groups)
        self.fingerprint = ModelFingerprint.of(model, self.config.block_size, model_id)
        self._model_ref = weakref.ref(runtime_model(model)) if is_model else None  # a PeftModel's inner model runs
        if is_model:
            forward_watch.watch(self._model_ref())
        super().__init__(layers=[_BankLayer(self, i) for i in range(self.num_layers)])
        self._rows: list[Row] = []
        self._seq_len = 0
        self._step: Step | None = None
        self._pending_inputs: list[RowInputs] | DeferredInputs | None = None
        self._step_owner = next(_STEP_OWNER_IDS)
        self._block_set: set[int] = set()  # every block any row references (pinned during a step)
        self._pending_mask = None  # the attention mask the forward pre-hook saw (paged steps' start offsets)
        self._left_window: list[int] = []  # blocks sliding rows left, freed once that lease ends
        self._closed = False
        # told of every committed step: step_committed(bank, num_new_tokens, num_tokens, step_s)
        # (tiered_kv/trace's TraceRecorder); None: nobody listens
        self.step_observer = None
        self._plan = None  # the open step's StepPlan (plan.py), prepared before layer 0
        self._gather_buffer = GatherBuffer()  # where gathered reads land, reused by every step
        self._plan_counts = dict.fromkeys(KINDS, 0)  # steps by how their layers read (stats()["steps_by_read"])
        self._last_lease = None  # the last committed step's lease, which a decode step may extend
        self._forced_eager = False  # compiled.py made the coming forward run eagerly (restored at its end)
        self._generate_compiles = False  # the generate() running now compiles its decode steps (compiled.py)
        self._in_forward = False  # between the watched model's forward hooks (eager forwards)
        self._unsettled_inputs: list = []  # committed steps whose token ids are still on their way (GPU)
        if is_model:  # bind now, so attach() finds stored blocks before the first forward pass
            self._bind_store(getattr(model, "dtype", None) or next(model.parameters()).dtype)

    @property
    def verifies_token_ids(self) -> bool:
        """True when the bank sees the ids of the tokens it computes (built from a model)."""
        return self._model_ref is not None

    # ---- transformers Cache contract -------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the layer's new K/V and return its whole K/V (a prepared step: plan.py)."""
        if layer_idx == 0:
            if torch.compiler.is_compiling():  # a compiled decode step: prepared outside the graph (compiled.py)
                plan = compiled.check_traced(self)
            else:
                self._check_open()
                plan = self._layer0(key_states)
        else:
            plan = self._plan
            if plan is None:
                raise RuntimeError(f"CacheBank.update: layer {layer_idx} came without layer 0 of the same forward pass "
                                   "(the step was rolled back); call the model again")
        if plan.is_grouped:
            return self._update_grouped(self._step, torch.stack((key_states, value_states)), layer_idx)
        return plan.layer(layer_idx, key_states, value_states, kwargs.get("kwargs"))

    def _update_grouped(self, step: Step, kv_new: torch.Tensor, layer_idx: int):
        """update() for a model of several layer groups or of sliding layers: the layer's rows in
        its group, read back as DynamicLayer / DynamicSlidingWindowLayer return them, through the
        lease's token runs. Attention gets these K/V and transformers' masks (sliding ones sized
        by get_mask_sizes)."""
        groups, lease = self.layer_groups, step.lease
        g, local = groups.group_of_layer[layer_idx], groups.local_of_layer[layer_idx]
        group, num_groups = groups.groups[g], self._num_groups
        visible = group.kept_tokens(self._seq_len) + step.num_new_tokens
        # a group short of a block's layers (the last of its kind, above MAX_GROUPS) writes zeros
        # there, so every layer of its blocks is written (a cold record is durable only then)
        padding = range(len(group.layers), groups.layers_per_group) if local == len(group.layers) - 1 else ()
        with self._rolled_back_on_error():
            rows = []
            for r in range(kv_new.shape[1]):
                store_row = r * num_groups + g
                lease.write_layer(local, store_row, kv_new[:, r])
                for pad in padding:
                    lease.write_layer(pad, store_row, torch.zeros_like(kv_new[:, r]))
                kv = lease.read_layer(local, store_row)
                if lease.rows[store_row].skipped_new_tokens:  # gapped: its old tokens, then the new ones
                    kv = torch.cat((kv, kv_new[:, r]), dim=2)
                rows.append(kv if kv.shape[2] == visible else kv[:, :, -visible:])
        kv = rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)
        if layer_idx == self.num_layers - 1:
            if not step.forward_seen:
                kv = kv.clone()  # (committed now: nobody says when attention is done with its views)
            self._layers_done()
        return kv[0], kv[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_open()
        if not torch.compiler.is_compiling():  # (a compiled step that ran counts from now on)
            step = self._step
            if step is not None and step.compiled and step.layers_done:
                compiled.settle(self)
        return self._seq_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the next forward's queries start: the bank's length, with a compiled step that
        ran counted (generate() asks this first, then get_mask_sizes, when it builds a mask)."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of what `update` returns for this layer, as transformers' own
        layers give them: a full layer every token; a sliding one its window's last tokens.
        generate() asks before each step, outside the model; before a compiled decode forward the
        bank prepares the step there (compiled.py)."""
        self._ready_for(query_length)
        groups = self.layer_groups
        if 0 <= layer_idx < groups.num_layers:
            group = groups.groups[groups.group_of_layer[layer_idx]]
            if group.is_sliding:
                return group.kept_tokens(self._seq_len) + query_length, max(self._seq_len - group.window + 1, 0)
        return self._seq_len + query_length, 0

    def _ready_for(self, query_length: int) -> None:
        """Before a decode forward that may be compiled (generate() builds its mask outside the
        model): settle the step before and prepare this one (compiled.py)."""
        if query_length == 1 and not torch.compiler.is_compiling() and (self._step is None or self._step.compiled) \
                and not self._closed and compiled.expected(self):
            compiled.prepare_decode(self, query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._rows) // self._num_groups or -1

    def _rows_and_groups(self):
        """`(row, its LayerGroup)` for every store row (rows are batch-row-major, a group each)."""
        return zip(self._rows, itertools.cycle(self.layer_groups.groups))

    @property
    def is_compileable(self) -> bool:
        """Whether generate() may compile decode steps with this bank (bank/compiled.py)."""
        if torch.compiler.is_compiling():  # (asked again inside the graph, by the mask functions)
            return True
        return compiled.answer_is_compileable(self, sys._getframe(1))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop `-tokens_to_remove` tokens from the end (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"CacheBank.crop({tokens_to_remove}): pass a negative count of tokens to remove (or use truncate(n))")
        if tokens_to_remove < 0:
            self.truncate(max(0, self._seq_len + tokens_to_remove))

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of every row. A sliding-window layer keeps only
        its window: a length whose window it released already is refused (0 always works)."""
        self._check_open()
        self._abandon_step()
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"truncate({num_tokens}): allowed 0..{self._seq_len}")
        if num_tokens and self._servable_length(num_tokens) != num_tokens:
            raise ValueError(
                f"truncate({num_tokens}): this model's sliding-window layers released the tokens that length "
                f"needs (they keep only their window); allowed: 0, or {self._shortest_servable()}..{self._seq_len}")
        self._truncate_rows(num_tokens)

    def _servable_length(self, num_tokens: int) -> int:
        """`num_tokens` when every sliding row still holds the window a sequence of that length
        needs, else 0 (the whole sequence is recomputed)."""
        bs = self.config.block_size
        for row, group in self._rows_and_groups():
            if group.is_sliding and row.first_block * bs > max(0, num_tokens - (group.window - 1)):
                return 0
        return num_tokens

    def _shortest_servable(self) -> int:
        bs = self.config.block_size
        return max([row.first_block * bs + group.window - 1 for row, group in self._rows_and_groups()
                    if group.is_sliding and row.first_block] or [0])

    def _truncate_rows(self, num_tokens: int) -> None:
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
        self._select_rows([row for row in range(len(self._rows) // self._num_groups) for _ in range(repeats)])

    def _select_rows(self, row_indices: list[int]) -> None:
        """New rows are copies of old rows by index; full blocks are shared (ref-counted) and a
        shared partial tail is copied before its next write (copy-on-write)."""
        self._check_open()
        self._abandon_step()
        if not self._rows:
            return
        old_rows, num_groups = self._rows, self._num_groups
        self._rows = [old_rows[r * num_groups + g].copy() for r in row_indices for g in range(num_groups)]
        self.store.retain([b for row in self._rows for b in row.table])
        self.store.release([b for row in old_rows for b in row.table])
        self._structure_changed()

    def _structure_changed(self) -> None:
        self._block_set = {b for row in self._rows for b in row.table}
        self._last_lease = None  # the rows changed: the next step opens a lease of its own

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
        other._pending_mask = None
        other._left_window = []
        other._plan = other._last_lease = None
        other._forced_eager = other._generate_compiles = other._in_forward = False
        other._gather_buffer = GatherBuffer()
        other._unsettled_inputs = []
        other.step_observer = None  # an observer follows the bank it was given, not its copies
        other._plan_counts = dict.fromkeys(KINDS, 0)
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
            self.store.forget_chat(self._step_owner)
        self._closed = True
        self._gather_buffer = GatherBuffer()
        if self._owns_store:
            self.store.drop_owner()

    def __del__(self):
        # May run inside the cyclic GC at any allocation, even while this thread is inside a store call:
        # hand the references to the store to release at its next operation, touch nothing here.
        try:
            if not self._closed and not self.store.is_closed:
                allocated = self._step.allocated_block_ids() if self._step is not None else []
                self.store.release_later([b for row in self._rows for b in row.table] + allocated + self._left_window,
                                         self._step_owner)
        except Exception:
            pass

    def block_table(self, row: int = 0, group: int = 0) -> list[int]:
        """A copy of one row's logical block ids in token order, in one layer group (for
        diagnosis and tests; a sliding group's table starts at its window)."""
        index = row * self._num_groups + group
        return list(self._rows[index].table) if index < len(self._rows) else []

    def __repr__(self) -> str:
        return f"CacheBank(rows={len(self._rows)}, tokens={self._seq_len}, block_size={self.config.block_size})"

    def stats(self) -> dict:
        """Store-wide tier use, hits, misses and bytes moved, plus this bank's blocks per tier
        and length. A step this thread opened and never finished (a config-only bank has no
        hook to see its forward fail) is rolled back first, so the figures are committed ones."""
        self._check_open()
        if self._step is not None and self._step.compiled:
            compiled.settle(self)
        elif self._step is not None and self._step.thread_id == threading.get_ident():
            self._rollback_step()
        out = self.store.stats()
        counts = tier_counts([self.store.placements(row.table) for row in self._rows])
        out["bank_blocks"] = {name: counts.get(tier, 0) for tier, name in enumerate(TIER_NAMES)}
        out["seq_tokens"] = self._seq_len
        out["contiguity"] = self.store.reporting.contiguity([row.table for row in self._rows])
        out["store_critical_path"] = out["critical_path"]
        cp = self._critical_path
        out["critical_path"] = {"move_s": cp["demote_s"] + cp["promote_s"], **cp}
        out["cost_sensitivity"] = self.cost_sensitivity
        out["kv_bytes"] = self._kv_bytes()
        # steps by how their layers read (plan.py); the gather buffer: the device memory beyond the tiers
        out["hooks"] = {"mode": self.hooks_mode, "gather_buffer_bytes": self._gather_buffer.num_bytes,
                        "steps_by_read": dict(self._plan_counts)}
        return out

    def _kv_bytes(self) -> dict:
        """Bytes of KV this bank's rows hold, per layer type, beside what one DynamicLayer per
        layer (every token of every layer) would hold: `full_attention_equivalent`."""
        layout = self.store.layout
        if layout is None:
            return {"total": 0, "full_attention_equivalent": 0}
        layer_bytes = layout.layer_bytes
        out: dict[str, int] = {}
        for row, group in self._rows_and_groups():
            out[group.layer_type] = out.get(group.layer_type, 0) + len(row.table) * len(group.layers) * layer_bytes
        out["total"] = sum(out.values())
        per_token_layer = layer_bytes // layout.block_size
        out["full_attention_equivalent"] = self.batch_size * self._seq_len * self.num_layers * per_token_layer \
            if self._rows else 0
        return out

    # ---- tiered_kv.hooks ---------------------------------------------------------------------
    @property
    def hooks_mode(self) -> str | None:
        """"exact" / "fast" / "merge" while the bank's model runs tiered_kv.hooks' attention, else None."""
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return None
        return HOOKS_MODES.get(getattr(model.config, "_attn_implementation", None))
