/*
 * int64 -> int32 conversion of the DashAttention index inputs (coords and batch metadata).
 *
 * The kernels read int32 indices only (DashParams). When TensorRT hands the plugin int64
 * tensors (an ONNX model whose metadata is int64), enqueue converts them into the plugin's
 * workspace first: one launch for all of them, on the plugin's stream.
 */
#ifndef DASH_TRT_INDEX_CAST_H
#define DASH_TRT_INDEX_CAST_H

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace dash {
namespace trt {

constexpr int32_t kMaxCastJobs = 8;

struct IndexCastJobs {
    int64_t const* src[kMaxCastJobs];
    int32_t* dst[kMaxCastJobs];
    int64_t count[kMaxCastJobs];
    int32_t n;  // jobs used
};

//! Converts each job's `count` int64 values to int32, saturating at the int32 range, so that an
//! out-of-range value stays out of range (the kernels then flag it instead of reading with a
//! wrapped index). Enqueued on `stream`; returns the launch status.
cudaError_t castIndicesToInt32(IndexCastJobs const& jobs, cudaStream_t stream) noexcept;

}  // namespace trt
}  // namespace dash

#endif  // DASH_TRT_INDEX_CAST_H
