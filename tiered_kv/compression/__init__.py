"""Compressed KV for the lower tiers: the packed bytes of one layer slice of a block, and the codecs.

Config `compression` on warm, cold and remote: `none` (the model's dtype, bitwise exact), `fp8`
(e4m3 with a scale), `int8` or `int4`. Hot always holds the model's dtype: a block is compressed
when it moves down into a compressed tier and decompressed when it is read or moved up.

One layer slice `[2, H, bs, D]` (K, V) of one block packs into `packed_layer_bytes` bytes:

    K payload   H*bs*D codes (1 byte each; int4: two per byte, along D)
    V payload   the same
    K scales    H*D float16: keys are quantized per channel (each head-dim channel of each head,
                over the block's tokens), as KIVI does: key outliers live in fixed channels
    K zeros     H*D float16, fp8 and int4 (the channel's midpoint for fp8, its minimum for int4)
    V scales    H*bs float16: values are quantized per token (over head_dim)
    V zeros     H*bs float16, int4 only

int8 is symmetric: scale = absmax / 127. fp8 centres each key channel on its midpoint first (e4m3
keeps 3 mantissa bits, so its error grows with the magnitude: on SmolLM2 the keys' channel offsets
alone cost 2 points of next-token agreement), then scales by absmax / 448 (e4m3's largest normal),
never a bare cast, so no value saturates; values are symmetric. int4 is asymmetric with 16 levels
from the minimum to the maximum. Values per token beat values per channel on SmolLM2 (next-token
agreement 99.8% against 99.2% with int8; bench/compression.py measures both). `tiered-kv quality`
measures what a mode costs a model (README: the bundled model's figures).

This module (no torch) has the modes and sizes; packing.py packs and unpacks (vectorized torch, CPU
or CUDA, no per-token Python: the native kernel's reference); codec.py is what the tiers call (it
decodes with the native kernel on a GPU). tools/quality.py measures what a mode costs a model.
"""

from __future__ import annotations

MODES = ("none", "fp8", "int8", "int4")
KEY_ZERO_MODES = ("fp8", "int4")  # modes that store a zero per key channel
VALUE_ZERO_MODES = ("int4",)  # modes that store a zero per value token


def packed_layer_bytes(num_kv_heads: int, block_size: int, head_dim: int, mode: str) -> int:
    """Bytes of one layer slice `[2, H, bs, D]` of one block in `mode` (not `none`)."""
    if mode not in MODES[1:]:
        raise ValueError(f"compression {mode!r} has no packed layout; allowed: {MODES[1:]}")
    codes = num_kv_heads * block_size * head_dim // (2 if mode == "int4" else 1)
    key_halves = num_kv_heads * head_dim * (2 if mode in KEY_ZERO_MODES else 1)
    value_halves = num_kv_heads * block_size * (2 if mode in VALUE_ZERO_MODES else 1)
    return 2 * codes + 2 * (key_halves + value_halves)


def check_shape(mode: str, head_dim: int) -> str | None:
    """Why `mode` cannot pack heads of `head_dim`, or None."""
    if mode == "int4" and head_dim % 2:
        return f"int4 packs two codes per byte along head_dim, which must be even (got {head_dim})"
    return None
