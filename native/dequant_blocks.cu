// Device code (CUDA): dequantize compressed blocks (tiered_kv/compression) straight into the model's dtype.
//
// One thread block per (list entry i, layer, K/V x head): it turns that head's block_size x D codes
// of one packed layer slice into elements of dst[slot], where slot = slots[i] (or i without a list):
// a staging buffer, or the hot slab's slots themselves, so a promotion out of a compressed warm or
// cold tier moves the packed bytes over the link and expands them only where they land. The
// packed slice (compression/__init__.py): K codes, V codes, K scales [H, D] (per channel), K zeros
// (fp8, int4), V scales [H, bs] (per token), V zeros (int4); scales and zeros float16.
// value = code * scale (+ zero), the product rounded before the zero is added, as the torch codec
// does, so both give the same bits.
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
    const int codes = num_kv_heads * block_size * head_dim;
    const int code_bytes = mode == TKV_DEQUANT_INT4 ? codes / 2 : codes;
    const unsigned short* k_scale = reinterpret_cast<const unsigned short*>(p + 2 * code_bytes);
    const bool key_zero = mode != TKV_DEQUANT_INT8;  // fp8 centres key channels, int4 starts them at their minimum
    const bool value_zero = mode == TKV_DEQUANT_INT4;
    const unsigned short* k_zero = k_scale + num_kv_heads * head_dim;
    const unsigned short* v_scale = key_zero ? k_zero + num_kv_heads * head_dim : k_zero;
    const unsigned short* v_zero = v_scale + num_kv_heads * block_size;
    const unsigned char* q = p + kv * code_bytes;
    T* d = dst + slot * dst_slot + layer * dst_layer + kv * dst_kv + h * dst_head;
    const int count = block_size * head_dim;
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
        const int t = e / head_dim;
        const int c = e - t * head_dim;
        const int index = (h * block_size + t) * head_dim + c;
        float code;
        if (mode == TKV_DEQUANT_INT4) {
            const unsigned int b = q[index >> 1];
            code = (float)((index & 1) ? (b >> 4) : (b & 15u));
        } else if (mode == TKV_DEQUANT_INT8) {
            code = (float)(signed char)q[index];
        } else {
            code = tkv_fp8_e4m3_to_float(q[index]);
        }
        const int group = kv == 0 ? h * head_dim + c : h * block_size + t;  // keys per channel, values per token
        float value = __fmul_rn(code, tkv_half_bits_to_float(kv == 0 ? k_scale[group] : v_scale[group]));
        if (kv == 0 ? key_zero : value_zero)
            value = __fadd_rn(value, tkv_half_bits_to_float(kv == 0 ? k_zero[group] : v_zero[group]));
        d[t * dst_tok + c] = tkv_from_float<T>(value);
    }
}

#define TKV_DEQUANT_ARGS \
    dst, dst_slot, dst_layer, dst_kv, dst_head, dst_tok, num_dst_slots, src, src_block, src_layer, slots, \
    num_kv_heads, block_size, head_dim, mode

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
