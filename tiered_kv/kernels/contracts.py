"""Layout contracts of the native ops, checked before any launch (see native/tiered_kv_ops.h).

Every check looks only at tensor metadata (dtype, shape, strides, device, pinning), never at
values, so it costs no device sync and runs the same on CPU tensors: the torch reference
calls these checks too, and tests exercise them without a GPU. A failure raises LayoutError
naming the op, the tensor, the layout expected and what was given.

Device rule: the op runs on the query's device (for block copies: the device of whichever of
dst/src is on CUDA). Every other tensor is on that device, except a K/V source or a copy side,
which may be pinned host memory that the kernel reads or writes through UVA (a warm slab).
`require_cuda=True` (the CUDA wrappers) additionally demands that device be CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..compression import layout_parts, mode_spec, packed_layer_bytes
from ..errors import LayoutError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPE = torch.int32
TAG_DTYPES = (torch.int8, torch.int32)
MAX_HEAD_DIM = 256  # TKV_MAX_HEAD_DIM in native/tiered_kv_ops.h
MAX_SOURCES = 3  # hot, warm (pinned host, UVA), staging
MAX_BLOCK_SIZE = 1024  # tokens; the kernels take any power of two up to the config's limit
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class DecodeShape:
    """Sizes of one paged_decode call, derived once by the check."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int

    @property
    def groups(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def describe(t) -> str:
    """'int64 [2, 5] on cpu' (with strides when they matter), or the type of a non-tensor."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    dtype = str(t.dtype).removeprefix("torch.")
    pinned = " (pinned)" if t.device.type == "cpu" and _is_pinned(t) else ""
    return f"{dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}{pinned}"


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # builds without an accelerator may refuse the question
        return False


def _fail(op: str, name: str, expected: str, t) -> LayoutError:
    return LayoutError(f"{op}: `{name}` must be {expected}; got {describe(t)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _home_device(op: str, name: str, t, require_cuda: bool) -> torch.device:
    if require_cuda and t.device.type != "cuda":
        raise _fail(op, name, "on a CUDA device (the CUDA path launches there)", t)
    return t.device


def _check_index(op: str, name: str, t, shape: tuple[int, ...], shape_text: str, device: torch.device,
                 dtypes=(INDEX_DTYPE,), contiguous: bool = True) -> None:
    dtype_text = " or ".join(_dtype_name(d) for d in dtypes)
    expected = f"{dtype_text} {shape_text} on {device}" + (" (contiguous)" if contiguous else "")
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape or t.device != device:
        raise _fail(op, name, expected, t)
    if contiguous and not t.is_contiguous():
        raise _fail(op, name, expected, t)
    if not contiguous and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise _fail(op, name, expected + " with last stride 1", t)


def _on_device_or_pinned(t: torch.Tensor, device: torch.device) -> bool:
    if t.device == device:
        return True
    return device.type == "cuda" and t.device.type == "cpu" and _is_pinned(t)


def _check_kv(op: str, name: str, t, dtype: torch.dtype, device: torch.device, shape=None) -> tuple[int, ...]:
    where = f"on {device}" + (" or pinned host memory" if device.type == "cuda" else "")
    expected = f"{_dtype_name(dtype)} [num_slots, H_kv, block_size, D] with D stride 1 {where}"
    if shape is not None:
        expected = f"{_dtype_name(dtype)} {list(shape)[1:]} per slot (as `{name.split('.')[0]}.k`) with D stride 1 {where}"
    ok = isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype == dtype
    ok = ok and (t.shape[-1] <= 1 or t.stride(-1) == 1) and _on_device_or_pinned(t, device)
    ok = ok and (shape is None or tuple(t.shape[1:]) == tuple(shape[1:]))
    if not ok:
        raise _fail(op, name, expected, t)
    return tuple(t.shape)


def check_paged_decode(query, sources: Sequence, block_table, tier_tags, start_offsets, seq_lens, scale,
                       *, require_cuda: bool = False) -> DecodeShape:
    """Checks one paged_decode call (see native/tiered_kv_ops.h) and returns its sizes."""
    op = "paged_decode"
    float_text = " or ".join(_dtype_name(d) for d in FLOAT_DTYPES)
    if (not isinstance(query, torch.Tensor) or query.dtype not in FLOAT_DTYPES or query.dim() != 3
            or (query.shape[-1] > 1 and query.stride(-1) != 1)):
        raise _fail(op, "query", f"{float_text} [B, Hq, D] with D stride 1", query)
    device = _home_device(op, "query", query, require_cuda)
    batch, num_q_heads, head_dim = query.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _fail(op, "query", f"[B, Hq, D] with 1 <= D <= {MAX_HEAD_DIM}", query)

    if not isinstance(sources, (list, tuple)) or not 1 <= len(sources) <= MAX_SOURCES:
        raise LayoutError(f"{op}: `sources` must be a list of 1 to {MAX_SOURCES} (k, v) pairs "
                          f"(0 hot, 1 warm, 2 staging); got {describe(sources) if not isinstance(sources, (list, tuple)) else f'{len(sources)} entries'}")
    first_shape = None
    for index, pair in enumerate(sources):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise LayoutError(f"{op}: `sources[{index}]` must be a (k, v) pair; got {describe(pair)}")
        k, v = pair
        k_shape = _check_kv(op, f"sources[{index}].k", k, query.dtype, device)
        _check_kv(op, f"sources[{index}].v", v, query.dtype, device, shape=k_shape)
        if v.shape[0] != k.shape[0]:
            raise _fail(op, f"sources[{index}].v", f"{k.shape[0]} slots like `sources[{index}].k`", v)
        if first_shape is None:
            first_shape = k_shape
        elif k_shape[1:] != first_shape[1:]:
            raise _fail(op, f"sources[{index}].k", f"[num_slots, {', '.join(map(str, first_shape[1:]))}] "
                        "like `sources[0].k` (same H_kv, block_size, D)", k)
    _, num_kv_heads, block_size, kv_dim = first_shape
    if kv_dim != head_dim:
        raise _fail(op, "sources[0].k", f"head_dim D = {head_dim} like `query`", sources[0][0])
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise _fail(op, "query", f"Hq a multiple of the sources' H_kv = {num_kv_heads} (GQA)", query)
    if not (1 <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0):
        raise _fail(op, "sources[0].k", f"[num_slots, H_kv, block_size, D] with block_size a power of two "
                    f"from 1 to {MAX_BLOCK_SIZE}", sources[0][0])

    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise _fail(op, "block_table", f"int32 [B, max_blocks] on {device}", block_table)
    max_blocks = block_table.shape[1]
    _check_index(op, "block_table", block_table, (batch, max_blocks), f"[{batch}, max_blocks]", device,
                 contiguous=False)
    if max_blocks * block_size > _INT32_MAX:
        raise _fail(op, "block_table", f"at most {_INT32_MAX // block_size} blocks per row", block_table)
    if tier_tags is not None:
        _check_index(op, "tier_tags", tier_tags, (batch, max_blocks), f"[{batch}, {max_blocks}]", device,
                     dtypes=TAG_DTYPES)
    _check_index(op, "start_offsets", start_offsets, (batch,), f"[{batch}]", device)
    _check_index(op, "seq_lens", seq_lens, (batch,), f"[{batch}]", device)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise LayoutError(f"{op}: `scale` must be a finite Python float; got {scale!r}")
    return DecodeShape(batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks)


def check_merge_states(out_a, lse_a, out_b, lse_b, *, require_cuda: bool = False) -> tuple[int, int, int]:
    """Checks one merge_states call; returns (B, H, D)."""
    op = "merge_states"
    float_text = " or ".join(_dtype_name(d) for d in FLOAT_DTYPES)
    if (not isinstance(out_a, torch.Tensor) or out_a.dtype not in FLOAT_DTYPES or out_a.dim() != 3
            or (out_a.shape[-1] > 1 and out_a.stride(-1) != 1)):
        raise _fail(op, "out_a", f"{float_text} [B, H, D] with D stride 1", out_a)
    device = _home_device(op, "out_a", out_a, require_cuda)
    batch, heads, head_dim = out_a.shape
    expected_b = f"{_dtype_name(out_a.dtype)} {list(out_a.shape)} with D stride 1 on {device}"
    if (not isinstance(out_b, torch.Tensor) or out_b.dtype != out_a.dtype or out_b.shape != out_a.shape
            or out_b.device != device or (head_dim > 1 and out_b.stride(-1) != 1)):
        raise _fail(op, "out_b", expected_b, out_b)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check_index(op, name, lse, (batch, heads), f"[{batch}, {heads}]", device, dtypes=(torch.float32,))
    return batch, heads, head_dim


def check_block_copy(op: str, dst, src, slots, *, require_cuda: bool = False) -> torch.device:
    """Checks one gather_blocks/scatter_blocks call; returns the device the copy runs on.

    dst and src: [N, H, block_size, D] of one dtype, D stride 1, equal per-slot shapes; the list
    side (dst for gather, src for scatter) has at least len(slots) entries.
    """
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[-1] > 1 and t.stride(-1) != 1):
            raise _fail(op, name, "[N, H, block_size, D] with D stride 1", t)
    cuda_sides = [t.device for t in (dst, src) if t.device.type == "cuda"]
    device = cuda_sides[0] if cuda_sides else dst.device
    if require_cuda and not cuda_sides:
        raise _fail(op, "dst", "on a CUDA device, or `src` on one (the CUDA path launches there)", dst)
    where = f"on {device}" + (" or pinned host memory" if device.type == "cuda" else "")
    for name, t in (("dst", dst), ("src", src)):
        if not _on_device_or_pinned(t, device):
            raise _fail(op, name, f"[N, H, block_size, D] {where}", t)
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise _fail(op, "src", f"{_dtype_name(dst.dtype)} [N, {', '.join(map(str, dst.shape[1:]))}] like `dst`", src)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
        raise _fail(op, "slots", f"int32 [n] on {device} (contiguous)", slots)
    _check_index(op, "slots", slots, (slots.shape[0],), "[n]", device)
    listed, listed_name = (dst, "dst") if op == "gather_blocks" else (src, "src")
    if listed.shape[0] < slots.shape[0]:
        raise _fail(op, listed_name, f"at least len(slots) = {slots.shape[0]} entries", listed)
    indexed = src if op == "gather_blocks" else dst
    if indexed.shape[0] > _INT32_MAX:
        raise _fail(op, "src" if op == "gather_blocks" else "dst", f"at most {_INT32_MAX} slots", indexed)
    return device


DEQUANT_MODES = {"fp8": 0, "int8": 1, "int4": 2}  # TKV_DEQUANT_* in native/tiered_kv_ops.h
ROW0_KINDS = {None: 0, "fp8": 1, "f16": 2}  # TKV_ROW0_* in native/tiered_kv_ops.h


def dequant_layout_args(mode: str, heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """The codec-version-3 layout a dequant launch passes after `mode`: value_group, row0, and the byte
    offsets of V codes, token-0 data, K scales, K zeros, V scales, V zeros, token-0 scales (-1: absent)."""
    spec = mode_spec(mode, head_dim, block_size)
    parts = layout_parts(mode, heads, block_size, head_dim)

    def at(name: str) -> int:
        return parts[name][0] if name in parts else -1

    return (spec.value_group, ROW0_KINDS[spec.row0], at("v"), at("r0"), at("k_scale"), at("k_zero"), at("v_scale"),
            at("v_zero"), at("r0_scale"))


def quant_layout_args(mode: str, heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """A quant launch's layout arguments: dequant_layout_args's, then the pad byte before the float16s
    (the codes end at an odd offset; the kernel writes it 0), or -1."""
    parts = layout_parts(mode, heads, block_size, head_dim)
    codes_end = max(end for first, end in parts.values() if end <= parts.first_half)
    pad = parts.first_half - 1 if codes_end < parts.first_half else -1
    return (*dequant_layout_args(mode, heads, block_size, head_dim), pad)


def check_quant(dst, src, slots, mode: str, *, require_cuda: bool = False) -> torch.device:
    """Checks one quant_blocks call; returns the device it runs on (src's).

    src: float32/float16/bfloat16 [N, L, 2, H, block_size, D] with D stride 1 (any other strides: a
    hot slab's slot-major view); dst: uint8 [n, L, P] with P stride 1, P the packed slice bytes of
    `mode` for (H, bs, D), 2-byte aligned (its address and strides even), on src's device or pinned
    host memory; slots: None (src[i] for i < n, so N >= n) or int32 [n] contiguous on src's device.
    """
    op = "quant_blocks"
    if mode not in DEQUANT_MODES:
        raise LayoutError(f"{op}: `mode` must be one of {', '.join(map(repr, DEQUANT_MODES))}; got {mode!r}")
    if not isinstance(src, torch.Tensor) or src.dim() != 6 or src.dtype not in FLOAT_DTYPES or \
            (src.shape[-1] > 1 and src.stride(-1) != 1) or src.shape[2] != 2:
        raise _fail(op, "src", "float32, float16 or bfloat16 [N, L, 2, H, block_size, D] with D stride 1", src)
    device = _home_device(op, "src", src, require_cuda)
    _, layers, _, heads, block_size, head_dim = src.shape
    if mode == "int4" and head_dim % 2:
        raise _fail(op, "src", "an even D for int4 (two codes per byte)", src)
    packed = packed_layer_bytes(heads, block_size, head_dim, mode)
    where = f"on {device}" + (" or pinned host memory" if device.type == "cuda" else "")
    expected = f"uint8 [n, {layers}, {packed}] ({mode} slices of H={heads} bs={block_size} D={head_dim}) with " \
               f"byte stride 1, an even address and even strides, {where}"
    ok = isinstance(dst, torch.Tensor) and dst.dtype == torch.uint8 and dst.dim() == 3
    ok = ok and tuple(dst.shape[1:]) == (layers, packed) and (packed <= 1 or dst.stride(2) == 1)
    ok = ok and dst.data_ptr() % 2 == 0 and dst.stride(0) % 2 == 0 and dst.stride(1) % 2 == 0
    if not ok or not _on_device_or_pinned(dst, device):
        raise _fail(op, "dst", expected, dst)
    if slots is None:
        if src.shape[0] < dst.shape[0]:
            raise _fail(op, "src", f"at least n = {dst.shape[0]} slots (no `slots` list: dst[i] = encode(src[i]))", src)
    else:
        _check_index(op, "slots", slots, (dst.shape[0],), f"[{dst.shape[0]}]", device)
    if src.shape[0] > _INT32_MAX:
        raise _fail(op, "src", f"at most {_INT32_MAX} slots", src)
    return device


def check_dequant(dst, src, slots, mode: str, *, require_cuda: bool = False) -> torch.device:
    """Checks one dequant_blocks call; returns the device it runs on (dst's).

    dst: float32/float16/bfloat16 [N, L, 2, H, bs, D] with D stride 1; src: uint8 [n, L, P] with P
    stride 1, P the packed slice bytes of `mode` for (H, bs, D), 2-byte aligned (its address and
    strides even), on dst's device or pinned host memory; slots: None (dst[i] for i < n, so N >= n)
    or int32 [n] contiguous on dst's device.
    """
    op = "dequant_blocks"
    if mode not in DEQUANT_MODES:
        raise LayoutError(f"{op}: `mode` must be one of {', '.join(map(repr, DEQUANT_MODES))}; got {mode!r}")
    if not isinstance(dst, torch.Tensor) or dst.dim() != 6 or dst.dtype not in FLOAT_DTYPES or \
            (dst.shape[-1] > 1 and dst.stride(-1) != 1):
        raise _fail(op, "dst", "float32, float16 or bfloat16 [N, L, 2, H, block_size, D] with D stride 1", dst)
    device = _home_device(op, "dst", dst, require_cuda)
    _, layers, two, heads, block_size, head_dim = dst.shape
    if two != 2:
        raise _fail(op, "dst", "[N, L, 2, H, block_size, D] (K and V on its third dim)", dst)
    if mode == "int4" and head_dim % 2:
        raise _fail(op, "dst", "an even D for int4 (two codes per byte)", dst)
    packed = packed_layer_bytes(heads, block_size, head_dim, mode)
    where = f"on {device}" + (" or pinned host memory" if device.type == "cuda" else "")
    expected = f"uint8 [n, {layers}, {packed}] ({mode} slices of H={heads} bs={block_size} D={head_dim}) with " \
               f"byte stride 1, an even address and even strides, {where}"
    ok = isinstance(src, torch.Tensor) and src.dtype == torch.uint8 and src.dim() == 3
    ok = ok and tuple(src.shape[1:]) == (layers, packed) and (packed <= 1 or src.stride(2) == 1)
    ok = ok and src.data_ptr() % 2 == 0 and src.stride(0) % 2 == 0 and src.stride(1) % 2 == 0
    if not ok or not _on_device_or_pinned(src, device):
        raise _fail(op, "src", expected, src)
    if slots is None:
        if dst.shape[0] < src.shape[0]:
            raise _fail(op, "dst", f"at least n = {src.shape[0]} slots (no `slots` list: dst[i] = decode(src[i]))", dst)
    else:
        _check_index(op, "slots", slots, (src.shape[0],), f"[{src.shape[0]}]", device)
    if dst.shape[0] > _INT32_MAX:
        raise _fail(op, "dst", f"at most {_INT32_MAX} slots", dst)
    return device


def copy_vector_bytes(row_bytes: int, *addresses_and_strides: int) -> int:
    """The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing the row and every address/stride."""
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0 and all(value % width == 0 for value in addresses_and_strides):
            return width
    return 1
