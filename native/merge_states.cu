// Device code (CUDA): merge two partial attentions by their log-sum-exp (flash-decoding merge).
//
// One thread block per (head h, row b); threads stride over D. Each partial covers a disjoint
// set of keys; its weight is exp(lse - max lse), so the merge is exact up to float32 rounding.
#include "tiered_kv_ops.h"
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void merge_states_impl(TKV_MERGE_PARAMS(T)) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const long long row = (long long)b * num_heads + h;
    const float la = lse_a[row];
    const float lb = lse_b[row];
    const float m = fmaxf(la, lb);
    const bool empty = m == tkv_neg_inf();
    // exp(-inf - m) = 0 for an empty side; both empty is handled apart (it would be 0/0)
    const float wa = empty ? 0.0f : expf(la - m);
    const float wb = empty ? 0.0f : expf(lb - m);
    const float total = wa + wb;
    const T* a_row = out_a + b * a_stride_b + h * a_stride_h;
    const T* b_row = out_b + b * b_stride_b + h * b_stride_h;
    T* out_row = out + row * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        if (!empty) value = (wa * tkv_to_float(a_row[d]) + wb * tkv_to_float(b_row[d])) / total;
        out_row[d] = tkv_from_float<T>(value);
    }
    if (threadIdx.x == 0) lse[row] = empty ? tkv_neg_inf() : m + logf(total);
}

#define TKV_MERGE_ARGS \
    out, lse, out_a, a_stride_b, a_stride_h, lse_a, out_b, b_stride_b, b_stride_h, lse_b, num_heads, head_dim

// One kernel, instantiated per element type under C names (no C++ mangling for the loader).
extern "C" __global__ void merge_states_f32(TKV_MERGE_PARAMS(float)) {
    merge_states_impl<float>(TKV_MERGE_ARGS);
}
extern "C" __global__ void merge_states_f16(TKV_MERGE_PARAMS(tkv_half)) {
    merge_states_impl<tkv_half>(TKV_MERGE_ARGS);
}
extern "C" __global__ void merge_states_bf16(TKV_MERGE_PARAMS(tkv_bf16)) {
    merge_states_impl<tkv_bf16>(TKV_MERGE_ARGS);
}
