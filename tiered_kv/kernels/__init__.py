"""Native ops over tiered KV blocks: paged-attention decode, LSE merge, block gather/scatter,
quantization and dequantization of compressed blocks.

    from tiered_kv.kernels import ops
    out, lse = ops.paged_decode(query, sources, block_table, tier_tags, start_offsets, seq_lens, scale)
    out, lse = ops.merge_states(out_a, lse_a, out_b, lse_b)
    ops.gather_blocks(dst, src, slots)     # dst[i] = src[slots[i]]
    ops.scatter_blocks(dst, src, slots)    # dst[slots[i]] = src[i]
    ops.dequant_blocks(dst, packed, slots, "int8")  # dst[slots[i]] = decode(packed[i]) (or dst[i])
    ops.quant_blocks(packed, src, slots, "int8")    # packed[i] = encode(src[slots[i]]) (or src[i])
    ops.backend                            # "cuda" (cupy + native/*.cu) or "torch" (reference.py)
    ops.fallback_reason                    # why "torch", or None

`ops` is chosen once, on first use (backend.py). The layout contract is in
native/tiered_kv_ops.h and checked by contracts.py before any launch.
"""

from __future__ import annotations

from .backend import KernelOps, get_ops
from .selfcheck import selfcheck
from .sources import native_dir

__all__ = ["ops", "get_ops", "KernelOps", "native_dir", "selfcheck"]


def __getattr__(name: str):
    if name == "ops":  # resolved lazily: importing the package compiles nothing
        return get_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
