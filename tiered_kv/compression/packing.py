"""The packed layout of compression/__init__.py in torch: `encode`, and `decode_torch`, the decode that
runs on the CPU and is the reference of the native kernel (native/dequant_blocks.cu,
kernels.ops.dequant_blocks). Vectorized torch on CPU or CUDA, no per-token Python.

`encode` packs layer slices `[..., 2, H, bs, D]` into uint8 `[..., P]`; `decode_torch` unpacks them
straight into a destination of the model's dtype (any strided view). Each part is a handful of
whole-tensor passes (no temporaries the size of the output for fp32):

- int8: codes copied (converted) into the destination, multiplied by their scales in place;
- fp8: e4m3 bytes turned into float16 bit patterns with integer ops (e4m3 is float16 with 4
  exponent bits and 3 mantissa bits, so `sign | magnitude << 7` is the float16 of value / 256,
  subnormals included) and converted in one copy: torch's own float8 -> float32 cast runs ~3x
  slower than that on CPU; the scale carries the 256;
- int4: two nibbles per byte spread into two bytes in int16 passes, converted, scaled, plus a zero.

The kernels import this module (their reference and self-check); codec.py, which chooses between
the kernel and this torch path, imports the kernels: one direction.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from . import KEY_ZERO_MODES, MODES, VALUE_ZERO_MODES, packed_layer_bytes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT4_LEVELS = 15.0
_SCALE_DTYPE = torch.float16
_SCALE_MAX = 65504.0  # largest finite float16
_FP8_AS_HALF = 256.0  # an e4m3 byte read as float16 bits (see the module docstring) is value / 256


@functools.lru_cache(maxsize=64)
def parts(mode: str, heads: int, bs: int, dim: int) -> dict[str, tuple[int, int]]:
    """name -> (first byte, end byte) of the packed slice's parts, in order (compression/__init__.py)."""
    if mode not in MODES[1:]:
        raise ValueError(f"compression {mode!r} has no packed layout; allowed: {MODES[1:]}")
    codes = heads * bs * dim // (2 if mode == "int4" else 1)
    sizes = [("k", codes), ("v", codes), ("k_scale", 2 * heads * dim)]
    if mode in KEY_ZERO_MODES:
        sizes.append(("k_zero", 2 * heads * dim))
    sizes.append(("v_scale", 2 * heads * bs))
    if mode in VALUE_ZERO_MODES:
        sizes.append(("v_zero", 2 * heads * bs))
    out, at = {}, 0
    for name, size in sizes:
        out[name] = (at, at + size)
        at += size
    assert at == packed_layer_bytes(heads, bs, dim, mode), (mode, at)
    return out


def _scale16(amax: torch.Tensor, levels: float) -> torch.Tensor:
    """The float16 scale of a group whose largest magnitude (or range) is `amax` (kept finite)."""
    return (amax / levels).clamp_(max=_SCALE_MAX).to(_SCALE_DTYPE)


def _inverse(scale16: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 where the scale is 0 (an all-zero group: every code 0)."""
    scale = scale16.float()
    return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))


def _put_halves(packed: torch.Tensor, part: tuple[int, int], values16: torch.Tensor) -> None:
    packed[..., part[0]:part[1]] = values16.contiguous().view(torch.uint8).reshape(*packed.shape[:-1], -1)


def _low_high(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum over `dim`, kept as size 1 (two reductions: aminmax is ~5x slower on CPU)."""
    return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)


def _encode_symmetric(x: torch.Tensor, reduce_dim: int, mode: str, codes_out: torch.Tensor,
                      centred: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of float32 `x` into the uint8 view `codes_out` (same shape); returns float16 scales
    (and, `centred`, the float16 midpoints subtracted first) with `reduce_dim` kept as size 1."""
    low, high = _low_high(x, reduce_dim)
    zero16 = None
    if centred:
        zero16 = ((low + high) * 0.5).clamp_(-_SCALE_MAX, _SCALE_MAX).to(_SCALE_DTYPE)
        zero = zero16.float()
        x = x - zero
        low, high = low - zero, high - zero
    scale16 = _scale16(torch.maximum(low.neg_(), high), FP8_MAX if mode == "fp8" else INT8_MAX)
    scaled = x * _inverse(scale16)
    if mode == "fp8":
        codes_out.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-FP8_MAX, FP8_MAX))
    else:
        codes_out.view(torch.int8).copy_(scaled.round_().clamp_(-INT8_MAX, INT8_MAX))
    return scale16, zero16


def _encode_int4(x: torch.Tensor, reduce_dim: int, codes_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of float32 `x` `[..., D]`, two per byte along D, into `codes_out`
    `[..., D / 2]`; returns float16 (scales, zeros) with `reduce_dim` kept as size 1."""
    low, high = _low_high(x, reduce_dim)
    zero16 = low.clamp_(-_SCALE_MAX, _SCALE_MAX).to(_SCALE_DTYPE)
    zero = zero16.float()
    scale16 = _scale16(high - zero, INT4_LEVELS)
    codes = (x - zero).mul_(_inverse(scale16)).round_().clamp_(0, INT4_LEVELS).to(torch.uint8)
    pairs = codes.view(torch.int16)  # little-endian: an even element in the low byte, the odd one in the high
    codes_out.copy_(pairs.bitwise_and(0x0F).bitwise_or_(pairs.bitwise_right_shift(4).bitwise_and_(0xF0)))
    return scale16, zero16


def encode(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Layer slices `[..., 2, H, bs, D]` (any float dtype, any device) as uint8 `[..., P]` there.

    Keys are quantized per channel (over the block's tokens), values per token (over head_dim)."""
    lead, (heads, bs, dim) = x.shape[:-4], x.shape[-3:]
    layout = parts(mode, heads, bs, dim)
    x = x.float().contiguous()
    keys, values = x[..., 0, :, :, :], x[..., 1, :, :, :]
    packed = torch.empty(*lead, packed_layer_bytes(heads, bs, dim, mode), dtype=torch.uint8, device=x.device)
    per_code = (heads, bs, dim // 2) if mode == "int4" else (heads, bs, dim)

    def codes(name: str) -> torch.Tensor:
        first, end = layout[name]
        return packed[..., first:end].unflatten(-1, per_code)

    if mode == "int4":
        k_scale, k_zero = _encode_int4(keys, -2, codes("k"))
        v_scale, v_zero = _encode_int4(values, -1, codes("v"))
        _put_halves(packed, layout["v_zero"], v_zero)
    else:
        k_scale, k_zero = _encode_symmetric(keys, -2, mode, codes("k"), centred=mode in KEY_ZERO_MODES)
        v_scale, _ = _encode_symmetric(values, -1, mode, codes("v"))
    if mode in KEY_ZERO_MODES:
        _put_halves(packed, layout["k_zero"], k_zero)
    _put_halves(packed, layout["k_scale"], k_scale)
    _put_halves(packed, layout["v_scale"], v_scale)
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


def _codes_into(packed: torch.Tensor, mode: str, name: str, shape: tuple[int, int, int], out: torch.Tensor) -> None:
    """One part's codes, converted to numbers, into `out` (`[..., H, bs, D]`, any strides)."""
    first, end = parts(mode, *shape)[name]
    raw = packed[..., first:end]
    if mode == "int8":
        out.copy_(raw.view(torch.int8).unflatten(-1, shape))
    elif mode == "fp8":
        out.copy_(_fp8_as_half(raw).unflatten(-1, shape))
    else:
        out.copy_(_int4_as_bytes(raw).unflatten(-1, shape))


def decode_torch(packed: torch.Tensor, mode: str, out: torch.Tensor) -> None:
    """`decode_into` in torch ops (any device): the CPU path and the native kernel's reference."""
    heads, bs, dim = out.shape[-3:]
    layout = parts(mode, heads, bs, dim)
    target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    keys, values = target[..., 0, :, :, :], target[..., 1, :, :, :]
    shape = (heads, bs, dim)
    # every scale and zero sits after the codes: one float32 copy of them all, sliced per part
    first_half = layout["k_scale"][0]
    halves = packed[..., first_half:].contiguous().view(_SCALE_DTYPE).float()

    def part(name: str, group: tuple[int, int, int]) -> torch.Tensor:
        first, end = layout[name]
        return halves[..., (first - first_half) // 2:(end - first_half) // 2].unflatten(-1, group)

    k_scale, v_scale = part("k_scale", (heads, 1, dim)), part("v_scale", (heads, bs, 1))
    if mode == "fp8":
        halves.mul_(_FP8_AS_HALF)  # the codes are read as value / 256 (zeros are scaled back below)
    _codes_into(packed, mode, "k", shape, keys)
    keys.mul_(k_scale)  # code * scale, rounded, then + zero: the same two roundings as the native kernel
    if mode in KEY_ZERO_MODES:
        zero = part("k_zero", (heads, 1, dim))
        keys.add_(zero / _FP8_AS_HALF if mode == "fp8" else zero)
    _codes_into(packed, mode, "v", shape, values)
    values.mul_(v_scale)
    if mode in VALUE_ZERO_MODES:
        values.add_(part("v_zero", (heads, bs, 1)))
    if target is not out:
        out.copy_(target)
