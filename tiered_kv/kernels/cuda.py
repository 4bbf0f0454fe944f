"""CUDA path of the native ops: the `.cu` files in native/, compiled at run time by cupy.

Each wrapper is one contract check (contracts.py: metadata only, no sync) and one launch on
torch's current stream (handed to cupy by `Stream.from_external`, or `ExternalStream` before
cupy 14), with raw pointers taken from the torch tensors (no copies, no cupy arrays). Modules are compiled once per process and file (cupy also keeps the binary in its
on-disk cache). cupy is imported lazily, so this module imports, and its checks run, without
CUDA. Calls whose tensors are all on the CPU take the torch reference (same semantics).
"""

from __future__ import annotations

import functools
import threading
from typing import Sequence

import numpy as np
import torch

from ..blocks import num_blocks_for
from ..errors import LayoutError
from . import contracts, reference
from .sources import KERNEL_FILES, read_source

DECODE_THREADS = 128  # TKV_DECODE_THREADS
DECODE_GROUP_TILES = (1, 2, 4, 8)  # entry points paged_decode_g<G>_*; TKV_DECODE_MAX_GROUP = 8
PARTITION_MIN_TOKENS = 256  # rows no longer than this (table width) run as one partition, no merge
PARTITION_CTAS_PER_SM = 32  # partitions grow (x2) until the split grid has at most this many CTAs per SM
DEFAULT_SM_COUNT = 132  # when the device cannot be asked (recording tests on CPU)
# Tests set a partition size (tokens, rounded up to a multiple of block_size) to force many partitions.
DECODE_PARTITION_TOKENS: int | None = None
MERGE_THREADS = 128  # TKV_MERGE_THREADS
COPY_THREADS = 128  # TKV_COPY_THREADS
DEQUANT_THREADS = 128  # TKV_DEQUANT_THREADS
QUANT_THREADS = 128  # TKV_QUANT_THREADS
COMPILE_OPTIONS = ("-std=c++17",)
_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_compile_lock = threading.Lock()
# The checks demand a CUDA device; tests switch this off (with a recording `_launch` and `_ptr`)
# to drive the launch path with CPU tensors and check each launch's arguments against the header.
_REQUIRE_CUDA = True


@functools.lru_cache(maxsize=None)
def _module(file_name: str):
    import cupy

    return cupy.RawModule(code=read_source(file_name), options=COMPILE_OPTIONS)


def _function(file_name: str, kernel_name: str):
    with _compile_lock:  # one compile per file even when threads race to the first call
        return _module(file_name).get_function(kernel_name)


def compile_all() -> None:
    """Compiles and loads every kernel on the current device; raises what the compiler raised."""
    for file_name, kernel_names in KERNEL_FILES.items():
        for kernel_name in kernel_names:
            _function(file_name, kernel_name)


def _launch(file_name: str, kernel_name: str, grid: tuple, block: tuple, args: tuple, device: torch.device) -> None:
    import cupy

    with cupy.cuda.Device(device.index):
        kernel = _function(file_name, kernel_name)
        with _cupy_stream(device.index, torch.cuda.current_stream(device).cuda_stream):
            kernel(grid, block, args)


class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol (what cupy 14's Stream.from_external takes)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _cupy_stream(device_index: int, handle: int):
    """cupy's view of one of torch's streams (torch never frees its streams, so caching is safe)."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # cupy >= 14 (ExternalStream is deprecated there)
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device_index)


def _takes_cuda_path(*tensors: torch.Tensor) -> bool:
    """True when a kernel launches: some operand is on CUDA (all-CPU calls take the reference)."""
    return any(t.device.type == "cuda" for t in tensors)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    """A device-usable address: the tensor's own for CUDA memory, the UVA alias for pinned host memory."""
    if t is None:
        return np.uint64(0)
    address = t.data_ptr()
    if t.device.type == "cuda" or address == 0:
        return np.uint64(address)
    import cupy

    attributes = cupy.cuda.runtime.pointerGetAttributes(address)
    device_address = getattr(attributes, "devicePointer", 0)
    if not device_address:
        raise LayoutError(f"native ops: a host tensor ({contracts.describe(t)}) the device cannot address (not pinned)")
    return np.uint64(device_address)


def _i32(value: int) -> np.int32:
    return np.int32(value)


def _i64(value: int) -> np.int64:
    return np.int64(value)


def decode_group_tile(groups: int) -> int:
    """Query heads per CTA: the smallest tile of DECODE_GROUP_TILES holding the GQA group, at most 8."""
    for tile in DECODE_GROUP_TILES:
        if groups <= tile:
            return tile
    return DECODE_GROUP_TILES[-1]


def decode_partitions(max_tokens: int, block_size: int, row_ctas: int, sm_count: int,
                      forced: int | None = None) -> tuple[int, int]:
    """(partition_size, num_partitions) of a split decode over rows of at most `max_tokens` positions.

    `max_tokens` is the block table's width * block_size (the longest row possible: no sync to learn
    the real lengths), `row_ctas` = B * H_kv * group tiles (the CTAs of one partition). A table no
    wider than PARTITION_MIN_TOKENS runs as one partition (the kernel writes out/lse, no merge);
    otherwise partitions start at PARTITION_MIN_TOKENS (or block_size when larger) and double while
    the grid would exceed PARTITION_CTAS_PER_SM CTAs per SM (large batches need no split; it also
    bounds the workspace). Partition sizes are multiples of block_size.
    """
    if forced is not None:
        size = num_blocks_for(max(int(forced), 1), block_size) * block_size
    elif max_tokens <= max(PARTITION_MIN_TOKENS, block_size):
        return max(max_tokens, block_size), 1
    else:
        size = max(PARTITION_MIN_TOKENS, block_size)
        budget = PARTITION_CTAS_PER_SM * max(sm_count, 1)
        while size < max_tokens and -(-max_tokens // size) * row_ctas > budget:
            size *= 2
    count = max(-(-max_tokens // size), 1)
    if count == 1:
        return max(max_tokens, block_size), 1
    return size, count


def decode_vector_loads(sources: Sequence, addresses: Sequence, head_dim: int, element_size: int) -> bool:
    """True when every K/V row of every source is 16-byte aligned (the kernel then loads 16-byte units).

    addresses: the device address of each source's (k, v). D and every stride of a dim longer than 1
    must be multiples of 16 / element_size elements, every base address a multiple of 16 bytes.
    """
    width = 16 // element_size
    if head_dim % width:
        return False
    for (k, v), (k_address, v_address) in zip(sources, addresses):
        if int(k_address) % 16 or int(v_address) % 16:
            return False
        for t in (k, v):
            if any(stride % width for stride, size in zip(t.stride()[:3], t.shape[:3]) if size > 1):
                return False
    return True


@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return DEFAULT_SM_COUNT
    return int(torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
               .multi_processor_count)


def paged_decode(query: torch.Tensor, sources: Sequence, block_table: torch.Tensor, tier_tags,
                 start_offsets: torch.Tensor, seq_lens: torch.Tensor, scale: float):
    """Same contract and result as reference.paged_decode.

    One launch of paged_decode_g<G>_* (16-byte loads; paged_decode_scalar_* when the K/V rows are
    not 16-byte aligned, see decode_vector_loads) over grid (partitions, H_kv * group tiles, B).
    With more than one partition (decode_partitions) it writes float32 partials to a workspace
    allocated on the query's device, and a second launch, merge_partitions_* over (Hq, B), merges
    them into out/lse. No host sync; both launches on torch's current stream.
    """
    if not _takes_cuda_path(query):
        return reference.paged_decode(query, sources, block_table, tier_tags, start_offsets, seq_lens, scale)
    shape = contracts.check_paged_decode(query, sources, block_table, tier_tags, start_offsets, seq_lens, scale,
                                         require_cuda=_REQUIRE_CUDA)
    out = torch.empty(shape.batch, shape.num_q_heads, shape.head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(shape.batch, shape.num_q_heads, dtype=torch.float32, device=query.device)
    if shape.batch == 0 or shape.num_q_heads == 0:
        return out, lse
    source_args: list = []
    addresses = []
    for index in range(contracts.MAX_SOURCES):
        if index < len(sources):
            k, v = sources[index]
            k_ptr, v_ptr = _ptr(k), _ptr(v)
            addresses.append((k_ptr, v_ptr))
            source_args += [k_ptr, v_ptr, *map(_i64, k.stride()[:3]), *map(_i64, v.stride()[:3]), _i32(k.shape[0])]
        else:
            source_args += [_ptr(None), _ptr(None), *[_i64(0)] * 6, _i32(0)]
    if decode_vector_loads(sources, addresses, shape.head_dim, query.element_size()):
        tile = decode_group_tile(shape.groups)
        variant = f"g{tile}"
    else:  # element-by-element loads for any layout; one entry (tile 8) keeps the module small
        tile, variant = DECODE_GROUP_TILES[-1], "scalar"
    tiles = -(-shape.groups // tile)
    max_tokens = shape.max_blocks * shape.block_size
    partition_size, num_partitions = decode_partitions(
        max_tokens, shape.block_size, shape.batch * shape.num_kv_heads * tiles,
        _sm_count(query.device.type, query.device.index), DECODE_PARTITION_TOKENS)
    part_out = part_lse = None
    if num_partitions > 1:
        part_out = torch.empty(shape.batch, shape.num_q_heads, num_partitions, shape.head_dim, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(shape.batch, shape.num_q_heads, num_partitions, dtype=torch.float32,
                               device=query.device)
    tag_bytes = 0 if tier_tags is None else tier_tags.element_size()
    args = (
        _ptr(out), _ptr(lse), _ptr(query), _i64(query.stride(0)), _i64(query.stride(1)),
        *source_args,
        _i32(len(sources)), _ptr(block_table), _i64(block_table.stride(0)),
        _ptr(tier_tags), _i32(tag_bytes), _ptr(start_offsets), _ptr(seq_lens),
        _i32(shape.num_kv_heads), _i32(shape.groups), _i32(shape.head_dim), _i32(shape.block_size),
        _i32(shape.max_blocks), np.float32(scale),
        _ptr(part_out), _ptr(part_lse), _i32(num_partitions), _i32(partition_size),
    )
    suffix = _DTYPE_SUFFIX[query.dtype]
    _launch("paged_decode.cu", f"paged_decode_{variant}_{suffix}",
            (num_partitions, shape.num_kv_heads * tiles, shape.batch), (DECODE_THREADS, 1, 1), args, query.device)
    if num_partitions > 1:
        merge_args = (
            _ptr(out), _ptr(lse), _ptr(part_out), _ptr(part_lse), _ptr(start_offsets), _ptr(seq_lens),
            _i32(shape.num_q_heads), _i32(shape.head_dim), _i32(num_partitions), _i32(partition_size),
            _i32(max_tokens),
        )
        # the workspace goes back to torch's caching allocator on return: freed in stream order
        # (allocated and used on the current stream), so no later kernel can reuse it too early
        _launch("merge_partitions.cu", f"merge_partitions_{suffix}", (shape.num_q_heads, shape.batch, 1),
                (MERGE_THREADS, 1, 1), merge_args, query.device)
    return out, lse


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Same contract and result as reference.merge_states; one launch, grid (H, B)."""
    if not _takes_cuda_path(out_a):
        return reference.merge_states(out_a, lse_a, out_b, lse_b)
    batch, heads, head_dim = contracts.check_merge_states(out_a, lse_a, out_b, lse_b, require_cuda=_REQUIRE_CUDA)
    out = torch.empty(batch, heads, head_dim, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=out_a.device)
    if batch == 0 or heads == 0:
        return out, lse
    args = (
        _ptr(out), _ptr(lse), _ptr(out_a), _i64(out_a.stride(0)), _i64(out_a.stride(1)), _ptr(lse_a),
        _ptr(out_b), _i64(out_b.stride(0)), _i64(out_b.stride(1)), _ptr(lse_b), _i32(heads), _i32(head_dim),
    )
    kernel = f"merge_states_{_DTYPE_SUFFIX[out_a.dtype]}"
    _launch("merge_states.cu", kernel, (heads, batch, 1), (MERGE_THREADS, 1, 1), args, out_a.device)
    return out, lse


def gather_blocks(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[i] = src[slots[i]]; same contract as reference.gather_blocks (out-of-range slots are skipped)."""
    _block_copy("gather_blocks", dst, src, slots)


def scatter_blocks(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[slots[i]] = src[i]; same contract as reference.scatter_blocks (out-of-range slots are skipped)."""
    _block_copy("scatter_blocks", dst, src, slots)


def _block_copy(op: str, dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    if not _takes_cuda_path(dst, src):
        return getattr(reference, op)(dst, src, slots)
    device = contracts.check_block_copy(op, dst, src, slots, require_cuda=_REQUIRE_CUDA)
    count, heads, block_size, head_dim = slots.shape[0], dst.shape[1], dst.shape[2], dst.shape[3]
    if count == 0 or heads == 0 or block_size == 0 or head_dim == 0:
        return
    esize = dst.element_size()
    dst_ptr, src_ptr = _ptr(dst), _ptr(src)
    dst_strides = [s * esize for s in dst.stride()[:3]]
    src_strides = [s * esize for s in src.stride()[:3]]
    row_bytes = head_dim * esize
    vec = contracts.copy_vector_bytes(row_bytes, int(dst_ptr), int(src_ptr), *dst_strides, *src_strides)
    indexed_slots = src.shape[0] if op == "gather_blocks" else dst.shape[0]
    args = (
        dst_ptr, src_ptr, *map(_i64, dst_strides), *map(_i64, src_strides), _ptr(slots), _i32(indexed_slots),
        _i32(block_size), _i32(row_bytes), _i32(vec),
    )
    _launch(f"{op}.cu", op, (count, heads, 1), (COPY_THREADS, 1, 1), args, device)


def dequant_blocks(dst: torch.Tensor, src: torch.Tensor, slots, mode: str) -> None:
    """dst[slots[i]] (or dst[i]) = decode(src[i]); same contract as reference.dequant_blocks. One
    launch, grid (n, L, 2 * H); src may be pinned host memory (a compressed warm slab, read through UVA)."""
    if not _takes_cuda_path(dst, src):
        return reference.dequant_blocks(dst, src, slots, mode)
    device = contracts.check_dequant(dst, src, slots, mode, require_cuda=_REQUIRE_CUDA)
    count, layers, _, heads, block_size, head_dim = src.shape[0], *dst.shape[1:]
    if count == 0 or layers == 0 or heads == 0 or block_size == 0 or head_dim == 0:
        return
    args = (
        _ptr(dst), *map(_i64, dst.stride()[:5]), _i32(dst.shape[0]), _ptr(src), _i64(src.stride(0)),
        _i64(src.stride(1)), _ptr(slots), _i32(heads), _i32(block_size), _i32(head_dim),
        _i32(contracts.DEQUANT_MODES[mode]), *map(_i32, contracts.dequant_layout_args(mode, heads, block_size, head_dim)),
    )
    _launch("dequant_blocks.cu", f"dequant_blocks_{_DTYPE_SUFFIX[dst.dtype]}", (count, layers, 2 * heads),
            (DEQUANT_THREADS, 1, 1), args, device)


def quant_blocks(dst: torch.Tensor, src: torch.Tensor, slots, mode: str) -> None:
    """dst[i] = encode(src[slots[i]]) (or src[i]); same contract as reference.quant_blocks, the same bytes
    as packing.encode on the CPU. One launch, grid (n, L, 2 * H), on src's device; dst may be pinned
    host memory (written through UVA)."""
    if not _takes_cuda_path(dst, src):
        return reference.quant_blocks(dst, src, slots, mode)
    device = contracts.check_quant(dst, src, slots, mode, require_cuda=_REQUIRE_CUDA)
    count, (layers, _, heads, block_size, head_dim) = dst.shape[0], src.shape[1:]
    if count == 0 or layers == 0 or heads == 0 or block_size == 0 or head_dim == 0:
        return
    args = (
        _ptr(dst), _i64(dst.stride(0)), _i64(dst.stride(1)), _ptr(src), *map(_i64, src.stride()[:5]),
        _i32(src.shape[0]), _ptr(slots), _i32(heads), _i32(block_size), _i32(head_dim),
        _i32(contracts.DEQUANT_MODES[mode]), *map(_i32, contracts.quant_layout_args(mode, heads, block_size, head_dim)),
    )
    _launch("quant_blocks.cu", f"quant_blocks_{_DTYPE_SUFFIX[src.dtype]}", (count, layers, 2 * heads),
            (QUANT_THREADS, 1, 1), args, device)
