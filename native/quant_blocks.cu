// Device code (CUDA): quantize blocks of the model's dtype into compressed packed layer slices (tiered_kv/compression).
//
// One thread block per (list entry i, layer, K/V x head), the grid of dequant_blocks.cu: it packs head h's keys or
// values of src[slot] (slot = slots[i], or i without a list; a slot-major view such as the hot slab's slots) into the
// packed layer slice dst[i, layer] (device memory, or pinned host memory through UVA), so a demotion into a
// compressed tier reads the model's bytes once where they lie and sends only the packed bytes over the link.
// The layout is codec version 3 (compression/__init__.py); the host passes each part's byte offset (layout_parts).
//
// Bit for bit compression/packing.py's `encode` on the CPU: the same float32 operations in the same order (min and
// max reductions; float16 scales and zeros clamped to +-65504 and rounded to nearest even; x * (1 / scale) with a
// correctly rounded reciprocal, 0 for a zero scale; rintf (half to even); clamps; e4m3 codes rounded to nearest even
// as c10's fp8_e4m3fn_from_fp32_value does, after a clamp to +-448), the int4 nibble order (an even channel in the
// low nibble) and a zero pad byte. One liberty: a group of zeros has the scale +0 (torch's maximum gives -0 or +0
// there, by the element's position in its vector loop).
//
//   keys:   one group per channel over the rows quantized (tokens first..bs-1): a thread per channel (int4: per
//           pair of channels, one code byte), min/max over the rows, then the codes; uint8 (int8), fp8c (fp8),
//           int4; always with a zero.
//   values: one group per row and value_group channels: a warp per group, lanes over its channels, warp min/max.
//   row 0:  float16 values (fp8 mode), or e4m3 with a scale per (K/V, head) over head_dim (int4: one warp).
#include "tiered_kv_ops.h"
#include "common.cuh"

#define TKV_FMT_INT8 0   // symmetric: 127 levels each side of 0
#define TKV_FMT_UINT8 1  // asymmetric: zero = the minimum, 255 levels
#define TKV_FMT_INT4 2   // asymmetric, 15 levels, two codes a byte
#define TKV_FMT_FP8 3    // e4m3, symmetric: the largest magnitude maps to 448
#define TKV_FMT_FP8C 4   // e4m3 centred on the group's midpoint (the zero)

__device__ __forceinline__ float tkv_pos_inf() { return __int_as_float(0x7f800000); }

// packing._half: clamped to the largest finite float16, then rounded to nearest even.
__device__ __forceinline__ unsigned short tkv_half_bits(float x) {
    return tkv_from_float<tkv_half>(fminf(fmaxf(x, -65504.0f), 65504.0f)).bits;
}

__device__ __forceinline__ float tkv_half_value(unsigned short bits) {
    tkv_half h;
    h.bits = bits;
    return tkv_to_float(h);
}

// float -> float8_e4m3fn byte as c10's fp8e4m3fn_from_fp32_value (what torch's cast does): round to nearest even;
// below 2^-6 through a float add of 2^14, whose ulp is the e4m3 subnormal step 2^-9; 480 and up NaN (never here).
__device__ __forceinline__ unsigned int tkv_float_to_e4m3(float f) {
    unsigned int bits = __float_as_uint(f);
    const unsigned int sign = bits & 0x80000000u;
    bits ^= sign;
    unsigned int result;
    if (bits >= (1087u << 20)) {
        result = 0x7fu;
    } else if (bits < (121u << 23)) {
        const unsigned int denorm_mask = 141u << 23;
        result = (__float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(denorm_mask))) - denorm_mask) & 0xffu;
    } else {
        const unsigned int mantissa_odd = (bits >> 20) & 1u;
        bits += (unsigned int)((7 - 127) * (1 << 23)) + 0x7ffffu;
        bits += mantissa_odd;
        result = (bits >> 20) & 0xffu;
    }
    return result | (sign >> 24);
}

struct tkv_qgroup {
    float zero;                // code = q((x - zero) * inv)
    float inv;                 // 1 / scale, 0 for a scale that is not positive (every code 0)
    unsigned short scale_bits;  // the float16 stored
    unsigned short zero_bits;
};

// A group's scale and zero from its minimum and maximum (packing._encode_group).
__device__ __forceinline__ tkv_qgroup tkv_qgroup_of(int fmt, float low, float high) {
    tkv_qgroup g;
    g.zero = 0.0f;
    g.zero_bits = 0;
    float scale;
    if (fmt == TKV_FMT_UINT8 || fmt == TKV_FMT_INT4) {
        g.zero_bits = tkv_half_bits(low);
        g.zero = tkv_half_value(g.zero_bits);
        scale = (high - g.zero) / (fmt == TKV_FMT_UINT8 ? 255.0f : 15.0f);
    } else {
        if (fmt == TKV_FMT_FP8C) {
            g.zero_bits = tkv_half_bits(__fmul_rn(low + high, 0.5f));
            g.zero = tkv_half_value(g.zero_bits);
            low = low - g.zero;
            high = high - g.zero;
        }
        // + 0: max(-0, +0) of a group of zeros is +0 whichever operand fmaxf returns
        scale = __fadd_rn(fmaxf(-low, high), 0.0f) / (fmt == TKV_FMT_INT8 ? 127.0f : 448.0f);
    }
    g.scale_bits = tkv_half_bits(scale);
    const float s = tkv_half_value(g.scale_bits);
    g.inv = s > 0.0f ? 1.0f / s : 0.0f;
    return g;
}

// The code of x in its group: a byte (int8 as its two's complement), a nibble for int4.
__device__ __forceinline__ unsigned int tkv_qcode(int fmt, const tkv_qgroup& g, float x) {
    if (fmt == TKV_FMT_INT8) {
        const float c = fminf(fmaxf(rintf(__fmul_rn(x, g.inv)), -127.0f), 127.0f);
        return (unsigned int)(unsigned char)(signed char)(int)c;
    }
    if (fmt == TKV_FMT_UINT8 || fmt == TKV_FMT_INT4) {
        const float c = fminf(fmaxf(rintf(__fmul_rn(x - g.zero, g.inv)), 0.0f), fmt == TKV_FMT_UINT8 ? 255.0f : 15.0f);
        return (unsigned int)c;
    }
    return tkv_float_to_e4m3(fminf(fmaxf(__fmul_rn(x - g.zero, g.inv), -448.0f), 448.0f));
}

__device__ __forceinline__ float tkv_warp_min(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float tkv_warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// One group along a row of `count` contiguous elements, by one warp: its float16 scale (and zero) and its codes
// (`codes`: one byte per `wide` elements).
template <typename T>
__device__ __forceinline__ tkv_qgroup tkv_quant_row(int fmt, int wide, const T* x, int count, unsigned char* codes,
                                                   int lane) {
    const int units = count / wide;
    float low = tkv_pos_inf(), high = tkv_neg_inf();
    for (int u = lane; u < units; u += 32) {
        for (int j = 0; j < wide; ++j) {
            const float v = tkv_to_float(x[u * wide + j]);
            low = fminf(low, v);
            high = fmaxf(high, v);
        }
    }
    low = tkv_warp_min(low);
    high = tkv_warp_max(high);
    const tkv_qgroup g = tkv_qgroup_of(fmt, low, high);
    for (int u = lane; u < units; u += 32) {
        unsigned int byte = 0;
        for (int j = 0; j < wide; ++j) byte |= tkv_qcode(fmt, g, tkv_to_float(x[u * wide + j])) << (4 * j);
        codes[u] = (unsigned char)byte;
    }
    return g;
}

template <typename T>
__device__ __forceinline__ void quant_blocks_impl(TKV_QUANT_PARAMS(T)) {
    const int i = blockIdx.x;
    const int layer = blockIdx.y;
    const int kv = (int)blockIdx.z / num_kv_heads;  // 0: keys, 1: values
    const int h = (int)blockIdx.z - kv * num_kv_heads;
    const int slot = slots != nullptr ? slots[i] : i;
    if (slot < 0 || slot >= num_src_slots) return;  // never read out of bounds; dst[i] is left as it is
    const T* s = src + slot * src_slot + layer * src_layer + kv * src_kv + h * src_head;
    unsigned char* p = dst + i * dst_block + layer * dst_layer;
    const int first = row0 != TKV_ROW0_NONE ? 1 : 0;  // token 0 stored apart
    const int rows = block_size - first;
    const int fmt = mode == TKV_DEQUANT_FP8 ? (kv == 0 ? TKV_FMT_FP8C : TKV_FMT_FP8)
                  : mode == TKV_DEQUANT_INT8 ? (kv == 0 ? TKV_FMT_UINT8 : TKV_FMT_INT8) : TKV_FMT_INT4;
    const int wide = fmt == TKV_FMT_INT4 ? 2 : 1;  // channels per code byte
    const int row_bytes = head_dim / wide;
    const int lane = (int)threadIdx.x & 31;
    const int warp = (int)threadIdx.x >> 5;
    const int warps = (int)blockDim.x >> 5;
    unsigned char* codes = p + (kv == 0 ? 0 : off_v) + h * rows * row_bytes;  // [rows, row_bytes] of this head
    if (kv == 0) {  // keys: a group per channel over the rows; a thread per code byte's channels
        unsigned short* k_scale = reinterpret_cast<unsigned short*>(p + off_k_scale) + h * head_dim;
        unsigned short* k_zero = reinterpret_cast<unsigned short*>(p + off_k_zero) + h * head_dim;
        for (int u = threadIdx.x; u < row_bytes; u += blockDim.x) {
            float low[2] = {tkv_pos_inf(), tkv_pos_inf()}, high[2] = {tkv_neg_inf(), tkv_neg_inf()};
            for (int t = first; t < block_size; ++t) {
                for (int j = 0; j < wide; ++j) {
                    const float v = tkv_to_float(s[t * src_tok + u * wide + j]);
                    low[j] = fminf(low[j], v);
                    high[j] = fmaxf(high[j], v);
                }
            }
            tkv_qgroup g[2];
            for (int j = 0; j < wide; ++j) {
                g[j] = tkv_qgroup_of(fmt, low[j], high[j]);
                k_scale[u * wide + j] = g[j].scale_bits;
                k_zero[u * wide + j] = g[j].zero_bits;
            }
            for (int t = first; t < block_size; ++t) {
                unsigned int byte = 0;
                for (int j = 0; j < wide; ++j) byte |= tkv_qcode(fmt, g[j], tkv_to_float(s[t * src_tok + u * wide + j])) << (4 * j);
                codes[(t - first) * row_bytes + u] = (unsigned char)byte;
            }
        }
    } else {  // values: a group per row and value_group channels; a warp per group
        const int groups = head_dim / value_group;
        unsigned short* v_scale = reinterpret_cast<unsigned short*>(p + off_v_scale) + h * rows * groups;
        unsigned short* v_zero = off_v_zero >= 0 ? reinterpret_cast<unsigned short*>(p + off_v_zero) + h * rows * groups
                                                 : nullptr;
        for (int item = warp; item < rows * groups; item += warps) {
            const int r = item / groups;
            const int group = item - r * groups;
            const tkv_qgroup g = tkv_quant_row(fmt, wide, s + (r + first) * src_tok + group * value_group, value_group,
                                               codes + r * row_bytes + group * (value_group / wide), lane);
            if (lane == 0) {
                v_scale[item] = g.scale_bits;
                if (v_zero != nullptr) v_zero[item] = g.zero_bits;
            }
        }
    }
    if (first) {  // token 0 of the block, this (K/V, head)'s row: float16 values, or e4m3 with a scale
        const int row = kv * num_kv_heads + h;
        if (row0 == TKV_ROW0_F16) {
            unsigned short* r0 = reinterpret_cast<unsigned short*>(p + off_r0) + row * head_dim;
            for (int c = threadIdx.x; c < head_dim; c += blockDim.x) r0[c] = tkv_half_bits(tkv_to_float(s[c]));
        } else if (warp == warps - 1) {
            const tkv_qgroup g = tkv_quant_row(TKV_FMT_FP8, 1, s, head_dim, p + off_r0 + row * head_dim, lane);
            if (lane == 0) reinterpret_cast<unsigned short*>(p + off_r0_scale)[row] = g.scale_bits;
        }
    }
    if (off_pad >= 0 && blockIdx.z == 0 && threadIdx.x == 0) p[off_pad] = 0;  // the byte before the float16s
}

#define TKV_QUANT_ARGS \
    dst, dst_block, dst_layer, src, src_slot, src_layer, src_kv, src_head, src_tok, num_src_slots, slots, \
    num_kv_heads, block_size, head_dim, mode, value_group, row0, off_v, off_r0, off_k_scale, off_k_zero, \
    off_v_scale, off_v_zero, off_r0_scale, off_pad

// One kernel, instantiated per source element type under C names (no C++ mangling for the loader).
extern "C" __global__ void quant_blocks_f32(TKV_QUANT_PARAMS(float)) {
    quant_blocks_impl<float>(TKV_QUANT_ARGS);
}
extern "C" __global__ void quant_blocks_f16(TKV_QUANT_PARAMS(tkv_half)) {
    quant_blocks_impl<tkv_half>(TKV_QUANT_ARGS);
}
extern "C" __global__ void quant_blocks_bf16(TKV_QUANT_PARAMS(tkv_bf16)) {
    quant_blocks_impl<tkv_bf16>(TKV_QUANT_ARGS);
}
