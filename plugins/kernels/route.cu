// Stage 3: score the complete sparse blocks each query may read remotely and pick its top-k,
// exactly as SPEC.md's route_blocks: forced (same-page image) blocks first, then score
// descending, ties to the lower block index. Output rows are fixed-size and padded with -1,
// so nothing downstream depends on data read back to the host.
//
// Two shapes of launch, chosen by the plan (Plan::route_split):
//   many tokens (prefill): one fused CTA per tile of plan.route_tile consecutive tokens scores
//     their blocks into shared memory (each summary row read once per tile, not once per token)
//     and a warp per token selects from there;
//   few tokens (decode) with more blocks than one CTA scores, or any decode-only call:
//     route_splits CTAs per token score 256 blocks each (a long context has thousands of blocks)
//     and keep their own top-k by rank; the last CTA of a token to finish (a counter per token,
//     zeroed by dash_run) merges those candidates. One launch; on decode-only calls
//     (Plan::fused_front) it also does the write and summary stages' work (front_write).
// Both score a row with a whole warp in one fixed order (score_rows), so they agree bit for bit.
#include "route_split.cuh"

namespace dash {
namespace {

constexpr int kRouteThreads = 256;  // fused routing CTA
constexpr int kRouteTile = 8;       // most tokens one fused routing CTA serves (a warp each to select)

// Fused: one CTA per tile of plan.route_tile (<= kRouteTile) consecutive tokens. Tokens of one
// sequence share each summary row load; a warp per token then selects from shared memory.
// Shared memory: iq [tile][Di4] floats, keys [tile][max_blocks], best [tile][topk]. At most 80
// registers a thread (3 CTAs per SM, as the shared memory of a tile allows at 64k context).
template <typename T>
__global__ void __launch_bounds__(kRouteThreads, 3) route_tile_kernel(const DashParams p, const Plan plan, Workspace ws) {
    const int tile = plan.route_tile, t0 = blockIdx.x * tile, tn = min(tile, p.num_tokens - t0);
    const int di = p.index_dim, di4 = (di + 3) / 4 * 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* iq = reinterpret_cast<float*>(smem_raw);
    uint64_t* keys = reinterpret_cast<uint64_t*>(iq + (size_t)tile * di4);
    uint64_t* best = keys + (size_t)tile * plan.max_blocks;
    __shared__ int s_seq[kRouteTile], s_n[kRouteTile], s_qp[kRouteTile];
    if (threadIdx.x < kRouteTile) {
        const int j = threadIdx.x, t = t0 + j;
        const int seq = j < tn ? ws.token_seq[t] : -1;
        s_seq[j] = seq;
        s_n[j] = seq >= 0 ? remote_blocks(p, plan, ws.token_pos[t], ws.token_prompt[t]) : 0;
        s_qp[j] = j < tn ? p.coords[t * DASH_NUM_COORDS + DASH_COORD_QUERY_PAGE] : -1;
    }
    __syncthreads();
    for (int j = 0; j < tn; ++j)
        if (s_seq[j] >= 0) load_index_query(p, ws, t0 + j, iq + (size_t)j * di4);
    __syncthreads();
    for (int lead = 0; lead < tn; ++lead) {  // each sequence of the tile once, at its first token
        const int seq = s_seq[lead];
        bool first = seq >= 0;
        int n = 0;
        for (int j = 0; j < tn; ++j) {
            if (s_seq[j] != seq) continue;
            first = first && j >= lead;
            n = max(n, s_n[j]);
        }
        if (!first) continue;
        auto emit = [&](int j, int b, uint64_t key) {
            if (s_seq[j] == seq && b < s_n[j]) keys[(size_t)j * plan.max_blocks + b] = key;
        };
        switch (chunks_per_lane(di)) {
            case 1: score_rows<1, kRouteTile, 32>(p, ws, seq, iq, di4, s_qp, tn, 0, n, 32, emit); break;
            case 2: score_rows<2, kRouteTile, 32>(p, ws, seq, iq, di4, s_qp, tn, 0, n, 32, emit); break;
            default: score_rows<4, kRouteTile, 32>(p, ws, seq, iq, di4, s_qp, tn, 0, n, 32, emit); break;
        }
    }
    __syncthreads();
    const int lane = threadIdx.x % 32;
    for (int j = threadIdx.x / 32; j < tn; j += blockDim.x / 32) {
        const int t = t0 + j, n = s_n[j];
        int32_t* sel = ws.selected + (int64_t)t * plan.kmax;
        uint8_t* forced = ws.forced + (int64_t)t * plan.kmax;
        uint64_t* kj = keys + (size_t)j * plan.max_blocks;
        if (s_seq[j] < 0) {
            write_selection(plan, nullptr, 0, sel, forced, lane, 32);
        } else if (p.dense_layer) {
            // Every remote block is selected; the order inside a row does not change the output.
            for (int i = lane; i < plan.kmax; i += 32) {
                sel[i] = i < n ? i : -1;
                forced[i] = i < n ? (uint8_t)(kj[i] >> 63) : 0;
            }
        } else {
            const int k = min(p.topk, n);
            uint64_t* bj = best + (size_t)j * p.topk;
            warp_topk(kj, 0, n, k, bj);
            __syncwarp();
            write_selection(plan, bj, k, sel, forced, lane, 32);
        }
        if (p.selected_out != nullptr) {
            __syncwarp();
            for (int i = lane; i < plan.kmax; i += 32) p.selected_out[(int64_t)t * plan.kmax + i] = sel[i];
        }
    }
}

// Split routing: grid (T, route_splits), kSplitRows blocks per CTA. Each CTA keeps the best
// min(topk, kSplitRows) keys of its blocks (by rank: a key's rank is the number of larger keys;
// keys are distinct) in the workspace; the token's last CTA merges them the same way
// (select_topk's warp lists when there are too many candidates for a quadratic rank). A token
// with one CTA selects by its ranks directly.
template <typename T, bool Front>
__global__ void __launch_bounds__(kSplitThreads, kSplitCtasPerSm) route_split_kernel(const DashParams p, const Plan plan, Workspace ws) {
    static_assert(kSplitThreads > 32 + kMaxIndexDimDevice / 2, "a thread per indexer pair and more (front_token)");
    const int t = blockIdx.x, y = blockIdx.y;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(16) float iq[kMaxIndexDimDevice];
    __shared__ __align__(16) uint64_t keys[kSplitRows];
    __shared__ float2 cs[Front ? kMaxIndexDimDevice / 2 : 1];
    DASH_MARK(g_route_trace, 0);
    if constexpr (Front) {
        const FrontToken f = front_token<T>(p, ws, t, y == 0, iq, cs);
        DASH_MARK(g_route_trace, 1);
        const int ry = y - plan.front_writer_cta;  // routing CTA index (-1: the writer alone)
        if (ry >= 0 && f.seq >= 0)
            route_split_cta<kSplitThreads, kScoreBatch>(p, plan, ws, t, ry, f.seq, f.pos, f.prompt, iq, keys, smem_raw);
        else if (ry == 0) no_selection(p, plan, ws, t);
        if (y == 0) front_write<T>(p, ws, t, f, cs, smem_raw);
        DASH_MARK(g_route_trace, 7);
    } else {
        const int seq = ws.token_seq[t];
        if (seq < 0) {
            if (y == 0) no_selection(p, plan, ws, t);
            return;
        }
        load_index_query(p, ws, t, iq);  // the barrier after it: route_split_cta's first
        DASH_MARK(g_route_trace, 1);
        route_split_cta<kSplitThreads, kScoreBatch>(p, plan, ws, t, y, seq, ws.token_pos[t], ws.token_prompt[t], iq, keys,
                                                    smem_raw);
        DASH_MARK(g_route_trace, 7);
    }
}

// Plan::fused_front (fp16 / bf16 only).
template <typename T>
cudaError_t launch_front(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    const cudaError_t err = allow_smem(route_split_kernel<T, true>, plan.route_smem);
    if (err != cudaSuccess) return err;
    route_split_kernel<T, true>
        <<<dim3(p.num_tokens, plan.route_splits + plan.front_writer_cta), kSplitThreads, plan.route_smem, stream>>>(
            p, plan, ws);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_route(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    if (plan.fused_front) {
        if (p.dtype == DASH_FLOAT16) return launch_front<__half>(p, plan, ws, stream);
        if (p.dtype == DASH_BFLOAT16) return launch_front<__nv_bfloat16>(p, plan, ws, stream);
        return cudaErrorInvalidValue;  // the plan never fuses float32
    }
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        cudaError_t err;
        if (!plan.route_split) {
            if ((err = allow_smem(route_tile_kernel<T>, plan.route_smem)) != cudaSuccess) return err;
            const int tiles = (p.num_tokens + plan.route_tile - 1) / plan.route_tile;
            route_tile_kernel<T><<<tiles, kRouteThreads, plan.route_smem, stream>>>(p, plan, ws);
            return cudaGetLastError();
        }
        if ((err = allow_smem(route_split_kernel<float, false>, plan.route_smem)) != cudaSuccess) return err;
        route_split_kernel<float, false><<<dim3(p.num_tokens, plan.route_splits), kSplitThreads, plan.route_smem,
                                           stream>>>(p, plan, ws);
        return cudaGetLastError();
    });
}

#ifdef DASH_TRACE
cudaError_t read_route_trace(unsigned long long* host) { return read_and_clear_trace(g_route_trace, host); }
#endif

int route_split_threads() { return kSplitThreads; }
int route_split_ctas_per_sm() { return kSplitCtasPerSm; }
int route_split_rows() { return kSplitRows; }
int route_max_tile() { return kRouteTile; }

}  // namespace dash
