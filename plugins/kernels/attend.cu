// Stage 4: attention of each new token over its selected sparse blocks plus its local window.
//
// Work unit: one CTA per (token, KV head, split). The G = H / Hkv query heads of the KV head
// share every key/value load (routing is per token, not per head). A token's keys come in
// "pieces" of sbs positions: its kmax selected blocks, then the local window cut into
// sparse_local_block pieces. Split-K spreads the pieces of one token over `splits` CTAs so a
// single decoding sequence still fills the GPU; a combine kernel merges the partial softmaxes.
// NOTE: logits, softmax and accumulation are float32; masked keys never enter the sums.
#include "common.cuh"

namespace dash {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;       // key positions per tile
constexpr int kMaxGroup = 16;   // H / Hkv supported

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(const DashParams p, const Plan plan, Workspace ws) {
    const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int seq = ws.token_seq[t];
    if (seq < 0) return;
    const int pos = ws.token_pos[t];
    const int group = p.num_heads / p.num_kv_heads;
    const int sbs = p.sparse_block_size, local = p.sparse_local_block * sbs;
    const int prompt = p.prompt_lens[seq];
    const int hkv = p.num_kv_heads;
    constexpr int kPerLane = D / 32;

    extern __shared__ float smem[];
    float* q_s = smem;                       // [G, D] rotated queries
    float* logit = q_s + group * D;          // [G, kTile] logits, then probabilities
    __shared__ int64_t row_slot[kTile];      // cache slot of each key row in the tile, -1 masked
    __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], alpha_s[kMaxGroup];

    // Rotate the G queries (in T precision, like the reference) into shared memory.
    const RopeConfig rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate,
                          p.rope_page_mod};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const T* q = static_cast<const T*>(p.q) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
    for (int idx = threadIdx.x; idx < group * (D / 2); idx += kThreads) {
        const int g = idx / (D / 2), i = idx % (D / 2);
        float lo, hi;
        rope_pair<T>(to_f(q[g * D + i]), to_f(q[g * D + i + D / 2]), rope_angle(i, D, tok, page, rope), lo, hi);
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
    const uint8_t* forced = ws.forced + (int64_t)t * plan.kmax;
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    const int first = split * plan.pieces_per_split;
    const int last = min(plan.pieces, first + plan.pieces_per_split);
    for (int piece = first; piece < last; ++piece) {
        int base;       // first position of the piece
        float bias = 0.0f;
        bool remote = piece < plan.kmax;
        if (remote) {
            const int b = sel[piece];
            if (b < 0) continue;  // padding: fewer remote blocks than kmax
            base = b * sbs;
            bias = forced[piece] ? p.page_bias : 0.0f;
        } else {
            base = pos - local + 1 + (piece - plan.kmax) * sbs;
        }
        for (int tile = 0; tile < sbs; tile += kTile) {
            const int n = min(kTile, sbs - tile);
            // Key rows: validity and slot. Local tokens win where a selected block overlaps
            // the window; remote reads stop at prompt_length.
            for (int j = threadIdx.x; j < kTile; j += kThreads) {
                int64_t slot = -1;
                const int kp = base + tile + j;
                if (j < n) {
                    const bool ok = remote ? (kp <= pos - local && (prompt < 0 || kp < prompt))
                                           : (kp >= 0 && kp <= pos);
                    if (ok) slot = cache_slot(p, seq, kp, ws.error);
                }
                row_slot[j] = slot;
            }
            __syncthreads();
            // Logits: a warp per key row, lanes across D, all G heads per load.
            for (int j = warp; j < n; j += kWarps) {
                const int64_t slot = row_slot[j];
                if (slot < 0) {
                    if (lane < group) logit[lane * kTile + j] = -INFINITY;
                    continue;
                }
                const T* krow = kc + (slot * hkv + h) * D;
                float kv[kPerLane];
#pragma unroll
                for (int e = 0; e < kPerLane; ++e) kv[e] = to_f(krow[lane * kPerLane + e]);
                for (int g = 0; g < group; ++g) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < kPerLane; ++e) dot += q_s[g * D + lane * kPerLane + e] * kv[e];
                    dot = warp_sum(dot);
                    if (lane == 0) logit[g * kTile + j] = dot * scale + bias;
                }
            }
            __syncthreads();
            // Online softmax per head: a warp per head.
            for (int g = warp; g < group; g += kWarps) {
                float mt = -INFINITY;
                for (int j = lane; j < n; j += 32) mt = fmaxf(mt, logit[g * kTile + j]);
                mt = warp_max(mt);
                const float m_old = m_s[g];
                const float m_new = fmaxf(m_old, mt);
                float sum = 0.0f;
                for (int j = lane; j < n; j += 32) {
                    const float l = logit[g * kTile + j];
                    const float e = (m_new == -INFINITY || l == -INFINITY) ? 0.0f : expf(l - m_new);
                    logit[g * kTile + j] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    const float a = (m_old == -INFINITY) ? 0.0f : expf(m_old - m_new);
                    alpha_s[g] = a;
                    l_s[g] = l_s[g] * a + sum;
                    m_s[g] = m_new;
                }
            }
            __syncthreads();
            // P @ V: thread owns dims d for all heads; one V element load serves G heads.
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) {
                if (g < group) {
#pragma unroll
                    for (int c = 0; c < kCols; ++c) acc[g][c] *= alpha_s[g];
                }
            }
            for (int j = 0; j < n; ++j) {
                const int64_t slot = row_slot[j];
                if (slot < 0) continue;
                const T* vrow = vc + (slot * hkv + h) * D;
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int d = threadIdx.x + c * kThreads;
                    if (d < D) {
                        const float vv = to_f(vrow[d]);
#pragma unroll
                        for (int g = 0; g < kMaxGroup; ++g)
                            if (g < group) acc[g][c] += logit[g * kTile + j] * vv;
                    }
                }
            }
            __syncthreads();
        }
    }

    if (plan.splits == 1) {
        T* out = static_cast<T*>(p.out) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g >= group) break;
            const float inv = 1.0f / l_s[g];
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int d = threadIdx.x + c * kThreads;
                if (d < D) out[g * D + d] = from_f<T>(acc[g][c] * inv);
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
        if (ml[s].x != -INFINITY) denom += expf(ml[s].x - m) * ml[s].y;
    T* out = static_cast<T*>(p.out) + (int64_t)th * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < plan.splits; ++s)
            if (ml[s].x != -INFINITY) num += expf(ml[s].x - m) * ws.part_acc[((int64_t)th * plan.splits + s) * D + d];
        out[d] = from_f<T>(num / denom);
    }
}

}  // namespace

cudaError_t launch_attend(const DashParams& p, const Plan& plan, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        return DASH_DISPATCH_HEAD_DIM(p.head_dim, D, [&] {
            const dim3 grid(p.num_tokens, p.num_kv_heads, plan.splits);
            cudaError_t err = cudaSuccess;
            if (plan.attend_smem > 48 * 1024) {
                err = cudaFuncSetAttribute(attend_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)plan.attend_smem);
                if (err != cudaSuccess) return err;
            }
            attend_kernel<T, D><<<grid, kThreads, plan.attend_smem, stream>>>(p, plan, ws);
            err = cudaGetLastError();
            if (err != cudaSuccess || plan.splits == 1) return err;
            combine_kernel<T, D><<<p.num_tokens * p.num_heads, 128, 0, stream>>>(p, plan, ws);
            return cudaGetLastError();
        });
    });
}

size_t attend_smem_bytes(int group, int head_dim) { return sizeof(float) * (size_t)group * (head_dim + kTile); }
int attend_max_group() { return kMaxGroup; }

}  // namespace dash
