// Device code (CUDA): element conversions and small helpers shared by the kernels.
// No system headers: fp16 goes through PTX cvt, bf16 through bit arithmetic (round to
// nearest even, the same rounding torch uses), so NVRTC needs no include path.
#pragma once
#include "tiered_kv_ops.h"

__device__ __forceinline__ float tkv_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float tkv_nan() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ int tkv_max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int tkv_min(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float tkv_to_float(float x) { return x; }
__device__ __forceinline__ float tkv_to_float(tkv_half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float tkv_to_float(tkv_bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T tkv_from_float(float f);
template <> __device__ __forceinline__ float tkv_from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ tkv_half tkv_from_float<tkv_half>(float f) {
    tkv_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ tkv_bf16 tkv_from_float<tkv_bf16>(float f) {
    tkv_bf16 h;
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = 0x7fc0;  // NaN stays NaN (a plain round could carry it into inf)
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        h.bits = (unsigned short)(u >> 16);
    }
    return h;
}

// 16 bytes from global memory (device or pinned host through UVA) at a 16-byte aligned generic
// address: a pointer that went through shared memory has lost its address space, so it is
// converted back explicitly (a generic load would do, but not as an LDG.128).
__device__ __forceinline__ uint4 tkv_load_global16(const void* p) {
    uint4 r;
    asm("{\n\t.reg .u64 ga;\n\tcvta.to.global.u64 ga, %4;\n\tld.global.v4.u32 {%0, %1, %2, %3}, [ga];\n\t}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ float tkv_warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Copies one block (block_size rows of row_bytes contiguous bytes each) in units of U.
template <typename U>
__device__ __forceinline__ void tkv_copy_block(char* dst, const char* src, long long dst_tok,
                                               long long src_tok, int block_size, int row_bytes) {
    const int units_per_row = row_bytes / (int)sizeof(U);
    const int num_units = block_size * units_per_row;
    for (int i = threadIdx.x; i < num_units; i += blockDim.x) {
        const int tok = i / units_per_row;
        const int unit = i - tok * units_per_row;
        const U* s = reinterpret_cast<const U*>(src + tok * src_tok) + unit;
        U* d = reinterpret_cast<U*>(dst + tok * dst_tok) + unit;
        *d = *s;
    }
}


__device__ __forceinline__ void tkv_copy_block_vec(char* dst, const char* src, long long dst_tok,
                                                   long long src_tok, int block_size, int row_bytes,
                                                   int vec) {
    switch (vec) {
        case 16: tkv_copy_block<uint4>(dst, src, dst_tok, src_tok, block_size, row_bytes); break;
        case 8: tkv_copy_block<uint2>(dst, src, dst_tok, src_tok, block_size, row_bytes); break;
        case 4: tkv_copy_block<unsigned int>(dst, src, dst_tok, src_tok, block_size, row_bytes); break;
        case 2: tkv_copy_block<unsigned short>(dst, src, dst_tok, src_tok, block_size, row_bytes); break;
        default: tkv_copy_block<unsigned char>(dst, src, dst_tok, src_tok, block_size, row_bytes); break;
    }
}
