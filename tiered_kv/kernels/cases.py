"""Random paged-decode inputs laid out exactly as the tiers lay them, with the dense K/V they encode.

Used by the self-check and the tests. Sources follow the repository's slabs: hot is a view of
a `[L, 2, H, S*bs, D]` slab (strided slots), warm a `[S, L, 2, H, bs, D]` slab (pinned when the
device is CUDA, read through UVA), staging a contiguous `[S, H, bs, D]` buffer. Every slab
position that no row may read (left padding, past seq_len, unused slots) holds NaN, and table
entries that must not be read hold slot -1 with an invalid tier tag, so a kernel that reads
outside its rows' ranges returns NaN instead of a plausible number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

TIERS = ("hot", "warm", "staging")  # tier tag = index
_NUM_LAYERS = 2
_LAYER = 1  # the layer the case reads (not 0, so a wrong layer offset shows)
_UNREAD_TAG = 7  # an invalid tag in entries past a row's tokens: reading one poisons the row


@dataclass
class DecodeCase:
    query: torch.Tensor  # [B, Hq, D], strided (a permuted view)
    sources: list  # (k, v) per tier tag
    block_table: torch.Tensor  # int32 [B, max_blocks]
    tier_tags: torch.Tensor | None  # int8/int32 [B, max_blocks]
    start_offsets: torch.Tensor  # int32 [B]
    seq_lens: torch.Tensor  # int32 [B]
    scale: float
    keys: torch.Tensor = field(repr=False)  # [B, H_kv, T, D] float32 (values as stored)
    values: torch.Tensor = field(repr=False)
    valid: torch.Tensor = field(repr=False)  # [B, T] bool: positions each row attends to

    def args(self) -> tuple:
        return (self.query, self.sources, self.block_table, self.tier_tags, self.start_offsets, self.seq_lens,
                self.scale)


def make_sources(tiers_used: int, num_slots: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fill: float = float("nan")) -> list:
    """(k, v) pairs for tags 0..tiers_used-1 in the repository's slab layouts, every element `fill`."""
    sources = []
    shape = (num_slots, num_kv_heads, block_size, head_dim)
    for tag in range(tiers_used):
        if TIERS[tag] == "hot":
            slab = torch.full((_NUM_LAYERS, 2, num_kv_heads, num_slots * block_size, head_dim), fill, dtype=dtype,
                              device=device)
            k, v = (slab[_LAYER, i].view(num_kv_heads, num_slots, block_size, head_dim).permute(1, 0, 2, 3)
                    for i in (0, 1))
        elif TIERS[tag] == "warm":
            slab = torch.full((num_slots, _NUM_LAYERS, 2, num_kv_heads, block_size, head_dim), fill, dtype=dtype,
                              pin_memory=device.type == "cuda")
            k, v = slab[:, _LAYER, 0], slab[:, _LAYER, 1]
        else:
            k, v = (torch.full(shape, fill, dtype=dtype, device=device) for _ in (0, 1))
        sources.append((k, v))
    return sources


def build_decode_case(*, batch: int = 3, num_kv_heads: int = 2, groups: int = 2, head_dim: int = 64,
                      block_size: int = 16, dtype: torch.dtype = torch.float32, tiers=("hot",),
                      max_tokens: int = 50, left_pad: bool = True, tag_dtype: torch.dtype = torch.int8,
                      device="cpu", seed: int = 0) -> DecodeCase:
    """A case whose rows' blocks are spread over `tiers` at scattered slots (see module doc)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * groups
    seq_lens = [max_tokens] + [int(torch.randint(1, max_tokens + 1, (1,), generator=gen)) for _ in range(batch - 1)]
    starts = [int(torch.randint(0, n, (1,), generator=gen)) if left_pad else 0 for n in seq_lens]
    if left_pad and max_tokens > block_size + 3:
        starts[0] = block_size + 3  # a whole block of padding, then a partial one
    max_blocks = math.ceil(max_tokens / block_size) + 1  # + a column no row reaches
    tags_used = [TIERS.index(t) for t in tiers]
    num_sources = max(tags_used) + 1
    num_slots = batch * max_blocks + 3
    sources = make_sources(num_sources, num_slots, num_kv_heads, block_size, head_dim, dtype, device)
    free_slots = [torch.randperm(num_slots, generator=gen).tolist() for _ in range(num_sources)]

    keys = torch.randn(batch, num_kv_heads, max_tokens, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, num_kv_heads, max_tokens, head_dim, generator=gen).to(dtype)
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    tags = torch.full((batch, max_blocks), _UNREAD_TAG, dtype=tag_dtype)
    valid = torch.zeros(batch, max_tokens, dtype=torch.bool)
    for b in range(batch):
        valid[b, starts[b]:seq_lens[b]] = True
        for j in range(math.ceil(seq_lens[b] / block_size)):
            first, last = max(j * block_size, starts[b]), min((j + 1) * block_size, seq_lens[b])
            if first >= last:
                continue  # a block of padding only: never read, so left as (-1, invalid tag)
            tag = tags_used[int(torch.randint(0, len(tags_used), (1,), generator=gen))]
            slot = free_slots[tag].pop()
            table[b, j], tags[b, j] = slot, tag
            k, v = sources[tag]
            tokens = slice(first - j * block_size, last - j * block_size)
            k[slot, :, tokens] = keys[b, :, first:last].to(k.device)
            v[slot, :, tokens] = values[b, :, first:last].to(v.device)

    query = torch.randn(num_q_heads, batch, head_dim, generator=gen).to(dtype).to(device).permute(1, 0, 2)
    return DecodeCase(
        query=query, sources=sources, block_table=table.to(device), tier_tags=tags.to(device),
        start_offsets=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=1.0 / math.sqrt(head_dim),
        keys=keys.float(), values=values.float(), valid=valid,
    )
