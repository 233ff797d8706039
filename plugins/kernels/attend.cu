// Stage 4: attention of each new token over its selected sparse blocks plus its local window.
//
// Work unit: one CTA per (token, KV head, split). The G = H / Hkv query heads of the KV head
// share every key/value load (routing is per token, not per head). A token's keys are "rows":
// its kmax selected blocks of sbs positions, then the local window's sparse_local_block pieces
// (row r of a split: piece r / sbs, offset r % sbs). Split-K spreads the pieces of one token
// over `splits` CTAs so a single decoding sequence still fills the GPU; a combine kernel merges
// the partial softmaxes.
//
// fp16/bf16 (attend_mma_kernel): each warp runs its own pipeline over units of 16 rows (units
// w, w + W, ... of the split): K and V of the next unit in flight (cp.async) while the current
// one is multiplied, the block-table reads of the unit after that issued before the math and
// used after it. S = Q K^T (the G heads padded to 16 rows), the online softmax and P V stay in
// registers (mma.sync m16n8k16, mma.cuh); no CTA barrier until the warps' softmax states are
// merged at the end.
// fp32 (attend_fp32_kernel): CUDA cores, 16-64 keys per tile staged in shared memory (the
// reference's exact dtype; no TF32).
// NOTE: logits, the online softmax and the output accumulation are float32; masked keys never
// enter the sums. On the tensor-core path P is rounded to the input dtype for P V, as
// FlashAttention does; the row sums use the unrounded P.
#include <cuda_pipeline.h>

#include <algorithm>

#include "common.cuh"
#include "mma.cuh"

namespace dash {
namespace {

constexpr int kMaxGroup = 16;    // H / Hkv supported
constexpr int kPieceCache = 64;  // pieces of a split whose base and bias are kept in shared memory
constexpr int kNoPiece = INT32_MIN;

#ifdef DASH_TRACE
// Tensor-core attention marks: 0 entry, 1 first-round reads landed (the token's sequence), 2
// pieces in shared memory, 3 raw queries and angles landed, 4 queries rotated (and the writer's
// K/V stored), 5 first units issued (the main loop starts), 6 main loop done, 7 exit.
__device__ TraceTable g_attend_trace;
#endif

// What every attention CTA knows about its token: where its pieces start, their logit bias,
// and which rows it may read.
struct TokenRows {
    int seq, pos, prompt, sbs, local, first, last, kmax;

    // First position of piece `pc` (kNoPiece: padding) and its logit bias, from its selection
    // entry b and the routing's bias rb for it (read by the caller; unused for the local
    // window's pieces, which get no bias).
    __device__ __forceinline__ void piece_of(int pc, int b, float rb, int& base, float& bias) const {
        bias = 0.0f;
        if (pc < kmax) {
            base = b < 0 ? kNoPiece : b * sbs;
            bias = b < 0 ? 0.0f : rb;
        } else {
            base = window_first(pos, local) + (pc - kmax) * sbs;
        }
    }
    __device__ __forceinline__ void piece(const int32_t* sel, const float* rbias, int pc, int& base,
                                          float& bias) const {
        const bool remote = pc < kmax;  // both reads at once
        piece_of(pc, remote ? sel[pc] : -1, remote ? rbias[pc] : 0.0f, base, bias);
    }
    // Position of key row kp of piece pc if this token may read it, else -1: local tokens win
    // where a selected block overlaps the window; remote reads stop at prompt_length.
    __device__ __forceinline__ int readable(int pc, int kp) const {
        const bool ok = pc < kmax ? kp <= selected_last(pos, local, prompt) : (kp >= 0 && kp <= pos);
        return ok ? kp : -1;
    }
};

// ================================================================== fp16 / bf16: tensor cores
constexpr int kMmaThreads = 128;

// Warps per CTA and pipeline stages per warp (3 where the device's shared memory allows: two
// units in flight per warp; else 2); shared memory per CTA: the queries (16 rows) and each
// warp's stages of K and V (16 rows each), rows D + 8 elements apart (16-byte aligned,
// ldmatrix's eight row addresses in different banks). D = 256 uses 2 warps, so that two stages
// fit the 99 KB of sm_86 / sm_89.
template <int D, int Stages>
struct MmaSmem {
    static constexpr int kWarps = D >= 256 ? 2 : 4;
    static constexpr int kStages = Stages;
    static constexpr int RS = D + 8;
    static constexpr int unit_elems = 16 * RS;                            // one K or V unit
    static constexpr size_t q_elems = (size_t)16 * RS;
    static constexpr size_t stage_elems = (size_t)kWarps * kStages * 2 * unit_elems;
    static constexpr size_t bytes(int dtype_bytes) { return (q_elems + stage_elems) * dtype_bytes; }
};

template <typename T, int D, int Stages>
__global__ void __launch_bounds__(kMmaThreads) attend_mma_kernel(const DashParams p, const Plan plan, Workspace ws) {
    using S = MmaSmem<D, Stages>;
    constexpr int W = S::kWarps;
    const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nthreads = W * 32;
    DASH_MARK(g_attend_trace, 0);
    // The prologue is a chain of dependent global reads (about 1 us each on a loaded GPU), so
    // everything that does not depend on an earlier read goes out in the first round, before
    // any of them is used: the token's sequence, position, prompt length and cache slot, and the
    // cos / sin of its RoPE angles (all from its writer: the write stage, or the routing
    // launch's writer), its selection entries, the raw queries (cp.async into q_s), the new K
    // and V (writer). Second round: the block-table entries of the units the pipeline starts
    // with, all at once.
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads;
    const int32_t* sel = ws.selected + (int64_t)t * plan.kmax;
    const float* rbias = ws.bias + (int64_t)t * plan.kmax;
    extern __shared__ __align__(128) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem);                   // [16, RS] rotated queries, rows >= G zero
    T* kv_w = q_s + S::q_elems + (size_t)warp * S::kStages * 2 * S::unit_elems;  // this warp's stages
    __shared__ int s_base[kPieceCache];
    __shared__ float s_bias[kPieceCache];
    __shared__ int64_t u_slot[W][S::kStages][16];  // cache slot of each row of a staged unit, -1 masked
    __shared__ float u_bias[W][S::kStages][16];
    __shared__ __align__(16) float2 cs[D / 2];

    const T* q = static_cast<const T*>(p.q) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
    constexpr int kChunk = 8;  // elements per 16-byte copy
    // Rows g < G of q_s get the raw queries (rotated in place below), by 16-byte copies where
    // the tensor allows, else by the rotation's own loads.
    const bool q_async = reinterpret_cast<uintptr_t>(q) % 16 == 0;
    if (q_async)
        for (int c = threadIdx.x; c < group * (D / kChunk); c += nthreads) {
            const int g = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            __pipeline_memcpy_async(q_s + g * S::RS + d, q + g * D + d, 16);
        }
    // The angles' cos / sin (float2 pairs), 16 bytes a copy.
    static_assert(D / 2 % 2 == 0, "whole 16-byte copies of the angles");
    const float2* cs_src = ws.token_cs + (int64_t)t * (D / 2);
    for (int c = threadIdx.x; c < D / 4; c += nthreads) __pipeline_memcpy_async(cs + 2 * c, cs_src + 2 * c, 16);
    __pipeline_commit();
    TokenRows tr;
    const int seq = ws.token_seq[t];
    tr.seq = seq, tr.pos = ws.token_pos[t], tr.prompt = ws.token_prompt[t], tr.sbs = p.sparse_block_size;
    tr.local = p.sparse_local_block * tr.sbs, tr.kmax = plan.kmax;
    tr.first = split * plan.pieces_per_split, tr.last = min(plan.pieces, tr.first + plan.pieces_per_split);
    const int npieces = tr.last - tr.first;
    // Thread i < min(pieces, kPieceCache) keeps piece i's base and bias in shared memory: its
    // selection entry and bias are read here and used after the other reads are out.
    static_assert(kPieceCache <= 2 * 32, "a piece per thread (kernels of 2 or 4 warps)");
    const int tid = threadIdx.x, my_pc = tid < min(npieces, kPieceCache) ? tr.first + tid : -1;
    const bool my_remote = my_pc >= 0 && my_pc < plan.kmax;
    const int my_sel = my_remote ? sel[my_pc] : -1;
    const float my_rbias = my_remote ? rbias[my_pc] : 0.0f;
    // Decode-only calls (plan.fused_front): the split holding the local window, which reads the
    // token's own position, first writes the token's K (rotated: the queries' angles) and V of
    // this KV head into the cache, the write stage's work for the head.
    constexpr int kPairs = (D / 2 + W * 32 - 1) / (W * 32);
    const bool writer = plan.fused_front && split == plan.splits - 1;
    float kx[kPairs][2];
    T vx[kPairs][2];
    const T* k_new = static_cast<const T*>(p.k) + ((int64_t)t * hkv + h) * D;
    const T* v_new = static_cast<const T*>(p.v) + ((int64_t)t * hkv + h) * D;
    const int64_t own_slot = writer ? ws.token_slot[t] : -1;  // checked and flagged by its writer
    if (writer) {
#pragma unroll
        for (int u = 0; u < kPairs; ++u) {
            const int i = threadIdx.x + u * nthreads;
            if (i >= D / 2) break;
            kx[u][0] = to_f(k_new[i]), kx[u][1] = to_f(k_new[i + D / 2]);
            vx[u][0] = v_new[i], vx[u][1] = v_new[i + D / 2];  // bits copied as they are
        }
    }
    if (seq < 0) {  // skipped (flagged) token; uniform over the CTA
        __pipeline_wait_prior(0);
        return;
    }
    DASH_MARK(g_attend_trace, 1);
    if (my_pc >= 0) tr.piece_of(my_pc, my_sel, my_rbias, s_base[threadIdx.x], s_bias[threadIdx.x]);
    __syncthreads();  // s_base, s_bias
    DASH_MARK(g_attend_trace, 2);

    // Row r of the split (piece r / sbs): its readable position (or -1) and bias.
    auto row_of = [&](int r, float& bias) {
        const int i = r / tr.sbs;
        int base;
        if (i < kPieceCache) base = s_base[i], bias = s_bias[i];
        else tr.piece(sel, rbias, tr.first + i, base, bias);
        return base == kNoPiece ? -1 : tr.readable(tr.first + i, base + r % tr.sbs);
    };
    const int nrows = npieces * tr.sbs;
    const int nunits = (nrows + 15) / 16;
    // This warp's k-th unit is w + k * W. Lanes 0-15 own its rows: the block-table read goes out
    // early (fetch) and becomes a slot later (settle).
    struct Pending {
        int kp;
        int32_t entry;
        float bias;
    };
    auto fetch = [&](int k) {
        Pending pe{-1, kNoEntry, 0.0f};
        const int u = warp + k * W;
        if (u < nunits && lane < 16) {
            const int r = u * 16 + lane;
            pe.kp = r < nrows ? row_of(r, pe.bias) : -1;
            if (pe.kp >= 0) pe.entry = table_entry(p, seq, pe.kp);
        }
        return pe;
    };
    auto settle = [&](int k, const Pending& pe) {
        if (lane < 16) {
            u_slot[warp][k % S::kStages][lane] = pe.kp >= 0 ? slot_of_entry(p, pe.kp, pe.entry, ws.error) : -1;
            u_bias[warp][k % S::kStages][lane] = pe.bias;
        }
    };
    // Units 0 .. Stages-1: their table reads all out before any is used.
    constexpr int kAhead = S::kStages - 1;
    Pending first[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) first[k] = fetch(k);
    Pending next = fetch(kAhead);

    __pipeline_wait_prior(0);  // the raw queries and the angles
    __syncthreads();
    DASH_MARK(g_attend_trace, 3);
    for (int idx = threadIdx.x; idx < 16 * (D / 2); idx += nthreads) {
        const int g = idx / (D / 2), i = idx % (D / 2);
        float lo = 0.0f, hi = 0.0f;
        if (g < group) {
            const float x_lo = to_f(q_async ? q_s[g * S::RS + i] : q[g * D + i]);
            const float x_hi = to_f(q_async ? q_s[g * S::RS + i + D / 2] : q[g * D + i + D / 2]);
            rope_rotate<T>(x_lo, x_hi, cs[i].x, cs[i].y, lo, hi);
        }
        q_s[g * S::RS + i] = from_f<T>(lo);  // exact: lo/hi are already T values; in place: this
        q_s[g * S::RS + i + D / 2] = from_f<T>(hi);  // thread alone reads and writes the pair
    }
    if (writer) {  // uniform over the CTA
        const int64_t slot = own_slot;
        if (slot >= 0) {
            T* kc_new = static_cast<T*>(p.key_cache) + (slot * hkv + h) * D;
            T* vc_new = static_cast<T*>(p.value_cache) + (slot * hkv + h) * D;
#pragma unroll
            for (int u = 0; u < kPairs; ++u) {
                const int i = threadIdx.x + u * nthreads;
                if (i >= D / 2) break;
                float lo, hi;
                rope_rotate<T>(kx[u][0], kx[u][1], cs[i].x, cs[i].y, lo, hi);
                kc_new[i] = from_f<T>(lo);
                kc_new[i + D / 2] = from_f<T>(hi);
                vc_new[i] = vx[u][0], vc_new[i + D / 2] = vx[u][1];
            }
        }
    }
    __syncthreads();  // the queries, and the token's K/V stores before any warp's copies of its row
    DASH_MARK(g_attend_trace, 4);

    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    auto issue = [&](int k) {  // K and V of unit k into its stage; masked rows zero-filled
        T* k_s = kv_w + (k % S::kStages) * 2 * S::unit_elems;
        T* v_s = k_s + S::unit_elems;
        const int64_t* rs = u_slot[warp][k % S::kStages];
#pragma unroll
        for (int c = lane; c < 16 * (D / kChunk); c += 32) {
            const int j = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            const int64_t slot = rs[j];
            const int64_t off = slot >= 0 ? (slot * hkv + h) * D + d : 0;
            const size_t zfill = slot >= 0 ? 0 : 16;
            __pipeline_memcpy_async(k_s + j * S::RS + d, kc + off, 16, zfill);
            __pipeline_memcpy_async(v_s + j * S::RS + d, vc + off, 16, zfill);
        }
    };

    const int my_units = warp < nunits ? (nunits - warp + W - 1) / W : 0;
    // Units 0 .. Stages-2 in flight before the loop; unit Stages-1's table reads pending.
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
        settle(k, first[k]);
        __syncwarp();
        if (k < my_units) issue(k);
        __pipeline_commit();
    }
    DASH_MARK(g_attend_trace, 5);

    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const int quad = lane % 4, r0 = lane / 4;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows r0 and r0 + 8; l per lane
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int k = 0; k < my_units; ++k) {
        if (k + kAhead < my_units) {
            settle(k + kAhead, next);
            __syncwarp();
            issue(k + kAhead);
        }
        __pipeline_commit();
        next = fetch(k + kAhead + 1);  // used after this unit's math
        __pipeline_wait_prior(kAhead);  // unit k has landed (later ones may still be in flight)
        __syncwarp();
        const T* k_s = kv_w + (k % S::kStages) * 2 * S::unit_elems;
        const T* v_s = k_s + S::unit_elems;
        // S = Q K^T: 16 (head) rows x 16 keys, two n-tiles of 8 keys.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4], b[4];
            ldmatrix_x4(a, q_s + ((lane / 8) % 2 * 8 + lane % 8) * S::RS + kk * 16 + (lane / 16) * 8);
            ldmatrix_x4(b, k_s + ((lane / 16) * 8 + lane % 8) * S::RS + kk * 16 + ((lane / 8) % 2) * 8);
            mma16816<T>(s[0], a, b[0], b[1]);
            mma16816<T>(s[1], a, b[2], b[3]);
        }
        // Mask, scale and bias by key column; online softmax of rows r0 and r0 + 8 (a quad of
        // lanes shares a row).
        const int64_t* rs = u_slot[warp][k % S::kStages];
        const float* rb = u_bias[warp][k % S::kStages];
        float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + quad * 2 + (e & 1);
                const float x = rs[col] >= 0 ? s[n][e] * scale + rb[col] : -INFINITY;
                s[n][e] = x;
                mt[e / 2] = fmaxf(mt[e / 2], x);
            }
        float alpha[2];
        online_softmax_step<false>(m, l, mt, alpha);
        uint32_t pa[4];  // P as the A operand of P V (16 keys)
#pragma unroll
        for (int n = 0; n < 2; ++n) softmax_tile<T>(s[n], m, l, pa[n * 2 + 0], pa[n * 2 + 1]);
        scale_rows(o, alpha);  // O = O * alpha + P V
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_s + (((lane / 8) % 2) * 8 + lane % 8) * S::RS + dp * 16 + (lane / 16) * 8);
            mma16816<T>(o[2 * dp], pa, b[0], b[1]);
            mma16816<T>(o[2 * dp + 1], pa, b[2], b[3]);
        }
        __syncwarp();  // this stage is free for unit k + Stages
    }
    __pipeline_wait_prior(0);
    DASH_MARK(g_attend_trace, 6);
#pragma unroll
    for (int half = 0; half < 2; ++half) l[half] = quad_sum(l[half]);
    // Merge the warps' states: each warp's rows (heads) < G to shared memory (over the stages).
    __syncthreads();
    float* mo = reinterpret_cast<float*>(q_s + S::q_elems);  // [W][G][D] outputs, then [W][G] m and l
    float* mm = mo + (size_t)W * group * D;
    float* ml = mm + W * group;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int g = r0 + half * 8;
        if (g >= group) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int col = n * 8 + quad * 2;
            mo[((size_t)warp * group + g) * D + col] = o[n][half * 2];
            mo[((size_t)warp * group + g) * D + col + 1] = o[n][half * 2 + 1];
        }
        if (quad == 0) mm[warp * group + g] = m[half], ml[warp * group + g] = l[half];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * D; idx += nthreads) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < W; ++w) mx = fmaxf(mx, mm[w * group + g]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float mw = mm[w * group + g];
            if (mw == -INFINITY) continue;
            const float f = partial_scale(mw, mx);
            num += f * mo[((size_t)w * group + g) * D + d];
            den += f * ml[w * group + g];
        }
        const int head = h * group + g;
        if (plan.splits == 1) {
            static_cast<T*>(p.out)[((int64_t)t * p.num_heads + head) * D + d] = from_f<T>(num / den);
        } else {
            const int64_t row = ((int64_t)t * p.num_heads + head) * plan.splits + split;
            ws.part_acc[row * D + d] = num;
            if (d == 0) ws.part_ml[row] = make_float2(mx, den);
        }
    }
    DASH_MARK(g_attend_trace, 7);
}

// ================================================================== fp32: CUDA cores
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// Key rows per tile: about 16 KB of K (and of V), between 16 and 64 rows.
__host__ __device__ constexpr int tile_rows(int head_dim) {
    return 16384 / (head_dim * 4) > 64 ? 64 : 16384 / (head_dim * 4) < 16 ? 16 : 16384 / (head_dim * 4);
}

// Shared-memory layout of one fp32 CTA, in bytes; the same on host (launch size) and device.
struct Layout {
    int tile, ks;  // rows per tile; K row stride (elements)
    size_t v, k, q32, logit, bytes;
};

__host__ __device__ constexpr Layout make_layout(int head_dim, int group) {
    Layout l{};
    l.tile = tile_rows(head_dim);
    l.ks = head_dim + 1;  // a K row per thread: an odd number of words keeps the reads conflict-free
    size_t off = 0;
    auto take = [&](size_t bytes) {
        const size_t at = off;
        off += (bytes + 127) / 128 * 128;
        return at;
    };
    l.v = take((size_t)l.tile * head_dim * 4);
    l.k = take((size_t)l.tile * l.ks * 4);
    l.q32 = take(sizeof(float) * (size_t)group * head_dim);
    l.logit = take(sizeof(float) * (size_t)group * l.tile);
    l.bytes = off;
    return l;
}

template <int D>
__global__ void __launch_bounds__(kThreads) attend_fp32_kernel(const DashParams p, const Plan plan, Workspace ws) {
    const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int seq = ws.token_seq[t];
    if (seq < 0) return;
    const int group = p.num_heads / p.num_kv_heads;
    TokenRows tr;
    tr.seq = seq, tr.pos = ws.token_pos[t], tr.prompt = ws.token_prompt[t], tr.sbs = p.sparse_block_size;
    tr.local = p.sparse_local_block * tr.sbs, tr.kmax = plan.kmax;
    tr.first = split * plan.pieces_per_split, tr.last = min(plan.pieces, tr.first + plan.pieces_per_split);
    const int sbs = tr.sbs, hkv = p.num_kv_heads;
    const Layout L = make_layout(D, group);
    constexpr int kChunksPerRow = D / 4;  // 16-byte chunks

    extern __shared__ __align__(128) unsigned char smem[];
    float* v_s = reinterpret_cast<float*>(smem + L.v);
    float* k_s = reinterpret_cast<float*>(smem + L.k);
    float* q_s = reinterpret_cast<float*>(smem + L.q32);      // [G, D] rotated queries
    float* logit = reinterpret_cast<float*>(smem + L.logit);  // [G, tile] logits, then P
    __shared__ int64_t row_slot[64];  // cache slot of each key row in the tile, -1 masked
    __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], alpha_s[kMaxGroup];

    // Rotate the G queries (float32, like the reference).
    const RopeConfig rope = main_rope(p);
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const float* q = static_cast<const float*>(p.q) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
    __shared__ float2 cs[D / 2];  // cos and sin of each pair's angle, shared by the G heads
    for (int i = threadIdx.x; i < D / 2; i += kThreads) cs[i] = rope_cos_sin<float>(rope_angle(i, D, tok, page, rope));
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * (D / 2); idx += kThreads) {
        const int g = idx / (D / 2), i = idx % (D / 2);
        float lo, hi;
        rope_rotate<float>(q[g * D + i], q[g * D + i + D / 2], cs[i].x, cs[i].y, lo, hi);
        q_s[g * D + i] = lo;
        q_s[g * D + i + D / 2] = hi;
    }
    if (threadIdx.x < kMaxGroup) m_s[threadIdx.x] = -INFINITY, l_s[threadIdx.x] = 0.0f;
    // Each thread accumulates output dims d = threadIdx.x + c * kThreads for all G heads.
    constexpr int kCols = (D + kThreads - 1) / kThreads;
    float acc[kMaxGroup][kCols];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[g][c] = 0.0f;
    __syncthreads();

    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const int32_t* sel = ws.selected + (int64_t)t * plan.kmax;
    const float* rbias = ws.bias + (int64_t)t * plan.kmax;
    const float* kc = static_cast<const float*>(p.key_cache);
    const float* vc = static_cast<const float*>(p.value_cache);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    for (int piece = tr.first; piece < tr.last; ++piece) {
        int base;  // first position of the piece
        float bias;
        tr.piece(sel, rbias, piece, base, bias);
        if (base == kNoPiece) continue;  // padding: fewer remote blocks than kmax
        for (int tile = 0; tile < sbs; tile += L.tile) {
            const int n = min(L.tile, sbs - tile);
            for (int j = threadIdx.x; j < L.tile; j += kThreads) {
                const int kp = j < n ? tr.readable(piece, base + tile + j) : -1;
                row_slot[j] = kp >= 0 ? cache_slot(p, seq, kp, ws.error) : -1;
            }
            __syncthreads();
            // Stage K and V: V by asynchronous 16-byte copies, K (odd row stride, not 16-byte
            // aligned) through registers; masked rows zero-filled.
            for (int chunk = threadIdx.x; chunk < L.tile * kChunksPerRow; chunk += kThreads) {
                const int j = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
                const int64_t slot = row_slot[j];
                const int64_t off = slot >= 0 ? (slot * hkv + h) * D + c * 4 : 0;
                __pipeline_memcpy_async(v_s + j * D + c * 4, vc + off, 16, slot >= 0 ? 0 : 16);
                const float4 w4 = slot >= 0 ? *reinterpret_cast<const float4*>(kc + off) : make_float4(0, 0, 0, 0);
                float* dst = k_s + j * L.ks + c * 4;
                dst[0] = w4.x, dst[1] = w4.y, dst[2] = w4.z, dst[3] = w4.w;
            }
            __pipeline_commit();
            __pipeline_wait_prior(0);
            __syncthreads();
            {  // logits: thread -> key row j, heads g = part, part + parts, ...
                const int parts = kThreads / L.tile;
                const int j = threadIdx.x % L.tile, part = threadIdx.x / L.tile;
                const bool valid = j < n && row_slot[j] >= 0;
                for (int g = part; g < group; g += parts) {
                    float dot = 0.0f;
                    const float* krow = k_s + j * L.ks;
                    const float* qg = q_s + g * D;
#pragma unroll 8
                    for (int d = 0; d < D; ++d) dot += qg[d] * krow[d];
                    logit[g * L.tile + j] = valid ? dot * scale + bias : -INFINITY;
                }
            }
            __syncthreads();
            // Online softmax per head: a warp per head.
            for (int g = warp; g < group; g += kWarps) {
                float mt = -INFINITY;
                for (int j = lane; j < L.tile; j += 32) mt = fmaxf(mt, logit[g * L.tile + j]);
                mt = warp_max(mt);
                const float m_old = m_s[g];
                const float m_new = fmaxf(m_old, mt);
                float sum = 0.0f;
                for (int j = lane; j < L.tile; j += 32) {
                    const float lg = logit[g * L.tile + j];
                    const float e = (m_new == -INFINITY || lg == -INFINITY) ? 0.0f : expf(lg - m_new);
                    logit[g * L.tile + j] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    const float a = online_alpha<false>(m_old, m_new);
                    alpha_s[g] = a;
                    l_s[g] = l_s[g] * a + sum;
                    m_s[g] = m_new;
                }
            }
            __syncthreads();
            // P @ V.
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g)
                if (g < group)
#pragma unroll
                    for (int c = 0; c < kCols; ++c) acc[g][c] *= alpha_s[g];
#pragma unroll 4
            for (int j = 0; j < L.tile; ++j) {
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int d = threadIdx.x + c * kThreads;
                    if (d < D) {
                        const float vv = v_s[j * D + d];
#pragma unroll
                        for (int g = 0; g < kMaxGroup; ++g)
                            if (g < group) acc[g][c] += logit[g * L.tile + j] * vv;
                    }
                }
            }
            __syncthreads();
        }
    }

    if (plan.splits == 1) {
        float* out = static_cast<float*>(p.out) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g >= group) break;
            const float inv = 1.0f / l_s[g];
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int d = threadIdx.x + c * kThreads;
                if (d < D) out[g * D + d] = acc[g][c] * inv;
            }
        }
    } else {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g >= group) break;
            const int64_t row = ((int64_t)t * p.num_heads + h * group + g) * plan.splits + split;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int d = threadIdx.x + c * kThreads;
                if (d < D) ws.part_acc[row * D + d] = acc[g][c];
            }
            if (threadIdx.x == 0) ws.part_ml[row] = make_float2(m_s[g], l_s[g]);
        }
    }
}

// Merge the split-K partial softmaxes of one (token, head).
template <typename T, int D>
__global__ void combine_kernel(const DashParams p, const Plan plan, Workspace ws) {
    const int th = blockIdx.x;  // token * H + head
    const int t = th / p.num_heads;
    if (ws.token_seq[t] < 0) return;
    const float2* ml = ws.part_ml + (int64_t)th * plan.splits;
    float m = -INFINITY;
    for (int s = 0; s < plan.splits; ++s) m = fmaxf(m, ml[s].x);
    float denom = 0.0f;
    for (int s = 0; s < plan.splits; ++s)
        if (ml[s].x != -INFINITY) denom += partial_scale(ml[s].x, m) * ml[s].y;
    T* out = static_cast<T*>(p.out) + (int64_t)th * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < plan.splits; ++s)
            if (ml[s].x != -INFINITY) num += partial_scale(ml[s].x, m) * ws.part_acc[((int64_t)th * plan.splits + s) * D + d];
        out[d] = from_f<T>(num / denom);
    }
}

template <typename T, int D, int Stages>
cudaError_t launch_mma(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    const dim3 grid(p.num_tokens, p.num_kv_heads, plan.splits);
    const cudaError_t err = allow_smem(attend_mma_kernel<T, D, Stages>, plan.attend_smem);
    if (err != cudaSuccess) return err;
    attend_mma_kernel<T, D, Stages><<<grid, MmaSmem<D, Stages>::kWarps * 32, plan.attend_smem, stream>>>(p, plan, ws);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_attend_as(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    const dim3 grid(p.num_tokens, p.num_kv_heads, plan.splits);
    cudaError_t err;
    if constexpr (sizeof(T) == 2) {
        err = plan.attend_stages == 3 ? launch_mma<T, D, 3>(p, plan, ws, stream) : launch_mma<T, D, 2>(p, plan, ws, stream);
        if (err != cudaSuccess) return err;
    } else {
        if ((err = allow_smem(attend_fp32_kernel<D>, plan.attend_smem)) != cudaSuccess) return err;
        attend_fp32_kernel<D><<<grid, kThreads, plan.attend_smem, stream>>>(p, plan, ws);
    }
    if ((err = cudaGetLastError()) != cudaSuccess || plan.splits == 1) return err;
    combine_kernel<T, D><<<p.num_tokens * p.num_heads, 128, 0, stream>>>(p, plan, ws);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_attend(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        return DASH_DISPATCH_HEAD_DIM(p.head_dim, D, [&] { return launch_attend_as<T, D>(p, plan, ws, stream); });
    });
}

size_t attend_smem_bytes(int dtype_bytes, int group, int head_dim, int stages) {
    if (dtype_bytes == 4) return make_layout(head_dim, group).bytes;
    size_t bytes = 0;
    (void)DASH_DISPATCH_HEAD_DIM(head_dim, D, [&] {
        bytes = stages == 3 ? MmaSmem<D, 3>::bytes(dtype_bytes) : MmaSmem<D, 2>::bytes(dtype_bytes);
        return cudaSuccess;
    });
    return bytes;
}
int attend_max_group() { return kMaxGroup; }

#ifdef DASH_TRACE
cudaError_t read_attend_trace(unsigned long long* host) { return read_and_clear_trace(g_attend_trace, host); }
#endif

}  // namespace dash
