// Device code (CUDA): split paged-attention decode over tiered K/V blocks (flash-decoding).
//
// Grid (num_partitions, num_kv_heads * group tiles, B), TKV_DECODE_THREADS = 128 threads. A CTA
// takes one partition of one row's positions for up to G query heads of one KV head's GQA group
// (G = 1, 2, 4 or 8: one entry point each, so a small group does not pay the registers of a large
// one; a group larger than 8 is cut into tiles of 8 over gridDim.y; the scalar entries, for rows
// that are not 16-byte aligned, use G = 8). Every K/V element the CTA needs is loaded once and
// used for all of its query heads.
//
// Lanes: a row of D elements is split into `nv` units (16-byte vectors of 8 halves / 4 floats
// when the host promises alignment, single elements otherwise). `tg` = min(32, next power of two
// >= nv) consecutive lanes share one position (a "slice"); lane j of a slice holds units j, j+tg,
// ... (at most 8 elements per lane, since D <= 256). 128 / tg slices walk the partition's positions
// (two per step, loads first), each keeping a float32 online softmax (running max m, sum l, acc)
// per query head in the log2 domain (the query is pre-multiplied by scale * log2(e)). At the end
// the slices of a warp merge through shuffles, the four warps through shared memory.
//
// The block table is read in windows of TKV_DECODE_TABLE_WINDOW blocks: each entry (slot, tag)
// once per CTA, validated and resolved to K/V row pointers for this KV head in shared memory. A
// bad entry makes the partition NaN (merged: the whole row). Positions outside the row's
// [start, end) are never read, nor their table entries.
//
// num_partitions == 1: the CTA writes out (query dtype) and lse itself. Otherwise it writes the
// normalised partial out and lse (natural log) of its partition to part_out/part_lse and
// merge_partitions.cu combines them.
#include "tiered_kv_ops.h"
#include "common.cuh"

#define TKV_DECODE_WARPS (TKV_DECODE_THREADS / 32)
#define TKV_LANE_ELEMS (TKV_MAX_HEAD_DIM / 32)  // elements of one K/V row a lane holds, at most
#define TKV_DECODE_UNROLL 2                      // positions per slice per step (loads issued together)
#define TKV_LOG2E 1.4426950408889634f
#define TKV_LN2 0.6931471805599453f

// The parameter names of TKV_DECODE_PARAMS, to forward them.
#define TKV_DECODE_ARGS                                                                          \
    out, lse, query, q_stride_b, q_stride_h,                                                     \
    k0, v0, k0_slot, k0_head, k0_tok, v0_slot, v0_head, v0_tok, num_slots0,                      \
    k1, v1, k1_slot, k1_head, k1_tok, v1_slot, v1_head, v1_tok, num_slots1,                      \
    k2, v2, k2_slot, k2_head, k2_tok, v2_slot, v2_head, v2_tok, num_slots2,                      \
    num_sources, block_table, table_stride_b, tier_tags, tag_bytes, start_offsets, seq_lens,     \
    num_kv_heads, groups, head_dim, block_size, max_blocks, scale,                               \
    part_out, part_lse, num_partitions, partition_size

// One table entry of the current window, resolved for the CTA's KV head: token 0's K and V rows.
template <typename T>
struct tkv_block_rows {
    const T* k;
    const T* v;
    long long k_tok;
    long long v_tok;
};

template <typename T, int G>
struct tkv_decode_smem {
    tkv_block_rows<T> blocks[TKV_DECODE_TABLE_WINDOW];
    float m[TKV_DECODE_WARPS][G];
    float l[TKV_DECODE_WARPS][G];
    float acc[TKV_DECODE_WARPS][G][TKV_MAX_HEAD_DIM];
};

// What one CTA works on: row b, KV head kv_head, query heads [h0, h0 + ng), positions [lo, hi).
struct tkv_decode_cta {
    int b, kv_head, h0, ng, lo, hi, log2_bs;
};

template <typename T, int VEC>
struct tkv_pack {
    T e[VEC];
};

// VEC consecutive elements at p: one 16-byte load when they fill 16 bytes (p aligned), else one by one.
template <typename T, int VEC>
__device__ __forceinline__ tkv_pack<T, VEC> tkv_load_pack(const T* p) {
    tkv_pack<T, VEC> r;
    if constexpr (VEC * sizeof(T) == 16) {
        union {
            uint4 u;
            tkv_pack<T, VEC> t;
        } x;
        x.u = tkv_load_global16(p);
        r = x.t;
    } else {
#pragma unroll
        for (int c = 0; c < VEC; ++c) r.e[c] = p[c];
    }
    return r;
}

// Reads, validates and resolves table entries [first, first + count) of row cta.b into sm.blocks;
// returns non-zero (to every thread) when one names a tag >= num_sources or a slot outside its source.
template <typename T, int G>
__device__ __forceinline__ int tkv_load_window(tkv_decode_smem<T, G>& sm, const tkv_decode_cta& cta, int first,
                                               int count, TKV_DECODE_PARAMS(T)) {
    int bad = 0;
    for (int i = threadIdx.x; i < count; i += TKV_DECODE_THREADS) {
        const int blk = first + i;
        const int slot = block_table[cta.b * table_stride_b + blk];
        int tag = 0;
        if (tier_tags != 0) {
            const long long at = (long long)cta.b * max_blocks + blk;
            tag = tag_bytes == 1 ? (int)((const signed char*)tier_tags)[at] : ((const int*)tier_tags)[at];
        }
        const T* k = 0;
        const T* v = 0;
        long long ks = 0, kh = 0, kt = 0, vs = 0, vh = 0, vt = 0;
        int num_slots = 0;  // an unknown tag has no slots: every slot is out of range
        if (tag == 0) {
            k = k0; v = v0; ks = k0_slot; kh = k0_head; kt = k0_tok; vs = v0_slot; vh = v0_head; vt = v0_tok;
            num_slots = num_slots0;
        } else if (tag == 1) {
            k = k1; v = v1; ks = k1_slot; kh = k1_head; kt = k1_tok; vs = v1_slot; vh = v1_head; vt = v1_tok;
            num_slots = num_slots1;
        } else if (tag == 2) {
            k = k2; v = v2; ks = k2_slot; kh = k2_head; kt = k2_tok; vs = v2_slot; vh = v2_head; vt = v2_tok;
            num_slots = num_slots2;
        }
        if (tag < 0 || tag >= num_sources || slot < 0 || slot >= num_slots) {
            bad = 1;
        } else {
            tkv_block_rows<T> rows;
            rows.k = k + slot * ks + cta.kv_head * kh;
            rows.v = v + slot * vs + cta.kv_head * vh;
            rows.k_tok = kt;
            rows.v_tok = vt;
            sm.blocks[i] = rows;
        }
    }
    return __syncthreads_or(bad);
}

// The lanes' work for one CTA with K/V units of VEC elements: online softmax over [cta.lo, cta.hi),
// then each warp's merged state (m, l, acc per query head, log2 domain) into sm.m/sm.l/sm.acc.
// Returns non-zero (uniformly) when a table entry in range is bad; sm then holds no state.
template <typename T, int VEC, int G>
__device__ __forceinline__ int tkv_decode_lanes(tkv_decode_smem<T, G>& sm, const tkv_decode_cta& cta,
                                                TKV_DECODE_PARAMS(T)) {
    constexpr int UNITS = TKV_LANE_ELEMS / VEC;  // units per lane, at most
    constexpr int U = TKV_DECODE_UNROLL;
    const unsigned full = 0xffffffffu;
    const int nv = head_dim / VEC;
    int tg = 1;
    while (tg < nv && tg < 32) tg <<= 1;
    const int units = (nv + tg - 1) / tg;  // <= UNITS since head_dim <= TKV_MAX_HEAD_DIM
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = lane & (tg - 1);
    const int per_warp = 32 / tg;
    const int slice = warp * per_warp + lane / tg;
    const int slices = TKV_DECODE_WARPS * per_warp;
    const int warp_first = warp * per_warp;  // the warp's lowest slice: it has work whenever any does
    const int ng = cta.ng;
    const int bs_mask = block_size - 1;

    float q[G][TKV_LANE_ELEMS];
    float acc[G][TKV_LANE_ELEMS];
    float m[G];
    float l[G];
    const float qscale = scale * TKV_LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const T* q_row = query + cta.b * q_stride_b + (long long)(cta.h0 + g) * q_stride_h;
#pragma unroll
        for (int i = 0; i < UNITS; ++i) {
            const int unit = j + tg * i;
            const bool active = g < ng && i < units && unit < nv;
#pragma unroll
            for (int c = 0; c < VEC; ++c) {
                q[g][i * VEC + c] = active ? tkv_to_float(q_row[unit * VEC + c]) * qscale : 0.0f;
                acc[g][i * VEC + c] = 0.0f;
            }
        }
        m[g] = tkv_neg_inf();
        l[g] = 0.0f;
    }

    const int blk_first = cta.lo >> cta.log2_bs;
    const int blk_end = ((cta.hi - 1) >> cta.log2_bs) + 1;
    for (int first = blk_first; first < blk_end; first += TKV_DECODE_TABLE_WINDOW) {
        const int count = tkv_min(TKV_DECODE_TABLE_WINDOW, blk_end - first);
        __syncthreads();  // every thread is done with the previous window's entries
        if (tkv_load_window<T, G>(sm, cta, first, count, TKV_DECODE_ARGS)) return 1;
        const int p_lo = tkv_max(cta.lo, first << cta.log2_bs);
        const int p_hi = tkv_min(cta.hi, (first + count) << cta.log2_bs);
        // warp-uniform trip count: the shuffles below need all 32 lanes; a slice past p_hi idles
        for (int base = p_lo; base + warp_first < p_hi; base += slices * U) {
            tkv_pack<T, VEC> kr[U][UNITS];
            tkv_pack<T, VEC> vr[U][UNITS];
            bool ok[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int p = base + slice + u * slices;
                ok[u] = p < p_hi;
                const T* k_row = 0;
                const T* v_row = 0;
                if (ok[u]) {
                    const tkv_block_rows<T> rows = sm.blocks[(p >> cta.log2_bs) - first];
                    const int tok = p & bs_mask;
                    k_row = rows.k + tok * rows.k_tok;
                    v_row = rows.v + tok * rows.v_tok;
                }
#pragma unroll
                for (int i = 0; i < UNITS; ++i) {
                    const int unit = j + tg * i;
                    kr[u][i] = tkv_pack<T, VEC>{};
                    vr[u][i] = tkv_pack<T, VEC>{};
                    if (ok[u] && i < units && unit < nv) {
                        kr[u][i] = tkv_load_pack<T, VEC>(k_row + unit * VEC);
                        vr[u][i] = tkv_load_pack<T, VEC>(v_row + unit * VEC);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float dot[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    dot[g] = 0.0f;
                    if (g < ng) {
#pragma unroll
                        for (int i = 0; i < UNITS; ++i) {
#pragma unroll
                            for (int c = 0; c < VEC; ++c) dot[g] += q[g][i * VEC + c] * tkv_to_float(kr[u][i].e[c]);
                        }
                    }
                }
                for (int offset = tg >> 1; offset > 0; offset >>= 1) {
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        if (g < ng) dot[g] += __shfl_xor_sync(full, dot[g], offset);
                    }
                }
                if (!ok[u]) continue;  // uniform within the slice (its lanes share the position)
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g >= ng) continue;
                    const float s = dot[g];
                    if (s > m[g]) {  // a new max: rescale (exp2(-inf) = 0 on the first position)
                        const float carry = exp2f(m[g] - s);
                        m[g] = s;
                        l[g] *= carry;
#pragma unroll
                        for (int e = 0; e < TKV_LANE_ELEMS; ++e) acc[g][e] *= carry;
                    }
                    const float weight = exp2f(s - m[g]);  // NaN scores stay NaN (s > m is false)
                    l[g] += weight;
#pragma unroll
                    for (int i = 0; i < UNITS; ++i) {
#pragma unroll
                        for (int c = 0; c < VEC; ++c) {
                            acc[g][i * VEC + c] += weight * tkv_to_float(vr[u][i].e[c]);
                        }
                    }
                }
            }
        }
    }

    // merge the warp's slices (lanes j, j + tg, j + 2tg, ... hold the same elements)
    for (int offset = tg; offset < 32; offset <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= ng) continue;
            const float m_other = __shfl_xor_sync(full, m[g], offset);
            const float l_other = __shfl_xor_sync(full, l[g], offset);
            const float m_new = fmaxf(m[g], m_other);
            // a slice that saw no position has m = -inf, l = 0, acc = 0: weight 0 (never -inf - -inf)
            const float w_self = m[g] == tkv_neg_inf() ? 0.0f : exp2f(m[g] - m_new);
            const float w_other = m_other == tkv_neg_inf() ? 0.0f : exp2f(m_other - m_new);
            l[g] = l[g] * w_self + l_other * w_other;
#pragma unroll
            for (int e = 0; e < TKV_LANE_ELEMS; ++e) {
                const float a_other = __shfl_xor_sync(full, acc[g][e], offset);
                acc[g][e] = acc[g][e] * w_self + a_other * w_other;
            }
            m[g] = m_new;
        }
    }
    if (lane < tg) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= ng) continue;
#pragma unroll
            for (int i = 0; i < UNITS; ++i) {
                const int unit = j + tg * i;
                if (i < units && unit < nv) {
#pragma unroll
                    for (int c = 0; c < VEC; ++c) sm.acc[warp][g][unit * VEC + c] = acc[g][i * VEC + c];
                }
            }
            if (lane == 0) {
                sm.m[warp][g] = m[g];
                sm.l[warp][g] = l[g];
            }
        }
    }
    return 0;
}

// VECTOR: K/V rows are 16-byte aligned (see the header) and read in 16-byte units; else element by element.
template <typename T, int G, bool VECTOR>
__device__ __forceinline__ void paged_decode_impl(TKV_DECODE_PARAMS(T)) {
    __shared__ tkv_decode_smem<T, G> sm;
    const int part = blockIdx.x;
    const int tiles = (groups + G - 1) / G;
    tkv_decode_cta cta;
    cta.kv_head = blockIdx.y / tiles;
    const int tile = blockIdx.y - cta.kv_head * tiles;
    cta.b = blockIdx.z;
    cta.h0 = cta.kv_head * groups + tile * G;
    cta.ng = tkv_min(G, groups - tile * G);
    cta.log2_bs = __ffs(block_size) - 1;  // block_size is a power of two
    const int num_q_heads = num_kv_heads * groups;
    const int table_tokens = max_blocks * block_size;
    const int start = tkv_max(start_offsets[cta.b], 0);
    const int end = tkv_min(seq_lens[cta.b], table_tokens);
    const bool direct = num_partitions == 1;  // one partition: the whole row, written as out/lse
    const long long part_lo = (long long)part * partition_size;
    const long long part_hi = part_lo + partition_size;
    const long long lo = direct || start > part_lo ? (long long)start : part_lo;
    const long long hi = direct || end < part_hi ? (long long)end : part_hi;
    if (!direct && lo >= hi) return;  // a partition the row does not reach: merge_partitions skips it
    const bool empty = lo >= hi;
    cta.lo = (int)lo;
    cta.hi = (int)hi;
    const int ng = cta.ng;

    int bad = 0;
    if (!empty) bad = tkv_decode_lanes<T, VECTOR ? 16 / (int)sizeof(T) : 1, G>(sm, cta, TKV_DECODE_ARGS);

    const long long head_row = (long long)cta.b * num_q_heads + cta.h0;  // (row, first q head)
    const int total = ng * head_dim;
    if (bad || empty) {  // only in direct mode can `empty` get here
        if (direct) {
            const float value = bad ? tkv_nan() : 0.0f;
            T* out_rows = out + head_row * head_dim;
            for (int idx = threadIdx.x; idx < total; idx += TKV_DECODE_THREADS) {
                out_rows[idx] = tkv_from_float<T>(value);
            }
            if (threadIdx.x < ng) lse[head_row + threadIdx.x] = bad ? tkv_nan() : tkv_neg_inf();
        } else if (threadIdx.x < ng) {
            part_lse[(head_row + threadIdx.x) * num_partitions + part] = tkv_nan();
        }
        return;
    }

    __syncthreads();  // every warp's state is in sm
    for (int idx = threadIdx.x; idx < total; idx += TKV_DECODE_THREADS) {
        const int g = idx / head_dim;
        const int d = idx - g * head_dim;
        float m_all = tkv_neg_inf();
#pragma unroll
        for (int w = 0; w < TKV_DECODE_WARPS; ++w) m_all = fmaxf(m_all, sm.m[w][g]);
        float l_all = 0.0f;
        float value = 0.0f;
#pragma unroll
        for (int w = 0; w < TKV_DECODE_WARPS; ++w) {
            const float m_w = sm.m[w][g];
            const float weight = m_w == tkv_neg_inf() ? 0.0f : exp2f(m_w - m_all);
            l_all += weight * sm.l[w][g];
            value += weight * sm.acc[w][g][d];
        }
        value /= l_all;
        const float row_lse = (m_all + log2f(l_all)) * TKV_LN2;
        if (direct) {
            out[head_row * head_dim + idx] = tkv_from_float<T>(value);
            if (d == 0) lse[head_row + g] = row_lse;
        } else {
            const long long at = (head_row + g) * num_partitions + part;
            part_out[at * head_dim + d] = value;
            if (d == 0) part_lse[at] = row_lse;
        }
    }
}

// One kernel, instantiated per group tile, load width and element type under C names (no C++ mangling
// for the loader): paged_decode_g<G>_* read 16-byte units, paged_decode_scalar_* (G = 8) any layout.
extern "C" __global__ void paged_decode_g1_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float, 1, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g2_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float, 2, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g4_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float, 4, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g8_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float, 8, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_scalar_f32(TKV_DECODE_PARAMS(float)) {
    paged_decode_impl<float, 8, false>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g1_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half, 1, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g2_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half, 2, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g4_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half, 4, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g8_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half, 8, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_scalar_f16(TKV_DECODE_PARAMS(tkv_half)) {
    paged_decode_impl<tkv_half, 8, false>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g1_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16, 1, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g2_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16, 2, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g4_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16, 4, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_g8_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16, 8, true>(TKV_DECODE_ARGS);
}
extern "C" __global__ void paged_decode_scalar_bf16(TKV_DECODE_PARAMS(tkv_bf16)) {
    paged_decode_impl<tkv_bf16, 8, false>(TKV_DECODE_ARGS);
}
