"""Compressed KV for the lower tiers: the packed bytes of one layer slice of a block, and the codecs.

Config `compression` on warm, cold and remote: `none` (the model's dtype, bitwise exact), `int8`,
`fp8`, `int4`, or `auto` (the smallest of them that meets `compression.quality_floor` on the model:
calibration.py). Hot always holds the model's dtype: a block is compressed when it moves down into a
compressed tier and decompressed when it is read or moved up.

Each mode was chosen by measurement (bench/quantizers.py: 2 real models x 4 kinds of text, the worst
case kept): over 2,048 teacher-forced positions with ~95% of the history compressed.

- **Token 0 of every block** (K and V), in fp8 and int4, is stored apart: float16 values (fp8) or
  e4m3 with a scale per (K/V, head) (int4), and the block's other tokens are quantized without it. In
  block 0 this is the attention sink, which draws much of every head's attention: quantized with the
  rest it cost int4 1.5-2 points of next-token agreement alone. int8 keeps it with the others
  (apart, as int8 or e4m3 rows, it cost Gemma 3 0.5-1 point: its keys have outlier channels).
- **Keys per channel** (each head-dim channel of each head, over the block's other tokens), as KIVI
  does: key outliers live in fixed channels. int8 keys are asymmetric (a zero per channel: +0.4 to
  +0.6 points on dialogue over symmetric); fp8 keys are centred on the channel's midpoint (e4m3 has 3
  mantissa bits, so its error grows with the distance from it); int4 keys are asymmetric.
- **Values per token**, over head_dim (int8, fp8: symmetric) or groups of 32 of it (int4, asymmetric).

One layer slice `[2, H, bs, D]` (K, V) packs into `packed_layer_bytes` bytes, in this order (r rows
quantized in groups: bs - 1 when token 0 is apart, else bs; G value groups): K codes `[H, r, D]`, V
codes `[H, r, G, D/G]` (1 byte each; int4: two per byte along D), token-0 codes `[2, H, D]` (int4:
e4m3), a pad byte to an even offset if needed, then float16s: token 0 `[2, H, D]` (fp8), K scales
`[H, D]`, K zeros `[H, D]` (all three modes), V scales `[H, r, G]`, V zeros (int4), token-0 scales
`[2, H]` (int4). Decoded: `code * scale`, rounded, then `+ zero`, in float32.

`CODEC_VERSION` names this layout: a change of it is a new cold format version (tiers/cold_format.py),
so records of another layout are never read as this one (they are recomputed).

This module (no torch) has the modes, specs and sizes; packing.py packs and unpacks (vectorized
torch, CPU or CUDA: the native kernels' reference); codec.py is what the tiers call (it runs the
native kernels on a GPU); calibration.py measures what a mode costs a model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

MODES = ("none", "fp8", "int8", "int4")
AUTO = "auto"  # a tier config value: the mode calibration picks (calibration.py)
CODEC_VERSION = 3  # the packed layout below (2: issue 21's, per-token values, no token-0 rows)
CALIBRATION_METHOD = "kl1"  # how calibration.py derives a mode's agreement: part of a recorded entry's key
INT4_VALUE_GROUP = 32  # int4 values are quantized in groups of this many head_dim channels (when D allows)


@dataclass(frozen=True)
class ModeSpec:
    """How one mode quantizes: the group formats of keys and values, the values' group size along
    head_dim, and how token 0 of each block is stored when it has rows of its own (`row0`: None,
    "fp8": e4m3 with a float16 scale per (K/V, head), "f16": float16 values).

    Group formats: int8 (symmetric), uint8 (asymmetric: a zero, the group's minimum), int4
    (asymmetric, two per byte), fp8 (e4m3, symmetric), fp8c (e4m3 centred on the midpoint)."""
    key: str
    value: str
    value_group: int
    row0: str | None


_FORMATS = {"int8": ("uint8", "int8", None), "fp8": ("fp8c", "fp8", "f16"), "int4": ("int4", "int4", "fp8")}
_ZERO_FORMATS = ("uint8", "int4", "fp8c")
_BITS = {"int8": 8, "uint8": 8, "fp8": 8, "fp8c": 8, "int4": 4}


def mode_spec(mode: str, head_dim: int, block_size: int) -> ModeSpec:
    if mode not in _FORMATS:
        raise ValueError(f"compression {mode!r} has no packed layout; allowed: {MODES[1:]}")
    key, value, row0 = _FORMATS[mode]
    group = INT4_VALUE_GROUP if mode == "int4" and head_dim % INT4_VALUE_GROUP == 0 else head_dim
    return ModeSpec(key, value, group, row0 if block_size >= 2 else None)


class LayoutParts(dict):
    """name -> (first byte, end byte) of a packed slice's parts, in order; `first_half` is where
    the float16s start and `size` the slice's bytes."""
    first_half: int
    size: int


@functools.lru_cache(maxsize=256)
def layout_parts(mode: str, heads: int, bs: int, dim: int) -> LayoutParts:
    spec = mode_spec(mode, dim, bs)
    rows = bs - 1 if spec.row0 else bs
    groups = dim // spec.value_group
    codes = [("k", heads * rows * dim * _BITS[spec.key] // 8), ("v", heads * rows * dim * _BITS[spec.value] // 8)]
    halves = []
    if spec.row0 == "fp8":
        codes.append(("r0", 2 * heads * dim))
    elif spec.row0 == "f16":
        halves.append(("r0", 2 * heads * dim))
    if rows:
        halves.append(("k_scale", heads * dim))
        if spec.key in _ZERO_FORMATS:
            halves.append(("k_zero", heads * dim))
        halves.append(("v_scale", heads * rows * groups))
        if spec.value in _ZERO_FORMATS:
            halves.append(("v_zero", heads * rows * groups))
    if spec.row0 == "fp8":
        halves.append(("r0_scale", 2 * heads))
    out, at = LayoutParts(), 0
    for name, size in codes:
        out[name] = (at, at + size)
        at += size
    at += at % 2  # float16s start at an even offset
    out.first_half = at
    for name, count in halves:
        out[name] = (at, at + 2 * count)
        at += 2 * count
    out.size = at
    return out


def parts(mode: str, heads: int, bs: int, dim: int) -> LayoutParts:
    """The parts of a packed slice (`layout_parts`; the name the kernels' checks use)."""
    return layout_parts(mode, heads, bs, dim)


def packed_layer_bytes(num_kv_heads: int, block_size: int, head_dim: int, mode: str) -> int:
    """Bytes of one layer slice `[2, H, bs, D]` of one block in `mode` (not `none`)."""
    if mode not in MODES[1:]:
        raise ValueError(f"compression {mode!r} has no packed layout; allowed: {MODES[1:]}")
    problem = check_shape(mode, head_dim)
    if problem:
        raise ValueError(problem)
    return layout_parts(mode, num_kv_heads, block_size, head_dim).size


def check_shape(mode: str, head_dim: int) -> str | None:
    """Why `mode` cannot pack heads of `head_dim`, or None."""
    if mode == "int4" and head_dim % 2:
        return f"int4 packs two codes per byte along head_dim, which must be even (got {head_dim})"
    return None
