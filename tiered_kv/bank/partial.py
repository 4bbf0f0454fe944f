"""Attention over a spilled chat's runs of the CPU slab where they lie: one partial attention
per run, merged by their log-sum-exp, as flash-decoding merges its splits.

On a CPU store hot and paged warm share one slab (store/device_slab.py), so a chat whose history
spilled lies in a few runs of consecutive slots of it, each readable as a view. In the hooks'
merge mode a one-token decode step of one row attends to each run in place (torch's CPU flash
kernel returns each part's log-sum-exp) instead of gathering the runs into one buffer first: no
copy of the history, at the cost of a few small ops per layer to merge. The result equals exact
attention to ~1e-7 in fp32, not bit for bit (exact mode gathers). A mask that hides any key from
the step's one query (left padding) makes the step concatenate its runs and run sdpa instead.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MAX_PARTS = 8  # runs of one split step (each one more partial attention and merge)
_UNSEEN = object()


def prepare_split(plan, slab, blocks: np.ndarray, num_tokens: int) -> bool:
    """Views of each run of consecutive slab slots among `blocks` (a row's blocks' slab slots), for
    every layer; False (nothing set) when the blocks form one run or more than MAX_PARTS."""
    bounds = [0, *(np.flatnonzero(np.diff(blocks) != 1) + 1).tolist(), len(blocks)]
    if not 2 < len(bounds) <= MAX_PARTS + 1:
        return False
    bs, parts = slab.block_size, []
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        first, count = int(blocks[b0]) * bs, min(b1 * bs, num_tokens) - b0 * bs
        views = slab.flat[:, :, first:first + count].unsqueeze(1).unbind(0)  # [1, H, count, D], K then V per layer
        parts.append((views[0::2], views[1::2]))
    plan.split_parts = parts
    plan.mask_checked = _UNSEEN  # (the step's mask: looked at once, by the first layer's attention)
    plan.read_kind = "split"
    return True


def attend_split(plan, module, query: torch.Tensor, attention_mask, scale: float) -> torch.Tensor:
    """`[B, q, Hq, D]`: the attention of `module` (a layer's) over its runs (module docstring)."""
    layer = module.layer_idx
    if plan.mask_checked is not attention_mask:
        plan.mask_visible = _sees_every_key(attention_mask)
        plan.mask_checked = attention_mask
    parts = plan.split_parts
    sampled = plan.probe is not None and plan.probe.wants(layer)  # a sampled step (attention_stats.py)
    keys = torch.cat([k[layer] for k, _ in parts], dim=2) if sampled or not plan.mask_visible else None
    if sampled:
        plan.probe.observe(layer, query, keys, scale)
    if not plan.mask_visible:
        values = torch.cat([v[layer] for _, v in parts], dim=2)
        return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scale)[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, parts[0][0][layer], parts[0][1][layer], 0.0, False, scale=scale)
    for i in range(1, len(parts)):
        keys, values = parts[i]
        part_out, part_lse = flash(query, keys[layer], values[layer], 0.0, False, scale=scale)
        # out = (e^lse * out + e^part_lse * part_out) / (e^lse + e^part_lse)
        weight = torch.sigmoid(lse - part_lse).unsqueeze(-1)
        out = torch.lerp(part_out, out, weight.to(out.dtype))
        if i + 1 < len(parts):
            lse = torch.logaddexp(lse, part_lse)
    return out.transpose(1, 2)


def _sees_every_key(attention_mask) -> bool:
    """Whether a mask lets every query see every key (None does; read on the host: a CPU store)."""
    if attention_mask is None:
        return True
    return bool(attention_mask.all()) if attention_mask.dtype == torch.bool else bool((attention_mask == 0).all())


__all__ = ["prepare_split", "attend_split", "MAX_PARTS"]
