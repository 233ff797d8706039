// Read bandwidth of the decode attention's K/V access pattern, without its arithmetic.
//
// The decode attention (plugins/kernels/attend.cu) reads, for each of 32 tokens, 18 sparse
// blocks of 64 keys from caches laid out [block, row, kv_head, D] (bf16, Hkv = 8, D = 128): a
// 128 KB contiguous block of K and one of V per selected block, 151 MB per step. Each variant
// below reads exactly those bytes in a different order or with a different depth of
// asynchronous copies, and touches what it read so that nothing is optimised away. The ratio
// to a plain streaming read says how much of the attention's gap to copy bandwidth is the
// access pattern and how much is the kernel.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o gather_bw bench/gather_bw.cu && ./gather_bw
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr int T = 32, HKV = 8, D = 128, BS = 64, NSEL = 18, NB = 65536, NSETS = 6;
constexpr int RS = D + 8, UNIT = 16 * RS;  // staged rows: 16 x (D + 8) elements, as attend.cu
using u16 = unsigned short;

#define CHECK(x)                                                                             \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                                    \
        }                                                                                    \
    } while (0)

__device__ __forceinline__ unsigned touch(const u16* s, int lane) {  // 8 reads per lane per unit
    unsigned a = 0;
#pragma unroll
    for (int i = lane; i < 16 * D; i += 256) a += s[(i / D) * RS + i % D];
    return a;
}

// One warp's S-stage cp.async pipeline over its `my` units: issue(k) stages unit k, consume(k)
// reads it once it has landed; returns the sum of what consume returned.
template <int S, typename Issue, typename Consume>
__device__ __forceinline__ unsigned pipeline(int my, Issue issue, Consume consume) {
    unsigned acc = 0;
    for (int k = 0; k < S - 1; ++k) {
        if (k < my) issue(k);
        __pipeline_commit();
    }
    for (int k = 0; k < my; ++k) {
        if (k + S - 1 < my) issue(k + S - 1);
        __pipeline_commit();
        __pipeline_wait_prior(S - 1);
        __syncwarp();
        acc += consume(k);
        __syncwarp();
    }
    return acc;
}

// attend.cu's order: a CTA per (token, KV head) (token fastest unless HeadFast), W warps, warp w
// takes units w, w + W, ... of 16 key rows of its head (256 B each, 2 KB apart), K and V by
// cp.async into S stages per warp.
template <int W, int S, bool HeadFast>
__global__ void __launch_bounds__(W * 32) per_head(const u16* kc, const u16* vc, const int* sel, unsigned* sink) {
    extern __shared__ __align__(128) u16 sm[];
    const int t = HeadFast ? blockIdx.y : blockIdx.x, h = HeadFast ? blockIdx.x : blockIdx.y;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u16* kv_w = sm + (size_t)warp * S * 2 * UNIT;
    constexpr int nunits = NSEL * BS / 16;
    const int* s = sel + t * NSEL;
    auto issue = [&](int k) {
        const int r0 = (warp + k * W) * 16;
        u16* ks = kv_w + (k % S) * 2 * UNIT;
        u16* vs = ks + UNIT;
        const long blk = s[r0 / BS];
#pragma unroll
        for (int c = lane; c < 16 * (D / 8); c += 32) {
            const int j = c / (D / 8), d = (c % (D / 8)) * 8;
            const long off = ((blk * BS + r0 % BS + j) * HKV + h) * D + d;
            __pipeline_memcpy_async(ks + j * RS + d, kc + off, 16);
            __pipeline_memcpy_async(vs + j * RS + d, vc + off, 16);
        }
    };
    const unsigned acc = pipeline<S>((nunits - warp + W - 1) / W, issue, [&](int k) {
        const u16* ks = kv_w + (k % S) * 2 * UNIT;
        return touch(ks, lane) ^ touch(ks + UNIT, lane);
    });
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Key-row order: a CTA per (token, part of its rows); a unit is 2 keys x all KV heads (2 x 2 KB
// contiguous) of K and of V: the same 8 KB per unit as per_head, read as whole 2 KB rows.
template <int W, int S, int P>
__global__ void __launch_bounds__(W * 32) per_row(const u16* kc, const u16* vc, const int* sel, unsigned* sink) {
    extern __shared__ __align__(128) u16 sm[];
    const int t = blockIdx.x, part = blockIdx.y;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    constexpr int kUnit = 2 * HKV * D;  // elements per unit (K or V)
    u16* kv_w = sm + (size_t)warp * S * 2 * kUnit;
    constexpr int rows = NSEL * BS / P, nunits = rows / 2;
    const int* s = sel + t * NSEL;
    auto issue = [&](int k) {
        const int r0 = part * rows + (warp + k * W) * 2;
        u16* ks = kv_w + (k % S) * 2 * kUnit;
        u16* vs = ks + kUnit;
        const long blk = s[r0 / BS];
        const long base = (blk * BS + r0 % BS) * HKV * D;
#pragma unroll
        for (int c = lane; c < kUnit / 8; c += 32) {
            __pipeline_memcpy_async(ks + c * 8, kc + base + c * 8, 16);
            __pipeline_memcpy_async(vs + c * 8, vc + base + c * 8, 16);
        }
    };
    const unsigned acc = pipeline<S>((nunits - warp + W - 1) / W, issue, [&](int k) {
        const u16* ks = kv_w + (k % S) * 2 * kUnit;
        unsigned a = 0;
#pragma unroll
        for (int i = lane; i < kUnit; i += 256) a += ks[i] ^ ks[kUnit + i];
        return a;
    });
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Ceiling for these bytes: a CTA per selected block of K or V, 16-byte loads into registers.
__global__ void __launch_bounds__(256) whole_blocks(const u16* kc, const u16* vc, const int* sel, unsigned* sink) {
    const int t = blockIdx.x / (NSEL * 2), i = blockIdx.x % (NSEL * 2);
    const u16* src = (i % 2 ? vc : kc) + (long)sel[t * NSEL + i / 2] * BS * HKV * D;
    const uint4* p = reinterpret_cast<const uint4*>(src);
    unsigned acc = 0;
    constexpr int n = BS * HKV * D / 8;
#pragma unroll 8
    for (int c = threadIdx.x; c < n; c += 256) {
        const uint4 v = __ldg(p + c);
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Streaming read of a contiguous buffer (no gather).
__global__ void __launch_bounds__(256) stream_read(const uint4* p, long n, unsigned* sink) {
    unsigned acc = 0;
    for (long c = blockIdx.x * 256L + threadIdx.x; c < n; c += (long)gridDim.x * 256) {
        const uint4 v = __ldg(p + c);
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <typename F>
float median_ms(F launch) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch(i);
    CHECK(cudaGetLastError());
    std::vector<float> ms;
    for (int i = 0; i < 30; ++i) {
        CHECK(cudaEventRecord(a));
        launch(i);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float x;
        CHECK(cudaEventElapsedTime(&x, a, b));
        ms.push_back(x);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

}  // namespace

int main() {
    const size_t cache_elems = (size_t)NB * BS * HKV * D;
    u16 *kc, *vc;
    int* sel;
    unsigned* sink;
    CHECK(cudaMalloc(&kc, cache_elems * 2));
    CHECK(cudaMalloc(&vc, cache_elems * 2));
    CHECK(cudaMemset(kc, 0x3c, cache_elems * 2));  // non-zero
    CHECK(cudaMemset(vc, 0x3d, cache_elems * 2));
    CHECK(cudaMalloc(&sel, sizeof(int) * NSETS * T * NSEL));
    CHECK(cudaMalloc(&sink, 4));
    // NSETS selection sets (distinct random blocks per token), rotated between timed runs so that
    // no run finds the previous run's blocks in L2.
    std::mt19937 rng(7);
    std::vector<int> h(NSETS * T * NSEL);
    for (int st = 0; st < NSETS * T; ++st) {
        std::vector<int> pick;
        while ((int)pick.size() < NSEL) {
            const int b = (int)(rng() % NB);
            if (std::find(pick.begin(), pick.end(), b) == pick.end()) pick.push_back(b);
        }
        std::copy(pick.begin(), pick.end(), h.begin() + st * NSEL);
    }
    CHECK(cudaMemcpy(sel, h.data(), sizeof(int) * h.size(), cudaMemcpyHostToDevice));
    const double bytes = 2.0 * T * NSEL * BS * HKV * D * 2;
    auto set = [&](int i) { return sel + (i % NSETS) * T * NSEL; };
    auto report = [&](const char* name, float ms) {
        std::printf("| %-44s | %7.1f | %6.0f |\n", name, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
    };
    std::printf("gather of %.1f MB (32 tokens x 18 blocks x K and V, bf16 [block, row, 8, 128])\n", bytes / 1e6);
    std::printf("| variant | us | GB/s |\n| --- | ---: | ---: |\n");

    auto run_head = [&](auto kernel, int w, int s, bool head_fast, const char* name) {
        const size_t smem = (size_t)w * s * 2 * UNIT * 2;
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        const dim3 grid = head_fast ? dim3(HKV, T) : dim3(T, HKV);
        report(name, median_ms([&](int i) { kernel<<<grid, w * 32, smem>>>(kc, vc, set(i), sink); }));
    };
    run_head(per_head<4, 2, false>, 4, 2, false, "per head, 4 warps, 2 stages");
    run_head(per_head<4, 3, false>, 4, 3, false, "per head, 4 warps, 3 stages (attend_mma)");
    run_head(per_head<4, 3, true>, 4, 3, true, "per head, 4 warps, 3 stages, head-fast grid");
    run_head(per_head<4, 4, false>, 4, 4, false, "per head, 4 warps, 4 stages");
    run_head(per_head<8, 3, false>, 8, 3, false, "per head, 8 warps, 3 stages");
    run_head(per_head<2, 6, false>, 2, 6, false, "per head, 2 warps, 6 stages");

    auto run_row = [&](auto kernel, int w, int s, int parts, const char* name) {
        const size_t smem = (size_t)w * s * 2 * (2 * HKV * D) * 2;
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        report(name, median_ms([&](int i) { kernel<<<dim3(T, parts), w * 32, smem>>>(kc, vc, set(i), sink); }));
    };
    run_row(per_row<4, 3, 8>, 4, 3, 8, "per key row (2 KB), 4 warps, 3 stages, 8 parts");
    run_row(per_row<4, 4, 8>, 4, 4, 8, "per key row (2 KB), 4 warps, 4 stages, 8 parts");
    run_row(per_row<8, 3, 8>, 8, 3, 8, "per key row (2 KB), 8 warps, 3 stages, 8 parts");

    report("whole 128 KB blocks, registers", median_ms([&](int i) {
               whole_blocks<<<T * NSEL * 2, 256>>>(kc, vc, set(i), sink);
           }));
    const long n = (long)(bytes / 16);
    report("streaming read of the same byte count", median_ms([&](int i) {
               stream_read<<<132 * 8, 256>>>(reinterpret_cast<const uint4*>(kc) + (i % 4) * n, n, sink);
           }));
    CHECK(cudaDeviceSynchronize());
    return 0;
}
