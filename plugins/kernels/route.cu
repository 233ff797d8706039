// Stage 3: score the complete sparse blocks each query may read remotely and pick its top-k,
// exactly as SPEC.md's route_blocks: forced (same-page image) blocks first, then score
// descending, ties to the lower block index. Output rows are fixed-size and padded with -1,
// so nothing downstream depends on data read back to the host.
#include "common.cuh"

namespace dash {
namespace {

// Sort key whose maximum is the block route_blocks takes first:
//   bit 63 forced | bits 31..62 order-preserving score bits | bits 0..30 (2^31 - 1 - block).
__device__ __forceinline__ uint64_t route_key(float score, bool forced, int block) {
    score += 0.0f;  // -0.0 -> +0.0: equal scores must tie and fall back to the block index
    uint32_t bits = __float_as_uint(score);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((uint64_t)(forced ? 1u : 0u) << 63) | ((uint64_t)bits << 31) |
           (uint64_t)(0x7fffffffu - (uint32_t)block);
}

__device__ __forceinline__ uint64_t block_max_u64(uint64_t v, uint64_t* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[warp] = v;
    __syncthreads();
    uint64_t best = scratch[0];
    for (int w = 1; w < nwarps; ++w) best = scratch[w] > best ? scratch[w] : best;
    return best;
}

// One CTA per query token.
template <typename T>
__global__ void route_kernel(const DashParams p, const Plan plan, Workspace ws) {
    const int t = blockIdx.x;
    const int seq = ws.token_seq[t];
    int32_t* sel = ws.selected + (int64_t)t * plan.kmax;
    uint8_t* forced = ws.forced + (int64_t)t * plan.kmax;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* iq = reinterpret_cast<float*>(smem_raw);                              // [Di]
    uint64_t* keys = reinterpret_cast<uint64_t*>(iq + ((p.index_dim + 3) & ~3));  // [max_blocks]
    __shared__ uint64_t scratch[32];
    if (seq < 0) {
        for (int j = threadIdx.x; j < plan.kmax; j += blockDim.x) sel[j] = -1, forced[j] = 0;
        return;
    }
    const int pos = ws.token_pos[t];
    const int sbs = p.sparse_block_size, di = p.index_dim;
    const int prompt = p.prompt_lens[seq];
    // Remote blocks form a prefix: b <= pos / sbs - local_blocks, and b * sbs < prompt_length.
    int n_remote = pos / sbs - p.sparse_local_block + 1;
    if (prompt >= 0) n_remote = min(n_remote, (prompt + sbs - 1) / sbs);
    n_remote = max(0, min(n_remote, plan.max_blocks));

    // Rotated, finite, float32 indexer query.
    const RopeConfig rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.index_truncate,
                          p.rope_page_mod};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const int qp = p.coords[t * DASH_NUM_COORDS + DASH_COORD_QUERY_PAGE];
    const T* src = static_cast<const T*>(p.iq) + (int64_t)t * di;
    for (int i = threadIdx.x; i < di / 2; i += blockDim.x) {
        float lo, hi;
        rope_pair<T>(to_f(src[i]), to_f(src[i + di / 2]), rope_angle(i, di, tok, page, rope), lo, hi);
        iq[i] = finite_or_zero(lo);
        iq[i + di / 2] = finite_or_zero(hi);
    }
    __syncthreads();

    // Scores: a warp per block. NOTE: clamp to +-1e4 like the reference; remote blocks only.
    const float inv_sqrt = __fdiv_rn(1.0f, sqrtf((float)di));
    const int lane = threadIdx.x % 32;
    for (int b = threadIdx.x / 32; b < n_remote; b += blockDim.x / 32) {
        const int64_t si = summary_index(p, seq, b, ws.error);
        float acc = 0.0f;
        bool cand = false;
        if (si >= 0) {
            const float* summ = p.summary_cache + si * di;
            for (int i = lane; i < di; i += 32) acc += iq[i] * summ[i];
            const int32_t* pg = p.summary_pages + si * 3;
            const int lo = pg[DASH_PAGE_LO], hi = pg[DASH_PAGE_HI];
            const bool inside = qp >= 0 && lo <= qp && qp <= hi;
            cand = inside && (pg[DASH_PAGE_DENSE] || qp == lo || qp == hi);
            if (inside && !cand) {
                // A page strictly inside the block's range may have no image token here.
                bool hit = false;
                for (int j = lane; j < sbs; j += 32) {
                    const int64_t slot = cache_slot(p, seq, b * sbs + j, ws.error);
                    hit |= slot >= 0 && p.image_page_cache[slot] == qp;
                }
                cand = __any_sync(0xffffffffu, hit);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const float score = fminf(fmaxf(acc * inv_sqrt, -1e4f), 1e4f);
            keys[b] = route_key(score, cand, b);
        }
    }
    __syncthreads();

    if (p.dense_layer) {
        // Every remote block is selected; the order inside a row does not change the output.
        for (int j = threadIdx.x; j < plan.kmax; j += blockDim.x) {
            sel[j] = j < n_remote ? j : -1;
            forced[j] = j < n_remote ? (uint8_t)(keys[j] >> 63) : 0;
        }
    } else {
        const int k = min(p.topk, n_remote);
        for (int r = 0; r < k; ++r) {
            uint64_t best = 0;
            for (int b = threadIdx.x; b < n_remote; b += blockDim.x) best = keys[b] > best ? keys[b] : best;
            best = block_max_u64(best, scratch);
            const int b = (int)(0x7fffffffu - (uint32_t)(best & 0x7fffffffu));
            if (threadIdx.x == 0) {
                sel[r] = b;
                forced[r] = (uint8_t)(best >> 63);
                keys[b] = 0;  // taken
            }
            __syncthreads();
        }
        for (int j = k + threadIdx.x; j < plan.kmax; j += blockDim.x) sel[j] = -1, forced[j] = 0;
    }
    if (p.selected_out != nullptr) {
        __syncthreads();
        for (int j = threadIdx.x; j < plan.kmax; j += blockDim.x)
            p.selected_out[(int64_t)t * plan.kmax + j] = sel[j];
    }
}

}  // namespace

cudaError_t launch_route(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        cudaError_t err = cudaSuccess;
        if (plan.route_smem > 48 * 1024) {
            err = cudaFuncSetAttribute(route_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)plan.route_smem);
            if (err != cudaSuccess) return err;
        }
        route_kernel<T><<<p.num_tokens, 128, plan.route_smem, stream>>>(p, plan, ws);
        return cudaGetLastError();
    });
}

}  // namespace dash
