// Device code (CUDA): declarations of tiered_kv's native ops and their layout contract.
//
// Loaded at run time by tiered_kv/kernels/cuda.py through cupy.RawModule (NVRTC): each
// .cu file is one module; `#include "..."` of the files in this folder is inlined by the
// loader, so this header and common.cuh use no system headers.
//
// Layout contract (checked in Python by tiered_kv/kernels/contracts.py BEFORE any launch):
//
//   K/V source (per layer, per source): a K tensor and a V tensor, each viewed as
//     [num_slots, H_kv, block_size, D]; element strides (slot, head, token) are free
//     (non-negative), the D stride is 1. Source 0 = hot slab on the device, 1 = warm slab
//     in pinned host memory read through UVA, 2 = a device staging buffer. Every source of
//     one call has the query's dtype and the same H_kv, block_size and D.
//       hot slab  [L, 2, H, S*bs, D]: layer l's K = slab[l,0].view(H,S,bs,D).permute(1,0,2,3)
//                 strides (bs*D, S*bs*D, D, 1)
//       warm slab [S, L, 2, H, bs, D] pinned: layer l's K = slab[:, l, 0]
//   query      [B, Hq, D], D stride 1, Hq = H_kv * groups (GQA: q head h reads kv head h / groups)
//   block_table int32 [B, max_blocks], row stride free, column stride 1
//   tier_tags  int8 or int32 [B, max_blocks] contiguous, or null (= all source 0)
//   start_offsets, seq_lens int32 [B] contiguous: row b attends to logical positions
//     p in [start_offsets[b], seq_lens[b]) (clamped to [0, max_blocks*block_size]);
//     position p lives in block_table[b, p / bs] at token p % bs of source tier_tags[b, p / bs].
//     Positions before start_offsets[b] are left padding and are never read.
//   out        [B, Hq, D] contiguous, the query's dtype; lse float32 [B, Hq] contiguous,
//     natural log of the sum of exp(scale * q.k). An empty row gives out 0 and lse -inf.
//     A row whose table names a tag >= num sources or a slot outside its source gives NaN.
//
//   Split decode (flash-decoding): the positions [0, num_partitions * partition_size) are cut
//     into num_partitions partitions of partition_size positions (absolute, not row-relative).
//     paged_decode_<variant>_<dtype> runs one CTA per (partition, kv head x group tile, row): it
//     handles up to G query heads of one KV head's GQA group over one partition of the row,
//     loading each K/V element once for all of them. With num_partitions == 1 it writes out
//     and lse itself (part_out / part_lse unused, may be null). Otherwise it writes a
//     normalised partial out and its lse (natural log) per (row, q head, partition) to
//       part_out float32 [B, Hq, num_partitions, D] contiguous,
//       part_lse float32 [B, Hq, num_partitions] contiguous,
//     only for the partitions that overlap the row's [start, end) (others are never written;
//     a partition whose table names a bad entry gets lse NaN), and merge_partitions_<dtype>
//     merges exactly those partitions of each (row, q head) by their lse into out and lse.
//     paged_decode_g<G>_<dtype> read K/V in 16-byte units and need 16-byte aligned rows: every
//     source's K/V base address a multiple of 16 bytes, D and the strides of the dims longer
//     than 1 multiples of 16 / sizeof(element). paged_decode_scalar_<dtype> (G = 8) read element
//     by element and take any layout of the contract.
//   Element types: float32, float16, bfloat16; accumulation in float32. D <= 256.
//   Scalars: strides are long long (elements; bytes for the block copies), sizes int.
//
//   gather_blocks: dst[i] = src[slots[i]] for i < n; scatter_blocks: dst[slots[i]] = src[i].
//     dst/src [N, H, block_size, D] any element type, element size `elem_bytes`, strides in
//     BYTES, D contiguous; slots int32 [n] contiguous on the device. A copy unit is `vec`
//     bytes (16, 8, 4, 2 or 1) and every address and stride is a multiple of it. A slot
//     outside [0, num_slots) is skipped (never read or written out of bounds).
//
//   dequant_blocks: packed layer slices of compressed blocks (tiered_kv/compression) expanded into
//     the model's dtype: dst[slot] = decode(src[i]) for i < n, slot = slots[i] (slots null: i).
//     src uint8 [n, L, P] with P stride 1 (byte strides of a block and a layer free; the device's
//     memory or pinned host memory through UVA), P = the mode's packed slice bytes for (H, bs, D);
//     every scale is 2-byte aligned (src, its strides even). dst [N, L, 2, H, bs, D] of the
//     element type, strides in elements, D stride 1. mode 0 fp8 (keys e4m3 centred per channel,
//     values e4m3 per token, token 0 float16), 1 int8 (keys uint8 with a zero per channel, values
//     int8 per token), 2 int4 (keys per channel, values per token and value_group channels, both
//     with a zero; token 0 e4m3 with a scale; D even): codec version 3, every part's byte offset
//     passed by the host (compression.layout_parts). A slot outside [0, N) is skipped.
//
//   quant_blocks: the inverse, the model's dtype packed: dst[i] = encode(src[slot]) for i < n,
//     slot = slots[i] (slots null: i), bit for bit compression/packing.py's encode on the CPU
//     (a group of zeros aside: its scale is +0 here, -0 or +0 there). src [N, L, 2, H, bs, D] of
//     the element type on the device (a hot slab's slot-major view), strides in elements, D
//     stride 1; dst uint8 [n, L, P], P stride 1, even address and strides (the device's memory or
//     pinned host memory through UVA). A slot outside [0, N) is skipped (dst[i] left as it is).
//
//   merge_states: two partial attentions over disjoint key sets, each (out [B, H, D] with D
//     stride 1, lse float32 [B, H] contiguous), merged by their log-sum-exp:
//       m = max(lse_a, lse_b); wa = exp(lse_a - m); wb = exp(lse_b - m)
//       out = (wa * out_a + wb * out_b) / (wa + wb); lse = m + log(wa + wb)
//     (both -inf: out 0, lse -inf). out is contiguous in out_a's dtype.

#pragma once

#define TKV_MAX_HEAD_DIM 256
#define TKV_DECODE_THREADS 128
#define TKV_MERGE_THREADS 128
#define TKV_COPY_THREADS 128

// paged_decode.cu: one thread block per (partition, kv head x group tile, row):
// grid (num_partitions, num_kv_heads * ceil(groups / G), B), TKV_DECODE_THREADS threads; G (the
// group tile, query heads per CTA) is 1, 2, 4 or 8 (the entry point's g<G>), 8 for scalar entries.
#define TKV_DECODE_MAX_GROUP 8
#define TKV_DECODE_TABLE_WINDOW 64
#define TKV_DECODE_PARAMS(T)                                                                   \
    T* out, float* lse, const T* query, long long q_stride_b, long long q_stride_h,           \
    const T* k0, const T* v0, long long k0_slot, long long k0_head, long long k0_tok,          \
    long long v0_slot, long long v0_head, long long v0_tok, int num_slots0,                    \
    const T* k1, const T* v1, long long k1_slot, long long k1_head, long long k1_tok,          \
    long long v1_slot, long long v1_head, long long v1_tok, int num_slots1,                    \
    const T* k2, const T* v2, long long k2_slot, long long k2_head, long long k2_tok,          \
    long long v2_slot, long long v2_head, long long v2_tok, int num_slots2,                    \
    int num_sources, const int* block_table, long long table_stride_b,                         \
    const void* tier_tags, int tag_bytes, const int* start_offsets, const int* seq_lens,      \
    int num_kv_heads, int groups, int head_dim, int block_size, int max_blocks, float scale,   \
    float* part_out, float* part_lse, int num_partitions, int partition_size

struct tkv_half { unsigned short bits; };
struct tkv_bf16 { unsigned short bits; };

extern "C" __global__ void paged_decode_g1_f32(TKV_DECODE_PARAMS(float));
extern "C" __global__ void paged_decode_g2_f32(TKV_DECODE_PARAMS(float));
extern "C" __global__ void paged_decode_g4_f32(TKV_DECODE_PARAMS(float));
extern "C" __global__ void paged_decode_g8_f32(TKV_DECODE_PARAMS(float));
extern "C" __global__ void paged_decode_scalar_f32(TKV_DECODE_PARAMS(float));
extern "C" __global__ void paged_decode_g1_f16(TKV_DECODE_PARAMS(tkv_half));
extern "C" __global__ void paged_decode_g2_f16(TKV_DECODE_PARAMS(tkv_half));
extern "C" __global__ void paged_decode_g4_f16(TKV_DECODE_PARAMS(tkv_half));
extern "C" __global__ void paged_decode_g8_f16(TKV_DECODE_PARAMS(tkv_half));
extern "C" __global__ void paged_decode_scalar_f16(TKV_DECODE_PARAMS(tkv_half));
extern "C" __global__ void paged_decode_g1_bf16(TKV_DECODE_PARAMS(tkv_bf16));
extern "C" __global__ void paged_decode_g2_bf16(TKV_DECODE_PARAMS(tkv_bf16));
extern "C" __global__ void paged_decode_g4_bf16(TKV_DECODE_PARAMS(tkv_bf16));
extern "C" __global__ void paged_decode_g8_bf16(TKV_DECODE_PARAMS(tkv_bf16));
extern "C" __global__ void paged_decode_scalar_bf16(TKV_DECODE_PARAMS(tkv_bf16));

// merge_partitions.cu: one thread block per (q head, row): grid (Hq, B), TKV_MERGE_THREADS
// threads. Row b merges the partitions [start / partition_size, (end - 1) / partition_size]
// of part_out/part_lse (layout above), start/end clamped as in paged_decode (end to max_tokens =
// max_blocks * block_size). Empty row: out 0, lse -inf; any merged lse NaN: out and lse NaN.
#define TKV_PARTITION_MERGE_PARAMS(T)                                                          \
    T* out, float* lse, const float* part_out, const float* part_lse, const int* start_offsets, \
    const int* seq_lens, int num_heads, int head_dim, int num_partitions, int partition_size,  \
    int max_tokens

extern "C" __global__ void merge_partitions_f32(TKV_PARTITION_MERGE_PARAMS(float));
extern "C" __global__ void merge_partitions_f16(TKV_PARTITION_MERGE_PARAMS(tkv_half));
extern "C" __global__ void merge_partitions_bf16(TKV_PARTITION_MERGE_PARAMS(tkv_bf16));

// merge_states.cu: one thread block per (head, row): grid (H, B), TKV_MERGE_THREADS threads.
#define TKV_MERGE_PARAMS(T)                                                                    \
    T* out, float* lse, const T* out_a, long long a_stride_b, long long a_stride_h,            \
    const float* lse_a, const T* out_b, long long b_stride_b, long long b_stride_h,            \
    const float* lse_b, int num_heads, int head_dim

extern "C" __global__ void merge_states_f32(TKV_MERGE_PARAMS(float));
extern "C" __global__ void merge_states_f16(TKV_MERGE_PARAMS(tkv_half));
extern "C" __global__ void merge_states_bf16(TKV_MERGE_PARAMS(tkv_bf16));

// dequant_blocks.cu: one thread block per (list entry, layer, K/V x head): grid (n, L, 2 * H),
// TKV_DEQUANT_THREADS threads.
#define TKV_DEQUANT_THREADS 128
#define TKV_DEQUANT_FP8 0
#define TKV_DEQUANT_INT8 1
#define TKV_DEQUANT_INT4 2
#define TKV_ROW0_NONE 0
#define TKV_ROW0_FP8 1
#define TKV_ROW0_F16 2
// codec version 3: part offsets in bytes within a packed layer slice (compression.layout_parts;
// -1: the part is absent), value_group channels per value scale, row0 how token 0 is stored.
#define TKV_DEQUANT_PARAMS(T)                                                                  \
    T* dst, long long dst_slot, long long dst_layer, long long dst_kv, long long dst_head,     \
    long long dst_tok, int num_dst_slots, const unsigned char* src, long long src_block,       \
    long long src_layer, const int* slots, int num_kv_heads, int block_size, int head_dim,     \
    int mode, int value_group, int row0, int off_v, int off_r0, int off_k_scale,               \
    int off_k_zero, int off_v_scale, int off_v_zero, int off_r0_scale

extern "C" __global__ void dequant_blocks_f32(TKV_DEQUANT_PARAMS(float));
extern "C" __global__ void dequant_blocks_f16(TKV_DEQUANT_PARAMS(tkv_half));
extern "C" __global__ void dequant_blocks_bf16(TKV_DEQUANT_PARAMS(tkv_bf16));

// quant_blocks.cu: one thread block per (list entry, layer, K/V x head): grid (n, L, 2 * H),
// TKV_QUANT_THREADS threads (a multiple of 32: values are quantized a warp per group). mode and
// the layout arguments as dequant_blocks' (TKV_DEQUANT_*, TKV_ROW0_*); off_pad the byte before
// the float16s when the codes end at an odd offset (written 0), else -1.
#define TKV_QUANT_THREADS 128
#define TKV_QUANT_PARAMS(T)                                                                    \
    unsigned char* dst, long long dst_block, long long dst_layer, const T* src, long long src_slot, \
    long long src_layer, long long src_kv, long long src_head, long long src_tok,              \
    int num_src_slots, const int* slots, int num_kv_heads, int block_size, int head_dim,       \
    int mode, int value_group, int row0, int off_v, int off_r0, int off_k_scale,               \
    int off_k_zero, int off_v_scale, int off_v_zero, int off_r0_scale, int off_pad

extern "C" __global__ void quant_blocks_f32(TKV_QUANT_PARAMS(float));
extern "C" __global__ void quant_blocks_f16(TKV_QUANT_PARAMS(tkv_half));
extern "C" __global__ void quant_blocks_bf16(TKV_QUANT_PARAMS(tkv_bf16));

// gather_blocks.cu / scatter_blocks.cu: one thread block per (list entry, head): grid (n, H).
#define TKV_COPY_PARAMS                                                                        \
    char* dst, const char* src, long long dst_slot, long long dst_head, long long dst_tok,     \
    long long src_slot, long long src_head, long long src_tok, const int* slots, int num_slots,\
    int block_size, int row_bytes, int vec

extern "C" __global__ void gather_blocks(TKV_COPY_PARAMS);
extern "C" __global__ void scatter_blocks(TKV_COPY_PARAMS);
