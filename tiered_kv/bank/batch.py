"""BankBatch: one forward pass for many conversations, each row a CacheBank of its own.

A server with sixteen chats in decode runs one forward of sixteen rows instead of sixteen of one:
the weights are read once a step (on a GPU a small model's step is host time, whatever its batch).
Row i of the batch is bank i: its own history, its own length, its own position. Nothing is
padded and no row's KV is copied next to another's:

- the forward hooks hand each bank its own row of the ids and positions, so every row's tokens
  are verified and published by its own bank (docs/design.md, invariant 2);
- `update()` hands each row's new K/V to its bank (a prepared step of its own, opened at layer 0:
  invariant 9) and leaves the rows' K/V for attention in the kwargs the model passes on
  (`BATCH_KEY`); the hooks' attention (tiered_kv.hooks, installed for the batch when the model
  runs none) attends each row over its own K/V (batch_attention.py);
- the step is atomic per row and for the batch: it commits in every bank at the forward's end or
  is rolled back in every bank. A row whose bank fails (a corrupt block, no room, a closed bank)
  raises `RowFailure` naming the row, after every bank rolled back; `forward_rows()` takes the row
  out and runs the others again (failures stay in their row).

Rows must be unpadded: pass `position_ids` (each row's own: `batch.positions()`) and no attention
mask (an all-ones one is accepted). The input is a rectangle `[B, q]` (every row adds q tokens:
one each for decode) or, with `tokens_per_row`, the rows packed one after another in `[1, sum]`
(a prompt's chunk beside decode tokens: what `forward_rows` builds from lists of ids).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..logs import log_once
from .batch_attention import BATCH_KEY, RowFailure, RowsForAttention, is_row_error
from .steps import StepMachine

log = logging.getLogger(__name__)


class _BatchLayer(CacheLayerMixin):
    """The per-layer face transformers' generic Cache code expects; the rows' state is in their banks."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, batch: "BankBatch", layer_idx: int, is_sliding: bool):
        super().__init__()
        self._batch, self.layer_idx, self.is_sliding = batch, layer_idx, is_sliding

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._batch.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._batch.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._batch.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class BankBatch(Cache):
    """A transformers Cache whose row i is `banks[i]` (module docstring). Build one per step (it
    is cheap) or keep one while the same conversations decode together."""

    def __init__(self, banks, tokens_per_row=None):
        """`tokens_per_row`: the rows are packed, one after another along the sequence of a batch of
        one (`input_ids` `[1, sum(tokens_per_row)]`), row i adding tokens_per_row[i] tokens: a prompt's
        chunk and other conversations' decode tokens in one forward pass. None: a rectangle
        `[len(banks), q]`, every row adding q tokens."""
        banks = list(banks)
        check_batch(banks)
        self.banks = banks
        if tokens_per_row is not None:
            tokens_per_row = [int(n) for n in tokens_per_row]
            if len(tokens_per_row) != len(banks) or min(tokens_per_row) < 1:
                raise ValueError(f"BankBatch(tokens_per_row={tokens_per_row}): give one count >= 1 per bank "
                                 f"({len(banks)} banks)")
        self.tokens_per_row = tokens_per_row
        first = banks[0]
        self.store, self.model_ref, self.layer_groups = first.store, first.model_ref, first.layer_groups
        self.num_layers = first.num_layers
        groups = self.layer_groups
        super().__init__(layers=[_BatchLayer(self, i, groups.groups[groups.group_of_layer[i]].is_sliding)
                                 for i in range(self.num_layers)])
        self.steps = BatchSteps(self)
        self._rows: RowsForAttention | None = None
        _ensure_attention(self.model)

    @property
    def model(self):
        return self.model_ref()

    # ---- transformers Cache contract -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Row r's new K/V go to bank r; attention reads each row's own K/V (BATCH_KEY in `kwargs`)."""
        seam = kwargs.get("kwargs")
        if seam is None:
            raise RuntimeError(f"BankBatch: layer {layer_idx} called cache.update() without the kwargs dict it hands "
                               "its attention, so attention cannot find the rows' own K/V; this model's attention "
                               "does not fit a BankBatch: run its banks one at a time")
        self.check_shape(key_states.shape[0], key_states.shape[2])
        rows = self._rows
        if layer_idx == 0 or rows is None:
            rows = self._rows = RowsForAttention(self)
        rows.fill(layer_idx, key_states, value_states)
        seam[BATCH_KEY] = rows
        return key_states, value_states  # (what attention sees of them is BATCH_KEY's: each row's whole K/V)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = {bank.get_seq_length() for bank in self.banks}
        if len(lengths) != 1:
            raise ValueError("BankBatch: the rows hold different lengths "
                             f"({sorted(bank.seq.num_tokens for bank in self.banks)}), so there is no one length; "
                             "pass position_ids (each row's own positions) to the model")
        return lengths.pop()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # (masks are sized as for the new tokens alone: attention builds each row's own)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self.banks)

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("BankBatch.crop: crop each bank (bank.crop / bank.truncate); a batch holds no KV")

    def reset(self) -> None:
        raise NotImplementedError("BankBatch.reset: reset each bank; a batch holds no KV")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("BankBatch rows are conversations, not beams: build a new BankBatch instead")

    batch_select_indices = batch_repeat_interleave = reorder_cache

    def __repr__(self) -> str:
        return f"BankBatch(rows={len(self.banks)}, tokens={[bank.seq.num_tokens for bank in self.banks]})"

    # ---- one decode step for many conversations -----------------------------------------------------
    def positions(self, num_new_tokens: int = 1, device=None) -> torch.Tensor:
        """Position ids, each row continuing its own bank's tokens: `[B, num_new_tokens]`, or, packed,
        `[1, sum(tokens_per_row)]`."""
        device = device if device is not None else self.store.device
        if self.tokens_per_row is not None:
            return torch.cat([torch.arange(bank.seq.num_tokens, bank.seq.num_tokens + n)
                              for bank, n in zip(self.banks, self.tokens_per_row)])[None].to(device)
        starts = torch.tensor([bank.seq.num_tokens for bank in self.banks], dtype=torch.long)
        return (starts[:, None] + torch.arange(num_new_tokens)[None, :]).to(device)

    def spans(self, num_tokens: int) -> list[tuple[int, int, int]]:
        """Per row, where its tokens are in the forward's input: (batch index, first, end)."""
        if self.tokens_per_row is None:
            return [(r, 0, num_tokens) for r in range(len(self.banks))]
        out, start = [], 0
        for n in self.tokens_per_row:
            out.append((0, start, start + n))
            start += n
        return out

    @property
    def is_packed(self) -> bool:
        return self.tokens_per_row is not None

    def check_shape(self, batch_rows: int, num_tokens: int) -> None:
        if self.tokens_per_row is not None:
            if batch_rows != 1 or num_tokens != sum(self.tokens_per_row):
                raise ValueError(f"BankBatch packs {len(self.banks)} rows of {self.tokens_per_row} tokens: the input "
                                 f"must be [1, {sum(self.tokens_per_row)}], got [{batch_rows}, {num_tokens}]")
        elif len(self.banks) != batch_rows:
            raise ValueError(f"BankBatch of {len(self.banks)} banks got a batch of {batch_rows} rows; row i of the "
                             "input is bank i")


@dataclass
class BatchOutput:
    """What `forward_rows` computed: `logits[i]` is row `rows[i]`'s (the banks' indices, in order);
    `failed` maps the index of every row taken out to what its bank raised."""

    logits: torch.Tensor | None
    rows: list[int]
    failed: dict[int, BaseException] = field(default_factory=dict)


def forward_rows(model, banks, input_ids, **model_kwargs) -> BatchOutput:
    """One forward pass of `model` whose row i continues `banks[i]` with `input_ids[i]` (each at
    its own position), committed in every bank; the logits of each row's last token. `input_ids`:
    a `[B, q]` tensor, or a list of token-id lists of any lengths (packed into one sequence: a
    prompt's chunk beside other conversations' decode tokens). A row whose bank fails (a corrupt block, no room
    left, a closed bank: `RowFailure`) is taken out: every row was rolled back, and the others run
    again without it, so one conversation's failure never costs another its token. Any other error
    (the model's own) rolls every row back and is raised. A batch of one runs its bank alone."""
    banks = list(banks)
    ragged = not isinstance(input_ids, torch.Tensor)
    rows = [list(map(int, ids)) for ids in input_ids] if ragged else None
    if ragged and len(rows) != len(banks):
        raise ValueError(f"forward_rows: {len(rows)} rows of ids for {len(banks)} banks")
    device = next(model.parameters()).device
    failed: dict[int, BaseException] = {}
    for r, bank in enumerate(banks):
        try:
            bank.check_open()
        except Exception as error:  # noqa: BLE001 - a closed bank (or store) is its row's failure
            failed[r] = error
    alive = [r for r in range(len(banks)) if r not in failed]
    with torch.no_grad():
        while alive:
            try:
                if len(alive) == 1:
                    bank = banks[alive[0]]
                    ids = torch.tensor([rows[alive[0]]], device=device) if ragged else input_ids[alive]
                    start = bank.seq.num_tokens
                    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
                    logits = model(input_ids=ids, position_ids=positions[None], cache=bank, use_cache=True,
                                   logits_to_keep=1, **model_kwargs).logits
                elif ragged:
                    lengths = [len(rows[r]) for r in alive]
                    batch = BankBatch([banks[r] for r in alive], tokens_per_row=lengths)
                    ids = torch.tensor([[t for r in alive for t in rows[r]]], device=device)
                    last = torch.tensor(list(itertools.accumulate(lengths)), device=device) - 1
                    logits = model(input_ids=ids, position_ids=batch.positions(device=device), cache=batch,
                                   use_cache=True, logits_to_keep=last, **model_kwargs).logits[0][:, None]
                else:
                    ids = input_ids[alive] if len(alive) < len(banks) else input_ids
                    batch = BankBatch([banks[r] for r in alive])
                    logits = model(input_ids=ids, position_ids=batch.positions(ids.shape[1], ids.device), cache=batch,
                                   use_cache=True, logits_to_keep=1, **model_kwargs).logits
            except RowFailure as failure:
                failed[alive.pop(failure.row)] = failure.error
                continue
            except Exception as error:
                if len(alive) == 1 and is_row_error(error):
                    failed[alive.pop()] = error
                    continue
                raise
            return BatchOutput(logits, alive, failed)
    return BatchOutput(None, [], failed)


class BatchSteps:
    """The batch's seam with the model's forward hooks (forward_watch.py): each bank sees its own row."""

    def __init__(self, batch: BankBatch):
        self.batch = batch

    def note_forward_inputs(self, module, input_ids, attention_mask, position_ids) -> None:
        from ..identity import refresh_for_forward
        batch = self.batch
        batch._rows = None
        if attention_mask is not None and not _all_ones(attention_mask):
            raise ValueError("BankBatch rows are not padded: pass attention_mask=None (or all ones) and each row's "
                             "own position_ids (BankBatch.positions())")
        if position_ids is None and len({bank.seq.num_tokens for bank in batch.banks}) > 1:
            raise ValueError("BankBatch: the rows hold different lengths; pass position_ids=batch.positions(q) so "
                             "each row continues its own conversation")
        if isinstance(input_ids, torch.Tensor):
            batch.check_shape(input_ids.shape[0], input_ids.shape[1])
        spans = batch.spans(input_ids.shape[1]) if isinstance(input_ids, torch.Tensor) else None
        for r, bank in enumerate(batch.banks):
            ids = positions = None
            if spans is not None:
                b, start, end = spans[r]
                ids = input_ids[b:b + 1, start:end]
                if position_ids is not None:
                    positions = position_ids[b:b + 1 if position_ids.shape[0] > 1 else 1, start:end]
            refresh_for_forward(bank, module, ids)
            bank.steps.note_forward_inputs(module, ids, None, positions)

    def note_forward_end(self, failed: bool) -> None:
        batch = self.batch
        batch._rows = None
        first_error = None
        for bank in batch.banks:
            try:
                bank.steps.note_forward_end(failed)
            except BaseException as error:  # noqa: BLE001 - every bank ends its step; the first error is raised
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def check_batch(banks) -> None:
    """ValueError / TypeError naming the row and what is wrong, before anything is written."""
    if not banks:
        raise ValueError("BankBatch([]): give at least one CacheBank")
    for r, bank in enumerate(banks):
        if not isinstance(getattr(bank, "steps", None), StepMachine):  # (a CacheBank: it imports this module)
            raise TypeError(f"BankBatch: row {r} is a {type(bank).__name__}; every row must be a tiered_kv.CacheBank")
        bank.check_open()
        if not bank.verifies_token_ids:
            raise ValueError(f"BankBatch: row {r}'s bank was built from a model config alone, so it cannot see the "
                             "ids of its tokens; build every bank of a batch from the model (CacheBank(model, ...))")
        if bank.seq.rows and bank.batch_size != 1:
            raise ValueError(f"BankBatch: row {r}'s bank holds {bank.batch_size} sequences; each row of a batch is a "
                             "bank of one conversation")
    first = banks[0]
    for r, bank in enumerate(banks[1:], start=1):
        if bank.store is not first.store:
            raise ValueError(f"BankBatch: row {r}'s bank is on another TierStore than row 0's; the banks of a batch "
                             "share one store (CacheBank(model, store=store))")
        if bank.model is not first.model:
            raise ValueError(f"BankBatch: row {r}'s bank was built from another model than row 0's; one forward "
                             "pass runs one model: batch banks of the same model")
    seen = {}
    for r, bank in enumerate(banks):
        if id(bank) in seen:
            raise ValueError(f"BankBatch: rows {seen[id(bank)]} and {r} are the same bank; a conversation is one row "
                             "(copy.deepcopy(bank) makes an independent one sharing its blocks)")
        seen[id(bank)] = r


def _all_ones(mask) -> bool:
    if isinstance(mask, dict):
        return all(_all_ones(m) for m in mask.values())
    return mask.dim() == 2 and bool(mask.bool().all())


def _ensure_attention(model) -> None:
    """A batch's rows are attended one by one by tiered_kv.hooks' attention: installed (exact)
    when the model runs none; a model whose attention the hooks cannot run is refused."""
    from .. import hooks
    if hooks.installed_mode(model) is not None:
        return
    reason = hooks.pass_through_reason(model)
    if reason is not None:
        raise ValueError(f"BankBatch: this model {reason}, which tiered_kv.hooks' attention does not; its banks "
                         "cannot share a forward pass: run them one at a time")
    hooks.check_servable(model)
    hooks.install_attention(model, "exact")
    log_once(log, logging.INFO, "BankBatch: installed tiered_kv.hooks (exact) on %s: a batch's rows are attended "
             "each over its own K/V", type(model).__name__)


__all__ = ["BankBatch", "BatchOutput", "RowFailure", "check_batch", "forward_rows"]
