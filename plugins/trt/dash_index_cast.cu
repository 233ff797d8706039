// Saturating int64 -> int32 conversion of the DashAttention index inputs.
#include <cuda_runtime.h>

#include <climits>

#include "dash_index_cast.h"

namespace dash {
namespace trt {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksPerJob = 1024;

__global__ void cast_indices_kernel(IndexCastJobs jobs) {
    const int j = blockIdx.y;
    const int64_t n = jobs.count[j];
    const int64_t* src = jobs.src[j];
    int32_t* dst = jobs.dst[j];
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t x = src[i];
        dst[i] = x > INT_MAX ? INT_MAX : (x < INT_MIN ? INT_MIN : (int32_t)x);
    }
}

}  // namespace

cudaError_t castIndicesToInt32(IndexCastJobs const& jobs, cudaStream_t stream) noexcept {
    if (jobs.n <= 0) return cudaSuccess;
    if (jobs.n > kMaxCastJobs) return cudaErrorInvalidValue;
    int64_t longest = 0;
    for (int j = 0; j < jobs.n; ++j) longest = jobs.count[j] > longest ? jobs.count[j] : longest;
    if (longest == 0) return cudaSuccess;
    int64_t blocks = (longest + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocksPerJob) blocks = kMaxBlocksPerJob;
    cast_indices_kernel<<<dim3((unsigned)blocks, (unsigned)jobs.n), kThreads, 0, stream>>>(jobs);
    return cudaGetLastError();
}

}  // namespace trt
}  // namespace dash
