"""The attention functions registered by `install`: exact (the reference) and merge.

Both receive, in the kwargs dict the model shares between `cache.update` and attention, a
`LayerReads` handle (bank/layer_reads.py) under `LAYER_KEY`; without it (another cache, or
hooks not serving this step) they are plain sdpa over the K/V the cache returned.

exact: transformers' own `sdpa_attention_forward` over the layer's whole K/V, which the handle
gives as a zero-copy view of consecutive hot slots or as a buffer it filled (history by the
stream worker, new tokens here). Same function, same mask, same shapes as sdpa over a
DynamicCache: the logits are bitwise equal.

merge: one partial attention per part (the hot view; the lower-tier and scattered tokens
gathered into a stream buffer), each with its log-sum-exp, merged as in flash-decoding:
out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m). Nothing is copied for the hot part.
Float32 accumulation; equal to exact within ~1e-6 relative in fp32, not bitwise.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

LAYER_KEY = "tiered_kv_layer"
PAGED_ON_CPU = False  # tests set it to run the paged path through the kernels' torch reference


def paged_kernels():
    """The native ops (cupy) when chosen at start, else None; on CPU (tests) the torch reference."""
    from ..kernels import ops
    if ops.backend == "cuda" or PAGED_ON_CPU:
        return ops
    return None


def exact_attention(module, query, key, value, attention_mask, **kwargs):
    reads = kwargs.pop(LAYER_KEY, None)
    if reads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _sdpa_over_full_kv(reads, module, query, attention_mask, **kwargs)


def _sdpa_over_full_kv(reads, module, query, attention_mask, **kwargs):
    """transformers' sdpa over the layer's whole K/V as the handle gives it (view or buffer)."""
    key, value = reads.full_kv()
    result = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    reads.done()
    return result


def merge_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    reads = kwargs.pop(LAYER_KEY, None)
    if reads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1 and not reads.is_view and (query.is_cuda or PAGED_ON_CPU):
        kernels = paged_kernels()
        paged = reads.paged_decode(query[:, :, 0].contiguous(), attention_mask, scale, kernels) if kernels is not None else None
        if paged is not None:  # the native paged decode kernel read every block where it lies
            reads.done()
            return paged[0].unsqueeze(1).contiguous(), None
    parts = reads.parts()
    if parts is None:  # this step cannot be split (see LayerReads.parts): the exact path
        return _sdpa_over_full_kv(reads, module, query, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    num_tokens, query_length = reads.num_tokens, query.shape[2]
    outs, lses = [], []
    for part_key, part_value, positions in parts:
        mask = part_mask(attention_mask, positions, query_length, num_tokens, query.device)
        out, lse = attention_with_lse(query, part_key, part_value, mask, scale)
        outs.append(out)
        lses.append(lse)
    reads.done()
    merged = merge_partials(outs, lses).to(query.dtype)
    return merged.transpose(1, 2).contiguous(), None


def part_mask(attention_mask, positions: torch.Tensor, query_length: int, num_tokens: int, device):
    """Boolean mask `[B or 1, 1, q, len(positions)]` (True = attend) for the keys at
    `positions`, or None when every query sees every one of them."""
    if attention_mask is not None:
        mask = attention_mask[..., -num_tokens:] if attention_mask.shape[-1] >= num_tokens else attention_mask
        mask = mask.index_select(-1, positions)
        return mask if mask.dtype == torch.bool else mask == 0  # additive float masks: 0 = attend
    if query_length == 1:
        return None
    query_positions = torch.arange(num_tokens - query_length, num_tokens, device=device)
    return (positions[None, :] <= query_positions[:, None])[None, None]


def attention_with_lse(query, key, value, mask, scale: float):
    """`(out [B, Hq, q, D] float32, lse [B, Hq, q] float32)` of softmax(q k^T * scale) v over
    these keys. GQA: key/value may have fewer heads than the query."""
    if query.device.type == "cpu":  # torch's CPU flash kernel returns the lse (DESIGN.md)
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=additive, scale=scale)
        return out.float(), lse.float()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1).nan_to_num(neginf=0.0))
    return torch.matmul(weights, value.float()), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attentions by log-sum-exp; a part no query could see (lse -inf) weighs 0."""
    lse = torch.stack(lses)  # [P, B, Hq, q]
    top = lse.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # exp(-inf) = 0
    total = weights.sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    merged = sum(w.unsqueeze(-1) * torch.nan_to_num(o, nan=0.0) for w, o in zip(weights, outs))
    return merged / total.unsqueeze(-1)
