"""The packed layout of compression/__init__.py in torch: `encode`, and `decode_torch`, the decode that
runs on the CPU and is the reference of the native kernels (native/dequant_blocks.cu and
native/quant_blocks.cu). Vectorized torch on CPU or CUDA, no per-token Python.

`encode` packs layer slices `[..., 2, H, bs, D]` into uint8 `[..., P]`; `decode_torch` unpacks them
straight into a destination of the model's dtype (any strided view). Each group format is a few
whole-tensor passes; a product and its zero are two roundings (`code * scale`, then `+ zero`), as the
native kernels compute them, so both give the same bits:

- int8 (symmetric): the codes times their scale, read straight from the int8 bytes in one pass;
- uint8 (asymmetric): the same with a zero (the group's minimum) added;
- int4: two nibbles per byte spread into two bytes in int16 passes, then as uint8;
- fp8 / fp8c (e4m3, fp8c centred on the group's midpoint): e4m3 bytes turned into float16 bit patterns
  with integer ops (e4m3 is float16 with 4 exponent bits and 3 mantissa bits, so `sign | magnitude << 7`
  is the float16 of value / 256, subnormals included), multiplied by 256 x the scale: exact rescalings,
  the same product. torch's own float8 -> float32 cast runs ~3x slower than that on CPU.

The kernels import this module (their reference and self-check); codec.py, which chooses between
the kernels and this torch path, imports the kernels: one direction.
"""

from __future__ import annotations

import math
import threading

import torch

from . import MODES, layout_parts, mode_spec, packed_layer_bytes, parts  # noqa: F401  (parts: re-exported)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
LEVELS = {"uint8": 255.0, "int4": 15.0}
INT4_LEVELS = LEVELS["int4"]
_SCALE_DTYPE = torch.float16
_SCALE_MAX = 65504.0  # largest finite float16
_FP8_AS_HALF = 256.0  # an e4m3 byte read as float16 bits (see the module docstring) is value / 256


def _half(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16, kept finite (the stored scales and zeros)."""
    return x.clamp_(-_SCALE_MAX, _SCALE_MAX).to(_SCALE_DTYPE)


def _inverse(scale16: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 where the scale is 0 (a constant group: every code 0)."""
    scale = scale16.float()
    return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))


def _low_high(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum over `dim`, kept as size 1 (two reductions: aminmax is ~5x slower on CPU)."""
    return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)


def _encode_group(x: torch.Tensor, dim: int, fmt: str, codes_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of float32 `x`, each group the elements along `dim`, into the uint8 view `codes_out`
    (x's shape; int4: the last dim halved); returns float16 (scale, zero or None), `dim` kept as 1."""
    low, high = _low_high(x, dim)
    zero16 = None
    if fmt in ("uint8", "int4"):
        zero16 = _half(low)
        zero = zero16.float()
        scale16 = _half((high - zero) / LEVELS[fmt])
        codes = (x - zero).mul_(_inverse(scale16)).round_().clamp_(0, LEVELS[fmt]).to(torch.uint8)
        if fmt == "uint8":
            codes_out.copy_(codes)
        else:
            pairs = codes.contiguous().view(torch.int16)  # little-endian: an even element in the low byte, the odd one in the high
            codes_out.copy_(pairs.bitwise_and(0x0F).bitwise_or_(pairs.bitwise_right_shift(4).bitwise_and_(0xF0)))
        return scale16, zero16
    if fmt == "fp8c":
        zero16 = _half((low + high) * 0.5)
        zero = zero16.float()
        x = x - zero
        low, high = low - zero, high - zero
    scale16 = _half(torch.maximum(low.neg_(), high) / (INT8_MAX if fmt == "int8" else FP8_MAX))
    scaled = x * _inverse(scale16)
    if fmt == "int8":
        codes_out.view(torch.int8).copy_(scaled.round_().clamp_(-INT8_MAX, INT8_MAX))
    else:
        codes_out.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-FP8_MAX, FP8_MAX))
    return scale16, zero16


def encode(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Layer slices `[..., 2, H, bs, D]` (any float dtype, any device) as uint8 `[..., P]` there."""
    lead, (heads, bs, dim) = x.shape[:-4], x.shape[-3:]
    spec, layout = mode_spec(mode, dim, bs), layout_parts(mode, heads, bs, dim)
    x = x.float().contiguous()
    packed = torch.zeros(*lead, packed_layer_bytes(heads, bs, dim, mode), dtype=torch.uint8, device=x.device)
    first = 1 if spec.row0 else 0
    rows, groups = bs - first, dim // spec.value_group

    def part(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        lo, hi = layout[name]
        return packed[..., lo:hi].unflatten(-1, shape)

    def put(name: str, halves: torch.Tensor | None) -> None:
        if halves is not None:
            lo, hi = layout[name]
            packed[..., lo:hi] = halves.contiguous().view(torch.uint8).reshape(*lead, hi - lo)

    if rows:
        half_d = dim // 2 if spec.key == "int4" else dim
        k_scale, k_zero = _encode_group(x[..., 0, :, first:, :], -2, spec.key, part("k", (heads, rows, half_d)))
        values = x[..., 1, :, first:, :].unflatten(-1, (groups, spec.value_group))
        v_codes = part("v", (heads, rows, groups, spec.value_group // (2 if spec.value == "int4" else 1)))
        v_scale, v_zero = _encode_group(values, -1, spec.value, v_codes)
        put("k_scale", k_scale), put("k_zero", k_zero), put("v_scale", v_scale), put("v_zero", v_zero)
    if spec.row0 == "fp8":  # token 0 of the block, keys and values: e4m3 per (K/V, head) over head_dim
        r0_scale, _ = _encode_group(x[..., :, :, 0, :], -1, "fp8", part("r0", (2, heads, dim)))
        put("r0_scale", r0_scale)
    elif spec.row0 == "f16":  # token 0 as float16 values
        put("r0", _half(x[..., :, :, 0, :].clone()))
    return packed


class _Scratch(threading.local):
    """Per thread, int16 buffers that only grow, for the bit work of fp8 and int4 decodes: a fresh
    temporary of a layer's codes (~0.7 MiB at 2,000 tokens) comes from mmap and costs its page
    faults on every call, more than the arithmetic on it."""

    def __init__(self):
        self.buffers: dict[tuple[int, torch.device], torch.Tensor] = {}

    def int16(self, which: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (which, device)
        flat = self.buffers.get(key)
        if flat is None or flat.numel() < numel:
            flat = self.buffers[key] = torch.empty(max(numel, 1 << 16), dtype=torch.int16, device=device)
        return flat[:numel].view(shape)


_scratch = _Scratch()


def _fp8_as_half(raw: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) as the float16 of value / 256: sign to bit 15, the rest shifted by 7
    (a per-thread scratch buffer: use it before the next call)."""
    bits = _scratch.int16(0, tuple(raw.shape), raw.device)
    bits.copy_(raw.view(torch.int8))  # sign-extended: bit 14 holds the sign after the shift
    return bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)


def _int4_as_bytes(raw: torch.Tensor) -> torch.Tensor:
    """Packed nibbles `[..., n]` as one byte each `[..., 2n]`, low nibble first (per-thread scratch)."""
    wide = _scratch.int16(0, tuple(raw.shape), raw.device)
    low = _scratch.int16(1, tuple(raw.shape), raw.device)
    wide.copy_(raw)
    torch.bitwise_and(wide, 0x0F, out=low)
    return low.bitwise_or_(wide.bitwise_left_shift_(4).bitwise_and_(0x0F00)).view(torch.uint8)


def _decode_group(raw: torch.Tensor, fmt: str, shape: tuple[int, ...], scale: torch.Tensor,
                  zero: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = codes * scale (+ zero): `raw` the part's bytes `[..., n]`, `shape` the codes' shape
    after the leading dims, scale and zero broadcast to it (float32; fp8's scale carries the 256)."""
    if fmt == "int8":
        codes = raw.view(torch.int8)
    elif fmt == "uint8":
        codes = raw
    elif fmt == "int4":
        codes = _int4_as_bytes(raw)
    else:
        codes = _fp8_as_half(raw)
    torch.mul(codes.unflatten(-1, shape), scale, out=out)
    if zero is not None:
        out.add_(zero)


def decode_torch(packed: torch.Tensor, mode: str, out: torch.Tensor) -> None:
    """`decode_into` in torch ops (any device): the CPU path and the native kernels' reference."""
    heads, bs, dim = out.shape[-3:]
    spec, layout = mode_spec(mode, dim, bs), layout_parts(mode, heads, bs, dim)
    target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    first = 1 if spec.row0 else 0
    rows, groups, g = bs - first, dim // spec.value_group, spec.value_group
    # every scale and zero sits after the codes: one float32 copy of them all, sliced per part
    first_half = layout.first_half
    halves = packed[..., first_half:].contiguous().view(_SCALE_DTYPE).float()

    def side(name: str, shape: tuple[int, ...], fp8_scale: bool = False) -> torch.Tensor | None:
        if name not in layout:
            return None
        lo, hi = layout[name]
        values = halves[..., (lo - first_half) // 2:(hi - first_half) // 2].unflatten(-1, shape)
        return values * _FP8_AS_HALF if fp8_scale else values

    def raw(name: str) -> torch.Tensor:
        lo, hi = layout[name]
        return packed[..., lo:hi]

    if rows:
        k_fp8, v_fp8 = spec.key.startswith("fp8"), spec.value.startswith("fp8")
        _decode_group(raw("k"), spec.key, (heads, rows, dim), side("k_scale", (heads, 1, dim), k_fp8),
                      side("k_zero", (heads, 1, dim)), target[..., 0, :, first:, :])
        _decode_group(raw("v"), spec.value, (heads, rows, groups, g), side("v_scale", (heads, rows, groups, 1), v_fp8),
                      side("v_zero", (heads, rows, groups, 1)),
                      target[..., 1, :, first:, :].unflatten(-1, (groups, g)))
    if spec.row0 == "fp8":
        _decode_group(raw("r0"), "fp8", (2, heads, dim), side("r0_scale", (2, heads, 1), True), None,
                      target[..., :, :, 0, :])
    elif spec.row0 == "f16":
        target[..., :, :, 0, :] = side("r0", (2, heads, dim))
    if target is not out:
        out.copy_(target)
