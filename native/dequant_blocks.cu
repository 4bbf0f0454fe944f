// Device code (CUDA): dequantize compressed blocks (tiered_kv/compression) straight into the model's dtype.
//
// One thread block per (list entry i, layer, K/V x head): it turns that head's block_size x D codes
// of one packed layer slice into elements of dst[slot], where slot = slots[i] (or i without a list):
// a staging buffer, or the hot slab's slots themselves, so a promotion out of a compressed warm or
// cold tier moves the packed bytes over the link and expands them only where they land. The
// packed slice is codec version 3 (compression/__init__.py): K codes, V codes, token-0 codes, then
// float16s; the host passes each part's byte offset (layout_parts). Keys per channel with a zero
// (int8: uint8 codes; fp8: e4m3 centred; int4), values per token in groups of value_group channels
// (int8, fp8 symmetric; int4 with a zero); token 0 of each block apart (row0: float16 values, or e4m3
// with a scale per K/V and head). value = code * scale (+ zero), the product rounded before the
// zero is added, as the torch codec does, so both give the same bits.
#include "tiered_kv_ops.h"
#include "common.cuh"

// An e4m3 byte (float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits; exponent 0 subnormal).
__device__ __forceinline__ float tkv_fp8_e4m3_to_float(unsigned int b) {
    const unsigned int magnitude = b & 0x7fu;
    const float value = magnitude < 8u ? (float)magnitude * 0.001953125f  // m / 8 * 2^-6
                                       : __uint_as_float((((magnitude >> 3) + 120u) << 23) | ((magnitude & 7u) << 20));
    return (b & 0x80u) ? -value : value;
}

__device__ __forceinline__ float tkv_half_bits_to_float(unsigned short bits) {
    tkv_half h;
    h.bits = bits;
    return tkv_to_float(h);
}

template <typename T>
__device__ __forceinline__ void dequant_blocks_impl(TKV_DEQUANT_PARAMS(T)) {
    const int i = blockIdx.x;
    const int layer = blockIdx.y;
    const int kv = (int)blockIdx.z / num_kv_heads;  // 0: keys, 1: values
    const int h = (int)blockIdx.z - kv * num_kv_heads;
    const int slot = slots != nullptr ? slots[i] : i;
    if (slot < 0 || slot >= num_dst_slots) return;  // never out of bounds
    const unsigned char* p = src + i * src_block + layer * src_layer;
    const int first = row0 != TKV_ROW0_NONE ? 1 : 0;  // token 0 stored apart
    const int rows = block_size - first;
    const int groups = head_dim / value_group;
    const unsigned short* k_scale = reinterpret_cast<const unsigned short*>(p + off_k_scale);
    const unsigned short* k_zero = reinterpret_cast<const unsigned short*>(p + off_k_zero);
    const unsigned short* v_scale = reinterpret_cast<const unsigned short*>(p + off_v_scale);
    const unsigned short* v_zero = reinterpret_cast<const unsigned short*>(p + off_v_zero);  // int4 only
    const unsigned char* q = p + (kv == 0 ? 0 : off_v);
    T* d = dst + slot * dst_slot + layer * dst_layer + kv * dst_kv + h * dst_head;
    const int count = block_size * head_dim;
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
        const int t = e / head_dim;
        const int c = e - t * head_dim;
        float value;
        if (t < first) {  // token 0: float16 values (fp8 mode) or e4m3 with a scale per (K/V, head) (int4)
            const int at = (kv * num_kv_heads + h) * head_dim + c;
            if (row0 == TKV_ROW0_F16) {
                value = tkv_half_bits_to_float(reinterpret_cast<const unsigned short*>(p + off_r0)[at]);
            } else {
                const unsigned short* r0_scale = reinterpret_cast<const unsigned short*>(p + off_r0_scale);
                value = __fmul_rn(tkv_fp8_e4m3_to_float(p[off_r0 + at]),
                                  tkv_half_bits_to_float(r0_scale[kv * num_kv_heads + h]));
            }
        } else {
            const int r = t - first;
            const int index = (h * rows + r) * head_dim + c;
            float code;
            if (mode == TKV_DEQUANT_INT4) {
                const unsigned int b = q[index >> 1];
                code = (float)((index & 1) ? (b >> 4) : (b & 15u));
            } else if (mode == TKV_DEQUANT_INT8) {  // keys uint8 (with a zero), values int8
                code = kv == 0 ? (float)q[index] : (float)(signed char)q[index];
            } else {
                code = tkv_fp8_e4m3_to_float(q[index]);
            }
            if (kv == 0) {  // keys per channel, always with a zero
                const int group = h * head_dim + c;
                value = __fadd_rn(__fmul_rn(code, tkv_half_bits_to_float(k_scale[group])),
                                  tkv_half_bits_to_float(k_zero[group]));
            } else {  // values per token and group of value_group channels
                const int group = (h * rows + r) * groups + c / value_group;
                value = __fmul_rn(code, tkv_half_bits_to_float(v_scale[group]));
                if (mode == TKV_DEQUANT_INT4) value = __fadd_rn(value, tkv_half_bits_to_float(v_zero[group]));
            }
        }
        d[t * dst_tok + c] = tkv_from_float<T>(value);
    }
}

#define TKV_DEQUANT_ARGS \
    dst, dst_slot, dst_layer, dst_kv, dst_head, dst_tok, num_dst_slots, src, src_block, src_layer, slots, \
    num_kv_heads, block_size, head_dim, mode, value_group, row0, off_v, off_r0, off_k_scale, off_k_zero, \
    off_v_scale, off_v_zero, off_r0_scale

// One kernel, instantiated per element type under C names (no C++ mangling for the loader).
extern "C" __global__ void dequant_blocks_f32(TKV_DEQUANT_PARAMS(float)) {
    dequant_blocks_impl<float>(TKV_DEQUANT_ARGS);
}
extern "C" __global__ void dequant_blocks_f16(TKV_DEQUANT_PARAMS(tkv_half)) {
    dequant_blocks_impl<tkv_half>(TKV_DEQUANT_ARGS);
}
extern "C" __global__ void dequant_blocks_bf16(TKV_DEQUANT_PARAMS(tkv_bf16)) {
    dequant_blocks_impl<tkv_bf16>(TKV_DEQUANT_ARGS);
}
