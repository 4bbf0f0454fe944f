"""The attention functions registered by `install`: exact (the reference) and merge.

Both receive, in the kwargs dict the model shares between `cache.update` and attention, a
`LayerReads` handle (reads.py) under `LAYER_KEY`; without it (another cache, or hooks not
serving this step) they are plain sdpa over the K/V the cache returned. A CacheBank that left a
handle for this layer returns only the new tokens' K/V: should the model hand attention another
kwargs dict than the one it gave the cache, the handle is missing and attention over the new
tokens alone would be silently wrong, so that raises (`expect_handle` / `MissingLayerHandle`).

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

import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

LAYER_KEY = "tiered_kv_layer"
PAGED_ON_CPU = False  # tests set it to run the paged path through the kernels' torch reference

_expected = threading.local()  # layer index -> the handle a bank left for it on this thread


class MissingLayerHandle(RuntimeError):
    """Attention ran without the handle the cache left for its layer (see the module docstring)."""


def expect_handle(layer_idx: int, handle) -> None:
    """A bank left `handle` for layer `layer_idx`'s attention on this thread (in the model's kwargs)."""
    pending = getattr(_expected, "layers", None)
    if pending is None:
        pending = _expected.layers = {}
    pending[layer_idx] = handle


def clear_expected() -> None:
    """The step on this thread ended or was rolled back: no handle is owed any more."""
    pending = getattr(_expected, "layers", None)
    if pending:
        pending.clear()


def _take_handle(module, kwargs: dict):
    reads = kwargs.pop(LAYER_KEY, None)
    pending = getattr(_expected, "layers", None)
    layer_idx = getattr(module, "layer_idx", None)
    owed = pending.pop(layer_idx, None) if pending else None
    if reads is None and owed is not None:
        raise MissingLayerHandle(
            f"tiered_kv.hooks: layer {layer_idx}'s attention did not get the handle its CacheBank left in the "
            "kwargs passed to cache.update() (the model handed attention another kwargs dict); the K/V it got "
            "hold only the new tokens. This model does not fit tiered_kv.hooks: uninstall them "
            "(tiered_kv.hooks.uninstall(model)) to run it through CacheBank without hooks")
    if reads is not None and reads.layer != layer_idx and layer_idx is not None:
        raise MissingLayerHandle(f"tiered_kv.hooks: layer {layer_idx}'s attention got the handle of layer "
                                 f"{reads.layer}; this model does not fit tiered_kv.hooks")
    return reads


def paged_kernels():
    """The native ops (cupy) when chosen at start, else None; on CPU (tests) the torch reference."""
    from ..kernels import ops
    if ops.backend == "cuda" or PAGED_ON_CPU:
        return ops
    return None


def exact_attention(module, query, key, value, attention_mask, **kwargs):
    reads = _take_handle(module, kwargs)
    if reads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _sdpa_over_full_kv(reads, module, query, attention_mask, as_dynamic_cache=True, **kwargs)


def fast_attention(module, query, key, value, attention_mask, **kwargs):
    reads = _take_handle(module, kwargs)
    if reads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _sdpa_over_full_kv(reads, module, query, attention_mask, as_dynamic_cache=False, **kwargs)


def _sdpa_over_full_kv(reads, module, query, attention_mask, as_dynamic_cache: bool, **kwargs):
    """transformers' sdpa over the layer's whole K/V as the handle gives it (view or buffer).
    `as_dynamic_cache` (exact mode): on CUDA, SDPA gets K and V contiguous in separate
    allocations, as DynamicCache hands them: a strided view of the hot slab may make SDPA choose
    another kernel (or another split of the same one), and the logits differ in the last bits.
    On CPU a view gives the same bits (checked by the hooks tests), so it stays a view there."""
    key, value = reads.full_kv()
    if as_dynamic_cache and key.is_cuda:
        key, value = key.contiguous(), value.contiguous()
    result = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    reads.done()
    return result


def merge_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    reads = _take_handle(module, kwargs)
    if reads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1 and not reads.is_view and (query.is_cuda or PAGED_ON_CPU):
        paged = reads.paged_decode(query[:, :, 0].contiguous(), attention_mask, scale)
        if paged is not None:  # the native paged decode kernel read every block where it lies
            reads.done()
            return paged[0].unsqueeze(1).contiguous(), None
    parts = reads.parts()
    if parts is None:  # this step cannot be split (see LayerReads.parts): the exact path
        return _sdpa_over_full_kv(reads, module, query, attention_mask, as_dynamic_cache=False, scaling=scaling,
                                  dropout=dropout, **kwargs)
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
        lse = lse.float()
        if mask is not None:  # the kernel gives a query that sees none of these keys lse 0, not -inf
            lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))
        return out.float(), lse
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
    """Merge partial attentions by log-sum-exp: weights exp(lse_i - logsumexp(lse)); a part no
    query could see (lse -inf) weighs 0, and a query that saw no part at all gets 0."""
    lse = torch.stack(lses)  # [P, B, Hq, q]
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0)).nan_to_num_(nan=0.0)
    return (weights.unsqueeze(-1) * torch.stack(outs).nan_to_num_(nan=0.0)).sum(dim=0)
