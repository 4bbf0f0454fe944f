"""The codecs of compression/__init__.py's packed layout, as the tiers call them.

`encode` packs layer slices `[..., 2, H, bs, D]` into uint8 `[..., P]` (`encode_into`: into a given
buffer); `decode_into` unpacks them straight into a destination of the model's dtype (a stream
buffer, the hot slab's slots: any strided view), `decode` into a new tensor. A decode step over
history in a compressed warm tier runs `decode_into` for every layer; a demotion into a compressed
tier runs `encode` where the blocks are. The torch work is packing.py's (`encode`, `decode_torch`:
vectorized, CPU or CUDA); on CUDA the native kernels do each in one pass and are taken when the data
is on a GPU and the kernels run there: native/quant_blocks.cu (kernels.ops.quant_blocks: the bytes
packing.encode makes on the CPU) and native/dequant_blocks.cu (kernels.ops.dequant_blocks). On the
CPU both are packing.py's. Imports go one way: codec -> kernels -> packing.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import get_ops
from . import MODES, layout_parts, mode_spec, packed_layer_bytes
from .packing import FP8_MAX, INT4_LEVELS, INT8_MAX, decode_torch, parts  # noqa: F401  (codec's names)
from .packing import encode as encode_torch

_MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# device types whose tensors the native kernels take when they run there (tests add "cpu" to drive
# the kernels' host build, tests/kernel_emulation.py, through this module)
NATIVE_DEVICE_TYPES = ("cuda",)


def encode(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Layer slices `[..., 2, H, bs, D]` (any float dtype, any strides) packed as uint8 `[..., P]` on
    x's device: native/quant_blocks.cu on a GPU whose kernels run there, else packing.encode."""
    if x.device.type in NATIVE_DEVICE_TYPES:
        heads, bs, dim = x.shape[-3:]
        out = torch.empty(*x.shape[:-4], packed_layer_bytes(heads, bs, dim, mode), dtype=torch.uint8, device=x.device)
        if _native_encode(x, mode, out):
            return out
    return encode_torch(x, mode)


def encode_into(x: torch.Tensor, mode: str, out: torch.Tensor) -> None:
    """`encode` into uint8 `out` `[..., P]` (x's leading dims, P stride 1): on x's device, or pinned
    host memory that the kernel writes through UVA when x is on a GPU (a compressed warm slab)."""
    heads, bs, dim = x.shape[-3:]
    expected = (*x.shape[:-4], packed_layer_bytes(heads, bs, dim, mode))
    if tuple(out.shape) != expected or out.dtype != torch.uint8:
        raise ValueError(f"encode_into: out must be uint8 {list(expected)} for {mode} slices {list(x.shape)}; "
                         f"got {out.dtype} {list(out.shape)}")
    if x.device.type in NATIVE_DEVICE_TYPES and _native_encode(x, mode, out):
        return
    out.copy_(encode_torch(x, mode))


def decode_into(packed: torch.Tensor, mode: str, out: torch.Tensor) -> None:
    """uint8 `[..., P]` unpacked into `out` `[..., 2, H, bs, D]` (the same leading dims; any
    strides with D contiguous, any float dtype, on packed's device)."""
    heads, bs, dim = out.shape[-3:]
    expected = packed_layer_bytes(heads, bs, dim, mode)
    if packed.shape[-1] != expected:
        raise ValueError(f"compressed slice of {packed.shape[-1]} bytes; {mode} with H={heads} bs={bs} D={dim} "
                         f"packs {expected}")
    if out.is_cuda and _native_decode(packed, mode, out):
        return
    decode_torch(packed, mode, out)


def decode(packed: torch.Tensor, mode: str, heads: int, bs: int, dim: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[..., P]` back to layer slices `[..., 2, H, bs, D]` of `dtype`, on packed's device."""
    out = torch.empty(*packed.shape[:-1], 2, heads, bs, dim, dtype=dtype, device=packed.device)
    decode_into(packed, mode, out)
    return out


def reads_pinned_in_place(device) -> bool:
    """Whether a decode into `device` reads packed bytes in pinned host memory where they lie (the
    native kernel through UVA), so they need no copy to the device first."""
    if torch.device(device).type != "cuda":
        return False
    return get_ops().backend == "cuda"


def _native_decode(packed: torch.Tensor, mode: str, out: torch.Tensor) -> bool:
    """Decode on the GPU with native/dequant_blocks.cu when the kernels run here and the tensors
    fit its contract (`[n, L, P]` into `[n, L, 2, H, bs, D]`, or one layer: `[n, P]` into
    `[n, 2, H, bs, D]`); False: the torch path runs."""
    ops = get_ops()
    if ops.backend != "cuda":
        return False
    if out.dim() == 5 and packed.dim() == 2:
        out, packed = out.unsqueeze(1), packed.unsqueeze(1)
    if out.dim() != 6 or packed.dim() != 3 or packed.shape[:2] != out.shape[:2] or packed.data_ptr() % 2 \
            or packed.stride(0) % 2 or packed.stride(1) % 2 or packed.stride(2) != 1 \
            or out.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
            or not (packed.device == out.device or (packed.device.type == "cpu" and packed.is_pinned())):
        return False
    ops.dequant_blocks(out, packed, None, mode)
    return True


def _native_encode(x: torch.Tensor, mode: str, out: torch.Tensor) -> bool:
    """Encode with native/quant_blocks.cu when the kernels run here and the tensors fit its contract
    (`[n, L, 2, H, bs, D]` into `[n, L, P]`, `[n, 2, H, bs, D]` into `[n, P]` or one slice); False:
    the torch path runs."""
    ops = get_ops()
    if ops.backend != "cuda" or x.dim() - out.dim() != 3 or not 4 <= x.dim() <= 6:
        return False
    while x.dim() < 6:  # the kernel's [n, L] leading dims
        x, out = x.unsqueeze(-5), out.unsqueeze(-2)
    if x.shape[:2] != out.shape[:2] or x.dtype not in _KERNEL_DTYPES or (x.shape[-1] > 1 and x.stride(-1) != 1) \
            or out.data_ptr() % 2 or out.stride(0) % 2 or out.stride(1) % 2 or out.stride(2) != 1 \
            or not (out.device == x.device or (out.device.type == "cpu" and out.is_pinned())):
        return False
    ops.quant_blocks(out, x, None, mode)
    return True


def model_dtype(dtype_name: str) -> torch.dtype:
    return _MODEL_DTYPES[dtype_name]


def scales_finite(layout, packed) -> bool:
    """Whether every float16 scale and zero of packed slices (uint8, `[..., P]` of the compressed
    `layout`, numpy or torch) is finite. A record whose checksum holds but whose scales are NaN or
    infinite (a writer's bug, a foreign file) fails this check and is recomputed, never decoded."""
    lay = layout_parts(layout.compression, layout.num_kv_heads, layout.block_size, layout.head_dim)
    raw = packed.numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed)
    halves = np.ascontiguousarray(raw[..., lay.first_half:lay.size]).view(np.uint16)
    return not bool(((halves & 0x7C00) == 0x7C00).any())  # exponent all ones: inf or NaN


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


def _group_bound(t: torch.Tensor, dim: int, fmt: str) -> torch.Tensor:
    """The largest error of each element of float32 `t` quantized in groups along `dim` in `fmt`."""
    low, high = t.amin(dim=dim, keepdim=True), t.amax(dim=dim, keepdim=True)
    if fmt in ("uint8", "int4"):
        levels = 255.0 if fmt == "uint8" else INT4_LEVELS
        bound = (high - low) / levels * 0.51 + 2 ** -10 * (low.abs() + high.abs()) + 1e-6
    elif fmt == "int8":
        bound = torch.maximum(-low, high) * (0.51 / INT8_MAX + 2 ** -10) + 1e-6
    else:  # fp8 (symmetric) or fp8c (centred): 3 mantissa bits, plus the float16 rounding of scale and zero
        zero = (low + high) / 2 if fmt == "fp8c" else torch.zeros_like(low)
        residual = (t - zero).abs()
        amax = residual.amax(dim=dim, keepdim=True)
        return residual * (2 ** -4 + 2 ** -10) + amax / FP8_MAX * 2 ** -9 + amax * 2 ** -9 + zero.abs() * 2 ** -10 + 1e-6
    return bound.expand_as(t)


def error_bound(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The largest absolute error `decode(encode(x))` may have at each element of `[..., 2, H, bs, D]`
    (for tests and the quality report): half a step of its group's scale plus the float16 rounding
    of the scale and zero; for fp8 a relative 2^-4 (3 mantissa bits) and half its smallest subnormal."""
    x = x.float()
    if mode not in MODES[1:]:
        return torch.zeros_like(x)
    heads, bs, dim = x.shape[-3:]
    spec = mode_spec(mode, dim, bs)
    first = 1 if spec.row0 else 0
    out = torch.empty_like(x)
    if bs > first:
        out[..., 0, :, first:, :] = _group_bound(x[..., 0, :, first:, :], -2, spec.key)
        groups = dim // spec.value_group
        values = x[..., 1, :, first:, :].unflatten(-1, (groups, spec.value_group))
        out[..., 1, :, first:, :] = _group_bound(values, -1, spec.value).flatten(-2)
    if spec.row0 == "fp8":
        out[..., :, :, 0, :] = _group_bound(x[..., :, :, 0, :], -1, "fp8")
    elif spec.row0 == "f16":
        out[..., :, :, 0, :] = x[..., :, :, 0, :].abs() * 2 ** -11 + 2 ** -24
    return out
