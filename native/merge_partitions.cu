// Device code (CUDA): N-way log-sum-exp merge of paged_decode's partitions (the split decode's second kernel).
//
// One thread block per (q head h, row b), TKV_MERGE_THREADS threads. The row's partitions are
// those overlapping its [start, end) (the only ones paged_decode wrote): p in [start / P,
// (end - 1) / P]. Pass 1: the max lse and whether any is NaN (a bad table entry: the row is NaN).
// Pass 2, in chunks of TKV_MERGE_THREADS partitions: weight w_p = exp(lse_p - max) into shared
// memory, then each thread accumulates sum_p w_p * part_out[p][d] for its d (reads coalesced over
// d). out = sum / sum_p w_p (the partials are normalised), lse = max + log(sum_p w_p).
#include "tiered_kv_ops.h"
#include "common.cuh"

#define TKV_MERGE_WARPS (TKV_MERGE_THREADS / 32)
#define TKV_MERGE_PER_THREAD ((TKV_MAX_HEAD_DIM + TKV_MERGE_THREADS - 1) / TKV_MERGE_THREADS)

__device__ __forceinline__ float tkv_block_max(float x, float* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = scratch[0];
    for (int w = 1; w < TKV_MERGE_WARPS; ++w) r = fmaxf(r, scratch[w]);
    __syncthreads();  // scratch is free again
    return r;
}

__device__ __forceinline__ float tkv_block_sum(float x, float* scratch) {
    x = tkv_warp_sum(x);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = 0.0f;
    for (int w = 0; w < TKV_MERGE_WARPS; ++w) r += scratch[w];
    __syncthreads();
    return r;
}

template <typename T>
__device__ __forceinline__ void merge_partitions_impl(TKV_PARTITION_MERGE_PARAMS(T)) {
    __shared__ float scratch[TKV_MERGE_WARPS];
    __shared__ float weights[TKV_MERGE_THREADS];
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const long long row = (long long)b * num_heads + h;
    const int start = tkv_max(start_offsets[b], 0);
    const int end = tkv_min(seq_lens[b], max_tokens);
    T* out_row = out + row * head_dim;
    if (end <= start) {  // empty row: paged_decode wrote nothing for it
        for (int d = threadIdx.x; d < head_dim; d += TKV_MERGE_THREADS) out_row[d] = tkv_from_float<T>(0.0f);
        if (threadIdx.x == 0) lse[row] = tkv_neg_inf();
        return;
    }
    const int p_first = start / partition_size;
    const int p_end = tkv_min((end - 1) / partition_size + 1, num_partitions);
    const float* lse_row = part_lse + row * num_partitions;
    const float* parts = part_out + row * num_partitions * head_dim;

    float m = tkv_neg_inf();
    int nan = 0;
    for (int p = p_first + threadIdx.x; p < p_end; p += TKV_MERGE_THREADS) {
        const float x = lse_row[p];
        if (x != x) nan = 1;
        else m = fmaxf(m, x);
    }
    m = tkv_block_max(m, scratch);
    if (__syncthreads_or(nan)) {
        for (int d = threadIdx.x; d < head_dim; d += TKV_MERGE_THREADS) out_row[d] = tkv_from_float<T>(tkv_nan());
        if (threadIdx.x == 0) lse[row] = tkv_nan();
        return;
    }

    float acc[TKV_MERGE_PER_THREAD];
#pragma unroll
    for (int k = 0; k < TKV_MERGE_PER_THREAD; ++k) acc[k] = 0.0f;
    float total = 0.0f;
    for (int chunk = p_first; chunk < p_end; chunk += TKV_MERGE_THREADS) {
        const int p = chunk + threadIdx.x;
        float w = 0.0f;
        if (p < p_end) {
            const float x = lse_row[p];
            w = x == tkv_neg_inf() ? 0.0f : expf(x - m);  // a partition with no weight is never read
        }
        total += w;
        weights[threadIdx.x] = w;
        __syncthreads();
        const int count = tkv_min(TKV_MERGE_THREADS, p_end - chunk);
#pragma unroll 4
        for (int i = 0; i < count; ++i) {
            const float wi = weights[i];
            if (wi == 0.0f) continue;  // uniform: every thread reads the same weight
            const float* part = parts + (long long)(chunk + i) * head_dim;
#pragma unroll
            for (int k = 0; k < TKV_MERGE_PER_THREAD; ++k) {
                const int d = threadIdx.x + k * TKV_MERGE_THREADS;
                if (d < head_dim) acc[k] += wi * part[d];
            }
        }
        __syncthreads();  // weights is rewritten by the next chunk
    }
    total = tkv_block_sum(total, scratch);
#pragma unroll
    for (int k = 0; k < TKV_MERGE_PER_THREAD; ++k) {
        const int d = threadIdx.x + k * TKV_MERGE_THREADS;
        if (d < head_dim) out_row[d] = tkv_from_float<T>(acc[k] / total);
    }
    if (threadIdx.x == 0) lse[row] = m + logf(total);
}

#define TKV_PARTITION_MERGE_ARGS                                                                 \
    out, lse, part_out, part_lse, start_offsets, seq_lens, num_heads, head_dim, num_partitions,  \
    partition_size, max_tokens

// One kernel, instantiated per element type under C names (no C++ mangling for the loader).
extern "C" __global__ void merge_partitions_f32(TKV_PARTITION_MERGE_PARAMS(float)) {
    merge_partitions_impl<float>(TKV_PARTITION_MERGE_ARGS);
}
extern "C" __global__ void merge_partitions_f16(TKV_PARTITION_MERGE_PARAMS(tkv_half)) {
    merge_partitions_impl<tkv_half>(TKV_PARTITION_MERGE_ARGS);
}
extern "C" __global__ void merge_partitions_bf16(TKV_PARTITION_MERGE_PARAMS(tkv_bf16)) {
    merge_partitions_impl<tkv_bf16>(TKV_PARTITION_MERGE_ARGS);
}
