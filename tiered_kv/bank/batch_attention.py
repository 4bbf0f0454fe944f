"""Attention for a BankBatch: each row over its own K/V, never a padded copy of all rows'.

At every layer `BankBatch.update()` hands row r's new K/V to bank r, whose prepared step writes
them and returns the row's whole K/V (views of the slab, one gather, or what the lease read) or,
for a paged / split step (hooks merge mode), leaves its plan to attend. `RowsForAttention` keeps
what each row returned; the hooks' attention function finds it in the kwargs (`BATCH_KEY`) and
calls `attend`: transformers' sdpa per row, with the mask that row needs (none for a decode row
of a full layer, as a bank alone gets: the same call, so a row's attention is bitwise the one its
bank alone computes), and the outputs stacked into the batch's. When every row's step is paged
(hooks merge mode on a GPU: every block in hot or page-locked warm), the rows' block tables are
joined once per step and the native paged decode kernel reads all rows in one launch per layer.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..errors import BankClosedError, CapacityError, CorruptBlockError
from .plan import PAGED_KEY

BATCH_KEY = "tiered_kv_batch"  # where BankBatch.update() leaves the rows' K/V for attention


class RowFailure(RuntimeError):
    """A row's bank failed during a batched forward; every row was rolled back. `.row` is its index
    in the batch, `.error` what its bank raised."""

    def __init__(self, row: int, error: BaseException):
        super().__init__(f"row {row} of the BankBatch failed: {type(error).__name__}: {error}")
        self.row, self.error = row, error


def is_row_error(error: BaseException) -> bool:
    """Errors that belong to one bank (its blocks, its room, its state), not to the forward pass."""
    return isinstance(error, (CapacityError, CorruptBlockError, BankClosedError))


class RowsForAttention:
    """One layer's per-row K/V (or paged plans) of a batched forward, refilled layer by layer."""

    def __init__(self, batch):
        self.batch = batch
        self.kv: list = [None] * len(batch.banks)
        self._joined = None  # every row paged: (plans, kernels, sources, args) of one launch; False: not all paged
        self.spans = None  # per row (batch index, first, end) of its tokens: the same at every layer of the forward

    def fill(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv = self.kv
        if self.spans is None:
            self.spans = self.batch.spans(key_states.shape[2])
        spans = self.spans
        for r, bank in enumerate(self.batch.banks):
            seam: dict = {}
            b, start, end = spans[r]
            try:
                key, value = bank.update(key_states[b:b + 1, :, start:end], value_states[b:b + 1, :, start:end],
                                         layer_idx, kwargs=seam)
            except Exception as error:  # (its bank rolled itself back; the forward's end rolls back the others)
                if not is_row_error(error):
                    raise
                raise RowFailure(r, error) from error
            kv[r] = (key, value, seam.get(PAGED_KEY))

    def attend(self, module, query: torch.Tensor, dropout: float = 0.0, scaling: float | None = None,
               **kwargs) -> torch.Tensor:
        """`[B, q, Hq, D]`, as transformers' attention functions return it."""
        groups = self.batch.layer_groups
        group = groups.groups[groups.group_of_layer[module.layer_idx]]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        packed = self.batch.is_packed
        joined = self._joined if self._joined is not None else self._join_paged()
        if joined and not packed:
            return self._attend_joined(joined, module, query, scale)
        outs = []
        for r, (key, value, plan) in enumerate(self.kv):
            b, start, end = self.spans[r]
            row_query = query[b:b + 1, :, start:end]
            if plan is not None:  # a paged / split step: its own kernel over its blocks where they lie
                outs.append(plan.attend(module, row_query, None, scale))
                continue
            mask = row_mask(group, self.batch.banks[r].seq.num_tokens, end - start, key.shape[2], query.device)
            outs.append(sdpa_attention_forward(module, row_query, key, value, mask, dropout=dropout,
                                               scaling=scaling, **kwargs)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1 if packed else 0)

    def _join_paged(self):
        """When every row's step is paged over the same kernel sources: the rows' tables in one."""
        plans = [plan for _, _, plan in self.kv]
        if len(plans) < 2 or any(p is None or p.read_kind != "paged" for p in plans) or \
                any(p.kernel_sources is not plans[0].kernel_sources or p.kernels is not plans[0].kernels
                    for p in plans):
            self._joined = False
            return False
        width = max(p.kernel_args[0].shape[1] for p in plans)
        device = plans[0].kernel_args[0].device
        table = torch.zeros((len(plans), width), dtype=torch.int32, device=device)
        tags = torch.zeros((len(plans), width), dtype=torch.int8, device=device)
        for r, p in enumerate(plans):  # (once a step, not a layer)
            t, g = p.kernel_args[0], p.kernel_args[1]
            table[r, :t.shape[1]], tags[r, :g.shape[1]] = t[0], g[0]
        starts = torch.cat([p.kernel_args[2] for p in plans])
        lens = torch.cat([p.kernel_args[3] for p in plans])
        self._joined = (plans, plans[0].kernels, plans[0].kernel_sources, (table, tags, starts, lens))
        return self._joined

    def _attend_joined(self, joined, module, query: torch.Tensor, scale: float) -> torch.Tensor:
        plans, kernels, sources, args = joined
        layer = module.layer_idx
        out = kernels.paged_decode(query[:, :, 0].contiguous(), sources[layer], *args, scale)[0].unsqueeze(1)
        if layer == plans[0].last_layer:
            for plan in plans:  # (each row's step commits once its last attention ran)
                plan.on_last_layer()
        return out


def row_mask(group, num_tokens_before: int, num_new: int, kv_length: int, device):
    """A row's mask, as transformers' sdpa_mask makes it for a bank alone: None where it skips
    (a decode step, or no history, within a sliding window), else a bool `[1, 1, q, kv]` causal
    mask from the row's own position (and window)."""
    window = group.window if group.is_sliding else None
    if (num_new == 1 or kv_length == num_new) and (window is None or kv_length < window):
        return None
    end = num_tokens_before + num_new
    keys = torch.arange(end - kv_length, end, device=device)
    queries = torch.arange(num_tokens_before, end, device=device)[:, None]
    visible = keys[None, :] <= queries
    if window is not None:
        visible &= keys[None, :] > queries - window
    return visible[None, None]


__all__ = ["BATCH_KEY", "RowFailure", "RowsForAttention", "is_row_error", "row_mask"]
