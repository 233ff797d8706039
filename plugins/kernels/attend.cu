// Stage 4: attention of each new token over its selected sparse blocks plus its local window.
//
// Work unit: one CTA per (token, KV head, split). The G = H / Hkv query heads of the KV head
// share every key/value load (routing is per token, not per head). A token's keys come in
// "pieces" of sbs positions: its kmax selected blocks, then the local window cut into
// sparse_local_block pieces, processed in tiles of up to 64 keys staged in shared memory with
// asynchronous 16-byte copies. Split-K spreads the pieces of one token over `splits` CTAs so a
// single decoding sequence still fills the GPU; a combine kernel merges the partial softmaxes.
//
// fp16/bf16 use tensor cores (WMMA, m32n8k16) with the keys as the M dimension, since G is small:
//   S^T [keys x G] = K [keys x D] . Q^T [D x G],   O^T [D x G] = V^T [D x keys] . P^T [keys x G].
// fp32 keeps a CUDA-core path (the reference's exact dtype; no TF32).
// NOTE: logits, the online softmax and the output accumulation are float32; masked keys never
// enter the sums. On the tensor-core path P is rounded to the input dtype for P.V, as
// FlashAttention does; the row sums use the unrounded P.
#include <cuda_pipeline.h>
#include <mma.h>

#include <algorithm>

#include "common.cuh"

namespace dash {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 16;  // H / Hkv supported

// Key positions per tile: about 16 KB of K (and of V), between 16 and 64 rows, so every thread
// issues eight 16-byte copies of each whatever the dtype and head dim.
__host__ __device__ constexpr int tile_rows(int head_dim, int dtype_bytes) {
    return 16384 / (head_dim * dtype_bytes) > 64 ? 64
           : 16384 / (head_dim * dtype_bytes) < 16 ? 16
                                                  : 16384 / (head_dim * dtype_bytes);
}

// Shared-memory layout of one CTA, in bytes; the same on host (launch size) and device.
struct Layout {
    int tile, ks, vs, qs, ps;  // rows per tile; row strides (elements) of K, V, Q16, P16
    int nt;                    // n-tiles of 8 heads (tensor-core path)
    size_t v, k, q32, q16, logit, p16, o, bytes;
};

__host__ __device__ constexpr Layout make_layout(int head_dim, int dtype_bytes, int group) {
    Layout l{};
    const bool tc = dtype_bytes == 2;
    l.tile = tile_rows(head_dim, dtype_bytes);
    // Tensor-core loads need rows that are multiples of 16 bytes; 8 extra elements also spread
    // consecutive rows over the banks. The fp32 path reads one K row per thread: an odd number
    // of words per row keeps those reads conflict-free.
    l.ks = tc ? head_dim + 8 : head_dim + 1;
    l.vs = tc ? head_dim + 8 : head_dim;
    l.nt = (group + 7) / 8;
    l.qs = head_dim + 8;
    l.ps = l.tile + 8;
    size_t off = 0;
    auto take = [&](size_t bytes) {
        const size_t at = off;
        off += (bytes + 127) / 128 * 128;
        return at;
    };
    l.v = take((size_t)l.tile * l.vs * dtype_bytes);
    l.k = take((size_t)l.tile * l.ks * dtype_bytes);
    l.q32 = take(sizeof(float) * (size_t)group * head_dim);
    l.logit = take(sizeof(float) * (size_t)8 * l.nt * l.tile);
    if (tc) {
        l.q16 = take((size_t)2 * 8 * l.nt * l.qs);
        l.p16 = take((size_t)2 * 8 * l.nt * l.ps);
        l.o = take(sizeof(float) * (size_t)8 * l.nt * head_dim);
    }
    l.bytes = off;
    return l;
}

template <typename T>
struct IsTensorCore {
    static constexpr bool value = sizeof(T) == 2;
};

// S^T = K . Q^T for one tile into logit[g][j] (raw dot products).
template <typename T, int D>
__device__ void tile_logits_tc(const Layout& L, const T* k_s, const T* q16, float* logit) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
    const int mtiles = L.tile / 32;
    for (int job = warp; job < mtiles * L.nt; job += kWarps) {
        const int mt = job % mtiles, nt = job / mtiles;
        wmma::fragment<wmma::accumulator, 32, 8, 16, float> c;
        wmma::fill_fragment(c, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D; kk += 16) {
            wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major> b;
            wmma::load_matrix_sync(a, k_s + mt * 32 * L.ks + kk, L.ks);
            wmma::load_matrix_sync(b, q16 + nt * 8 * L.qs + kk, L.qs);
            wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(logit + nt * 8 * L.tile + mt * 32, c, L.tile, wmma::mem_col_major);
    }
}

// O^T = V^T . P^T for one tile into o[g][d].
template <typename T, int D>
__device__ void tile_pv_tc(const Layout& L, const T* v_s, const T* p16, float* o) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
    constexpr int mtiles = D / 32;
    for (int job = warp; job < mtiles * L.nt; job += kWarps) {
        const int mt = job % mtiles, nt = job / mtiles;
        wmma::fragment<wmma::accumulator, 32, 8, 16, float> c;
        wmma::fill_fragment(c, 0.0f);
        for (int kk = 0; kk < L.tile; kk += 16) {
            wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::col_major> a;
            wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major> b;
            wmma::load_matrix_sync(a, v_s + kk * L.vs + mt * 32, L.vs);
            wmma::load_matrix_sync(b, p16 + nt * 8 * L.ps + kk, L.ps);
            wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(o + nt * 8 * D + mt * 32, c, D, wmma::mem_col_major);
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(const DashParams p, const Plan plan, Workspace ws) {
    constexpr bool kTC = IsTensorCore<T>::value;
    const int t = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int seq = ws.token_seq[t];
    if (seq < 0) return;
    const int pos = ws.token_pos[t];
    const int group = p.num_heads / p.num_kv_heads;
    const int sbs = p.sparse_block_size, local = p.sparse_local_block * sbs;
    const int prompt = p.prompt_lens[seq];
    const int hkv = p.num_kv_heads;
    const Layout L = make_layout(D, (int)sizeof(T), group);
    constexpr int kChunk = 16 / (int)sizeof(T);  // elements per 16-byte copy
    constexpr int kChunksPerRow = D / kChunk;

    extern __shared__ __align__(128) unsigned char smem[];
    T* v_s = reinterpret_cast<T*>(smem + L.v);
    T* k_s = reinterpret_cast<T*>(smem + L.k);
    float* q_s = reinterpret_cast<float*>(smem + L.q32);   // [G, D] rotated queries (fp32 path)
    float* logit = reinterpret_cast<float*>(smem + L.logit);  // [8 * nt, tile] logits, then P
    T* q16 = reinterpret_cast<T*>(smem + L.q16);           // [8 * nt, qs] rotated queries (TC path)
    T* p16 = reinterpret_cast<T*>(smem + L.p16);           // [8 * nt, ps] P in T (TC path)
    float* o_s = reinterpret_cast<float*>(smem + L.o);     // [8 * nt, D] tile output (TC path)
    __shared__ int64_t row_slot[64];  // cache slot of each key row in the tile, -1 masked
    __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], alpha_s[kMaxGroup];

    // Rotate the G queries (in T precision, like the reference).
    const RopeConfig rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate,
                          p.rope_page_mod};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const T* q = static_cast<const T*>(p.q) + ((int64_t)t * p.num_heads + (int64_t)h * group) * D;
    __shared__ float2 cs[D / 2];  // cos and sin of each pair's angle, shared by the G heads
    for (int i = threadIdx.x; i < D / 2; i += kThreads) cs[i] = rope_cos_sin<T>(rope_angle(i, D, tok, page, rope));
    __syncthreads();
    for (int idx = threadIdx.x; idx < 8 * L.nt * (D / 2); idx += kThreads) {
        const int g = idx / (D / 2), i = idx % (D / 2);
        float lo = 0.0f, hi = 0.0f;
        if (g < group) rope_rotate<T>(to_f(q[g * D + i]), to_f(q[g * D + i + D / 2]), cs[i].x, cs[i].y, lo, hi);
        if (kTC) {
            q16[g * L.qs + i] = from_f<T>(lo);  // exact: lo/hi are already T values
            q16[g * L.qs + i + D / 2] = from_f<T>(hi);
        } else if (g < group) {
            q_s[g * D + i] = lo;
            q_s[g * D + i + D / 2] = hi;
        }
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
        int base;  // first position of the piece
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
        for (int tile = 0; tile < sbs; tile += L.tile) {
            const int n = min(L.tile, sbs - tile);
            // Key rows: validity and slot. Local tokens win where a selected block overlaps
            // the window; remote reads stop at prompt_length.
            for (int j = threadIdx.x; j < L.tile; j += kThreads) {
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
            // Stage K and V: asynchronous 16-byte copies, masked rows zero-filled.
            for (int chunk = threadIdx.x; chunk < L.tile * kChunksPerRow; chunk += kThreads) {
                const int j = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
                const int64_t slot = row_slot[j];
                const int64_t off = slot >= 0 ? (slot * hkv + h) * D + c * kChunk : 0;
                const size_t zfill = slot >= 0 ? 0 : 16;
                __pipeline_memcpy_async(v_s + j * L.vs + c * kChunk, vc + off, 16, zfill);
                if (kTC) {
                    __pipeline_memcpy_async(k_s + j * L.ks + c * kChunk, kc + off, 16, zfill);
                } else {  // odd row stride: not 16-byte aligned, copy through registers
                    const uint4 w4 = slot >= 0 ? *reinterpret_cast<const uint4*>(kc + off) : make_uint4(0, 0, 0, 0);
                    const uint32_t* w = reinterpret_cast<const uint32_t*>(&w4);
                    uint32_t* dst = reinterpret_cast<uint32_t*>(k_s + j * L.ks + c * kChunk);
#pragma unroll
                    for (int e = 0; e < 4; ++e) dst[e] = w[e];
                }
            }
            __pipeline_commit();
            __pipeline_wait_prior(0);
            __syncthreads();
            // Logits.
            if constexpr (kTC) {
                tile_logits_tc<T, D>(L, k_s, q16, logit);
                __syncthreads();
                for (int idx = threadIdx.x; idx < group * L.tile; idx += kThreads) {
                    const int g = idx / L.tile, j = idx % L.tile;
                    const bool valid = j < n && row_slot[j] >= 0;
                    logit[g * L.tile + j] = valid ? logit[g * L.tile + j] * scale + bias : -INFINITY;
                }
            } else {
                // thread -> key row j, heads g = part, part + parts, ...
                const int parts = kThreads / L.tile;
                const int j = threadIdx.x % L.tile, part = threadIdx.x / L.tile;
                const bool valid = j < n && row_slot[j] >= 0;
                for (int g = part; g < group; g += parts) {
                    float dot = 0.0f;
                    const T* krow = k_s + j * L.ks;
                    const float* qg = q_s + g * D;
#pragma unroll 8
                    for (int d = 0; d < D; ++d) dot += qg[d] * to_f(krow[d]);
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
                    const float l = logit[g * L.tile + j];
                    const float e = (m_new == -INFINITY || l == -INFINITY) ? 0.0f : expf(l - m_new);
                    logit[g * L.tile + j] = e;
                    if (kTC) p16[g * L.ps + j] = from_f<T>(e);
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
            if (kTC) {  // padding heads of the last n-tile hold zero probabilities
                for (int idx = threadIdx.x; idx < (8 * L.nt - group) * L.tile; idx += kThreads)
                    p16[(group + idx / L.tile) * L.ps + idx % L.tile] = from_f<T>(0.0f);
            }
            __syncthreads();
            // P @ V.
            if constexpr (kTC) {
                tile_pv_tc<T, D>(L, v_s, p16, o_s);
                __syncthreads();
            }
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g) {
                if (g < group) {
#pragma unroll
                    for (int c = 0; c < kCols; ++c) {
                        const int d = threadIdx.x + c * kThreads;
                        float a = acc[g][c] * alpha_s[g];
                        if (kTC && d < D) a += o_s[g * D + d];
                        acc[g][c] = a;
                    }
                }
            }
            if (!kTC) {
#pragma unroll 4
                for (int j = 0; j < L.tile; ++j) {
#pragma unroll
                    for (int c = 0; c < kCols; ++c) {
                        const int d = threadIdx.x + c * kThreads;
                        if (d < D) {
                            const float vv = to_f(v_s[j * L.vs + d]);
#pragma unroll
                            for (int g = 0; g < kMaxGroup; ++g)
                                if (g < group) acc[g][c] += logit[g * L.tile + j] * vv;
                        }
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
            cudaError_t err = allow_smem(attend_kernel<T, D>, plan.attend_smem);
            if (err != cudaSuccess) return err;
            attend_kernel<T, D><<<grid, kThreads, plan.attend_smem, stream>>>(p, plan, ws);
            if ((err = cudaGetLastError()) != cudaSuccess || plan.splits == 1) return err;
            combine_kernel<T, D><<<p.num_tokens * p.num_heads, 128, 0, stream>>>(p, plan, ws);
            return cudaGetLastError();
        });
    });
}

size_t attend_smem_bytes(int dtype_bytes, int group, int head_dim) {
    return make_layout(head_dim, dtype_bytes, group).bytes;
}
int attend_max_group() { return kMaxGroup; }

}  // namespace dash
