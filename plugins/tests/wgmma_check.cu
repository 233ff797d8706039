// GPU check of the warpgroup MMA helpers (plugins/kernels/wgmma.cuh) on one 64-row tile:
// S = Q K^T with K from 128-byte-swizzled shared memory (K-major), then O = P V with V read
// transposed from the same layout, P = S / 16 rounded to the input type (A from registers, as
// the block-major tiles do); and S = Q K^T again with Q from a swizzled tile too (both operands
// by descriptor, as the query-major tiles do). Each compared with a double-precision product on
// the host, for bf16 and fp16. Needs an sm_90 GPU and a build for CMake architecture 90a;
// elsewhere it says so and exits 0 (there is nothing it could check). Exit 1 on a mismatch.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "wgmma.cuh"

namespace {

constexpr int kRows = 64, kD = 128, kRS = kD + 8;

template <typename T>
__global__ void tile_kernel(const T* q, const T* k, const T* v, float* s_out, float* o_out, float* ss_out, int* ran) {
#if DASH_WGMMA_DEVICE
    extern __shared__ unsigned char raw[];
    // 1024-byte aligned K, V and swizzled Q tiles, then Q rows D + 8 apart.
    const uint32_t a0 = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    T* k_s = reinterpret_cast<T*>(raw + ((1024 - a0 % 1024) % 1024));
    T* v_s = k_s + kRows * kD;
    T* qz_s = v_s + kRows * kD;
    T* q_s = qz_s + kRows * kD;
    for (int c = threadIdx.x; c < kRows * (kD / 8); c += blockDim.x) {
        const int r = c / (kD / 8), d = (c % (kD / 8)) * 8;
        *reinterpret_cast<uint4*>(k_s + dash::sw128_offset<kRows>(r, d)) =
            *reinterpret_cast<const uint4*>(k + r * kD + d);
        *reinterpret_cast<uint4*>(v_s + dash::sw128_offset<kRows>(r, d)) =
            *reinterpret_cast<const uint4*>(v + r * kD + d);
        *reinterpret_cast<uint4*>(qz_s + dash::sw128_offset<kRows>(r, d)) =
            *reinterpret_cast<const uint4*>(q + r * kD + d);
        *reinterpret_cast<uint4*>(q_s + r * kRS + d) = *reinterpret_cast<const uint4*>(q + r * kD + d);
    }
    dash::fence_async_smem();
    __syncthreads();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const T* qw = q_s + warp * 16 * kRS;
    uint32_t a[kD / 16][4];
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) dash::ldmatrix_a(a[kk], qw, kRS, kk, lane);
    float s[8][4];
    float(&s32)[32] = reinterpret_cast<float(&)[32]>(s);
    dash::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) dash::wgmma_m64n64k16<T>(s32, a[kk], dash::kmajor_desc<kRows>(k_s, kk), kk);
    dash::wgmma_commit();
    dash::wgmma_wait_all();
    dash::fence_regs(s32);
    float ss[32];
    dash::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
        dash::wgmma_m64n64k16_ss<T>(ss, dash::kmajor_desc<kRows>(qz_s, kk), dash::kmajor_desc<kRows>(k_s, kk), kk);
    dash::wgmma_commit();
    dash::wgmma_wait_all();
    dash::fence_regs(ss);
    const int r0 = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
    uint32_t pa[4][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s_out[(r0 + (e / 2) * 8) * kRows + n * 8 + c0 + e % 2] = s[n][e];
            ss_out[(r0 + (e / 2) * 8) * kRows + n * 8 + c0 + e % 2] = ss[n * 4 + e];
        }
        pa[n / 2][(n % 2) * 2 + 0] = dash::pack2<T>(s[n][0] / 16.0f, s[n][1] / 16.0f);
        pa[n / 2][(n % 2) * 2 + 1] = dash::pack2<T>(s[n][2] / 16.0f, s[n][3] / 16.0f);
    }
    float o[kD / 8][4];
    float(&o64)[64] = reinterpret_cast<float(&)[64]>(o);
    dash::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) dash::wgmma_m64n128k16_tb<T>(o64, pa[kk], dash::mnmajor_desc<kRows>(v_s, kk), kk);
    dash::wgmma_commit();
    dash::wgmma_wait_all();
    dash::fence_regs(o64);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_out[(r0 + (e / 2) * 8) * kD + n * 8 + c0 + e % 2] = o[n][e];
    if (threadIdx.x == 0) *ran = 1;
#endif
}

float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
float to_float(__half x) { return __half2float(x); }
template <typename T>
T from_float(float x);
template <>
__nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <>
__half from_float(float x) { return __float2half_rn(x); }

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
            std::exit(1);                                                                     \
        }                                                                                     \
    } while (0)

// Returns the number of failed comparisons (0 or more); -1 when the kernel has no sm_90a code.
template <typename T>
int check(const char* name, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<T> q(kRows * kD), k(kRows * kD), v(kRows * kD);
    for (auto* x : {&q, &k, &v})
        for (auto& e : *x) e = from_float<T>(u(rng));
    T *dq, *dk, *dv;
    float *ds, *dout, *dss;
    int* dran;
    CHECK(cudaMalloc(&dq, sizeof(T) * q.size()));
    CHECK(cudaMalloc(&dk, sizeof(T) * k.size()));
    CHECK(cudaMalloc(&dv, sizeof(T) * v.size()));
    CHECK(cudaMalloc(&ds, sizeof(float) * kRows * kRows));
    CHECK(cudaMalloc(&dss, sizeof(float) * kRows * kRows));
    CHECK(cudaMalloc(&dout, sizeof(float) * kRows * kD));
    CHECK(cudaMalloc(&dran, sizeof(int)));
    CHECK(cudaMemset(dran, 0, sizeof(int)));
    CHECK(cudaMemcpy(dq, q.data(), sizeof(T) * q.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dk, k.data(), sizeof(T) * k.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dv, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
    const size_t smem = 1024 + sizeof(T) * (3 * kRows * kD + kRows * kRS);
    CHECK(cudaFuncSetAttribute(tile_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    tile_kernel<T><<<1, 128, smem>>>(dq, dk, dv, ds, dout, dss, dran);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    int ran = 0;
    std::vector<float> s(kRows * kRows), o(kRows * kD), ss(kRows * kRows);
    CHECK(cudaMemcpy(&ran, dran, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(s.data(), ds, sizeof(float) * s.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(o.data(), dout, sizeof(float) * o.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ss.data(), dss, sizeof(float) * ss.size(), cudaMemcpyDeviceToHost));
    cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(ds), cudaFree(dout), cudaFree(dss), cudaFree(dran);
    if (!ran) return -1;
    double s_err = 0.0, o_err = 0.0;
    for (int i = 0; i < kRows; ++i)
        for (int j = 0; j < kRows; ++j) {
            double ref = 0.0;
            for (int d = 0; d < kD; ++d) ref += (double)to_float(q[i * kD + d]) * to_float(k[j * kD + d]);
            s_err = std::fmax(s_err, std::fabs(ref - s[i * kRows + j]));
        }
    for (int i = 0; i < kRows; ++i)
        for (int d = 0; d < kD; ++d) {
            double ref = 0.0;  // P as the kernel rounded it, from the kernel's own S
            for (int j = 0; j < kRows; ++j)
                ref += (double)to_float(from_float<T>(s[i * kRows + j] / 16.0f)) * to_float(v[j * kD + d]);
            o_err = std::fmax(o_err, std::fabs(ref - o[i * kD + d]));
        }
    double ss_err = 0.0;
    int ss_diff = 0;  // against the register-A product (expected 0: the same products)
    for (int i = 0; i < kRows; ++i)
        for (int j = 0; j < kRows; ++j) {
            double ref = 0.0;
            for (int d = 0; d < kD; ++d) ref += (double)to_float(q[i * kD + d]) * to_float(k[j * kD + d]);
            ss_err = std::fmax(ss_err, std::fabs(ref - ss[i * kRows + j]));
            ss_diff += ss[i * kRows + j] != s[i * kRows + j];
        }
    // fp32 accumulation of 128 (S) or 64 (O) products of magnitude <= 1: far below 1e-3.
    const bool ok_s = s_err < 1e-3, ok_o = o_err < 1e-3, ok_ss = ss_err < 1e-3;
    std::printf("%s %s: S = Q K^T max abs error %.3g; O = P V max abs error %.3g; S with Q from shared memory "
                "max abs error %.3g (%d of %d differ from the register form)\n",
                ok_s && ok_o && ok_ss ? "PASS" : "FAIL", name, s_err, o_err, ss_err, ss_diff, kRows * kRows);
    return (ok_s ? 0 : 1) + (ok_o ? 0 : 1) + (ok_ss ? 0 : 1);
}

}  // namespace

int main() {
    int n = 0, dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 0;
    }
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major != 9 || prop.minor != 0) {
        std::printf("SKIP: %s is sm_%d%d; warpgroup MMA needs sm_90\n", prop.name, prop.major, prop.minor);
        return 0;
    }
    const int bf = check<__nv_bfloat16>("bf16", 1), hf = check<__half>("fp16", 2);
    if (bf < 0 || hf < 0) {
        std::printf("FAIL: the kernel carries no sm_90a code (build with CMAKE_CUDA_ARCHITECTURES 90a)\n");
        return 1;
    }
    return bf + hf == 0 ? 0 : 1;
}
