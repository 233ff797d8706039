// Warpgroup tensor-core helpers (sm_90a only): wgmma.mma_async with float accumulators, A from
// registers (or, for S = Q K^T, from shared memory too) and B from 128-byte-swizzled shared
// memory, for the block-major and query-major tiles of block_attend.cu. A warpgroup is four consecutive warps (128 threads); warp w of it
// owns rows 16w .. 16w + 15 of a 64-row tile, and its A registers and accumulators have the
// layouts of mma.sync m16n8k16 (mma.cuh): the accumulator of n-tile j (8 columns) is
// d[4j .. 4j + 3], so the softmax code of the mma.sync tiles runs on it unchanged (PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate": register fragments, shared memory
// matrix layout, matrix descriptor).
//
// Compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined (CMake architecture "90a"); elsewhere the
// functions trap, and the host never chooses them (warpgroup_tiles in dash_capi.cu).
#pragma once

#include "mma.cuh"

namespace dash {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DASH_WGMMA_DEVICE 1
#else
#define DASH_WGMMA_DEVICE 0
#endif

// A tile of R rows x C columns of 16-bit elements (C a multiple of 64) in the canonical 128-byte
// swizzle: column atom a = col / 64 takes R * 128 bytes from a * R * 128; row r is 128 bytes at
// r * 128 inside it; the row's 16-byte chunk c is stored at chunk c ^ (r % 8). The tile must start
// on a 1024-byte boundary. Element offset of (row, col), col a multiple of 8 for a 16-byte chunk.
template <int R>
__device__ __forceinline__ int sw128_offset(int row, int col) {
    return (col / 64) * R * 64 + row * 64 + ((((col % 64) / 8) ^ (row % 8)) * 8) + col % 8;
}

// Shared memory matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t lead_bytes, uint32_t stride_bytes) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return (uint64_t)((a & 0x3FFFFu) >> 4) | (uint64_t)((lead_bytes >> 4) & 0x3FFFu) << 16 |
           (uint64_t)((stride_bytes >> 4) & 0x3FFFu) << 32 | (uint64_t)1 << 62;
}

// B of S = Q K^T: the 64 keys x D of a block, K-major (rows are keys, contiguous along D), the
// k-step kk (16 elements of D) of it. Stride byte offset: 8 rows (1024 bytes); the leading one is
// unused with this swizzle (16 bytes, as CUTLASS sets it).
// The k-steps' descriptors differ from the tile's in the start address field alone (bytes / 16;
// no carry: shared addresses stay below 256 KB), so unrolled k-steps share one sw128_desc.
template <int R>
__device__ __forceinline__ uint64_t kmajor_desc(const void* tile, int kk) {
    return sw128_desc(tile, 16, 1024) + (uint64_t)(((kk / 4) * R * 128 + (kk % 4) * 32) >> 4);
}
// B of O = P V: the 64 keys x D of a block as stored (rows are keys, contiguous along D), read
// MN-major (transposed), the k-step kk (16 keys) of it: 2048 bytes on. Leading byte offset: from
// one 64-column atom to the next (R * 128 bytes); stride: 8 keys (1024 bytes).
template <int R>
__device__ __forceinline__ uint64_t mnmajor_desc(const void* tile, int kk, uint32_t lead = R * 128,
                                              uint32_t stride = 1024) {
    return sw128_desc(tile, lead, stride) + (uint64_t)(kk * 2048 >> 4);
}

__device__ __forceinline__ void wgmma_fence() {
#if DASH_WGMMA_DEVICE
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if DASH_WGMMA_DEVICE
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_wait_all() {
#if DASH_WGMMA_DEVICE
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Shared memory written by ordinary stores or cp.async, made visible to the wgmma (async) proxy:
// each writing thread, before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_async_smem() {
#if DASH_WGMMA_DEVICE
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accesses of accumulator registers across an async MMA.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the asm templates below: d[0 .. 31] (operands %0 .. %31, as
// DASH_WGMMA_R32 lists them), and d[0 .. 63].
#define DASH_WGMMA_R32 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define DASH_WGMMA_D32                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),          \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),        \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),        \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DASH_WGMMA_D64                                                                                   \
    DASH_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),          \
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]),        \
        "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),        \
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]),        \
        "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// One wgmma.mma_async with A from registers (a[4]), B by descriptor (desc), D (+)= A x B in float
// (d[N / 2]); scale_d = 0 overwrites D. TY: "bf16" or "f16"; TRANS_B: "0" (B K-major) or "1"
// (B MN-major, read transposed). The operand lists are the PTX ISA's register fragments.
#define DASH_WGMMA_M64N64K16(TY, TRANS_B)                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                             \
    DASH_WGMMA_R32 ", "                                                                          \
                 "{%32,%33,%34,%35}, %36, p, 1, 1, " TRANS_B ";\n}\n"                          \
      : DASH_WGMMA_D32\
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))

// The same m64n64k16 product with A by descriptor too (desc_a: a K-major swizzled tile, as
// kmajor_desc gives), so that A takes no registers.
#define DASH_WGMMA_M64N64K16_SS(TY)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                             \
    DASH_WGMMA_R32 ", "                                                                          \
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                   \
      : DASH_WGMMA_D32\
      : "l"(desc_a), "l"(desc), "r"(scale_d))

#define DASH_WGMMA_M64N128K16(TY, TRANS_B)                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                             \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"   \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"   \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"   \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "   \
                 "{%64,%65,%66,%67}, %68, p, 1, 1, " TRANS_B ";\n}\n"                          \
      : DASH_WGMMA_D64\
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))

// D[64 x 64] (+)= A[64 x 16] x B[16 x 64]: S = Q K^T, B (the keys) K-major.
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
#if DASH_WGMMA_DEVICE
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        DASH_WGMMA_M64N64K16("bf16", "0");
    } else {
        DASH_WGMMA_M64N64K16("f16", "0");
    }
#else
    __trap();
#endif
}

// D[64 x 64] (+)= A[64 x 16] x B[16 x 64] with both from shared memory (A: desc_a, K-major).
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc, int scale_d) {
#if DASH_WGMMA_DEVICE
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        DASH_WGMMA_M64N64K16_SS("bf16");
    } else {
        DASH_WGMMA_M64N64K16_SS("f16");
    }
#else
    __trap();
#endif
}

// D[64 x 128] (+)= A[64 x 16] x B[16 x 128]: O = P V, B (the values) read transposed.
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc,
                                                    int scale_d) {
#if DASH_WGMMA_DEVICE
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        DASH_WGMMA_M64N128K16("bf16", "1");
    } else {
        DASH_WGMMA_M64N128K16("f16", "1");
    }
#else
    __trap();
#endif
}

#undef DASH_WGMMA_M64N64K16
#undef DASH_WGMMA_M64N64K16_SS
#undef DASH_WGMMA_D32
#undef DASH_WGMMA_R32
#undef DASH_WGMMA_D64
#undef DASH_WGMMA_M64N128K16

}  // namespace dash
