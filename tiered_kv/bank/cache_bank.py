"""CacheBank: a transformers `Cache` whose KV lives in a TierStore's blocks.

One bank per chat (or per batch of sequences generated together). The bank is the seam with
transformers; its parts own their state:
- `seq` (sequence.py): per batch row and layer group a block table, the token ids it knows and
  their chain keys (rows.py), and the length they all have; the store decides each block's tier;
- `steps` (steps.py): one forward pass at a time, begun at layer 0 (its lease and plan), every
  layer a few tensor ops (plan.py), committed once the forward ended, or rolled back;
- `turn` (step.py): when the chat's turn began and what its own moves cost it;
- chat-level operations, attach / prefetch / offload (session.py).

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
from transformers.cache_utils import Cache

from ..adapters import runtime_model
from ..blocks import TIER_NAMES, layout_from_model_config, model_layer_groups, tier_counts
from ..config import Config, load_config
from ..errors import BankClosedError, CorruptBlockError, LayoutError
from ..identity import ModelFingerprint
from ..store import TierStore
from . import binding, compiled, forward_watch, session
from .grouped import grouped_layer
from .layers import BankLayer
from .plan import HOOKS_MODES
from .sequence import Sequence
from .step import Turn
from .steps import StepMachine

_OWNER_IDS = itertools.count(1)


def _check_cost_sensitivity(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"CacheBank(cost_sensitivity={value!r}): allowed: a number from 0 (send this chat's "
                         "blocks down first) to 1 (keep them hot longest), or None for scheduler.default_cost_sensitivity")


class CacheBank(Cache):
    def __init__(self, model, config: Config | dict | str | None = None, *, store: TierStore | None = None,
                 model_id: str | None = None, cost_sensitivity: float | None = None, tokenizer=None):
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
        self.layout_no_dtype = layout_from_model_config(model_config, self.config.block_size)
        self.num_layers = self.layer_groups.num_layers
        self.fingerprint = ModelFingerprint.of(model, self.config.block_size, model_id)
        self.model_ref = weakref.ref(runtime_model(model)) if is_model else None  # a PeftModel's inner model runs
        if is_model:
            forward_watch.watch(self.model_ref())
        super().__init__(layers=[BankLayer(self, i) for i in range(self.num_layers)])
        self.owner = next(_OWNER_IDS)  # the chat's id in the store (its steps' pins, its access record)
        self.closed = False
        # told of every committed step: step_committed(bank, num_new_tokens, num_tokens, step_s)
        # (tiered_kv/trace's TraceRecorder); None: nobody listens
        self.step_observer = None
        self.seq = Sequence(self.layer_groups, self.config.block_size)
        self.turn = Turn()
        self.steps = StepMachine(self)
        if is_model:  # bind now (compression: auto measured with `tokenizer` first), so attach() finds blocks at once
            binding.bind_model(self.store, self.layout_no_dtype, model, self.fingerprint, tokenizer, self._owns_store)

    @property
    def model(self):
        """The model whose forwards the bank sees (None: built from a config, or the model is gone)."""
        return self.model_ref() if self.model_ref is not None else None

    @property
    def verifies_token_ids(self) -> bool:
        """True when the bank sees the ids of the tokens it computes (built from a model)."""
        return self.model_ref is not None

    @property
    def publishes(self) -> bool:
        """Whether its full verified blocks are published (seen ids, weights it can name)."""
        return self.verifies_token_ids and self.fingerprint.is_shareable

    def root_key(self, group: int) -> bytes:
        """The key root of one layer group's blocks (the fingerprint's, tagged by the group when
        the model has several groups or sliding layers: its blocks hold other layers' bytes)."""
        root = self.fingerprint.root_key(self.store.layout.dtype_name)
        if self.layer_groups.is_single_full:
            return root
        return self.fingerprint.group_root(root, self.layer_groups.groups[group].key_tag)

    # ---- transformers Cache contract -------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the layer's new K/V and return its whole K/V (a prepared step: plan.py)."""
        steps = self.steps
        if layer_idx == 0:
            if torch.compiler.is_compiling():  # a compiled decode step: prepared outside the graph (compiled.py)
                plan = compiled.check_traced(steps)
            else:
                self.check_open()
                plan = steps.layer0(key_states)
        else:
            plan = steps.plan
            if plan is None:
                raise RuntimeError(f"CacheBank.update: layer {layer_idx} came without layer 0 of the same forward pass "
                                   "(the step was rolled back); call the model again")
        if plan.is_grouped:
            return grouped_layer(steps, key_states, value_states, layer_idx)
        return plan.layer(layer_idx, key_states, value_states, kwargs.get("kwargs"))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.check_open()
        if not torch.compiler.is_compiling():  # (a compiled step that ran counts from now on)
            step = self.steps.step
            if step is not None and step.compiled and step.layers_done:
                compiled.settle(self.steps)
        return self.seq.num_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the next forward's queries start: the bank's length, with a compiled step that
        ran counted (generate() asks this first, then get_mask_sizes, when it builds a mask)."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of what `update` returns for this layer, as transformers' own
        layers give them: a full layer every token; a sliding one its window's last tokens.
        generate() asks before each step, outside the model; before a compiled decode forward the
        bank prepares the step there (compiled.py)."""
        step = self.steps.step
        if query_length == 1 and not torch.compiler.is_compiling() and (step is None or step.compiled) \
                and not self.closed and compiled.expected(self.steps):
            compiled.prepare_decode(self.steps, query_length)
        num_tokens, groups = self.seq.num_tokens, self.layer_groups
        if 0 <= layer_idx < groups.num_layers:
            group = groups.groups[groups.group_of_layer[layer_idx]]
            if group.is_sliding:
                return group.kept_tokens(num_tokens) + query_length, max(num_tokens - group.window + 1, 0)
        return num_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.seq.batch_size

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
            self.truncate(max(0, self.seq.num_tokens + tokens_to_remove))

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of every row. A sliding-window layer keeps only
        its window: a length whose window it released already is refused (0 always works)."""
        self.check_open()
        self.steps.abandon()
        seq = self.seq
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate({num_tokens}): allowed 0..{seq.num_tokens}")
        if num_tokens and seq.servable_length(num_tokens) != num_tokens:
            raise ValueError(
                f"truncate({num_tokens}): this model's sliding-window layers released the tokens that length "
                f"needs (they keep only their window); allowed: 0, or {seq.shortest_servable()}..{seq.num_tokens}")
        dropped = seq.truncate(num_tokens)
        self.steps.rows_changed()
        self.store.release(dropped)

    def reset(self) -> None:  # (transformers' name for truncate(0))
        self.truncate(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self.seq.rows) // self.seq.num_groups) for _ in range(repeats)])

    def _select_rows(self, row_indices: list[int]) -> None:
        """New rows are copies of old rows by index; full blocks are shared (ref-counted) and a
        shared partial tail is copied before its next write (copy-on-write)."""
        self.check_open()
        self.steps.abandon()
        if not self.seq.rows:
            return
        old_rows = self.seq.select(row_indices)
        self.steps.rows_changed()
        self.store.retain(self.seq.all_blocks())
        self.store.release([b for row in old_rows for b in row.table])

    # ---- chat-level operations (session.py) ----------------------------------------------------
    def attach(self, ids) -> int:
        """Reuse as much stored KV as matches `ids` (the whole conversation, one sequence).

        Returns the number of leading tokens whose KV is reused; generate() computes the rest.
        At least one token is always left to compute."""
        return session.attach(self, ids)

    def prefetch(self, deadline_s: float | None = None) -> None:
        """Bring this chat's blocks up ahead of its next turn; returns at once (session.prefetch)."""
        session.prefetch(self, deadline_s)

    def offload(self, tier: str = "warm") -> dict:
        """Move this idle chat's blocks down to `tier` ("warm" or "cold") (session.offload)."""
        return session.offload(self, tier)

    def promote_rows(self, rows) -> None:  # (compiled.py: a chat's blocks up, before a graph reads them)
        session.promote_rows(self, rows)

    # ---- lifecycle -------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise BankClosedError("this CacheBank is closed (close() released its blocks); create a new CacheBank")
        if self.store.is_closed:
            raise BankClosedError("this CacheBank's TierStore is closed; create a new store and bank")

    def check_fits(self, num_rows: int, num_tokens: int, num_tokens_before: int | None = None) -> None:
        """CapacityError when `num_rows` sequences of `num_tokens` cannot fit in all tiers at once."""
        binding.check_fits(self.store, self.layer_groups, num_rows, num_tokens, num_tokens_before)

    def bind(self, key_states: torch.Tensor) -> None:
        """The store bound to the layout of the K/V a layer hands over (binding.py)."""
        binding.bind_kv(self.store, self.layout_no_dtype, key_states)

    def bind_dtype(self, dtype: torch.dtype) -> None:  # (a model's bank binds at construction)
        binding.bind_dtype(self.store, self.layout_no_dtype, dtype)

    def corrupt_error(self, error: CorruptBlockError) -> CorruptBlockError:
        """A step read a block that failed its checksum: the bank is cut before it; the error says so."""
        first_bad = session.drop_from_first_corrupt(self)
        where = f"; the bank dropped everything from token {first_bad} on" if first_bad is not None else ""
        return CorruptBlockError(f"{error}{where}. Call generate again with the whole conversation to recompute it")

    def __deepcopy__(self, memo):
        """An independent bank on the same store sharing this one's blocks (copy-on-write)."""
        self.check_open()
        self.steps.abandon()
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        Cache.__init__(other, layers=[BankLayer(other, i) for i in range(self.num_layers)])
        other.owner = next(_OWNER_IDS)
        other.step_observer = None  # an observer follows the bank it was given, not its copies
        other.seq = Sequence(self.layer_groups, self.config.block_size)
        other.seq.rows = [row.copy() for row in self.seq.rows]
        other.seq.num_tokens = self.seq.num_tokens
        other.seq.changed()
        other.turn = Turn()
        other.steps = StepMachine(other)
        self.store.retain(other.seq.all_blocks())
        if other._owns_store:
            self.store.add_owner()
        memo[id(self)] = other
        return other

    def close(self) -> None:
        if self.closed:
            return
        if not self.store.is_closed:
            self.steps.abandon()
            self.truncate(0)
            self.store.forget_chat(self.owner)
        self.closed = True
        self.steps = StepMachine(self)  # (its buffers go)
        if self._owns_store:
            self.store.drop_owner()

    def __del__(self):
        # May run inside the cyclic GC at any allocation, even while this thread is inside a store call:
        # hand the references to the store to release at its next operation, touch nothing here.
        try:
            if not self.closed and not self.store.is_closed:
                step = self.steps.step
                allocated = step.allocated_block_ids() if step is not None else []
                self.store.release_later(self.seq.all_blocks() + allocated + self.seq.left_window, self.owner)
        except Exception:
            pass

    # ---- what tests and tools look at -----------------------------------------------------------
    def block_table(self, row: int = 0, group: int = 0) -> list[int]:
        """A copy of one row's logical block ids in token order, in one layer group (for
        diagnosis and tests; a sliding group's table starts at its window)."""
        return self.seq.block_table(row, group)

    def __repr__(self) -> str:
        return f"CacheBank(rows={len(self.seq.rows)}, tokens={self.seq.num_tokens}, block_size={self.config.block_size})"

    def stats(self) -> dict:
        """Store-wide tier use, hits, misses and bytes moved, plus this bank's blocks per tier and
        length (a step this thread left open, or a compiled one, is settled first: committed figures)."""
        self.check_open()
        steps = self.steps
        if steps.step is not None and steps.step.compiled:
            compiled.settle(steps)
        elif steps.step is not None and steps.step.thread_id == threading.get_ident():
            steps.rollback()
        out = self.store.stats()
        rows = self.seq.rows
        counts = tier_counts([self.store.placements(row.table) for row in rows])
        out["bank_blocks"] = {name: counts.get(tier, 0) for tier, name in enumerate(TIER_NAMES)}
        out["seq_tokens"] = self.seq.num_tokens
        out["contiguity"] = self.store.reporting.contiguity([row.table for row in rows])
        out["store_critical_path"] = out["critical_path"]
        cp = self.turn.critical_path
        out["critical_path"] = {"move_s": cp["demote_s"] + cp["promote_s"], **cp}
        out["cost_sensitivity"] = self.cost_sensitivity
        out["kv_bytes"] = self.seq.kv_bytes(self.store.layout, self.num_layers)
        out["hooks"] = {"mode": self.hooks_mode, "gather_buffer_bytes": steps.gather_buffer.num_bytes,
                        "steps_by_read": dict(steps.counts)}  # (by how their layers read: plan.py)
        out["attention"] = steps.attention.report()  # sampled attention mass, sparse reads (attention_steps.py)
        return out

    @property
    def hooks_mode(self) -> str | None:
        """"exact" / "merge" while the bank's model runs tiered_kv.hooks' attention, else None."""
        model = self.model
        return HOOKS_MODES.get(getattr(model.config, "_attn_implementation", None)) if model is not None else None
