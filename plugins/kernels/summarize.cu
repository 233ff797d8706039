// Stage 2: summarise every sparse block this call completes (and record its image pages);
// the work for one block is summarize_block (summarize.cuh).
#include "summarize.cuh"

namespace dash {
namespace {

// grid (ceil(max_new / sbs) + 1, B): CTA x handles the x-th block completed by sequence y.
template <typename T>
__global__ void summarize_kernel(const DashParams p, Workspace ws) {
    const int seq = blockIdx.y;
    const int n_new = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    const int len = p.seq_lens[seq];
    const int max_new = p.max_new_tokens > 0 ? p.max_new_tokens : p.num_tokens;
    // Inconsistent lengths are flagged by stage 1 (locate_token), which skips the tokens.
    if (n_new > len || n_new > max_new || len > p.table_width * p.block_size) return;
    const int b = (len - n_new) / p.sparse_block_size + blockIdx.x;
    if (b >= len / p.sparse_block_size) return;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    summarize_block<T>(p, ws, seq, b, smem_raw);
}

}  // namespace

cudaError_t launch_summarize(const DashParams& p, const Plan& plan, const Workspace& ws,
                             cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    const int max_new = p.max_new_tokens > 0 ? p.max_new_tokens : p.num_tokens;
    const dim3 grid(max_new / p.sparse_block_size + 1, p.num_seqs);
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        const cudaError_t err = allow_smem(summarize_kernel<T>, plan.summarize_smem);
        if (err != cudaSuccess) return err;
        summarize_kernel<T><<<grid, 128, plan.summarize_smem, stream>>>(p, ws);
        return cudaGetLastError();
    });
}

}  // namespace dash
