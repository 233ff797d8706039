// Stage 4, prefill form: block-major attention over the selected blocks.
//
// In a long prefill every token selects its own top-k blocks, so a token-major kernel reads
// (top-k x sbs) keys per token and KV head: hundreds of gigabytes at 64k tokens, with no reuse.
// Here the work is turned around: for each sparse block, the list of (token, selection slot)
// entries that selected it is built on the device (count, scan, fill), and one CTA per (block,
// KV head) loads the block's keys and values once and serves all of its entries with tensor
// cores (rows = entries x G heads). Each entry leaves a partial softmax (normalised output in
// the input dtype, plus max and sum); the local window is done token-major into one more slot,
// and a combine kernel merges the slots. Tokens are processed in chunks so that the partials
// fit a fixed workspace. fp16/bf16 only; fp32 and dense layers keep the token-major path.
#include <cuda_pipeline.h>
#include <mma.h>

#include <cub/device/device_scan.cuh>

#include "common.cuh"

namespace dash {
namespace {

constexpr int kBmThreads = 128;
constexpr int kRows = 64;  // rows (entries x G) per tile

// Entry e = t * kmax + j of the chunk: the j-th selected block of token t (chunk-relative t).
// Its key is the physical sparse block it reads (summary_index), or -1 when it reads none.
__device__ __forceinline__ int64_t entry_key(const DashParams& p, const Plan& plan, const Workspace& ws, int t0,
                                             int64_t e) {
    const int t = t0 + (int)(e / plan.kmax);
    const int seq = ws.token_seq[t];
    const int b = ws.selected[(int64_t)t * plan.kmax + e % plan.kmax];
    if (seq < 0 || b < 0) return -1;
    return summary_index(p, seq, b, ws.error);
}

__global__ void count_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)tn * plan.kmax) return;
    const int64_t key = entry_key(p, plan, ws, t0, e);
    if (key >= 0) atomicAdd(ws.bm_counts + key, 1);
}

__global__ void fill_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)tn * plan.kmax) return;
    const int64_t key = entry_key(p, plan, ws, t0, e);
    if (key < 0) return;
    const int at = ws.bm_offsets[key] + atomicAdd(ws.bm_cursor + key, 1);
    ws.bm_entries[at] = (int32_t)e;
}

// Work items: a block's entries are served by ceil(count / kEntriesPerCta) CTAs, so the early
// blocks that almost every token selects do not serialise on one CTA.
constexpr int kEntriesPerCta = 128;

__global__ void parts_kernel(const Plan plan, Workspace ws) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < plan.bm_num_keys) ws.bm_parts[k] = (ws.bm_counts[k] + kEntriesPerCta - 1) / kEntriesPerCta;
}

// Rotated queries of the chunk, in T, for the block-major tiles: q_rot[t - t0][head][D].
template <typename T, int D>
__global__ void rope_q_kernel(const DashParams p, Workspace ws, int t0) {
    const int t = t0 + blockIdx.x;
    const RopeConfig rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate,
                          p.rope_page_mod};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const T* q = static_cast<const T*>(p.q) + (int64_t)t * p.num_heads * D;
    T* dst = static_cast<T*>(ws.bm_qrot) + (int64_t)blockIdx.x * p.num_heads * D;
    for (int idx = threadIdx.x; idx < p.num_heads * (D / 2); idx += blockDim.x) {
        const int hh = idx / (D / 2), i = idx % (D / 2);
        float lo, hi;
        rope_pair<T>(to_f(q[hh * D + i]), to_f(q[hh * D + i + D / 2]), rope_angle(i, D, tok, page, rope), lo, hi);
        dst[hh * D + i] = from_f<T>(lo);
        dst[hh * D + i + D / 2] = from_f<T>(hi);
    }
}

template <int D, typename T>
struct BmLayout {
    static constexpr int KS = D + 8;       // K / V / Q rows (elements)
    static constexpr int SS = 64 + 4;      // S rows (floats)
    static constexpr int PS = 64 + 8;      // P rows (elements)
    static constexpr int OS = D + 4;       // O rows (floats)
    static constexpr size_t k = 0;
    static constexpr size_t v = k + (size_t)64 * KS * sizeof(T);
    static constexpr size_t q = v + (size_t)64 * KS * sizeof(T);
    static constexpr size_t s = q + (size_t)kRows * KS * sizeof(T);
    // O reuses the Q and S space (both dead once P is formed).
    static constexpr size_t o = q;
    static constexpr size_t qs_end = s + (size_t)kRows * SS * sizeof(float);
    static constexpr size_t o_end = o + (size_t)kRows * OS * sizeof(float);
    static constexpr size_t pp = qs_end > o_end ? qs_end : o_end;
    static constexpr size_t bytes = pp + (size_t)kRows * PS * sizeof(T);
};

// local_tile_kernel keeps Q for every key tile: its O tile goes after P instead of over Q and S.
template <int D, typename T>
struct LocalLayout : BmLayout<D, T> {
    static constexpr size_t o = BmLayout<D, T>::bytes;
    static constexpr size_t bytes = o + (size_t)kRows * BmLayout<D, T>::OS * sizeof(float);
};

// The two products of a 64-row tile, a warp per band of 16 rows (4 warps):
//   S [64 rows x 64 keys] = Q [rows x D] . K^T, into s (float, row stride ss);
//   O [64 rows x D]      = P [rows x 64 keys] . V, into o (float, row stride os).
// K, V and Q rows are ks elements apart, P rows ps.
template <typename T, int D>
__device__ __forceinline__ void tile_qk(const T* q, const T* k, int ks, float* s, int ss) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, q + warp * 16 * ks + kk, ks);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
            wmma::load_matrix_sync(b, k + n * 16 * ks + kk, ks);
            wmma::mma_sync(acc[n], a, b, acc[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) wmma::store_matrix_sync(s + warp * 16 * ss + n * 16, acc[n], ss, wmma::mem_row_major);
}

template <typename T, int D>
__device__ __forceinline__ void tile_pv(const T* p, int ps, const T* v, int ks, float* o, int os) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int n0 = 0; n0 < D / 16; n0 += 4) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
        for (int kk = 0; kk < 64; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
            wmma::load_matrix_sync(a, p + warp * 16 * ps + kk, ps);
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(b, v + kk * ks + (n0 + n) * 16, ks);
                wmma::mma_sync(acc[n], a, b, acc[n]);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n)
            wmma::store_matrix_sync(o + warp * 16 * os + (n0 + n) * 16, acc[n], os, wmma::mem_row_major);
    }
}

// One CTA per (physical sparse block, KV head). Needs sparse_block_size == 64.
template <typename T, int D>
__global__ void __launch_bounds__(kBmThreads) block_attend_kernel(const DashParams p, const Plan plan, Workspace ws,
                                                                  int t0) {
    using namespace nvcuda;
    using L = BmLayout<D, T>;
    const int w = blockIdx.x, h = blockIdx.y;
    if (w >= ws.bm_work[plan.bm_num_keys]) return;
    // The block this work item belongs to: bm_work[key] <= w < bm_work[key + 1].
    int lo = 0, hi = plan.bm_num_keys - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ws.bm_work[mid] <= w) lo = mid; else hi = mid - 1;
    }
    const int key = lo, part = w - ws.bm_work[key];
    const int begin = ws.bm_offsets[key] + part * kEntriesPerCta;
    const int count = min(kEntriesPerCta, ws.bm_offsets[key + 1] - begin);
    if (count <= 0) return;
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads;
    const int per = p.block_size / p.sparse_block_size;
    const int64_t first_slot = (int64_t)(key / per) * p.block_size + (key % per) * p.sparse_block_size;
    const int local = p.sparse_local_block * p.sparse_block_size;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_s = reinterpret_cast<T*>(smem + L::k);
    T* v_s = reinterpret_cast<T*>(smem + L::v);
    T* q_s = reinterpret_cast<T*>(smem + L::q);
    float* s_s = reinterpret_cast<float*>(smem + L::s);
    float* o_s = reinterpret_cast<float*>(smem + L::o);
    T* p_s = reinterpret_cast<T*>(smem + L::pp);
    __shared__ int row_pos[kRows], row_prompt[kRows], row_base[kRows];
    __shared__ float row_bias[kRows], row_m[kRows], row_l[kRows];
    __shared__ int64_t row_out[kRows];
    constexpr int kChunk = 8;  // elements per 16-byte copy
    // The block's keys and values, once.
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    for (int c = threadIdx.x; c < 64 * (D / kChunk); c += kBmThreads) {
        const int i = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
        const int64_t off = ((first_slot + i) * hkv + h) * D + d;
        __pipeline_memcpy_async(k_s + i * L::KS + d, kc + off, 16);
        __pipeline_memcpy_async(v_s + i * L::KS + d, vc + off, 16);
    }
    __pipeline_commit();
    const int per_tile = kRows / group;  // entries per tile
    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    // Every entry's metadata up front (one round of scattered loads instead of one per tile).
    __shared__ int ent_tl[kEntriesPerCta], ent_j[kEntriesPerCta], ent_pos[kEntriesPerCta],
        ent_prompt[kEntriesPerCta], ent_base[kEntriesPerCta];
    __shared__ float ent_bias[kEntriesPerCta];
    for (int i = threadIdx.x; i < count; i += kBmThreads) {
        const int e = ws.bm_entries[begin + i];
        const int tl = e / plan.kmax, j = e % plan.kmax;
        const int t = t0 + tl;
        ent_tl[i] = tl;
        ent_j[i] = j;
        ent_pos[i] = ws.token_pos[t];
        ent_prompt[i] = p.prompt_lens[ws.token_seq[t]];
        ent_base[i] = ws.selected[(int64_t)t * plan.kmax + j] * p.sparse_block_size;
        ent_bias[i] = ws.forced[(int64_t)t * plan.kmax + j] ? p.page_bias : 0.0f;
    }
    __syncthreads();
    for (int e0 = 0; e0 < count; e0 += per_tile) {
        const int ne = min(per_tile, count - e0);
        // Row metadata and the rotated queries of this tile's entries.
        for (int r = threadIdx.x; r < kRows; r += kBmThreads) {
            const int ei = r / group, g = r % group, i = e0 + ei;
            row_out[r] = -1;
            row_pos[r] = -1;
            if (ei < ne) {
                row_pos[r] = ent_pos[i];
                row_prompt[r] = ent_prompt[i];
                row_base[r] = ent_base[i];
                row_bias[r] = ent_bias[i];
                row_out[r] = ((int64_t)ent_tl[i] * p.num_heads + h * group + g) * plan.bm_slots + ent_j[i];
            }
        }
        for (int c = threadIdx.x; c < kRows * (D / kChunk); c += kBmThreads) {
            const int r = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            const int ei = r / group, g = r % group;
            const T* src = static_cast<const T*>(ws.bm_qrot);
            const bool in = ei < ne;
            const int64_t off = in ? ((int64_t)ent_tl[e0 + ei] * p.num_heads + h * group + g) * D + d : 0;
            __pipeline_memcpy_async(q_s + r * L::KS + d, src + off, 16, in ? 0 : 16);
        }
        __pipeline_commit();
        __pipeline_wait_prior(0);
        __syncthreads();
        // S = Q K^T.
        tile_qk<T, D>(q_s, k_s, L::KS, s_s, L::SS);
        __syncthreads();
        // Masked softmax per row (two threads per row). NOTE: float32; masked keys are -inf.
        {
            const int r = threadIdx.x / 2, half = threadIdx.x % 2;
            const int pos = row_pos[r], prompt = row_prompt[r], base = row_base[r];
            float m = -INFINITY;
            for (int i = half; i < 64; i += 2) {
                const int kp = base + i;
                const bool ok = pos >= 0 && kp <= pos - local && (prompt < 0 || kp < prompt);
                const float l = ok ? s_s[r * L::SS + i] * scale + row_bias[r] : -INFINITY;
                s_s[r * L::SS + i] = l;
                m = fmaxf(m, l);
            }
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            float sum = 0.0f;
            for (int i = half; i < 64; i += 2) {
                const float l = s_s[r * L::SS + i];
                const float e = m == -INFINITY || l == -INFINITY ? 0.0f : expf(l - m);
                p_s[r * L::PS + i] = from_f<T>(e);
                sum += e;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            if (half == 0) row_m[r] = m, row_l[r] = sum;
        }
        __syncthreads();
        // O = P V (O overwrites Q and S: both are dead once P is formed).
        tile_pv<T, D>(p_s, L::PS, v_s, L::KS, o_s, L::OS);
        __syncthreads();
        // Partials: normalised output in T, (max, sum) in float.
        for (int idx = threadIdx.x; idx < kRows * D; idx += kBmThreads) {
            const int r = idx / D, d = idx % D;
            const int64_t out = row_out[r];
            if (out < 0) continue;
            const float l = row_l[r];
            static_cast<T*>(ws.bm_part_o)[out * D + d] = from_f<T>(l > 0.0f ? o_s[r * L::OS + d] / l : 0.0f);
            if (d == 0) ws.bm_part_ml[out] = make_float2(row_m[r], l);
        }
        __syncthreads();
    }
}


// The local window of the block-major path, tiled over consecutive tokens: a CTA serves
// 64 / G consecutive tokens of the batch and one KV head, loading the union of their windows
// (local + tokens - 1 positions) in 64-key tiles, with tensor cores and an online softmax
// whose output accumulator stays in registers. Tokens of different sequences in one tile are
// served in turn. Writes slot kmax of the partials. D <= 128 (D = 256 uses the token-major
// kernel for this slot).
template <typename T, int D>
__global__ void __launch_bounds__(kBmThreads) local_tile_kernel(const DashParams p, const Plan plan, Workspace ws,
                                                                int t0, int tn) {
    using namespace nvcuda;
    using L = LocalLayout<D, T>;
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads;
    const int tokens = kRows / group;
    const int tile_t0 = t0 + blockIdx.x * tokens, h = blockIdx.y;
    const int local = p.sparse_local_block * p.sparse_block_size;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_s = reinterpret_cast<T*>(smem + L::k);
    T* v_s = reinterpret_cast<T*>(smem + L::v);
    T* q_s = reinterpret_cast<T*>(smem + L::q);
    float* s_s = reinterpret_cast<float*>(smem + L::s);
    T* p_s = reinterpret_cast<T*>(smem + L::pp);
    float* o_s = reinterpret_cast<float*>(smem + L::o);
    __shared__ int row_seq[kRows], row_pos[kRows];
    __shared__ float row_m[kRows], row_l[kRows], row_alpha[kRows];
    __shared__ int64_t key_slot[64];
    __shared__ int s_seq, s_lo, s_hi;
    constexpr int kChunk = 8;
    constexpr int kPer = kRows * D / kBmThreads;  // accumulator elements per thread
    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);

    for (int r = threadIdx.x; r < kRows; r += kBmThreads) {
        const int t = tile_t0 + r / group;
        const bool in = t < t0 + tn;
        row_seq[r] = in ? ws.token_seq[t] : -1;
        row_pos[r] = in ? ws.token_pos[t] : -1;
    }
    // Rotated queries of the tile's tokens (zero rows past the chunk).
    for (int c = threadIdx.x; c < kRows * (D / kChunk); c += kBmThreads) {
        const int r = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
        const int tl = blockIdx.x * tokens + r / group;
        const bool in = tile_t0 + r / group < t0 + tn;
        const int64_t off = in ? ((int64_t)tl * p.num_heads + h * group + r % group) * D + d : 0;
        __pipeline_memcpy_async(q_s + r * L::KS + d, static_cast<const T*>(ws.bm_qrot) + off, 16, in ? 0 : 16);
    }
    __pipeline_commit();
    __syncthreads();
    while (true) {
        // Next sequence to serve in this tile, and the union of its rows' windows.
        if (threadIdx.x == 0) {
            s_seq = -1;
            for (int r = 0; r < kRows && s_seq < 0; ++r) s_seq = row_seq[r];
            s_lo = INT32_MAX, s_hi = -1;
            for (int r = 0; r < kRows; ++r)
                if (row_seq[r] == s_seq && s_seq >= 0) {
                    s_lo = min(s_lo, max(0, row_pos[r] - local + 1));
                    s_hi = max(s_hi, row_pos[r]);
                }
        }
        __syncthreads();
        const int seq = s_seq;
        if (seq < 0) break;
        for (int r = threadIdx.x; r < kRows; r += kBmThreads) row_m[r] = -INFINITY, row_l[r] = 0.0f;
        float acc[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;
        for (int k0 = s_lo; k0 <= s_hi; k0 += 64) {
            for (int j = threadIdx.x; j < 64; j += kBmThreads)
                key_slot[j] = k0 + j <= s_hi ? cache_slot(p, seq, k0 + j, ws.error) : -1;
            __syncthreads();
            for (int c = threadIdx.x; c < 64 * (D / kChunk); c += kBmThreads) {
                const int j = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
                const int64_t slot = key_slot[j];
                const int64_t off = slot >= 0 ? (slot * hkv + h) * D + d : 0;
                __pipeline_memcpy_async(k_s + j * L::KS + d, kc + off, 16, slot >= 0 ? 0 : 16);
                __pipeline_memcpy_async(v_s + j * L::KS + d, vc + off, 16, slot >= 0 ? 0 : 16);
            }
            __pipeline_commit();
            __pipeline_wait_prior(0);
            __syncthreads();
            tile_qk<T, D>(q_s, k_s, L::KS, s_s, L::SS);  // S = Q K^T
            __syncthreads();
            {  // masked online softmax, two threads per row
                const int r = threadIdx.x / 2, half = threadIdx.x % 2;
                const int pos = row_pos[r];
                const bool mine = row_seq[r] == seq;
                float m = -INFINITY;
                for (int i = half; i < 64; i += 2) {
                    const int kp = k0 + i;
                    const bool ok = mine && key_slot[i] >= 0 && kp <= pos && kp >= pos - local + 1;
                    const float l = ok ? s_s[r * L::SS + i] * scale : -INFINITY;
                    s_s[r * L::SS + i] = l;
                    m = fmaxf(m, l);
                }
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                const float m_old = row_m[r];
                const float m_new = fmaxf(m_old, m);
                float sum = 0.0f;
                for (int i = half; i < 64; i += 2) {
                    const float l = s_s[r * L::SS + i];
                    const float e = m_new == -INFINITY || l == -INFINITY ? 0.0f : expf(l - m_new);
                    p_s[r * L::PS + i] = from_f<T>(e);
                    sum += e;
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                __syncwarp();
                if (half == 0) {
                    const float a = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                    row_alpha[r] = a;
                    row_l[r] = row_l[r] * a + sum;
                    row_m[r] = m_new;
                }
            }
            __syncthreads();
            tile_pv<T, D>(p_s, L::PS, v_s, L::KS, o_s, L::OS);  // O_tile = P V
            __syncthreads();
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const int idx = threadIdx.x + i * kBmThreads, r = idx / D, d = idx % D;
                acc[i] = acc[i] * row_alpha[r] + o_s[r * L::OS + d];
            }
            __syncthreads();
        }
        // Slot kmax of this sequence's rows; then they are done.
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int idx = threadIdx.x + i * kBmThreads, r = idx / D, d = idx % D;
            if (row_seq[r] != seq) continue;
            const int tl = blockIdx.x * tokens + r / group;
            const int64_t row = ((int64_t)tl * p.num_heads + h * group + r % group) * plan.bm_slots + plan.kmax;
            const float l = row_l[r];
            static_cast<T*>(ws.bm_part_o)[row * D + d] = from_f<T>(l > 0.0f ? acc[i] / l : 0.0f);
            if (d == 0) ws.bm_part_ml[row] = make_float2(row_m[r], l);
        }
        __syncthreads();
        for (int r = threadIdx.x; r < kRows; r += kBmThreads)
            if (row_seq[r] == seq) row_seq[r] = -1;
        __syncthreads();
    }
}

__host__ __device__ constexpr int combine_weight_floats(int slots) { return (slots + 3) / 4 * 4 + 4; }

// Merge the slots of one (token, head): kmax selected blocks + the local window.
template <typename T, int D>
__global__ void bm_combine_kernel(const DashParams p, const Plan plan, Workspace ws, int t0) {
    const int64_t th = blockIdx.x;  // chunk token * H + head
    const int t = t0 + (int)(th / p.num_heads);
    if (ws.token_seq[t] < 0) return;
    extern __shared__ float weight[];  // [combine_weight_floats(bm_slots)], zero past bm_slots
    const float2* ml = ws.bm_part_ml + th * plan.bm_slots;
    const T* po = static_cast<const T*>(ws.bm_part_o) + th * plan.bm_slots * D;
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int s = threadIdx.x; s < plan.bm_slots; s += 32)
            if (ml[s].y > 0.0f) m = fmaxf(m, ml[s].x);
        m = warp_max(m);
        float denom = 0.0f;
        for (int s = threadIdx.x; s < plan.bm_slots; s += 32) {
            const float w = ml[s].y > 0.0f ? expf(ml[s].x - m) * ml[s].y : 0.0f;
            weight[s] = w;
            denom += w;
        }
        denom = warp_sum(denom);
        __syncwarp();
        for (int s = threadIdx.x; s < plan.bm_slots; s += 32) weight[s] /= denom;
        // memcheck saw the weight loop below read 12 bytes past bm_slots (vectorised loads):
        // keep a zeroed tail so any such read stays inside the allocation.
        for (int s = plan.bm_slots + threadIdx.x; s < combine_weight_floats(plan.bm_slots); s += 32) weight[s] = 0.0f;
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out) + ((int64_t)t * p.num_heads + th % p.num_heads) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < plan.bm_slots; ++s)
            if (weight[s] != 0.0f) num += weight[s] * to_f(po[(int64_t)s * D + d]);
        out[d] = from_f<T>(num);
    }
}

template <typename K>
cudaError_t allow_smem(K kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

template <typename T>
cudaError_t launch_bm_attend(const DashParams& p, const Plan& plan, const Workspace& ws, int t0, int tn,
                             cudaStream_t stream) {
    if constexpr (sizeof(T) != 2) {
        return cudaErrorInvalidValue;  // fp32 never takes this path (block_major_supported)
    } else {
        return DASH_DISPATCH_HEAD_DIM(p.head_dim, D, [&] {
            rope_q_kernel<T, D><<<tn, 128, 0, stream>>>(p, ws, t0);
            cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) return err;
            const size_t smem = BmLayout<D, T>::bytes;
            if ((err = allow_smem(block_attend_kernel<T, D>, smem)) != cudaSuccess) return err;
            // Upper bound of the work items: every block's last CTA may be partly full.
            const int64_t items = ((int64_t)tn * plan.kmax + kEntriesPerCta - 1) / kEntriesPerCta + plan.bm_num_keys;
            block_attend_kernel<T, D><<<dim3((unsigned)items, p.num_kv_heads), kBmThreads, smem, stream>>>(p, plan, ws,
                                                                                                        t0);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
            // The local window into slot kmax: tiled over consecutive tokens where the accumulator
            // fits in registers, token-major otherwise.
            if constexpr (D <= 128) {
                const size_t lsmem = LocalLayout<D, T>::bytes;
                if ((err = allow_smem(local_tile_kernel<T, D>, lsmem)) != cudaSuccess) return err;
                const int tokens = kRows / (p.num_heads / p.num_kv_heads);
                local_tile_kernel<T, D><<<dim3((tn + tokens - 1) / tokens, p.num_kv_heads), kBmThreads, lsmem, stream>>>(
                    p, plan, ws, t0, tn);
                if ((err = cudaGetLastError()) != cudaSuccess) return err;
            } else {
                if ((err = launch_attend_local(p, plan, ws, t0, tn, stream)) != cudaSuccess) return err;
            }
            bm_combine_kernel<T, D><<<tn * p.num_heads, D, sizeof(float) * combine_weight_floats(plan.bm_slots), stream>>>(
                p, plan, ws, t0);
            return cudaGetLastError();
        });
    }
}

}  // namespace

bool block_major_supported(const DashParams& p) {
    const int group = p.num_heads / p.num_kv_heads;
    return p.dtype != DASH_FLOAT32 && !p.dense_layer && p.sparse_block_size == 64 && kRows % group == 0 &&
           (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) && p.topk > 0;
}

size_t block_major_scan_bytes(int num_items) {
    size_t bytes = 0;
    cub::DeviceScan::InclusiveSum(nullptr, bytes, (int*)nullptr, (int*)nullptr, num_items);
    return bytes;
}

cudaError_t launch_block_major(const DashParams& p, const Plan& plan, const Workspace& ws, int t0, int tn,
                               cudaStream_t stream) {
    cudaError_t err;
    const int nbs = plan.bm_num_keys;
    if ((err = cudaMemsetAsync(ws.bm_counts, 0, sizeof(int) * nbs, stream)) != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(ws.bm_cursor, 0, sizeof(int) * nbs, stream)) != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(ws.bm_part_ml, 0, sizeof(float2) * (size_t)tn * p.num_heads * plan.bm_slots,
                               stream)) != cudaSuccess)
        return err;
    const int64_t entries = (int64_t)tn * plan.kmax;
    const int grid = (int)((entries + 255) / 256);
    count_kernel<<<grid, 256, 0, stream>>>(p, plan, ws, t0, tn);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    size_t temp = plan.bm_scan_bytes;
    // Inclusive prefix in [1, nbs]: offsets[0] = 0 is set by the memset below.
    if ((err = cudaMemsetAsync(ws.bm_offsets, 0, sizeof(int), stream)) != cudaSuccess) return err;
    if ((err = cub::DeviceScan::InclusiveSum(ws.bm_scan_temp, temp, ws.bm_counts, ws.bm_offsets + 1, nbs, stream)) !=
        cudaSuccess)
        return err;
    fill_kernel<<<grid, 256, 0, stream>>>(p, plan, ws, t0, tn);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    parts_kernel<<<(nbs + 255) / 256, 256, 0, stream>>>(plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(ws.bm_work, 0, sizeof(int), stream)) != cudaSuccess) return err;
    temp = plan.bm_scan_bytes;
    if ((err = cub::DeviceScan::InclusiveSum(ws.bm_scan_temp, temp, ws.bm_parts, ws.bm_work + 1, nbs, stream)) !=
        cudaSuccess)
        return err;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] { return launch_bm_attend<T>(p, plan, ws, t0, tn, stream); });
}

}  // namespace dash
