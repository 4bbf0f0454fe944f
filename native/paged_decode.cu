// Device code (CUDA): paged-attention decode over tiered K/V blocks, returning out and LSE.
//
// One thread block per (q head h, row b); TKV_DECODE_THREADS threads = 4 warps. Warp w takes
// positions start+w, start+w+4, ...; its 32 lanes split D (lane i holds d = i, i+32, ...), so a
// score is one warp sum. Each warp keeps an online softmax (running max m, sum l, acc[D]) in
// float32; the four warp states are merged through shared memory at the end. The query is
// pre-multiplied by `scale`, so lse = log(sum(exp(scale * q.k))).
#include "tiered_kv_ops.h"
#include "common.cuh"

#define TKV_PER_LANE (TKV_MAX_HEAD_DIM / 32)
#define TKV_DECODE_WARPS (TKV_DECODE_THREADS / 32)

template <typename T>
__device__ __forceinline__ void paged_decode_impl(TKV_DECODE_PARAMS(T)) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int num_q_heads = gridDim.x;
    const int kv_head = h / groups;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    __shared__ float warp_max[TKV_DECODE_WARPS];
    __shared__ float warp_sum[TKV_DECODE_WARPS];
    __shared__ float warp_acc[TKV_DECODE_WARPS][TKV_MAX_HEAD_DIM];

    float q[TKV_PER_LANE];
    float acc[TKV_PER_LANE];
    const T* q_row = query + b * q_stride_b + h * q_stride_h;
#pragma unroll
    for (int i = 0; i < TKV_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        q[i] = d < head_dim ? tkv_to_float(q_row[d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }

    const int table_tokens = max_blocks * block_size;
    const int start = tkv_max(start_offsets[b], 0);
    const int end = tkv_min(seq_lens[b], table_tokens);
    float m = tkv_neg_inf();
    float l = 0.0f;
    int bad = 0;

    for (int p = start + warp; p < end; p += TKV_DECODE_WARPS) {
        const int blk = p / block_size;
        const int tok = p - blk * block_size;
        const int slot = block_table[b * table_stride_b + blk];
        int tag = 0;
        if (tier_tags != 0) {
            const long long at = (long long)b * max_blocks + blk;
            tag = tag_bytes == 1 ? (int)((const signed char*)tier_tags)[at] : ((const int*)tier_tags)[at];
        }
        const T* k;
        const T* v;
        long long k_off, v_off;
        int num_slots;
        if (tag == 0) {
            k = k0; v = v0; num_slots = num_slots0;
            k_off = slot * k0_slot + kv_head * k0_head + tok * k0_tok;
            v_off = slot * v0_slot + kv_head * v0_head + tok * v0_tok;
        } else if (tag == 1) {
            k = k1; v = v1; num_slots = num_slots1;
            k_off = slot * k1_slot + kv_head * k1_head + tok * k1_tok;
            v_off = slot * v1_slot + kv_head * v1_head + tok * v1_tok;
        } else {
            k = k2; v = v2; num_slots = num_slots2;
            k_off = slot * k2_slot + kv_head * k2_head + tok * k2_tok;
            v_off = slot * v2_slot + kv_head * v2_head + tok * v2_tok;
        }
        // the whole warp sees the same (tag, slot): this branch is uniform across its lanes
        if (tag < 0 || tag >= num_sources || slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        const T* k_row = k + k_off;
        const T* v_row = v + v_off;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < TKV_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) dot += q[i] * tkv_to_float(k_row[d]);
        }
        const float score = tkv_warp_sum(dot);
        const float m_new = fmaxf(m, score);
        const float carry = expf(m - m_new);  // exp(-inf) = 0 on the first position
        const float weight = expf(score - m_new);
        l = l * carry + weight;
#pragma unroll
        for (int i = 0; i < TKV_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            const float vd = d < head_dim ? tkv_to_float(v_row[d]) : 0.0f;
            acc[i] = acc[i] * carry + weight * vd;
        }
        m = m_new;
    }

    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < TKV_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) warp_acc[warp][d] = acc[i];
    }
    const int any_bad = __syncthreads_or(bad);

    float m_all = tkv_neg_inf();
    for (int w = 0; w < TKV_DECODE_WARPS; ++w) m_all = fmaxf(m_all, warp_max[w]);
    float weights[TKV_DECODE_WARPS];
    float l_all = 0.0f;
    for (int w = 0; w < TKV_DECODE_WARPS; ++w) {
        // a warp that saw no position has m = -inf and l = 0: weight 0
        weights[w] = warp_max[w] == tkv_neg_inf() ? 0.0f : expf(warp_max[w] - m_all);
        l_all += warp_sum[w] * weights[w];
    }
    // empty means no position at all; a row whose scores are all NaN is not empty (it stays NaN)
    const bool empty = end <= start;
    const long long row = (long long)b * num_q_heads + h;
    T* out_row = out + row * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        if (any_bad) {
            value = tkv_nan();
        } else if (!empty) {
            for (int w = 0; w < TKV_DECODE_WARPS; ++w) value += warp_acc[w][d] * weights[w];
            value /= l_all;
        }
        out_row[d] = tkv_from_float<T>(value);
    }
    if (threadIdx.x == 0) lse[row] = any_bad ? tkv_nan() : (empty ? tkv_neg_inf() : m_all + logf(l_all));
}

#define TKV_DECODE_ARGS                                                                          \
    out, lse, query, q_stride_b, q_stride_h,                                                     \
    k0, v0, k0_slot, k0_head, k0_tok, v0_slot, v0_head, v0_tok, num_slots0,                      \
    k1, v1, k1_slot, k1_head, k1_tok, v1_slot, v1_head, v1_tok, num_slots1,                      \
    k2, v2, k2_slot, k2_head, k2_tok, v2_slot, v2_head, v2_tok, num_slots2,                      \
    num_sources, block_table, table_stride_b, tier_tags, tag_bytes, start_offsets, seq_lens,     \
    num_kv_heads, groups, head_dim, block_size, max_blocks, scale

// One kernel, instantiated per element type under C names (no C++ mangling for the loader).
extern "C" __global__ void paged_decode_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16>(TKV_DECODE_ARGS);
}
