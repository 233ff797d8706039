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

// Softmax numerators of one 16 x 8 accumulator tile s (rows r0 and r0 + 8, lane's columns):
// exp(s - m) per row, masked (-inf) entries and rows with no key yet (m = -inf) giving 0; adds
// them to the lane's row sums l and packs them as the tile's two A-operand registers of P V
// (row r0, row r0 + 8).
// Base2: s and m are logits times log2 e, and the numerators exp2(s - m).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
template <typename T, bool Base2 = false>
__device__ __forceinline__ void softmax_tile(const float (&s)[4], const float (&m)[2], float (&l)[2], uint32_t& row0,
                                             uint32_t& row8) {
    float e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int half = e / 2;
        e4[e] = m[half] == -INFINITY || s[e] == -INFINITY ? 0.0f
                : Base2                                   ? exp2f(s[e] - m[half])
                                                          : expf(s[e] - m[half]);
        l[half] += e4[e];
    }
    row0 = pack2<T>(e4[0], e4[1]);
    row8 = pack2<T>(e4[2], e4[3]);
}

}  // namespace dash
