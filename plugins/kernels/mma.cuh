// Warp-level tensor-core helpers (sm_80+): mma.sync m16n8k16 with float accumulators, ldmatrix,
// and packing two floats into a 16-bit pair. Fragments as in the PTX ISA ("Matrix Fragments for
// mma.m16n8k16"): a lane holds rows lane/4 and lane/4 + 8, columns 2 * (lane % 4) + {0, 1} (+8).
// S = Q K^T, the softmax and P V can stay in registers (an accumulator's layout is the A layout
// of the next product).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <type_traits>

namespace dash {

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane i addresses row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The A operand of k-step kk (16 rows x 16 columns) from 16 rows of shared memory rs elements
// apart: the row-major A fragment of mma.sync m16n8k16, which is also a warp's share of a
// warpgroup MMA's A registers (wgmma.cuh).
template <typename T>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&a)[4], const T* rows, int rs, int kk, int lane) {
    ldmatrix_x4(a, rows + ((lane / 8) % 2 * 8 + lane % 8) * rs + kk * 16 + (lane / 16) * 8);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    uint32_t u;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&u, &v, 4);
    } else {
        const __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&u, &v, 4);
    }
    return u;
}


// Max and sum over the quad of lanes that shares an accumulator row.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The log2-domain constants of the prefill tiles (logits times log2 e; maxima back to base e).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// 2^x, one MUFU.EX2 (results below FLT_MIN flushed to 0; ex2(-inf) = 0). The prefill tiles'
// softmax numerators (block_attend.cu: softmax_numerators).
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Softmax numerators of one 16 x 8 accumulator tile s (rows r0 and r0 + 8, lane's columns):
// exp(s - m) per row, masked (-inf) entries and rows with no key yet (m = -inf) giving 0; adds
// them to the lane's row sums l and packs them as the tile's two A-operand registers of P V
// (row r0, row r0 + 8). The token-major attention's.
template <typename T>
__device__ __forceinline__ void softmax_tile(const float (&s)[4], const float (&m)[2], float (&l)[2], uint32_t& row0,
                                             uint32_t& row8) {
    float e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int half = e / 2;
        e4[e] = m[half] == -INFINITY || s[e] == -INFINITY ? 0.0f : expf(s[e] - m[half]);
        l[half] += e4[e];
    }
    row0 = pack2<T>(e4[0], e4[1]);
    row8 = pack2<T>(e4[2], e4[3]);
}

// The factor a row's running sum and output take when its max moves from m_old to m_new (0
// while the row had no key: m_old = -inf). Every online softmax here (the mma tiles through
// online_softmax_step, the float32 attention) applies this one.
template <bool Base2>
__device__ __forceinline__ float online_alpha(float m_old, float m_new) {
    return m_old == -INFINITY ? 0.0f : Base2 ? exp2f(m_old - m_new) : expf(m_old - m_new);  // 1 when unchanged
}

// One step of the online softmax (FlashAttention-2) of rows r0 and r0 + 8: mt, the step's maxima
// of the lane's columns (reduced over the quad here); m and l, the rows' running max and sum,
// move to the new max, l rescaled; alpha, the factor the rows' output accumulators take
// (0 while a row had no key yet). Base2: logits and maxima times log2 e (exp2). What the
// token-major attention and the query-major tiles both run between S = Q K^T and their numerators.
template <bool Base2>
__device__ __forceinline__ void online_softmax_step(float (&m)[2], float (&l)[2], const float (&mt)[2],
                                                    float (&alpha)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float mn = fmaxf(m[half], quad_max(mt[half]));
        alpha[half] = online_alpha<Base2>(m[half], mn);
        m[half] = mn;
        l[half] *= alpha[half];
    }
}

// Merging partial softmaxes of one row (split-K slices, a CTA's warps, block-major slots): a
// partial with max mp (base e) and sum lp enters a merge whose largest max is mx with its
// accumulators times partial_scale(mp, mx) and its sum times the same, partial_weight.
__device__ __forceinline__ float partial_scale(float mp, float mx) { return expf(mp - mx); }
__device__ __forceinline__ float partial_weight(float2 ml, float mx) { return partial_scale(ml.x, mx) * ml.y; }

// The output accumulators of rows r0 and r0 + 8 (NT n-tiles of 16 x 8) times the rows' alpha.
template <int NT>
__device__ __forceinline__ void scale_rows(float (&o)[NT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        o[n][0] *= alpha[0], o[n][1] *= alpha[0];
        o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
}

}  // namespace dash
