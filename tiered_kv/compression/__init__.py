"""Compressed KV for the lower tiers: the packed bytes of one layer slice of a block, and the codecs.

Config `compression` on warm, cold and remote: `none` (the model's dtype, bitwise exact), `fp8`
(e4m3 with a scale), `int8` or `int4`. Hot always holds the model's dtype: a block is compressed
when it moves down into a compressed tier and decompressed when it is read or moved up.

One layer slice `[2, H, bs, D]` (K, V) of one block packs into `packed_layer_bytes` bytes:

    K payload   H*bs*D codes (1 byte each; int4: two per byte, along D)
    V payload   the same
    K scales    H*D float16: keys are quantized per channel (each head-dim channel of each head,
                over the block's tokens), as KIVI does: key outliers live in fixed channels
    K zeros     H*D float16, int4 only (asymmetric: code 0 is the channel's minimum)
    V scales    H*bs float16: values are quantized per token (over head_dim)
    V zeros     H*bs float16, int4 only

fp8 and int8 are symmetric: scale = absmax / 448 (e4m3's largest normal) or / 127, never a bare
cast, so no value saturates. int4 is asymmetric with 16 levels from the minimum to the maximum.
`tiered-kv quality` measures what this costs a model (README: the bundled model's figures).

This module (no torch) has the modes and sizes; codec.py packs and unpacks (vectorized torch, CPU
or CUDA, no per-token Python); quality.py measures what a mode costs a model.
"""

from __future__ import annotations

MODES = ("none", "fp8", "int8", "int4")


def packed_layer_bytes(num_kv_heads: int, block_size: int, head_dim: int, mode: str) -> int:
    """Bytes of one layer slice `[2, H, bs, D]` of one block in `mode` (not `none`)."""
    codes = num_kv_heads * block_size * head_dim
    if mode == "int4":
        return 2 * (codes // 2) + 2 * 2 * num_kv_heads * (head_dim + block_size)
    if mode in ("int8", "fp8"):
        return 2 * codes + 2 * num_kv_heads * (head_dim + block_size)
    raise ValueError(f"compression {mode!r} has no packed layout; allowed: {MODES[1:]}")


def check_shape(mode: str, head_dim: int) -> str | None:
    """Why `mode` cannot pack heads of `head_dim`, or None."""
    if mode == "int4" and head_dim % 2:
        return f"int4 packs two codes per byte along head_dim, which must be even (got {head_dim})"
    return None
