"""What a forward's inputs say about the tokens a step stores: their ids, and whether the mask and
the positions show them continuing the bank's own tokens (verified: docs/design.md, invariant 2).

Everything here is tensor ops on the inputs' device, with no host sync: a GPU step's verdict and
ids are copied to the host after the forward was queued and read once the copy landed
(step.DeferredInputs). The masks generate() builds outside the model (4D, for a compileable cache)
count as verifying when they are exactly causal for the bank's tokens (no padding).
"""

from __future__ import annotations

import torch

from .step import DeferredInputs, RowInputs


def seen_inputs(input_ids, attention_mask, position_ids, num_tokens_before: int):
    """The ids of a forward and, per row, whether they continue the bank's `num_tokens_before`
    tokens: a list of RowInputs (CPU), DeferredInputs (GPU), or None when the mask or the
    positions cover fewer rows than the ids (they prove nothing)."""
    ok = rows_ok(input_ids, attention_mask, position_ids, num_tokens_before)
    if ok is None:
        return None
    if input_ids.is_cuda:  # no host sync: the ids are read once the step is long done
        return DeferredInputs.copy(input_ids, ok)
    return [RowInputs(ids, v) for ids, v in zip(input_ids.tolist(), ok.tolist())]


def take_inputs(pending, num_rows: int, num_new: int):
    """The inputs the forward hook saw, when they match a step of `num_rows` x `num_new` tokens;
    else every row unknown and unverified."""
    if isinstance(pending, DeferredInputs):
        return pending if pending.shape == (num_rows, num_new) else [RowInputs(None, False)] * num_rows
    if pending is None or len(pending) != num_rows or any(len(p.token_ids) != num_new for p in pending):
        return [RowInputs(None, False) for _ in range(num_rows)]
    return pending


def rows_ok(input_ids, attention_mask, position_ids, num_tokens_before: int):
    """Per row, whether the mask and the positions say these ids continue the bank's tokens: a
    bool tensor on the ids' device; None when the mask or the positions cover fewer rows than the
    ids (a one-row position tensor counts for all). A mask or positions of another rank or length
    leave every row unverified."""
    num_rows, num_new = input_ids.shape
    device = input_ids.device
    attention_mask = _full_attention_mask(attention_mask)
    ok, length = torch.ones(num_rows, dtype=torch.bool, device=device), num_rows
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            length = min(length, attention_mask.shape[0])
            ok = ok[:length] & attention_mask[:length].bool().all(dim=1).to(device)
        elif attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == num_new \
                and attention_mask.shape[3] == num_tokens_before + num_new:
            length = min(length, attention_mask.shape[0])
            ok = ok[:length] & is_causal_mask(attention_mask[:length], num_tokens_before).to(device)
        else:
            ok, length = torch.zeros(num_rows, dtype=torch.bool, device=device), num_rows
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != num_new:
            ok, length = torch.zeros(num_rows, dtype=torch.bool, device=device), num_rows
        else:
            expected = torch.arange(num_tokens_before, num_tokens_before + num_new, device=position_ids.device)
            rows = (position_ids == expected).all(dim=1).to(device)
            if len(rows) == 1:
                rows = rows.expand(num_rows)
            length = min(length, len(rows))
            ok = ok[:length] & rows[:length]
    return ok if length == num_rows else None


def is_causal_mask(mask: torch.Tensor, num_tokens_before: int) -> torch.Tensor:
    """Per row of a 4D mask `[B, 1, q, kv]` (bool: True attends; float: 0 attends), whether each
    query sees exactly the keys up to its own position (no padding)."""
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    q, kv = allowed.shape[-2:]
    positions = torch.arange(kv, device=mask.device)
    causal = positions[None, :] <= (num_tokens_before + torch.arange(q, device=mask.device))[:, None]
    return (allowed == causal).flatten(1).all(dim=1)


def mask_starts(attention_mask, num_tokens: int):
    """Per row, where its mask's ones begin among the step's `num_tokens` keys (left padding), as
    the paged kernel takes it: an int32 tensor on the mask's device. None without a 2D or 4D mask
    (every row starts at 0)."""
    attention_mask = _full_attention_mask(attention_mask)
    if attention_mask is None or attention_mask.dim() not in (2, 4):
        return None
    if attention_mask.dim() == 4:  # [B, 1, q, kv]: the keys the last query sees
        last = attention_mask[:, 0, -1, -num_tokens:]
        allowed = last if last.dtype == torch.bool else last == 0
    else:
        allowed = attention_mask[:, -num_tokens:] != 0
    return allowed.int().argmax(dim=1).to(torch.int32)


def _full_attention_mask(attention_mask):
    """generate() builds a dict of 4D masks (one per layer kind) for some models: the full one."""
    if isinstance(attention_mask, dict):
        return attention_mask.get("full_attention", next(iter(attention_mask.values()), None))
    return attention_mask


__all__ = ["seen_inputs", "take_inputs", "rows_ok", "is_causal_mask", "mask_starts"]
