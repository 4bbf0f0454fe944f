"""The codecs of compression/__init__.py's packed layout: vectorized torch on CPU or CUDA."""

from __future__ import annotations


import numpy as np
import torch

from . import MODES

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT4_LEVELS = 15.0
_SCALE_DTYPE = torch.float16
_SCALE_MAX = 65504.0  # largest finite float16
_MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


def _parts(mode: str, heads: int, bs: int, dim: int) -> list[tuple[str, int]]:
    """(name, bytes) of the packed slice's parts, in order."""
    codes = heads * bs * dim // (2 if mode == "int4" else 1)
    parts = [("k", codes), ("v", codes), ("k_scale", 2 * heads * dim)]
    if mode == "int4":
        parts.append(("k_zero", 2 * heads * dim))
    parts.append(("v_scale", 2 * heads * bs))
    if mode == "int4":
        parts.append(("v_zero", 2 * heads * bs))
    return parts


def _scale(amax: torch.Tensor, levels: float) -> torch.Tensor:
    """A float16 scale (kept finite) and its float32 value for quantizing."""
    return (amax / levels).clamp(max=_SCALE_MAX).to(_SCALE_DTYPE)


def _safe(scale16: torch.Tensor) -> torch.Tensor:
    scale = scale16.float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _symmetric(x: torch.Tensor, dim: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, float16 scales with `dim` reduced) of float32 `x`."""
    levels = FP8_MAX if mode == "fp8" else INT8_MAX
    scale16 = _scale(x.abs().amax(dim=dim, keepdim=True), levels)
    scaled = x / _safe(scale16)
    if mode == "fp8":
        codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(torch.uint8)
    return codes, scale16.squeeze(dim)


def _asymmetric(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 codes two per byte along the last axis, float16 scales, float16 zeros) of float32 `x`."""
    low = x.amin(dim=dim, keepdim=True)
    zero16 = low.clamp(-_SCALE_MAX, _SCALE_MAX).to(_SCALE_DTYPE)
    scale16 = _scale(x.amax(dim=dim, keepdim=True) - zero16.float(), INT4_LEVELS)
    codes = ((x - zero16.float()) / _safe(scale16)).round_().clamp_(0, INT4_LEVELS).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale16.squeeze(dim), zero16.squeeze(dim)


def encode(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Layer slices `[..., 2, H, bs, D]` (any float dtype, any device) as uint8 `[..., P]`."""
    lead, (heads, bs, dim) = x.shape[:-4], x.shape[-3:]
    x = x.float().reshape(-1, 2, heads, bs, dim)
    keys, values = x[:, 0], x[:, 1]
    if mode == "int4":
        k_codes, k_scale, k_zero = _asymmetric(keys, dim=-2)  # per channel: over the block's tokens
        v_codes, v_scale, v_zero = _asymmetric(values, dim=-1)  # per token: over head_dim
        pieces = [k_codes, v_codes, k_scale, k_zero, v_scale, v_zero]
    elif mode in ("int8", "fp8"):
        k_codes, k_scale = _symmetric(keys, -2, mode)
        v_codes, v_scale = _symmetric(values, -1, mode)
        pieces = [k_codes, v_codes, k_scale, v_scale]
    else:
        raise ValueError(f"compression {mode!r} cannot encode; allowed: {MODES[1:]}")
    n = x.shape[0]
    flat = [p.contiguous().view(torch.uint8).reshape(n, -1) for p in pieces]
    return torch.cat(flat, dim=1).reshape(*lead, -1)


def decode(packed: torch.Tensor, mode: str, heads: int, bs: int, dim: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[..., P]` back to layer slices `[..., 2, H, bs, D]` of `dtype`, on packed's device."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    n, parts, at = flat.shape[0], {}, 0
    for name, size in _parts(mode, heads, bs, dim):
        parts[name] = flat[:, at:at + size]
        at += size
    if at != flat.shape[1]:
        raise ValueError(f"compressed slice of {flat.shape[1]} bytes; {mode} with H={heads} bs={bs} D={dim} "
                         f"packs {at}")

    def halves(name: str, shape: tuple) -> torch.Tensor:
        return parts[name].contiguous().view(_SCALE_DTYPE).float().reshape(n, *shape)

    if mode == "int4":
        def unpack(codes: torch.Tensor) -> torch.Tensor:
            codes = codes.reshape(n, heads, bs, dim // 2)
            return torch.stack((codes & 15, codes >> 4), dim=-1).reshape(n, heads, bs, dim).float()
        keys = unpack(parts["k"]) * halves("k_scale", (heads, 1, dim)) + halves("k_zero", (heads, 1, dim))
        values = unpack(parts["v"]) * halves("v_scale", (heads, bs, 1)) + halves("v_zero", (heads, bs, 1))
    else:
        code_dtype = torch.float8_e4m3fn if mode == "fp8" else torch.int8

        def codes(name: str) -> torch.Tensor:
            return parts[name].contiguous().view(code_dtype).reshape(n, heads, bs, dim).float()
        keys = codes("k") * halves("k_scale", (heads, 1, dim))
        values = codes("v") * halves("v_scale", (heads, bs, 1))
    return torch.stack((keys, values), dim=1).to(dtype).reshape(*lead, 2, heads, bs, dim)


def model_dtype(dtype_name: str) -> torch.dtype:
    return _MODEL_DTYPES[dtype_name]


def pack_block_bytes(layout, block_bytes: np.ndarray) -> np.ndarray:
    """The model-dtype bytes of one block (uint8, `[L, 2, H, bs, D]` in C order) packed for the
    compressed `layout` (blocks.KVLayout with `compression` set): uint8 `layout.block_bytes`."""
    model = torch.from_numpy(np.ascontiguousarray(block_bytes).reshape(-1).view(np.uint8).copy())
    block = model.view(model_dtype(layout.dtype_name)).reshape(layout.num_layers, 2, layout.num_kv_heads,
                                                                layout.block_size, layout.head_dim)
    return encode(block, layout.compression).reshape(-1).numpy()


def unpack_block_bytes(layout, packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_block_bytes`: the block's model-dtype bytes (uint8)."""
    data = torch.from_numpy(np.ascontiguousarray(packed).reshape(layout.num_layers, -1).copy())
    block = decode(data, layout.compression, layout.num_kv_heads, layout.block_size, layout.head_dim,
                   model_dtype(layout.dtype_name))
    return block.contiguous().view(torch.uint8).reshape(-1).numpy()


def error_bound(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The largest absolute error `decode(encode(x))` may have at each element of `[..., 2, H, bs, D]`
    (for tests and the quality report): half a step of its scale group, plus the float16 rounding of
    the scale and zero; for fp8 a relative 2^-4 (3 mantissa bits) and half its smallest subnormal."""
    x = x.float()
    keys, values = x[..., 0, :, :, :], x[..., 1, :, :, :]
    if mode == "int4":
        def bound(t, dim):
            low, high = t.amin(dim=dim, keepdim=True), t.amax(dim=dim, keepdim=True)
            return (high - low) / INT4_LEVELS * 0.51 + 2 ** -10 * (low.abs() + high.abs()) + 1e-6
    elif mode == "int8":
        def bound(t, dim):
            return t.abs().amax(dim=dim, keepdim=True) * (0.51 / INT8_MAX + 2 ** -10) + 1e-6
    elif mode == "fp8":
        def bound(t, dim):
            amax = t.abs().amax(dim=dim, keepdim=True)
            return t.abs() * (2 ** -4 + 2 ** -10) + amax / FP8_MAX * 2 ** -9 + 1e-6
    else:
        return torch.zeros_like(x)
    return torch.stack((bound(keys, -2).expand_as(keys), bound(values, -1).expand_as(values)), dim=-4)
