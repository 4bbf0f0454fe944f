"""Pure-torch versions of the native ops, with the same signatures and contracts.

They are the CPU path (chosen when CUDA or cupy is missing) and the reference the CUDA
kernels are tested against. Each runs the same layout check as its CUDA wrapper and has the
same semantics for edge cases: an empty row gives out 0 and lse -inf; a row whose block
table names an unknown tier tag or a slot outside its source gives NaN. Block copies go
further than the kernels can (a kernel cannot raise): an out-of-range slot raises here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..compression.packing import decode_torch, encode
from ..errors import LayoutError
from . import contracts


def paged_decode(query: torch.Tensor, sources: Sequence, block_table: torch.Tensor, tier_tags,
                 start_offsets: torch.Tensor, seq_lens: torch.Tensor, scale: float):
    """Decode attention for one query token per row over paged, tiered K/V.

    query [B, Hq, D]; sources: (k, v) pairs, each [num_slots, H_kv, block_size, D]; block_table
    and tier_tags [B, max_blocks]; row b attends to positions [start_offsets[b], seq_lens[b]).
    Returns (out [B, Hq, D] in the query's dtype, lse [B, Hq] float32, natural log).
    """
    shape = contracts.check_paged_decode(query, sources, block_table, tier_tags, start_offsets, seq_lens, scale)
    device = query.device
    bs, groups = shape.block_size, shape.groups
    out = torch.zeros(shape.batch, shape.num_q_heads, shape.head_dim, dtype=torch.float32, device=device)
    lse = torch.full((shape.batch, shape.num_q_heads), float("-inf"), dtype=torch.float32, device=device)
    table = block_table.to("cpu", torch.long)
    tags = torch.zeros_like(table) if tier_tags is None else tier_tags.to("cpu", torch.long)
    starts = start_offsets.tolist()
    ends = seq_lens.tolist()
    for b in range(shape.batch):
        start, end = max(starts[b], 0), min(ends[b], shape.max_blocks * bs)
        if end <= start:
            continue
        positions = torch.arange(start, end)
        blocks, tokens = positions // bs, positions % bs
        slots, row_tags = table[b, blocks], tags[b, blocks]
        if not _entries_valid(sources, slots, row_tags):
            out[b] = float("nan")
            lse[b] = float("nan")
            continue
        keys = torch.empty(len(positions), shape.num_kv_heads, shape.head_dim, dtype=torch.float32, device=device)
        values = torch.empty_like(keys)
        for tag, (k, v) in enumerate(sources):
            picked = (row_tags == tag).nonzero().squeeze(1)
            if picked.numel() == 0:
                continue
            source_slots, source_tokens = slots[picked].to(k.device), tokens[picked].to(k.device)
            rows = picked.to(device)
            # k[slots, :, tokens] -> [n, H_kv, D]
            keys[rows] = k[source_slots, :, source_tokens].to(device, torch.float32)
            values[rows] = v[source_slots, :, source_tokens].to(device, torch.float32)
        q = query[b].to(torch.float32).view(shape.num_kv_heads, groups, shape.head_dim)
        scores = torch.einsum("hgd,nhd->hgn", q, keys) * scale
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        out[b] = torch.einsum("hgn,nhd->hgd", probs, values).reshape(shape.num_q_heads, shape.head_dim)
        lse[b] = row_lse.reshape(shape.num_q_heads)
    return out.to(query.dtype), lse


def _entries_valid(sources: Sequence, slots: torch.Tensor, row_tags: torch.Tensor) -> bool:
    if bool(((row_tags < 0) | (row_tags >= len(sources))).any()):
        return False
    for tag, (k, _) in enumerate(sources):
        picked = slots[row_tags == tag]
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= k.shape[0]):
            return False
    return True


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merges two partial attentions over disjoint keys by their LSE; returns (out, lse).

    out = (wa * out_a + wb * out_b) / (wa + wb) with w = exp(lse - max(lse_a, lse_b));
    lse = max + log(wa + wb). Both sides empty (lse -inf): out 0, lse -inf.
    """
    contracts.check_merge_states(out_a, lse_a, out_b, lse_b)
    m = torch.maximum(lse_a, lse_b)
    empty = m == float("-inf")
    safe_m = torch.where(empty, torch.zeros_like(m), m)
    wa = torch.where(empty, torch.zeros_like(m), torch.exp(lse_a - safe_m))
    wb = torch.where(empty, torch.zeros_like(m), torch.exp(lse_b - safe_m))
    total = wa + wb
    merged = (out_a.float() * wa.unsqueeze(-1) + out_b.float() * wb.unsqueeze(-1)) / torch.where(
        empty, torch.ones_like(total), total).unsqueeze(-1)
    lse = torch.where(empty, m, safe_m + torch.log(torch.where(empty, torch.ones_like(total), total)))
    return merged.to(out_a.dtype), lse


def gather_blocks(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[i] = src[slots[i]] for i < len(slots): whole blocks, any dtype."""
    contracts.check_block_copy("gather_blocks", dst, src, slots)
    indices = _slot_indices("gather_blocks", "src", slots, src.shape[0], src.device)
    dst[: len(indices)].copy_(src.index_select(0, indices))


def scatter_blocks(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[slots[i]] = src[i] for i < len(slots): whole blocks, any dtype; slots distinct."""
    contracts.check_block_copy("scatter_blocks", dst, src, slots)
    indices = _slot_indices("scatter_blocks", "dst", slots, dst.shape[0], dst.device)
    dst.index_copy_(0, indices, src[: len(indices)].to(dst.device))


def _slot_indices(op: str, name: str, slots: torch.Tensor, num_slots: int, device: torch.device) -> torch.Tensor:
    indices = slots.to(device, torch.long)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_slots):
        raise LayoutError(f"{op}: `slots` must name slots of `{name}` in [0, {num_slots}); "
                          f"got values from {int(indices.min())} to {int(indices.max())}")
    return indices


def dequant_blocks(dst: torch.Tensor, src: torch.Tensor, slots, mode: str) -> None:
    """dst[slots[i]] (or dst[i]) = the packed slices src[i] decoded (compression/packing.py)."""
    contracts.check_dequant(dst, src, slots, mode)
    src = src.to(dst.device)
    if slots is None:
        decode_torch(src, mode, dst[:src.shape[0]])
        return
    indices = _slot_indices("dequant_blocks", "dst", slots, dst.shape[0], dst.device)
    decoded = torch.empty((src.shape[0], *dst.shape[1:]), dtype=dst.dtype, device=dst.device)
    decode_torch(src, mode, decoded)
    dst.index_copy_(0, indices, decoded)


def quant_blocks(dst: torch.Tensor, src: torch.Tensor, slots, mode: str) -> None:
    """dst[i] = the layer slices src[slots[i]] (or src[i]) packed: compression/packing.py's `encode`,
    on src's device (a slot out of range raises here; the kernel skips it)."""
    contracts.check_quant(dst, src, slots, mode)
    count = dst.shape[0]
    if slots is None:
        picked = src[:count]
    else:
        picked = src.index_select(0, _slot_indices("quant_blocks", "src", slots, src.shape[0], src.device))
    dst.copy_(encode(picked, mode))
