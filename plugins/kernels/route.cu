// Stage 3: score the complete sparse blocks each query may read remotely and route them by
// Unlimited-OCR-2's rule (docs/spec.md, route_blocks): where the query's page has a remote image
// block, only those blocks compete (the own-page restriction), else every remote block; the
// routing value is x = score * route_scale / sqrt(Di); the top M = min(16, N) values go through
// entmax-1.5 (finish_route); the first K = min(topk, M) are kept, each with the logit bias
// (log max(p, floor) - its mean over the kept blocks) / sigma that the attention adds to every
// key of the block. Output rows (Workspace::selected, ::bias) are fixed-size and padded with -1
// and 0, so nothing downstream depends on data read back to the host.
//
// Two shapes of launch, chosen by the plan (Plan::route_split):
//   many tokens (prefill): one fused CTA per tile of plan.route_tile consecutive tokens scores
//     their blocks into shared memory (each summary row read once per tile, not once per token;
//     a lane per row and every token of the tile),
//     plan.route_chunk blocks at a time, and a warp per token merges each chunk into its running
//     top M (so the shared memory, and the CTAs an SM holds, do not depend on the context);
//   few tokens (decode) with more blocks than one CTA scores, or any decode-only call:
//     route_splits CTAs per token score 256 blocks each (a long context has thousands of blocks)
//     and keep their own top M by rank; the last CTA of a token to finish (a counter per token,
//     zeroed by dash_run) merges those candidates. One launch; on decode-only calls
//     (Plan::fused_front) it also does the write and summary stages' work (front_write).
// Both score a (token, block) pair in one thread in one fixed order (warp_score_rows), so they
// agree bit for bit.
#include <cuda_pipeline.h>

#include "summarize.cuh"
#include "token.cuh"

namespace dash {
namespace {

constexpr int kStageWidth = 32;                // elements of a row staged at a time
constexpr int kStageStride = kStageWidth + 4;  // floats a staged row: 16 B of padding, so that a
                                               // quarter-warp's stores (one row) and its reads (8
                                               // rows, one 16 B piece each) hit distinct banks
__host__ __device__ constexpr int stage_floats(int rows) { return rows * kStageStride; }
constexpr int kRouteThreads = 256;  // fused routing CTA
constexpr int kRouteTile = 8;       // most tokens one fused routing CTA serves (a warp each to select)
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kTileWarpRows = 32;  // rows a fused routing warp scores at a time (a lane each)
// Floats of a fused routing CTA's staged rows (its warps' shares).
constexpr int kTileStageFloats = kRouteWarps * stage_floats(kTileWarpRows);
constexpr int kSplitThreads = 512;  // split routing CTA: 16 warps ...
constexpr int kSplitRows = 256;     // ... scoring 16 blocks each (a lane per block)
constexpr int kSplitCtasPerSm = 2;  // its __launch_bounds__ (64 registers a thread)
constexpr int kSplitWarpRows = kSplitRows / (kSplitThreads / 32);  // rows a warp scores (a lane each)
static_assert(kSplitWarpRows * (kSplitThreads / 32) == kSplitRows && kSplitWarpRows <= 32, "a lane per row");
// Dynamic shared memory of a split routing CTA before its candidates: the warps' staged rows.
constexpr int kSplitStageBytes = (int)sizeof(float) * (kSplitThreads / 32) * stage_floats(kSplitWarpRows);

#ifdef DASH_TRACE
// Split routing marks: 0 entry, 1 token found and iq rotated (fused) / iq loaded, 2 rows scored,
// 3 CTA candidates out and counted (or the one CTA's selection), 4 merged selection written,
// 5 writer's token_seq / pos written, 6 writer done (summary included), 7 exit.
__device__ TraceTable g_route_trace;
#endif

// The routing value of a block the token may select that is not finite: the reference's
// NOT_CANDIDATE, which is also the value of every block it may not select.
constexpr float kNotCandidate = -1e4f;

// Sort key whose maximum is the block route_blocks ranks first:
//   bit 63 own-page candidate | bits 31..62 order-preserving bits of the routing value x |
//   bits 0..30 (2^31 - 1 - block).
// A row with an own-page candidate ranks only those (the restriction), and they sort above every
// other block; in a row without one every key has bit 63 clear and the remote blocks rank by x.
// Ties go to the lower block index (the reference's stable sort). Never 0: 0 marks "taken / empty".
__device__ __forceinline__ uint64_t route_key(float x, bool cand, int block) {
    x += 0.0f;  // -0.0 -> +0.0: equal values must tie and fall back to the block index
    uint32_t bits = __float_as_uint(x);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((uint64_t)(cand ? 1u : 0u) << 63) | ((uint64_t)bits << 31) |
           (uint64_t)(0x7fffffffu - (uint32_t)block);
}

__device__ __forceinline__ int key_block(uint64_t key) { return (int)(0x7fffffffu - (uint32_t)(key & 0x7fffffffu)); }
__device__ __forceinline__ bool key_candidate(uint64_t key) { return (key >> 63) != 0; }
__device__ __forceinline__ float key_value(uint64_t key) {
    const uint32_t bits = (uint32_t)(key >> 31);
    return __uint_as_float((bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits);
}

// The routing value of a block with score `score`: x = score * route_scale / sqrt(Di) (one
// float multiply by the plan's factor, as the reference multiplies by a scalar), not finite ->
// kNotCandidate.
__device__ __forceinline__ float route_value(const Plan& plan, float score) {
    const float x = __fmul_rn(score, plan.route_factor);
    return isfinite(x) ? x : kNotCandidate;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

// Remote blocks form a prefix: b <= pos / sbs - local_blocks, and b * sbs < prompt_length.
__device__ __forceinline__ int remote_blocks(const DashParams& p, const Plan& plan, int pos, int prompt) {
    const int sbs = p.sparse_block_size;
    int n = pos / sbs - p.sparse_local_block + 1;
    if (prompt >= 0) n = min(n, (prompt + sbs - 1) / sbs);
    return max(0, min(n, plan.max_blocks));
}

// Element d < di4 of token t's rotated, finite, float32 indexer query (written by an earlier
// launch, the write stage), zero past Di: a row of the routing's iq.
__device__ __forceinline__ float index_query(const DashParams& p, const Workspace& ws, int t, int d, int di4) {
    return d < p.index_dim ? __ldg(ws.iq_rot + (int64_t)t * di4 + d) : 0.0f;
}
__device__ __forceinline__ void load_index_query(const DashParams& p, const Workspace& ws, int t, float* iq) {
    const int di4 = (p.index_dim + 3) / 4 * 4;
    for (int i = threadIdx.x; i < di4; i += blockDim.x) iq[i] = index_query(p, ws, t, i, di4);
}

// The page range of block b's summary row si: its lowest and highest image page, and whether
// every page between them has an image token in the block (DASH_PAGE_DENSE).
struct BlockPages {
    int lo, hi, dense;
};
__device__ __forceinline__ BlockPages block_pages(const DashParams& p, int64_t si) {
    const int32_t* pg = p.summary_pages_cache + si * 3;
    return {pg[DASH_PAGE_LO], pg[DASH_PAGE_HI], pg[DASH_PAGE_DENSE]};
}

// Whether block b (page range pg) is an own-page candidate of query page qp: it holds an image
// token of that page.
__device__ __forceinline__ bool own_page_block(const DashParams& p, const Workspace& ws, int seq, int b,
                                             const BlockPages& pg, int qp) {
    const bool inside = qp >= 0 && pg.lo <= qp && qp <= pg.hi;
    bool cand = inside && (pg.dense || qp == pg.lo || qp == pg.hi);
    // A page strictly inside the block's range may have no image token here.
    for (int j = 0; inside && !cand && j < p.sparse_block_size; ++j) {
        const int64_t slot = cache_slot(p, seq, b * p.sparse_block_size + j, ws.error);
        cand = slot >= 0 && p.image_page_cache[slot] == qp;
    }
    return cand;
}

// ------------------------------------------------------------------ scoring, a thread per pair
// The indexer dot product of a (token, summary row) pair is one chain of fused multiply-adds in
// element order, from +0: acc = fma(q[d], s[d], acc) for d = 0, 1, ..., Di4 - 1 (query and row
// zero past Di). Every launch computes every pair this way, in one thread (warp_score_rows), so
// a block's score, and the selection, never depend on how many tokens a call has or on which
// launch shape routes them. The rows are staged through shared memory kStageWidth elements at a
// time (coalesced loads, cp.async), then each lane reads its own row from there while the
// tokens' queries are read by the whole warp at once (a broadcast): a register-tiled product of
// NT tokens by one row a lane, with no sum across lanes.

// Four steps of the chain.
__device__ __forceinline__ float dot_step4(float acc, const float4 q, const float4 s) {
    return __fmaf_rn(q.w, s.w, __fmaf_rn(q.z, s.z, __fmaf_rn(q.y, s.y, __fmaf_rn(q.x, s.x, acc))));
}

// The dot products of NT tokens' queries (iq: [NT][di4] shared memory, zero past Di) with the
// warp's rows: lane i < ROWS holds row i's address in my_row (0: absent or unmapped, scored as
// zeros) and gets acc[j], token j's product with its row. stage: the warp's own
// stage_floats(ROWS) floats of shared memory. vec: every row starts 16-byte aligned and Di is a
// multiple of 4 (cp.async; else element loads). Every lane of the warp calls it.
template <int NT, int ROWS, int DI4 = 0>
__device__ __forceinline__ void warp_score_rows(const float* iq, int di, int di4_arg, bool vec, unsigned long long my_row,
                                                const float* any_row, float* stage, float (&acc)[NT]) {
    static_assert(ROWS % 4 == 0 && ROWS <= 32, "a quarter-warp stages a row");
    const int lane = threadIdx.x % 32, di4 = DI4 > 0 ? DI4 : di4_arg;  // DI4: Di4 known when compiled
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = 0.0f;
    for (int d0 = 0; d0 < di4; d0 += kStageWidth) {
        const int w4 = min(kStageWidth, di4 - d0) / 4;  // 16-byte pieces of a row in this slice
        const int c = lane & 7;
#pragma unroll
        for (int m = 0; m < ROWS / 4; ++m) {  // quarter-warp q stages row 4 m + q
            const int r = 4 * m + (lane >> 3);
            const unsigned long long row = __shfl_sync(0xffffffffu, my_row, r);
            if (c >= w4) continue;
            float* dst = stage + r * kStageStride + 4 * c;
            const float* src = reinterpret_cast<const float*>(row) + d0 + 4 * c;
            if (vec) {
                __pipeline_memcpy_async(dst, row != 0 ? src : any_row, 16, row != 0 ? 0 : 16);
            } else {
                const int d = d0 + 4 * c;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (row != 0) {
                    v.x = d < di ? src[0] : 0.0f;
                    v.y = d + 1 < di ? src[1] : 0.0f;
                    v.z = d + 2 < di ? src[2] : 0.0f;
                    v.w = d + 3 < di ? src[3] : 0.0f;
                }
                *reinterpret_cast<float4*>(dst) = v;
            }
        }
        __pipeline_commit();
        __pipeline_wait_prior(0);
        __syncwarp();
        if (lane < ROWS) {
            const float4* s4 = reinterpret_cast<const float4*>(stage + lane * kStageStride);
            const float4* q4 = reinterpret_cast<const float4*>(iq + d0);
#pragma unroll(DI4 > 0 ? kStageWidth / 4 : 1)
            for (int i = 0; i < w4; ++i) {
                const float4 s = s4[i];
#pragma unroll
                for (int j = 0; j < NT; ++j) acc[j] = dot_step4(acc[j], q4[j * (di4 / 4) + i], s);
            }
        }
        __syncwarp();  // the slice's reads before the next slice's stores
    }
}

__device__ __forceinline__ float score_of(float dot, float inv_sqrt) { return clamp_index_logit(dot * inv_sqrt); }

// The address of row r's summary (0: r >= r1, or unmapped: flagged, scored 0 and never a candidate),
// and its summary index (-1 then).
__device__ __forceinline__ unsigned long long summary_row(const DashParams& p, const Workspace& ws, int seq, int r,
                                                          int r1, int64_t& si) {
    si = r < r1 ? summary_index(p, seq, r, ws.error) : -1;
    return si >= 0 ? reinterpret_cast<uintptr_t>(p.summary_cache + si * p.index_dim) : 0ull;
}

__device__ __forceinline__ bool summary_rows_aligned(const DashParams& p) {
    return p.index_dim % 4 == 0 && reinterpret_cast<uintptr_t>(p.summary_cache) % 16 == 0;
}

// The k largest keys of keys[lo, hi) (shared memory, consumed: taken keys become 0) into
// out[0, k), largest first, 0 past the end. One warp; each lane keeps the maximum of its
// stride of keys and rescans only when that maximum is taken.
__device__ void warp_topk(uint64_t* keys, int lo, int hi, int k, uint64_t* out) {
    const int lane = threadIdx.x % 32;
    auto lane_max = [&](int& at) {
        uint64_t m = 0;
        at = -1;
        for (int b = lo + lane; b < hi; b += 32)
            if (keys[b] > m) m = keys[b], at = b;
        return m;
    };
    int at;
    uint64_t mine = lane_max(at);
    for (int r = 0; r < k; ++r) {
        const uint64_t top = warp_max_u64(mine);
        if (lane == 0) out[r] = top;
        if (top != 0 && mine == top) {  // keys are distinct: exactly one lane holds it
            keys[at] = 0;
            mine = lane_max(at);
        }
        __syncwarp();
    }
}

// The last step of routing token t, by one warp: best[0, count) are its count (<= plan.route_m)
// largest keys, largest first; nblocks its sequence's sparse blocks, ceil(seq_len / sbs) (the
// reference's N; 0: an empty selection). Writes the token's row of Workspace::selected and ::bias
// (and of selected_out / bias_out where given): docs/spec.md, route_blocks, from the top M on.
//  * The ranked values: where an own-page candidate is among the keys (they sort first), the
//    candidates' x; else every key's. The reference ranks all N blocks, so the top M = min(16, N)
//    values are those plus M - R fillers at kNotCandidate (blocks the token may not select),
//    placed after the values >= kNotCandidate and before the rest (its stable sort puts blocks
//    of equal value in block order; a filler's block is never read).
//  * entmax-1.5 over the M values in closed form, in the reference's operations: z = (x - x_0) / 2;
//    for each support size r the running mean and mean square of z (the sums accumulated in
//    double, as torch's CPU cumsum does), tau_r = mean - sqrt(max((1 - r (mean_sq - mean^2)) / r,
//    0)); the support is the number of r with tau_r <= z_r; p = max(z - tau, 0)^2.
//  * The first K = min(topk, M) ranks are kept; a filler is not valid (selected -1, bias 0); the
//    valid ones get (log max(p, floor) - mean over the valid) / sigma.
__device__ void finish_route(const DashParams& p, const Plan& plan, const Workspace& ws, int t, const uint64_t* best,
                             int count, int nblocks) {
    constexpr unsigned kAll = 0xffffffffu;
    static_assert(DASH_ROUTE_TOP_M <= 32, "a lane per ranked value");
    const int lane = threadIdx.x % 32;
    const uint64_t key = lane < count ? best[lane] : 0;
    const unsigned have = __ballot_sync(kAll, key != 0);
    const unsigned cands = __ballot_sync(kAll, key != 0 && key_candidate(key));
    const int real = __popc(cands != 0 ? cands : have);  // a prefix of the keys: the ranked blocks
    const int m = max(min(plan.route_m, nblocks), real);
    const float x = key_value(key);
    const int above = __popc(__ballot_sync(kAll, lane < real && x >= kNotCandidate));
    const int fillers = m - real;
    const bool filler = lane >= above && lane < above + fillers;
    const int src = lane < above ? lane : min(max(lane - fillers, 0), 31);
    const float xs = __shfl_sync(kAll, x, src);
    const uint64_t ks = __shfl_sync(kAll, key, src);
    const bool in = lane < m;
    const float v = filler ? kNotCandidate : xs;
    const float v0 = __shfl_sync(kAll, v, 0);
    const float z = in ? __fmul_rn(__fsub_rn(v, v0), 0.5f) : 0.0f;
    double sum = 0.0, sum_sq = 0.0;
    for (int j = 0; j < m; ++j) {
        const float zj = __shfl_sync(kAll, z, j);
        if (j <= lane) sum += (double)zj, sum_sq += (double)__fmul_rn(zj, zj);
    }
    const float rank = (float)(lane + 1);
    const float mean = __fdiv_rn((float)sum, rank), mean_sq = __fdiv_rn((float)sum_sq, rank);
    const float gap = fmaxf(__fdiv_rn(__fsub_rn(1.0f, __fmul_rn(rank, __fsub_rn(mean_sq, __fmul_rn(mean, mean)))), rank),
                            0.0f);
    const float tau = __fsub_rn(mean, __fsqrt_rn(gap));
    const int support = max(1, __popc(__ballot_sync(kAll, in && tau <= z)));
    const float tau_s = __shfl_sync(kAll, tau, support - 1);
    const float d = fmaxf(__fsub_rn(z, tau_s), 0.0f);
    const float prior = __fmul_rn(d, d);
    const int k = min(p.topk, m);
    const bool valid = in && lane < k && !filler;
    const float logp = valid ? logf(fmaxf(prior, p.prior_floor)) : 0.0f;
    float total = 0.0f;  // in rank order
    for (int j = 0; j < k; ++j) total = __fadd_rn(total, __shfl_sync(kAll, logp, j));
    const int nvalid = __popc(__ballot_sync(kAll, valid));
    const float centre = __fdiv_rn(total, (float)max(nvalid, 1));
    const float bias = valid ? __fdiv_rn(__fsub_rn(logp, centre), p.sigma) : 0.0f;
    const int block = valid ? key_block(ks) : -1;
    if (lane < plan.kmax) {
        const int64_t at = (int64_t)t * plan.kmax + lane;
        ws.selected[at] = block;
        ws.bias[at] = bias;
        if (p.selected_out != nullptr) p.selected_out[at] = block;
        if (p.bias_out != nullptr) p.bias_out[at] = bias;
    }
}

// The sparse blocks of the sequence of a token (N of route_blocks).
__device__ __forceinline__ int sequence_blocks(const DashParams& p, int seq) {
    return seq < 0 ? 0 : (p.seq_lens[seq] + p.sparse_block_size - 1) / p.sparse_block_size;
}

// The k largest of keys[0, n) (shared memory, consumed) into out[0, k), largest first, with the
// whole CTA: every warp takes the k best of its slice (into scratch), then warp 0 the k best of
// those. Ends with a CTA barrier.
__device__ void select_topk(uint64_t* keys, int n, int k, uint64_t* scratch, uint64_t* out) {
    const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const int slice = (n + nwarps - 1) / nwarps;
    warp_topk(keys, min(n, warp * slice), min(n, (warp + 1) * slice), k, scratch + warp * k);
    __syncthreads();
    if (warp == 0) {  // merge the warps' lists (each sorted, largest first): lane w walks list w
        const int lane = threadIdx.x % 32;
        int at = 0;
        uint64_t head = lane < nwarps && k > 0 ? scratch[lane * k] : 0;
        for (int r = 0; r < k; ++r) {
            const uint64_t top = warp_max_u64(head);
            if (lane == 0) out[r] = top;
            if (top != 0 && head == top) head = ++at < k ? scratch[lane * k + at] : 0;
        }
    }
    __syncthreads();
}

// Token j's running selection (the warp of token j): best[0, count) holds the largest keys of
// its blocks scored so far, largest first; keys[0, m) the keys of the next chunk of its blocks
// (shared memory, consumed; room for m + k keys). Only the keys above the k-th best can enter
// (before there is a k-th best, those at or above a bound taken from the chunk itself):
// they are compacted to the front of keys, the running best appended, and the k largest of
// those become the new best: by rank (a lane per key) when there are at most 64, else by
// warp_topk. The result is the k largest keys over all chunks, the same as one top-k over
// every key (keys are distinct).
__device__ void merge_chunk(uint64_t* keys, int m, uint64_t* best, int& count, int k) {
    const int lane = threadIdx.x % 32;
    uint64_t thr = count == k ? best[k - 1] : 0;  // keys are never 0
    if (count < k && k <= 32 && m > 64) {
        // No running k-th best yet (the first chunk): the k-th largest of the lanes' maxima of
        // their strides bounds the chunk's k-th largest key from below (the k lanes' maxima at
        // or above it are k keys), so only keys at or above it can enter. Maxima other than 0
        // are distinct keys; with fewer than k lanes holding a key no lane has rank k - 1.
        uint64_t lm = 0;
        for (int i = lane; i < m; i += 32) lm = keys[i] > lm ? keys[i] : lm;
        int above = 0;
        for (int o = 0; o < 32; ++o) above += __shfl_sync(0xffffffffu, lm, o) > lm ? 1 : 0;
        const unsigned at = __ballot_sync(0xffffffffu, lm != 0 && above == k - 1);
        const uint64_t kth = at ? __shfl_sync(0xffffffffu, lm, __ffs(at) - 1) : 0;
        if (kth > 0 && kth - 1 > thr) thr = kth - 1;
    }
    int nc = 0;
    for (int base = 0; base < m; base += 32) {
        const int i = base + lane;
        const uint64_t key = i < m ? keys[i] : 0;
        const bool take = key > thr;
        const unsigned ballot = __ballot_sync(0xffffffffu, take);
        __syncwarp();  // this round's reads before its writes (which go to positions < base + 32)
        if (take) keys[nc + __popc(ballot & ((1u << lane) - 1u))] = key;
        nc += __popc(ballot);
        __syncwarp();
    }
    if (nc == 0) return;
    for (int i = lane; i < count; i += 32) keys[nc + i] = best[i];
    __syncwarp();
    const int u = nc + count, kk = min(k, u);
    if (u <= 64) {
        const uint64_t c0 = lane < u ? keys[lane] : 0, c1 = lane + 32 < u ? keys[lane + 32] : 0;
        int r0 = 0, r1 = 0;
        for (int x = 0; x < u; ++x) {
            const uint64_t y = keys[x];
            r0 += y > c0 ? 1 : 0;
            r1 += y > c1 ? 1 : 0;
        }
        if (c0 != 0 && r0 < kk) best[r0] = c0;  // best's old keys were copied above
        if (c1 != 0 && r1 < kk) best[r1] = c1;
    } else {
        warp_topk(keys, 0, u, kk, best);
    }
    count = kk;
    __syncwarp();
}

// Fused: one CTA per tile of plan.route_tile (<= kRouteTile) consecutive tokens. Tokens of one
// sequence share each summary row load. The blocks are scored plan.route_chunk at a time into
// shared memory; between chunks a warp per token merges the chunk's keys into its running top M
// (merge_chunk), so the shared memory does not grow with the context; the warp then finishes its
// token's routing (finish_route). Shared memory: iq [kRouteTile][Di4] floats (zero for absent
// tokens), each warp's staged rows [kRouteWarps][stage_floats(kTileWarpRows)], keys
// [tile][route_key_stride], best [tile][route_m]. At most 80
// registers a thread (3 CTAs per SM).
template <typename T>
__global__ void __launch_bounds__(kRouteThreads, 3) route_tile_kernel(const DashParams p, const Plan plan, Workspace ws) {
    static_assert(kRouteTile == kRouteThreads / 32, "a warp per token of the tile selects");
    const int tile = plan.route_tile, t0 = blockIdx.x * tile, tn = min(tile, p.num_tokens - t0);
    const int di = p.index_dim, di4 = (di + 3) / 4 * 4, chunk = plan.route_chunk;
    const int mslots = plan.route_m, kstride = route_key_stride(chunk, plan.max_blocks, mslots);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* iq = reinterpret_cast<float*>(smem_raw);
    float* stage = iq + (size_t)kRouteTile * di4;  // a warp's staged rows each
    uint64_t* keys = reinterpret_cast<uint64_t*>(stage + (size_t)kTileStageFloats);
    uint64_t* best = keys + (size_t)tile * kstride;
    __shared__ int s_seq[kRouteTile], s_n[kRouteTile], s_qp[kRouteTile], s_nmax;
    // The tile's sequences, each once (at its first token), and the most blocks a token of it scores.
    __shared__ int s_lseq[kRouteTile], s_ln[kRouteTile], s_nseq;
    if (threadIdx.x < kRouteTile) {
        const int j = threadIdx.x, t = t0 + j;
        const int seq = j < tn ? ws.token_seq[t] : -1;
        s_seq[j] = seq;
        s_n[j] = seq >= 0 ? remote_blocks(p, plan, ws.token_pos[t], ws.token_prompt[t]) : 0;
        s_qp[j] = j < tn ? p.coords[t * DASH_NUM_COORDS + DASH_COORD_QUERY_PAGE] : -1;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane j < kRouteTile: token j, and whether it leads its sequence
        const int j = threadIdx.x, seq = j < kRouteTile ? s_seq[j] : -1;
        bool first = seq >= 0;
        int n = 0;
        for (int i = 0; i < kRouteTile; ++i) {
            if (s_seq[i] != seq) continue;
            first = first && i >= j;
            n = max(n, s_n[i]);
        }
        const unsigned leads = __ballot_sync(0xffffffffu, first);
        if (first) {
            const int at = __popc(leads & ((1u << j) - 1u));
            s_lseq[at] = seq;
            s_ln[at] = n;
        }
        int nmax = j < kRouteTile ? s_n[j] : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) nmax = max(nmax, __shfl_xor_sync(0xffffffffu, nmax, o));
        if (j == 0) s_nmax = nmax, s_nseq = __popc(leads);
    }
    // The tokens' indexer queries (zero for absent tokens), every load of the tile in flight at once.
    for (int i = threadIdx.x; i < kRouteTile * di4; i += blockDim.x) {
        const int j = i / di4, d = i - j * di4;
        iq[i] = s_seq[j] >= 0 ? index_query(p, ws, t0 + j, d, di4) : 0.0f;
    }
    // Plan::rope_routed: warp j rotates token j's queries for the block-major tiles, its loads in
    // flight with the indexer queries' (on the H200 cheaper here than after the selection).
    if constexpr (sizeof(T) == 2) {
        const int j = threadIdx.x / 32;
        if (ws.q_rot != nullptr && j < tn) {
            const int64_t row = (int64_t)(t0 + j) * p.num_heads * p.head_dim;
            warp_rope_rows<T>(static_cast<const T*>(p.q) + row, static_cast<T*>(ws.q_rot) + row,
                                 ws.token_cs + (int64_t)(t0 + j) * (p.head_dim / 2), p.num_heads, p.head_dim,
                                 threadIdx.x % 32);
        }
    }
    __syncthreads();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nmax = s_nmax, nseq = s_nseq;
    const float inv_sqrt = index_inv_sqrt(di);
    float* my_stage = stage + (size_t)warp * stage_floats(kTileWarpRows);
    const int my_n = warp < tn ? s_n[warp] : 0, k = min(plan.route_m, my_n);
    int count = 0;  // warp's token: keys in its running best
    const bool vec = summary_rows_aligned(p);
    for (int c0 = 0; c0 < nmax; c0 += chunk) {
        for (int q = 0; q < nseq; ++q) {  // each sequence of the tile once
            const int seq = s_lseq[q], n = s_ln[q];
            if (n <= c0) continue;
            const int r1 = min(n, c0 + chunk);
            int lim[kRouteTile];  // token j's blocks, where it belongs to this sequence
#pragma unroll
            for (int j = 0; j < kRouteTile; ++j) lim[j] = s_seq[j] == seq ? s_n[j] : 0;
            // A warp per kTileWarpRows rows of the chunk, a lane per row.
            for (int base = c0 + kTileWarpRows * warp; base < r1; base += kTileWarpRows * kRouteWarps) {
                const int r = base + lane;
                int64_t si;
                const unsigned long long row = summary_row(p, ws, seq, r, r1, si);
                float acc[kRouteTile];
                if (di4 == 128)  // the common index dim, with constant offsets; the same arithmetic
                    warp_score_rows<kRouteTile, kTileWarpRows, 128>(iq, di, di4, vec, row, p.summary_cache, my_stage, acc);
                else
                    warp_score_rows<kRouteTile, kTileWarpRows>(iq, di, di4, vec, row, p.summary_cache, my_stage, acc);
                if (r >= r1) continue;
                const BlockPages pg = si >= 0 ? block_pages(p, si) : BlockPages{0, -1, 0};
#pragma unroll
                for (int j = 0; j < kRouteTile; ++j) {
                    if (r >= lim[j]) continue;
                    const bool f = si >= 0 && own_page_block(p, ws, seq, r, pg, s_qp[j]);
                    keys[(size_t)j * kstride + (r - c0)] = route_key(route_value(plan, score_of(acc[j], inv_sqrt)), f, r);
                }
            }
        }
        __syncthreads();
        const int m = min(chunk, my_n - c0);  // the warp's token's keys in this chunk
        uint64_t* kj = keys + (size_t)warp * kstride;
        if (warp < tn && s_seq[warp] >= 0 && m > 0) {
            if (k > 0) {
                merge_chunk(kj, m, best + (size_t)warp * mslots, count, k);
            }
        }
        __syncthreads();
    }
    if (warp >= tn) return;
    const int seq = s_seq[warp];
    finish_route(p, plan, ws, t0 + warp, best + (size_t)warp * mslots, seq < 0 ? 0 : count, sequence_blocks(p, seq));
}

constexpr int kRankMergeMax = 1024;  // split routing: most candidates merged by a quadratic rank

// A token skipped for bad metadata (flagged): an empty selection, also in selected_out. Called by
// the whole CTA; its first warp writes.
__device__ void no_selection(const DashParams& p, const Plan& plan, const Workspace& ws, int t) {
    if (threadIdx.x < 32) finish_route(p, plan, ws, t, nullptr, 0, 0);
}

// Routing of token t over its remote blocks [y * kSplitRows, ...) (seq >= 0; iq in shared
// memory). Every return is uniform over the CTA.
__device__ void route_split_cta(const DashParams& p, const Plan& plan, const Workspace& ws, int t, int y, int seq,
                                int pos, int prompt, const float* iq, unsigned char* smem_raw) {
    const int tid = threadIdx.x, nt = blockDim.x;
    const int n = remote_blocks(p, plan, pos, prompt);
    const int ctas = max(1, (n + kSplitRows - 1) / kSplitRows);  // CTAs with blocks (or the one)
    if (y >= ctas) return;
    const int r0 = y * kSplitRows, r1 = min(n, r0 + kSplitRows), di4 = (p.index_dim + 3) / 4 * 4;
    __shared__ __align__(16) uint64_t keys[kSplitRows];
    __shared__ int s_last;
    __shared__ int s_qp;
    if (tid == 0) s_qp = p.coords[t * DASH_NUM_COORDS + DASH_COORD_QUERY_PAGE];
    if (tid < kSplitRows) keys[tid] = 0;
    __syncthreads();
    const float inv_sqrt = index_inv_sqrt(p.index_dim);
    float* stage = reinterpret_cast<float*>(smem_raw);
    if (r0 + (tid / 32) * kSplitWarpRows < r1) {  // a warp per kSplitWarpRows rows, a lane per row
        const int warp = tid / 32, lane = tid % 32, r = r0 + warp * kSplitWarpRows + lane;
        int64_t si;
        const unsigned long long row = summary_row(p, ws, seq, lane < kSplitWarpRows ? r : r1, r1, si);
        float acc[1];
        warp_score_rows<1, kSplitWarpRows>(iq, p.index_dim, di4, summary_rows_aligned(p), row, p.summary_cache,
                                           stage + warp * stage_floats(kSplitWarpRows), acc);
        if (lane < kSplitWarpRows && r < r1) {
            const bool f = si >= 0 && own_page_block(p, ws, seq, r, block_pages(p, si), s_qp);
            keys[r - r0] = route_key(route_value(plan, score_of(acc[0], inv_sqrt)), f, r);
        }
    }
    __syncthreads();
    DASH_MARK(g_route_trace, 2);
    // Rank of each key among the CTA's: two threads per key (kSplitThreads = 2 * kSplitRows),
    // each counting the larger keys in its half, two keys per 16-byte load.
    static_assert(kSplitThreads == 2 * kSplitRows, "a pair of threads per key");
    const uint64_t mine = keys[tid / 2];
    const ulonglong2* half = reinterpret_cast<const ulonglong2*>(keys + (tid % 2) * (kSplitRows / 2));
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < kSplitRows / 4; ++j) {
        const ulonglong2 two = half[j];
        rank += (two.x > mine ? 1 : 0) + (two.y > mine ? 1 : 0);
    }
    rank += __shfl_xor_sync(0xffffffffu, rank, 1);
    if (mine == 0 || tid % 2 != 0) rank = kSplitRows;  // one thread of the pair places the key
    uint64_t* cand = reinterpret_cast<uint64_t*>(smem_raw + kSplitStageBytes);  // [ctas * kk], then the best / scratch
    const int k = min(plan.route_m, n);
    if (ctas == 1) {  // the token's only CTA: its ranks are final
        if (rank < k) cand[rank] = mine;
        __syncthreads();
        if (tid < 32) finish_route(p, plan, ws, t, cand, k, sequence_blocks(p, seq));
        DASH_MARK(g_route_trace, 3);
        return;
    }
    const int kk = min(plan.route_m, kSplitRows);  // candidates per CTA
    uint64_t* out = ws.route_keys + (int64_t)t * plan.route_cand + (int64_t)y * kk;
    if (rank < kk) out[rank] = mine;
    for (int r = max(0, min(kSplitRows, n - r0)) + tid; r < kk; r += nt) out[r] = 0;
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(ws.route_count + t, 1) == ctas - 1;
    __syncthreads();
    DASH_MARK(g_route_trace, 3);
    if (!s_last) return;
    __threadfence();
    const int nc = ctas * kk;
    const uint64_t* src = ws.route_keys + (int64_t)t * plan.route_cand;
    for (int i = tid; i < nc; i += nt) cand[i] = __ldcg(src + i);  // L2: written by other CTAs
    __syncthreads();
    if (nc <= kRankMergeMax) {
        uint64_t* best = cand + nc;
        for (int i = tid; i < nc; i += nt) {
            const uint64_t c = cand[i];
            if (c == 0) continue;
            int rk = 0;
            for (int j = 0; j < nc; ++j) rk += cand[j] > c ? 1 : 0;
            if (rk < k) best[rk] = c;
        }
        __syncthreads();
        if (tid < 32) finish_route(p, plan, ws, t, best, k, sequence_blocks(p, seq));
    } else {
        uint64_t* best = cand + nc + (size_t)(nt / 32) * k;  // after the warps' lists
        select_topk(cand, nc, k, cand + nc, best);
        if (tid < 32) finish_route(p, plan, ws, t, best, k, sequence_blocks(p, seq));
    }
    DASH_MARK(g_route_trace, 4);
}

// Decode-only calls (Plan::fused_front: at most one new token per sequence, so no token routes
// over a block completed in this call) fold the write and summary stages in. Every routing CTA
// finds its token's sequence and rotates its indexer query itself (front_token). CTA y = 0 of a
// token does the write stage's work for it except K and V (which the attention launch writes,
// attend.cu) and, when the token completes its sparse block, the summary (front_write): as an
// extra CTA that does nothing else where the grid still fits the GPU in one wave
// (Plan::front_writer_cta), else at the end of the token's first routing CTA, so that no routing
// CTA waits for a free SM behind it.
struct FrontToken {
    int seq, pos, prompt, ok;  // ok: consistent lengths (seq = -1 otherwise)
    float ik_lo, ik_hi;  // this thread's pair of the unrotated index key (CTA y = 0, tid < Di / 2)
};

template <typename T>
__device__ FrontToken front_token(const DashParams& p, const Workspace& ws, int t, bool writer, float* iq,
                                  float2* cs) {
    const int tid = threadIdx.x, nt = blockDim.x, di = p.index_dim, ihalf = di / 2;
    __shared__ int s_seq, s_pos, s_prompt, s_ok;
    FrontToken f{};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const T* q = static_cast<const T*>(p.iq) + (int64_t)t * di;
    const T* kx = static_cast<const T*>(p.ik) + (int64_t)t * di;
    const float ql = tid < ihalf ? to_f(q[tid]) : 0.0f, qh = tid < ihalf ? to_f(q[tid + ihalf]) : 0.0f;
    if (writer && tid < ihalf) f.ik_lo = to_f(kx[tid]), f.ik_hi = to_f(kx[tid + ihalf]);
    if (tid < 32) {
        int sq, ps, pr;
        const bool ok = locate_token(p, t, sq, ps, pr);
        if (tid == 0) s_seq = ok ? sq : -1, s_pos = ps, s_ok = ok, s_prompt = pr;
    }
    const RopeConfig rope = index_rope(p);
    for (int i = tid - 32; i >= 0 && i < ihalf; i += nt - 32) cs[i] = rope_cos_sin<T>(rope_angle(i, di, tok, page, rope));
    if (writer) {  // the main RoPE angles, for the attention launch (Workspace::token_cs), by other threads
        const RopeConfig mrope = main_rope(p);
        const int half = p.head_dim / 2, from = 32 + ihalf;
        for (int i = tid - from; i >= 0 && i < half; i += nt - from)
            ws.token_cs[(int64_t)t * half + i] = rope_cos_sin<T>(rope_angle(i, p.head_dim, tok, page, mrope));
    }
    __syncthreads();
    if (tid < ihalf) {
        const float2 r = index_pair<T>(ql, qh, cs[tid]);
        iq[tid] = r.x;
        iq[tid + ihalf] = r.y;
    }
    for (int i = di + tid; i < (di + 3) / 4 * 4; i += nt) iq[i] = 0.0f;
    f.seq = s_seq, f.pos = s_pos, f.prompt = s_prompt, f.ok = s_ok;
    __syncthreads();
    return f;
}

template <typename T>
__device__ void front_write(const DashParams& p, const Workspace& ws, int t, const FrontToken& f, const float2* cs,
                            unsigned char* smem_raw) {
    const int tid = threadIdx.x, di = p.index_dim, ihalf = di / 2;
    __shared__ int s_seq;
    __shared__ int64_t s_slot;
    __syncthreads();  // the routing's use of shared memory (smem_raw) is over
    if (tid == 0) {  // the attention launch skips the token at -1
        const int64_t slot = publish_token(p, ws, t, f.ok, f.seq, f.pos, f.prompt);
        s_seq = slot >= 0 ? f.seq : -1, s_slot = slot;
    }
    DASH_MARK(g_route_trace, 5);
    __syncthreads();
    if (s_seq < 0) return;
    T* ic = static_cast<T*>(p.index_key_cache) + s_slot * di;
    if (tid < ihalf) {
        const float2 r = index_pair<T>(f.ik_lo, f.ik_hi, cs[tid]);
        ic[tid] = from_f<T>(r.x);
        ic[tid + ihalf] = from_f<T>(r.y);
    }
    if (tid == 0) p.image_page_cache[s_slot] = p.coords[t * DASH_NUM_COORDS + DASH_COORD_IMAGE_PAGE];
    if ((f.pos + 1) % p.sparse_block_size != 0) return;
    __syncthreads();  // the key and page stores above, before the summary reads them
    summarize_block<T>(p, ws, s_seq, f.pos / p.sparse_block_size, smem_raw);
    DASH_MARK(g_route_trace, 6);
}

// Split routing: grid (T, route_splits), kSplitRows blocks per CTA. Each CTA keeps the best
// min(route_m, kSplitRows) keys of its blocks (by rank: a key's rank is the number of larger keys;
// keys are distinct) in the workspace; the token's last CTA merges them the same way
// (select_topk's warp lists when there are too many candidates for a quadratic rank). A token
// with one CTA selects by its ranks directly.
template <typename T, bool Front>
__global__ void __launch_bounds__(kSplitThreads, kSplitCtasPerSm) route_split_kernel(const DashParams p, const Plan plan, Workspace ws) {
    static_assert(kSplitThreads > 32 + kMaxIndexDimDevice / 2, "a thread per indexer pair and more (front_token)");
    const int t = blockIdx.x, y = blockIdx.y;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(16) float iq[kMaxIndexDimDevice];
    __shared__ float2 cs[Front ? kMaxIndexDimDevice / 2 : 1];
    DASH_MARK(g_route_trace, 0);
    if constexpr (Front) {
        const FrontToken f = front_token<T>(p, ws, t, y == 0, iq, cs);
        DASH_MARK(g_route_trace, 1);
        const int ry = y - plan.front_writer_cta;  // routing CTA index (-1: the writer alone)
        if (ry >= 0 && f.seq >= 0) route_split_cta(p, plan, ws, t, ry, f.seq, f.pos, f.prompt, iq, smem_raw);
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
        route_split_cta(p, plan, ws, t, y, seq, ws.token_pos[t], ws.token_prompt[t], iq, smem_raw);
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
size_t route_tile_stage_bytes() { return sizeof(float) * kTileStageFloats; }
size_t route_split_stage_bytes() { return kSplitStageBytes; }

}  // namespace dash
