// Stage 4: attention of each new token over its selected sparse blocks plus its local window.
//
// Work unit: one CTA per (token, KV head, split). The G = H / Hkv query heads of the KV head
// share every key/value load (routing is per token, not per head). A token's keys come in
// "pieces" of sbs positions: its kmax selected blocks, then the local window cut into
// sparse_local_block pieces. Split-K spreads the pieces of one token over `splits` CTAs so a
// single decoding sequence still fills the GPU; a combine kernel merges the partial softmaxes.
// NOTE: logits, softmax and accumulation are float32; masked keys never enter the sums.
#include <algorithm>

#include "common.cuh"

namespace dash {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Key positions per tile: about 16 KB of K (and of V) per tile, between 16 and 64 rows, so a
// thread keeps eight 16-byte loads of each in flight whatever the dtype and head dim.
template <typename T, int D>
__host__ __device__ constexpr int tile_rows() {
    return 16384 / (D * (int)sizeof(T)) > 64 ? 64 : (16384 / (D * (int)sizeof(T)) < 16 ? 16 : 16384 / (D * (int)sizeof(T)));
}
constexpr int kMaxGroup = 16;   // H / Hkv supported

// Shared-memory row stride of the K tile, in T elements: an odd number of 4-byte words, so that
// threads reading different rows at the same column hit different banks.
template <typename T, int D>
__host__ __device__ constexpr int k_stride() {
    return (D * (int)sizeof(T) / 4) % 2 == 1 ? D : D + 4 / (int)sizeof(T);
}

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
    constexpr int KS = k_stride<T, D>();
    constexpr int kTile = tile_rows<T, D>();
    constexpr int kChunk = 16 / (int)sizeof(T);       // elements per 16-byte load
    constexpr int kChunksPerRow = D / kChunk;
    constexpr int kLoads = kTile * kChunksPerRow / kThreads;  // 16-byte loads per thread per tensor
    static_assert(kTile * kChunksPerRow % kThreads == 0, "tile loads must divide evenly");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* v_s = reinterpret_cast<T*>(smem_raw);                 // [kTile, D]
    T* k_s = v_s + kTile * D;                                 // [kTile, KS]
    float* q_s = reinterpret_cast<float*>(k_s + kTile * KS); // [G, D] rotated queries
    float* logit = q_s + group * D;                           // [G, kTile] logits, then probabilities
    __shared__ int64_t row_slot[64];         // cache slot of each key row in the tile, -1 masked
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
        const bool remote = piece < plan.kmax;
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
            // Stage the K and V tiles in shared memory: all 16-byte loads in flight at once.
            uint4 kreg[kLoads], vreg[kLoads];
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
                const int chunk = threadIdx.x + i * kThreads;
                const int j = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
                const int64_t slot = row_slot[j];
                if (slot >= 0) {
                    const int64_t off = (slot * hkv + h) * D + c * kChunk;
                    kreg[i] = *reinterpret_cast<const uint4*>(kc + off);
                    vreg[i] = *reinterpret_cast<const uint4*>(vc + off);
                } else {
                    kreg[i] = make_uint4(0, 0, 0, 0);
                    vreg[i] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int i = 0; i < kLoads; ++i) {
                const int chunk = threadIdx.x + i * kThreads;
                const int j = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
                *reinterpret_cast<uint4*>(v_s + j * D + c * kChunk) = vreg[i];
                const uint32_t* w = reinterpret_cast<const uint32_t*>(&kreg[i]);
                uint32_t* dst = reinterpret_cast<uint32_t*>(k_s + j * KS + c * kChunk);
#pragma unroll
                for (int e = 0; e < 4; ++e) dst[e] = w[e];
            }
            __syncthreads();
            // Logits: thread -> key row j, heads g = half, half + 2, ...
            {
                const int j = threadIdx.x % kTile, half = threadIdx.x / kTile;
                constexpr int kHeadsPerThread = kMaxGroup / (kThreads / kTile);
                float dot[kHeadsPerThread];
#pragma unroll
                for (int e = 0; e < kHeadsPerThread; ++e) dot[e] = 0.0f;
                const T* krow = k_s + j * KS;
#pragma unroll 8
                for (int d = 0; d < D; ++d) {
                    const float kv = to_f(krow[d]);
#pragma unroll
                    for (int e = 0; e < kHeadsPerThread; ++e) {
                        const int g = half + e * (kThreads / kTile);
                        if (g < group) dot[e] += q_s[g * D + d] * kv;
                    }
                }
                const bool valid = j < n && row_slot[j] >= 0;
#pragma unroll
                for (int e = 0; e < kHeadsPerThread; ++e) {
                    const int g = half + e * (kThreads / kTile);
                    if (g < group) logit[g * kTile + j] = valid ? dot[e] * scale + bias : -INFINITY;
                }
            }
            __syncthreads();
            // Online softmax per head: a warp per head.
            for (int g = warp; g < group; g += kWarps) {
                float mt = -INFINITY;
                for (int j = lane; j < kTile; j += 32) mt = fmaxf(mt, logit[g * kTile + j]);
                mt = warp_max(mt);
                const float m_old = m_s[g];
                const float m_new = fmaxf(m_old, mt);
                float sum = 0.0f;
                for (int j = lane; j < kTile; j += 32) {
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
            // P @ V from shared memory: thread owns dims d for all heads.
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) {
                if (g < group) {
#pragma unroll
                    for (int c = 0; c < kCols; ++c) acc[g][c] *= alpha_s[g];
                }
            }
#pragma unroll 4
            for (int j = 0; j < kTile; ++j) {
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int d = threadIdx.x + c * kThreads;
                    if (d < D) {
                        const float vv = to_f(v_s[j * D + d]);
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

size_t attend_smem_bytes(int dtype_bytes, int group, int head_dim) {
    // V tile + padded K tile (one extra 4-byte word per row at most) + queries + logits
    const size_t rows = std::min<size_t>(64, std::max<size_t>(16, 16384 / ((size_t)head_dim * dtype_bytes)));
    const size_t tile = rows * head_dim * dtype_bytes;
    return 2 * tile + rows * 4 + sizeof(float) * (size_t)group * (head_dim + rows);
}
int attend_max_group() { return kMaxGroup; }

}  // namespace dash
