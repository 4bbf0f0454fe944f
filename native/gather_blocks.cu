// Device code (CUDA): gather whole blocks from a slab into a staging buffer: dst[i] = src[slots[i]].
//
// One thread block per (list entry i, head h); it copies block_size rows of row_bytes bytes in
// `vec`-byte units (16 when every address and stride allows). Bytes only: any element type.
// Either side may be pinned host memory reached through UVA (a warm slab).
#include "tiered_kv_ops.h"
#include "common.cuh"

extern "C" __global__ void gather_blocks(TKV_COPY_PARAMS) {
    const int i = blockIdx.x;
    const int h = blockIdx.y;
    const int slot = slots[i];
    if (slot < 0 || slot >= num_slots) return;  // never out of bounds; the wrapper's caller owns slot ids
    char* d = dst + i * dst_slot + h * dst_head;
    const char* s = src + slot * src_slot + h * src_head;
    tkv_copy_block_vec(d, s, dst_tok, src_tok, block_size, row_bytes, vec);
}
