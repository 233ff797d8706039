// Stage 4, prefill form: block-major attention over the selected blocks and the local window.
//
// In a long prefill every token selects its own top-k blocks, so a token-major kernel reads
// (top-k x sbs) keys per token and KV head: hundreds of gigabytes at 64k tokens, with no reuse.
// Here the work is turned around. A token's "entries" are the blocks it reads: its kmax
// selected blocks and the (sparse_local_block + 1) blocks its local window can touch. For each
// physical sparse block the list of (token, slot) entries reading it is built on the device
// (count, scan, fill), and CTAs per (block, KV head) load the block's keys and values once and
// serve its entries with tensor cores, a warp per 16 rows (rows = entries x G heads). Each
// entry leaves a partial softmax (normalised output in the input dtype, plus max and sum) and a
// combine kernel merges a token's slots. Tokens are processed in chunks so that the partials
// fit a fixed workspace. fp16/bf16 only; fp32 and dense layers keep the token-major path.
#include <cuda_pipeline.h>

#include <cub/device/device_scan.cuh>

#include "common.cuh"
#include "mma.cuh"

namespace dash {
namespace {

constexpr int kBmThreads = 128;
constexpr int kWarps = kBmThreads / 32;

// Entry e = t * bm_slots + j of the chunk (chunk-relative token t): for j < kmax the j-th
// selected block of token t; for j = kmax + i the block i blocks before the token's own, when
// its local window reaches it. Its key is the physical sparse block it reads (summary_index),
// or -1 when it reads none.
__device__ __forceinline__ int64_t entry_key(const DashParams& p, const Plan& plan, const Workspace& ws, int t0,
                                             int64_t e) {
    const int t = t0 + (int)(e / plan.bm_slots), j = (int)(e % plan.bm_slots);
    const int seq = ws.token_seq[t];
    if (seq < 0) return -1;
    int b;
    if (j < plan.kmax) {
        b = ws.selected[(int64_t)t * plan.kmax + j];
    } else {
        const int pos = ws.token_pos[t], sbs = p.sparse_block_size;
        b = pos / sbs - (j - plan.kmax);
        if ((b + 1) * sbs <= pos - p.sparse_local_block * sbs + 1) b = -1;  // ends before the window
    }
    if (b < 0) return -1;
    return summary_index(p, seq, b, ws.error);
}

__global__ void count_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)tn * plan.bm_slots) return;
    const int64_t key = entry_key(p, plan, ws, t0, e);
    if (key >= 0) atomicAdd(ws.bm_counts + key, 1);
}

__global__ void fill_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)tn * plan.bm_slots) return;
    const int64_t key = entry_key(p, plan, ws, t0, e);
    if (key < 0) return;
    const int at = ws.bm_offsets[key] + atomicAdd(ws.bm_cursor + key, 1);
    ws.bm_entries[at] = (int32_t)e;
}

// Work items: a block's entries are served by ceil(count / kEntriesPerCta) CTAs, so the early
// blocks that almost every token selects do not serialise on one CTA. (256 a CTA measured the
// same at 64k: 10.51 vs 10.55 ms of block_attend_kernel.)
constexpr int kEntriesPerCta = 128;

__global__ void parts_kernel(const Plan plan, Workspace ws) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < plan.bm_num_keys) ws.bm_parts[k] = (ws.bm_counts[k] + kEntriesPerCta - 1) / kEntriesPerCta;
}

// Each work item's block, first entry and entry count (bm_items), once per pass: work items
// bm_work[k] .. bm_work[k + 1] - 1 serve block k, kEntriesPerCta entries each. A CTA then finds
// its work in one read (a binary search over bm_work was 13 dependent reads at 64k context).
__global__ void items_kernel(const Plan plan, Workspace ws) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= plan.bm_num_keys) return;
    const int w0 = ws.bm_work[k], n = ws.bm_work[k + 1] - w0, first = ws.bm_offsets[k], last = ws.bm_offsets[k + 1];
    for (int i = 0; i < n; ++i) {
        const int begin = first + i * kEntriesPerCta;
        ws.bm_items[w0 + i] = make_int4(k, begin, min(kEntriesPerCta, last - begin), 0);
    }
}

// Rotated queries of the chunk, in T, for the block-major tiles: q_rot[t - t0][head][D]. The
// angles depend on the token only: cos and sin once per pair index, shared by every head.
template <typename T, int D>
__global__ void rope_q_kernel(const DashParams p, Workspace ws, int t0) {
    const int t = t0 + blockIdx.x;
    const RopeConfig rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate,
                          p.rope_page_mod};
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    __shared__ float2 cs[D / 2];
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) cs[i] = rope_cos_sin<T>(rope_angle(i, D, tok, page, rope));
    __syncthreads();
    const T* q = static_cast<const T*>(p.q) + (int64_t)t * p.num_heads * D;
    T* dst = static_cast<T*>(ws.bm_qrot) + (int64_t)blockIdx.x * p.num_heads * D;
    for (int idx = threadIdx.x; idx < p.num_heads * (D / 2); idx += blockDim.x) {
        const int hh = idx / (D / 2), i = idx % (D / 2);
        float lo, hi;
        rope_rotate<T>(to_f(q[hh * D + i]), to_f(q[hh * D + i + D / 2]), cs[i].x, cs[i].y, lo, hi);
        dst[hh * D + i] = from_f<T>(lo);
        dst[hh * D + i + D / 2] = from_f<T>(hi);
    }
}

// Shared memory of block_attend_kernel, in elements of T: the block's K and V (64 rows), then
// each warp's two 16-row query buffers (double-buffered gathers; a buffer also stages the
// tile's output for 16-byte stores). Rows are D + 8 elements apart: 16-byte aligned, and
// ldmatrix's eight row addresses fall in different banks.
template <int D>
struct BmSmem {
    static constexpr int RS = D + 8;
    static constexpr int kv_rows = 64;
    static constexpr int q_rows = 16;
    static constexpr size_t elems = (size_t)2 * kv_rows * RS + (size_t)kWarps * 2 * q_rows * RS;
};

// One CTA per (work item, KV head): a work item is up to kEntriesPerCta entries of one physical
// sparse block. The block's keys and values are loaded once; each warp then serves 16-row tiles
// (rows = entries x G heads of the KV head), gathering the next tile's rotated queries while it
// computes the current one. An entry's valid keys are the offsets [lo, hi] of the block: a
// selected block stops at the local window and at prompt_length; a local-window block covers
// [pos - local + 1, pos]. Each row leaves its normalised output in T and (max, sum) in float.
template <typename T, int D>
__global__ void __launch_bounds__(kBmThreads) block_attend_kernel(const DashParams p, const Plan plan, Workspace ws,
                                                                  int t0) {
    using S = BmSmem<D>;
    const int w = blockIdx.x, h = blockIdx.y;
    const int nitems = ws.bm_work[plan.bm_num_keys];  // both reads in one round; the item's entry
    const int4 item = ws.bm_items[w];                 // is stale past nitems, and unused
    if (w >= nitems) return;
    const int key = item.x, begin = item.y, count = item.z;
    if (count <= 0) return;
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads, sbs = p.sparse_block_size;
    const int per = p.block_size / sbs;
    const int64_t first_slot = (int64_t)(key / per) * p.block_size + (key % per) * sbs;
    const int local = p.sparse_local_block * sbs;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_s = reinterpret_cast<T*>(smem);
    T* v_s = k_s + S::kv_rows * S::RS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    T* q_w = v_s + S::kv_rows * S::RS + warp * 2 * S::q_rows * S::RS;  // this warp's two buffers
    // The block's 64 keys and values, once, issued before the entries' metadata is read (rows
    // past every entry's range are zeroed once they land, below).
    constexpr int kChunk = 8;  // elements per 16-byte copy
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    for (int c = threadIdx.x; c < S::kv_rows * (D / kChunk); c += kBmThreads) {
        const int i = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
        const int64_t off = ((first_slot + i) * hkv + h) * D + d;
        __pipeline_memcpy_async(k_s + i * S::RS + d, kc + off, 16);
        __pipeline_memcpy_async(v_s + i * S::RS + d, vc + off, 16);
    }
    __pipeline_commit();

    // Every entry's metadata: chunk token, slot, valid key offsets [lo, hi] and logit bias.
    __shared__ int ent_tl[kEntriesPerCta], ent_j[kEntriesPerCta], ent_lo[kEntriesPerCta], ent_hi[kEntriesPerCta];
    __shared__ float ent_bias[kEntriesPerCta];
    __shared__ int s_rows;  // key rows any entry may read; later rows are zero-filled
    if (threadIdx.x == 0) s_rows = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += kBmThreads) {
        const int e = ws.bm_entries[begin + i];
        const int tl = e / plan.bm_slots, j = e % plan.bm_slots;
        const int t = t0 + tl;
        const int pos = ws.token_pos[t];
        int base, lo, hi;
        float bias = 0.0f;
        if (j < plan.kmax) {
            base = ws.selected[(int64_t)t * plan.kmax + j] * sbs;
            const int prompt = ws.token_prompt[t];
            lo = 0;
            hi = min(pos - local, prompt >= 0 ? prompt - 1 : INT32_MAX) - base;
            bias = ws.forced[(int64_t)t * plan.kmax + j] ? p.page_bias : 0.0f;
        } else {
            base = (pos / sbs - (j - plan.kmax)) * sbs;
            lo = pos - local + 1 - base;
            hi = pos - base;
        }
        ent_tl[i] = tl;
        ent_j[i] = j;
        ent_lo[i] = max(lo, 0);
        ent_hi[i] = min(hi, sbs - 1);
        ent_bias[i] = bias;
        atomicMax(&s_rows, min(hi, sbs - 1) + 1);
    }
    __syncthreads();

    const int tiles = (count * group + 15) / 16;
    const T* qrot = static_cast<const T*>(ws.bm_qrot);
    // Rotated queries of tile `tile` (16 rows) into buffer `buf`; rows past the entries are zero.
    auto gather = [&](int tile, int buf) {
        T* dst = q_w + buf * S::q_rows * S::RS;
#pragma unroll
        for (int c = lane; c < 16 * (D / kChunk); c += 32) {
            const int r = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            const int row = tile * 16 + r, ei = row / group, g = row % group;
            const bool in = ei < count;
            const int64_t off = in ? ((int64_t)ent_tl[ei] * p.num_heads + h * group + g) * D + d : 0;
            __pipeline_memcpy_async(dst + r * S::RS + d, qrot + off, 16, in ? 0 : 16);
        }
    };
    if (warp < tiles) gather(warp, 0);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // K and V (the gather may still be in flight)
    // Rows past every entry's range may be unwritten slots: zero, so that a zero probability
    // never meets a NaN (their logits are masked whatever the keys hold). Each thread clears the
    // chunks it copied itself, which have landed.
    const int rows = s_rows;
    for (int c = threadIdx.x; c < S::kv_rows * (D / kChunk); c += kBmThreads) {
        const int i = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
        if (i < rows) continue;
        *reinterpret_cast<uint4*>(k_s + i * S::RS + d) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(v_s + i * S::RS + d) = make_uint4(0, 0, 0, 0);
    }
    __syncthreads();

    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const int quad = lane % 4, r0 = lane / 4;
    for (int tile = warp, it = 0; tile < tiles; tile += kWarps, ++it) {
        if (tile + kWarps < tiles) gather(tile + kWarps, (it + 1) & 1);
        __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncwarp();
        T* q_b = q_w + (it & 1) * S::q_rows * S::RS;
        // S = Q K^T: 16 rows x 64 keys, eight n-tiles of 8 keys.
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4];
            ldmatrix_x4(a, q_b + ((lane / 8) % 2 * 8 + lane % 8) * S::RS + kk * 16 + (lane / 16) * 8);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t b[4];
                ldmatrix_x4(b, k_s + (np * 16 + (lane / 16) * 8 + lane % 8) * S::RS + kk * 16 + ((lane / 8) % 2) * 8);
                mma16816<T>(s[2 * np], a, b[0], b[1]);
                mma16816<T>(s[2 * np + 1], a, b[2], b[3]);
            }
        }
        // Masked softmax of rows r0 and r0 + 8 (a quad of lanes shares a row).
        // NOTE: float32 logits; masked keys are -inf and never enter the sums.
        int lo[2], hi[2];
        float bias[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int ei = (tile * 16 + r0 + half * 8) / group;
            const bool in = ei < count;
            lo[half] = in ? ent_lo[ei] : 1;
            hi[half] = in ? ent_hi[ei] : 0;
            bias[half] = in ? ent_bias[ei] : 0.0f;
        }
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int half = e / 2, i = n * 8 + quad * 2 + (e & 1);
                const float x = i >= lo[half] && i <= hi[half] ? s[n][e] * scale + bias[half] : -INFINITY;
                s[n][e] = x;
                m[half] = fmaxf(m[half], x);
            }
#pragma unroll
        for (int half = 0; half < 2; ++half) m[half] = quad_max(m[half]);
        uint32_t pa[4][4];  // P as the A operand of P V: four k-steps of 16 keys
#pragma unroll
        for (int n = 0; n < 8; ++n) softmax_tile<T>(s[n], m, l, pa[n / 2][(n % 2) * 2 + 0], pa[n / 2][(n % 2) * 2 + 1]);
#pragma unroll
        for (int half = 0; half < 2; ++half) l[half] = quad_sum(l[half]);
        __syncwarp();  // every lane is done reading Q: the buffer now stages the output
        // O = P V in chunks of up to 128 columns (64 accumulators per lane), normalised into q_b.
        constexpr int DC = D < 128 ? D : 128;
#pragma unroll
        for (int dc = 0; dc < D; dc += DC) {
            float o[DC / 8][4];
#pragma unroll
            for (int n = 0; n < DC / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DC / 16; ++dp) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, v_s + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::RS + dc + dp * 16 +
                                             (lane / 16) * 8);
                    mma16816<T>(o[2 * dp], pa[kk], b[0], b[1]);
                    mma16816<T>(o[2 * dp + 1], pa[kk], b[2], b[3]);
                }
            }
            const float inv0 = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv1 = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
#pragma unroll
            for (int n = 0; n < DC / 8; ++n) {
                const int col = dc + n * 8 + quad * 2;
                *reinterpret_cast<uint32_t*>(q_b + r0 * S::RS + col) = pack2<T>(o[n][0] * inv0, o[n][1] * inv0);
                *reinterpret_cast<uint32_t*>(q_b + (r0 + 8) * S::RS + col) = pack2<T>(o[n][2] * inv1, o[n][3] * inv1);
            }
        }
        if (quad == 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = tile * 16 + r0 + half * 8, ei = row / group;
                if (ei < count) {
                    const int64_t at = ((int64_t)ent_tl[ei] * plan.bm_slots + ent_j[ei]) * p.num_heads + h * group +
                                       row % group;
                    ws.bm_part_ml[at] = make_float2(m[half], l[half]);
                }
            }
        }
        __syncwarp();
        // The staged rows to the partials, 16 bytes a lane.
#pragma unroll
        for (int c = lane; c < 16 * (D / kChunk); c += 32) {
            const int r = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            const int row = tile * 16 + r, ei = row / group;
            if (ei >= count) continue;
            const int64_t at = ((int64_t)ent_tl[ei] * plan.bm_slots + ent_j[ei]) * p.num_heads + h * group + row % group;
            *reinterpret_cast<uint4*>(static_cast<T*>(ws.bm_part_o) + at * D + d) =
                *reinterpret_cast<const uint4*>(q_b + r * S::RS + d);
        }
        __syncwarp();  // the buffer is gathered into again two tiles on
    }
}

// Merge the slots of each (token, head): the kmax selected blocks and the local-window blocks.
// A lane owns 8 output columns; a CTA covers 128 / (D / 8) heads of one token.
template <typename T, int D>
__global__ void bm_combine_kernel(const DashParams p, const Plan plan, Workspace ws, int t0) {
    constexpr int kLanes = D / 8, kHeads = kBmThreads / kLanes;
    const int tl = blockIdx.x, t = t0 + tl;
    const int head = blockIdx.y * kHeads + threadIdx.x / kLanes, d = (threadIdx.x % kLanes) * 8;
    if (ws.token_seq[t] < 0 || head >= p.num_heads) return;
    const int64_t row0 = (int64_t)tl * plan.bm_slots * p.num_heads + head;  // slot s: row0 + s * H
    float m = -INFINITY;
    for (int s = 0; s < plan.bm_slots; ++s) {
        const float2 ml = ws.bm_part_ml[row0 + (int64_t)s * p.num_heads];
        if (ml.y > 0.0f) m = fmaxf(m, ml.x);
    }
    float denom = 0.0f, num[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < plan.bm_slots; ++s) {
        const int64_t row = row0 + (int64_t)s * p.num_heads;
        const float2 ml = ws.bm_part_ml[row];
        if (!(ml.y > 0.0f)) continue;
        const float wgt = expf(ml.x - m) * ml.y;
        denom += wgt;
        const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(ws.bm_part_o) + row * D + d);
        const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) num[i] += wgt * to_f(x[i]);
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    uint4 res;
    T* y = reinterpret_cast<T*>(&res);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = from_f<T>(num[i] * inv);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + ((int64_t)t * p.num_heads + head) * D + d) = res;
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
            const size_t smem = sizeof(T) * BmSmem<D>::elems;
            if ((err = allow_smem(block_attend_kernel<T, D>, smem)) != cudaSuccess) return err;
            const int64_t items = block_major_items((int64_t)tn * plan.bm_slots, plan.bm_num_keys);
            block_attend_kernel<T, D><<<dim3((unsigned)items, p.num_kv_heads), kBmThreads, smem, stream>>>(p, plan, ws,
                                                                                                        t0);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
            constexpr int kHeads = kBmThreads / (D / 8);
            bm_combine_kernel<T, D><<<dim3(tn, (p.num_heads + kHeads - 1) / kHeads), kBmThreads, 0, stream>>>(p, plan,
                                                                                                           ws, t0);
            return cudaGetLastError();
        });
    }
}

}  // namespace

bool block_major_supported(const DashParams& p, size_t smem_limit) {
    const int group = p.num_heads / p.num_kv_heads;
    if (p.dtype == DASH_FLOAT32 || p.dense_layer || p.sparse_block_size != 64 || 16 % group != 0 || p.topk <= 0)
        return false;
    if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
    // Dynamic shared memory (2-byte elements) plus the static per-entry metadata (under 4 KB)
    // must fit the device's opt-in limit (99 KB on sm_86 / sm_89: D = 256 does not).
    const size_t elems = p.head_dim == 64 ? BmSmem<64>::elems : p.head_dim == 128 ? BmSmem<128>::elems
                                                                                   : BmSmem<256>::elems;
    return 2 * elems + 4096 <= smem_limit;
}

// Upper bound of a pass's work items: every block's last CTA may be partly full.
int64_t block_major_items(int64_t entries, int num_keys) {
    return (entries + kEntriesPerCta - 1) / kEntriesPerCta + num_keys;
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
    if ((err = cudaMemsetAsync(ws.bm_part_ml, 0, sizeof(float2) * (size_t)tn * plan.bm_slots * p.num_heads,
                               stream)) != cudaSuccess)
        return err;
    const int64_t entries = (int64_t)tn * plan.bm_slots;
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
    items_kernel<<<(nbs + 255) / 256, 256, 0, stream>>>(plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] { return launch_bm_attend<T>(p, plan, ws, t0, tn, stream); });
}

}  // namespace dash
