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
// fit a fixed workspace. fp16/bf16 only; fp32 keeps the token-major path.
//
// Query-major tiles take the entries that many neighbouring tokens share. Consecutive tokens
// of one sequence have the same local window blocks, and those of one document page, routed
// among that page's image blocks, mostly the same selected ones. A tile of
// 128 / G such tokens (128 query rows of a KV head) reads each block it shares once, keeps
// its rows' softmax state in registers across the blocks, then merges the block-major partials
// of its tokens into them and writes the output (qm_prep_kernel, qm_attend_kernel): fewer
// partials to write, no gathered queries, and no combine pass over those tokens.
// Which entries a tile serves is one rule (qm_serves), applied by both paths.
#include <cuda_pipeline.h>

#include <algorithm>

#include <cub/device/device_scan.cuh>

#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace dash {
namespace {

constexpr int kBmThreads = 128;  // block_attend_kernel's mma.sync form (four warps)
// bm_combine_kernel: a token's step covers up to 512 / (D / 8) heads (all 32 at D = 128) in one CTA.
constexpr int kCombineThreads = 512;
// CTAs of bm_combine_kernel at most (each takes its share of a pass's tokens): about four an SM.
constexpr int kCombineCtas = 1024;
// Threads of block_attend_kernel: four warps, or with warpgroup MMA wg (Plan::bm_warpgroups: 1
// or 2) warpgroups sharing the block's keys and values (two: twice the rows per load).
__host__ __device__ constexpr int bm_threads(int wg) { return wg ? 128 * wg : kBmThreads; }

// entry_block: the sparse block entry (t, j) reads (chunk token t = t0 + tl; slot j), or -1: for
// j < kmax the j-th selected block of the token (its logit bias: slot_bias); for j = kmax + i the
// block i blocks before the token's own, when its local window reaches it. slot_block: the same
// for a token known to be valid (no token_seq read).
__device__ __forceinline__ int slot_block(const DashParams& p, const Plan& plan, const Workspace& ws, int t, int j) {
    if (j < plan.kmax) return ws.selected[(int64_t)t * plan.kmax + j];
    const int pos = ws.token_pos[t], sbs = p.sparse_block_size;
    const int b = pos / sbs - (j - plan.kmax);
    return (b + 1) * sbs <= window_first(pos, p.sparse_local_block * sbs) ? -1 : b;  // -1: ends before the window
}
__device__ __forceinline__ int entry_block(const DashParams& p, const Plan& plan, const Workspace& ws, int t, int j) {
    return ws.token_seq[t] < 0 ? -1 : slot_block(p, plan, ws, t, j);
}
// The logit bias of slot j of token t: the routing's for a selected block, 0 for the local window.
__device__ __forceinline__ float slot_bias(const Plan& plan, const Workspace& ws, int t, int j) {
    return j < plan.kmax ? ws.bias[(int64_t)t * plan.kmax + j] : 0.0f;
}

// Whether entry (chunk-relative token tl, slot j) reading sparse block b is served by its
// query-major tile (qm_attend_kernel) instead of the block-major tiles: its tile is one
// sequence's and the entry is a local window one, or qm_prep_kernel listed b for the tile as a
// block at least plan.qm_min of its tokens select (qm_sel). The one rule both paths apply. (A
// token may read one block both ways: a selected block that its window overlaps gives the keys
// before the window, the local entry the rest.)
__device__ __forceinline__ bool qm_serves(const Plan& plan, const Workspace& ws, int tl, int j, int b) {
    if (plan.qm_tile == 0) return false;
    const int base = ws.qm_base[tl / plan.qm_tile];
    if (base < 0) return false;
    if (j >= plan.kmax) return b > base - kQmBlocks;  // local: the tile lists these (qm_prep_kernel)
    return ws.qm_sel[(int64_t)tl * plan.kmax + j] != 0;
}

// Entry e = t * bm_slots + j of the chunk (chunk-relative token t): its key is the physical
// sparse block it reads (summary_index), or -1 when it reads none or its query-major tile
// serves it.
// b: entry_block's.
__device__ __forceinline__ int64_t entry_key(const DashParams& p, const Plan& plan, const Workspace& ws, int t0,
                                             int64_t e, int& b) {
    const int tl = (int)(e / plan.bm_slots), j = (int)(e % plan.bm_slots), t = t0 + tl;
    b = entry_block(p, plan, ws, t, j);
    if (b < 0 || qm_serves(plan, ws, tl, j, b)) return -1;
    return summary_index(p, ws.token_seq[t], b, ws.error);
}

// count_kernel's work for entry e of the chunk: its (block key, rank) in bm_rank ((-1, 0) where
// the entry is not block-major), the rank the old count its atomicAdd on the block's tally line
// returns (parts_kernel compacts the tallies into bm_counts for the scan); fill_kernel places
// the entry by it and the merges read only the block-major slots' partials. The ranks of a block's
// entries come in any order; each entry's partial does not depend on its place.
__device__ __forceinline__ void count_entry(const DashParams& p, const Plan& plan, const Workspace& ws, int t0,
                                            int64_t e) {
    int b;
    const int64_t key = entry_key(p, plan, ws, t0, e, b);
    ws.bm_rank[e] = key >= 0 ? make_int2((int)key, atomicAdd(ws.bm_tally + key * kTallyStride, 1)) : make_int2(-1, 0);
}

constexpr int kQmPrepThreads = 256;

// Query-major tiles, step 1: for each tile of qm_tile consecutive chunk tokens, whether it is one
// sequence's (qm_base: its last token's own sparse block, else -1), and the blocks it reads
// (qm_list, ascending; qm_count of them): those at least qm_min of its tokens select, anywhere
// in the sequence, then the blocks its local windows may reach (lo..base). Per listed block,
// which of its tokens the tile serves as a selected block (qm_mask, and qm_bias: its logit bias),
// and per token and selected slot whether the tile serves it (qm_sel, for qm_serves).
// Shared memory: a byte per sparse block of the sequence (plan.max_blocks): its selectors among
// the tile's tokens (at most 128), then its list position + 1 where the tile serves it, else 0.
// The list is capped at kQmBlocks; the selected blocks past the cap stay block-major (the
// lowest-numbered are kept, a deterministic choice). Last, the tile's tokens' entries are counted
// (count_entry), which then see its qm_base and qm_sel: no count_kernel where there are tiles.
__global__ void __launch_bounds__(kQmPrepThreads) qm_prep_kernel(const DashParams p, const Plan plan, Workspace ws,
                                                                 int t0, int tn) {
    extern __shared__ uint32_t count_words[];  // plan.max_blocks bytes, rounded up to words
    __shared__ uint32_t mask[kQmBlocks * kQmWords];
    __shared__ int s_base, s_lo, s_part[kQmPrepThreads / 32];
    uint8_t* count = reinterpret_cast<uint8_t*>(count_words);
    const int tile = blockIdx.x, ta = t0 + tile * plan.qm_tile, tb = min(ta + plan.qm_tile, t0 + tn);
    const int nt = tb - ta, words = (plan.max_blocks + 3) / 4;
    for (int i = threadIdx.x; i < kQmBlocks * kQmWords; i += blockDim.x) mask[i] = 0;
    for (int i = threadIdx.x; i < words; i += blockDim.x) count_words[i] = 0;
    if (threadIdx.x == 0) {
        const int seq = ws.token_seq[ta];
        const bool one = seq >= 0 && ws.token_seq[tb - 1] == seq &&
                         ws.token_pos[tb - 1] - ws.token_pos[ta] == tb - 1 - ta;
        int base = one ? ws.token_pos[tb - 1] / p.sparse_block_size : -1;
        if (base >= plan.max_blocks) base = -1;  // past the table (bad metadata, reported elsewhere)
        s_base = base;
        // The local windows reach back to the first token's block minus sparse_local_block.
        s_lo = max(max(ws.token_pos[ta] / p.sparse_block_size - p.sparse_local_block, base - kQmBlocks + 1), 0);
    }
    __syncthreads();
    const int base = s_base, lo = s_lo;
    const int64_t m0 = (int64_t)tile * kQmBlocks * kQmWords;
    const int64_t e0 = (int64_t)(ta - t0) * plan.bm_slots, e1 = e0 + (int64_t)nt * plan.bm_slots;
    if (base < 0) {
        if (threadIdx.x == 0) ws.qm_base[tile] = -1, ws.qm_count[tile] = 0;
        __syncthreads();  // qm_base, for qm_serves
        for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) count_entry(p, plan, ws, t0, e);
        return;
    }
    // (1) Selectors per block (a token selects a block once: at most 128 per byte).
    for (int e = threadIdx.x; e < nt * plan.kmax; e += blockDim.x) {
        const int b = ws.selected[(int64_t)(ta + e / plan.kmax) * plan.kmax + e % plan.kmax];
        if (b >= 0 && b <= base) atomicAdd(&count_words[b / 4], 1u << (8 * (b % 4)));
    }
    __syncthreads();
    // (2) List positions: the blocks below lo that qm_min tokens select, ascending, up to the
    // cap left by the local blocks lo..base, which follow them. Each thread takes a contiguous
    // run of blocks; a block scan of the runs' counts gives each its first position.
    const int nloc = base - lo + 1, cap = kQmBlocks - nloc;
    const int per = (lo + kQmPrepThreads - 1) / kQmPrepThreads;
    const int b0 = min(lo, (int)threadIdx.x * per), b1 = min(lo, b0 + per);
    int mine = 0;
    for (int b = b0; b < b1; ++b) mine += count[b] >= plan.qm_min;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    if (lane == 31) s_part[warp] = incl;
    __syncthreads();
    int before = incl - mine, total = 0;
    for (int w = 0; w < kQmPrepThreads / 32; ++w) {
        if (w < warp) before += s_part[w];
        total += s_part[w];
    }
    const int nsel = min(total, cap);
    for (int b = b0, at = before; b < b1; ++b) {
        const bool take = count[b] >= plan.qm_min;
        count[b] = take && at < cap ? (uint8_t)(at + 1) : 0;
        at += take;
    }
    for (int b = lo + (int)threadIdx.x; b <= base; b += blockDim.x)  // local blocks: served selections too
        count[b] = count[b] >= plan.qm_min ? (uint8_t)(nsel + b - lo + 1) : 0;
    __syncthreads();
    // (3) The list, and which tokens' selections each listed block serves.
    int32_t* list = ws.qm_list + (int64_t)tile * kQmBlocks;
    for (int b = b0; b < b1; ++b)
        if (count[b] != 0) list[count[b] - 1] = b;
    for (int b = lo + (int)threadIdx.x; b <= base; b += blockDim.x) list[nsel + b - lo] = b;
    for (int e = threadIdx.x; e < nt * plan.kmax; e += blockDim.x) {
        const int tl = e / plan.kmax;
        const int64_t at = (int64_t)(ta + tl) * plan.kmax + e % plan.kmax;
        const int b = ws.selected[at];
        const int u = b >= 0 && b <= base ? count[b] - 1 : -1;
        ws.qm_sel[at - (int64_t)t0 * plan.kmax] = u >= 0 ? 1 : 0;
        if (u >= 0) {  // a token selects a block once: one (u, tl) writer
            atomicOr(&mask[u * kQmWords + tl / 32], 1u << (tl % 32));
            ws.qm_bias[((int64_t)tile * kQmBlocks + u) * plan.qm_tile + tl] = ws.bias[at];
        }
    }
    __syncthreads();
    const int n = nsel + nloc;
    if (threadIdx.x == 0) ws.qm_base[tile] = base, ws.qm_count[tile] = n;
    for (int i = threadIdx.x; i < n * kQmWords; i += blockDim.x) ws.qm_mask[m0 + i] = mask[i];
    __syncthreads();  // qm_base and every qm_sel of the tile (global stores of this CTA), for qm_serves
    for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) count_entry(p, plan, ws, t0, e);
}

// The entries' counts where there are no query-major tiles (qm_prep_kernel counts them otherwise).
__global__ void count_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < (int64_t)tn * plan.bm_slots) count_entry(p, plan, ws, t0, e);
}

// What block_attend_kernel needs of entry (chunk token tl = t - t0, slot j) reading sparse
// block b, in one 16-byte record: x its first rotated query row and y its first partial row
// (both of head 0: the kernel adds its KV head's first head), z its valid key offsets [lo, hi]
// of the block (lo in the low and hi in the high 16 bits, clamped to [0, sbs] and [-1, sbs - 1]:
// lo > hi still means none), w its logit bias (float bits). A selected block stops at the
// local window and at prompt_length; a local-window block covers [pos - local + 1, pos].
__device__ __forceinline__ int4 entry_record(const DashParams& p, const Plan& plan, const Workspace& ws, int t, int tl,
                                             int j, int b, float bias) {
    const int sbs = p.sparse_block_size, local = p.sparse_local_block * sbs, pos = ws.token_pos[t], base = b * sbs;
    int lo, hi;
    if (j < plan.kmax) {
        const int prompt = ws.token_prompt[t];
        lo = 0;
        hi = selected_last(pos, local, prompt) - base;
    } else {
        lo = window_first(pos, local) - base;
        hi = pos - base;
    }
    lo = min(max(lo, 0), sbs);
    hi = max(min(hi, sbs - 1), -1);
    return make_int4(tl * p.num_heads, (tl * plan.bm_slots + j) * p.num_heads, (lo & 0xffff) | (hi << 16),
                     __float_as_int(bias));
}

// Each block-major entry's record at its block's offset plus the rank count_entry gave it. The
// entry's (block, rank) and what its record needs are read together: none depends on another.
__global__ void fill_kernel(const DashParams p, const Plan plan, Workspace ws, int t0, int tn) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)tn * plan.bm_slots) return;
    const int tl = (int)(e / plan.bm_slots), j = (int)(e % plan.bm_slots), t = t0 + tl;
    const int2 kr = ws.bm_rank[e];
    const int b = slot_block(p, plan, ws, t, j);  // a block-major entry's token is valid
    const float bias = slot_bias(plan, ws, t, j);
    if (kr.x < 0) return;
    ws.bm_entries[ws.bm_offsets[kr.x] + kr.y] = entry_record(p, plan, ws, t, tl, j, b, bias);
}

// Work items: a block's entries are served by ceil(count / kEntriesPerCta) CTAs, so the early
// blocks that almost every token selects do not serialise on one CTA. (256 a CTA measured the
// same at 64k: 10.51 vs 10.55 ms of block_attend_kernel.)
constexpr int kEntriesPerCta = 128;

// Each block's count out of its tally line (bm_counts, which the scan takes), and the CTAs that
// serve it (bm_parts).
__global__ void parts_kernel(const Plan plan, Workspace ws) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= plan.bm_num_keys) return;
    const int n = ws.bm_tally[(int64_t)k * kTallyStride];
    ws.bm_counts[k] = n;
    ws.bm_parts[k] = (n + kEntriesPerCta - 1) / kEntriesPerCta;
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

// S = Q K^T of one warp: 16 query rows (q, rows RS elements apart) against 64 keys (k, the
// same stride), D deep; s holds eight n-tiles of 8 keys in the mma.sync accumulator layout.
// Both tile kernels (block-major, query-major) use it.
template <typename T, int D, int RS>
__device__ __forceinline__ void qk_tile(float (&s)[8][4], const T* q, const T* k, int lane) {
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_a(a, q, RS, kk, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, k + (np * 16 + (lane / 16) * 8 + lane % 8) * RS + kk * 16 + ((lane / 8) % 2) * 8);
            mma16816<T>(s[2 * np], a, b[0], b[1]);
            mma16816<T>(s[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// The maxima of a tile's rows when each reads its whole block or none of it (none[half]: rows r0
// and r0 + 8 of the lane), in the log2 domain: a row's logits are s * c2 + add[half] (c2 = scale x
// log2 e > 0), so their maximum is fmaf(max s, c2, add[half]), exactly (fmaf rounds monotonically):
// the masked path's maximum over the same logits. A row that reads nothing keeps m[half]. The
// scores stay raw: softmax_numerators applies c2 and each row's offset. Both tile kernels' fast path.
__device__ __forceinline__ void whole_block_max(const float (&s)[8][4], const bool (&none)[2], float c2,
                                                const float (&add)[2], float (&m)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
#pragma unroll
    for (int half = 0; half < 2; ++half)
        if (!none[half]) m[half] = fmaxf(m[half], fmaf(mx[half], c2, add[half]));
}

// Softmax numerators of a 16 x 64 tile (rows r0 and r0 + 8 of the lane): 2^(s * c + off[half]),
// added to the lane's row sums l and packed as P, the A operand of P V (four k-steps of 16 keys).
// off[half] is the row's logit offset less its max (numerator_offset); a masked entry
// holds s = -inf, and an offset of -inf (a row that reads nothing, or has no key yet) gives 0 too.
// The block-major tiles pass raw scores with c = c2 on both paths (so an entry's numerator is the
// same bits whichever path its warp took: the entries sharing a warp follow the order they were
// listed in, which is not fixed); the query-major tiles' masked path passes logits with c = 1.
template <typename T>
__device__ __forceinline__ void softmax_numerators(const float (&s)[8][4], float c, const float (&off)[2],
                                                   float (&l)[2], uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        float e4[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            e4[e] = ex2_ftz(fmaf(s[n][e], c, off[e / 2]));
            l[e / 2] += e4[e];
        }
        pa[n / 2][(n % 2) * 2 + 0] = pack2<T>(e4[0], e4[1]);
        pa[n / 2][(n % 2) * 2 + 1] = pack2<T>(e4[2], e4[3]);
    }
}
// A row's offset for softmax_numerators: add - m; -inf for a row that reads nothing here (its
// scores are raw on the fast path) or has no key yet (m = -inf).
__device__ __forceinline__ float numerator_offset(bool none, float add, float m) {
    return none || m == -INFINITY ? -INFINITY : add - m;
}

// The warpgroup forms of qk_tile and of P V (WG tiles; all four warps of the warpgroup call them
// together). S = Q K^T: this warp's 16 query rows (q, rows rs elements apart) as A registers,
// the 64 keys of k_s (a swizzled 64 x D tile) as B. O = P V: P in the A layout (pa, as
// softmax_numerators packs it), V a swizzled 64 x D tile read transposed; o holds D / 8 n-tiles.
template <typename T, int D>
__device__ __forceinline__ void wg_qk_tile(float (&s)[8][4], const T* q, int rs, const T* k_s, int lane) {
    uint32_t a[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_a(a[kk], q, rs, kk, lane);
    float(&d)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_m64n64k16<T>(d, a[kk], kmajor_desc<64>(k_s, kk), kk);
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(d);
}
// S = Q K^T with the warpgroup's 64 query rows from shared memory too (q_s: a swizzled 64 x D
// tile, K-major like k_s), so that the queries take no registers (the query-major tiles, whose
// output accumulators stay live across blocks).
template <typename T, int D>
__device__ __forceinline__ void wg_qk_tile_ss(float (&s)[8][4], const T* q_s, const T* k_s) {
    float(&d)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_m64n64k16_ss<T>(d, kmajor_desc<64>(q_s, kk), kmajor_desc<64>(k_s, kk), kk);
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(d);
}
// accumulate: O += P V (the query-major tiles' running output) instead of O = P V.
template <typename T, int D>
__device__ __forceinline__ void wg_pv_tile(float (&o)[D / 8][4], const uint32_t (&pa)[4][4], const T* v_s,
                                           bool accumulate = false) {
    static_assert(D == 128, "one m64n128 product per 16 keys");
    float(&d)[64] = reinterpret_cast<float(&)[64]>(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16_tb<T>(d, pa[kk], mnmajor_desc<64>(v_s, kk), accumulate || kk > 0);
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(d);
}

// Rotated queries of a pass's tokens t0 .. t0 + tn - 1, in T, for the block-major tiles, where the
// routing did not rotate them (Plan::rope_routed): q_rot[t - t0][head][D], a warp a token, the
// angles the write stage left in token_cs.
template <typename T>
__global__ void rope_q_kernel(const DashParams p, Workspace ws, int t0, int tn) {
    const int tl = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (tl >= tn) return;
    const int64_t hd = (int64_t)p.num_heads * p.head_dim;
    warp_rope_rows<T>(static_cast<const T*>(p.q) + (t0 + tl) * hd, static_cast<T*>(ws.bm_qrot) + tl * hd,
                         ws.token_cs + (int64_t)(t0 + tl) * (p.head_dim / 2), p.num_heads, p.head_dim,
                         threadIdx.x % 32);
}

// Shared memory of block_attend_kernel, in elements of T: the block's K and V (64 rows), then
// each warp's two 16-row query buffers (double-buffered gathers; a buffer also stages the
// tile's output for 16-byte stores). Rows are D + 8 elements apart: 16-byte aligned, and
// ldmatrix's eight row addresses fall in different banks. With warpgroup MMA (WG) K and V are
// 128-byte-swizzled tiles instead (wgmma.cuh), from a 1024-byte boundary: 1 KB more to align.
// WG: warpgroups of the CTA (0: the mma.sync form).
template <int D, int WG = 0>
struct BmSmem {
    static constexpr int RS = D + 8;
    static constexpr int kv_rows = 64;
    static constexpr int q_rows = 16;
    static constexpr int warps = bm_threads(WG) / 32;
    static constexpr size_t kv_elems = WG ? (size_t)kv_rows * D : (size_t)kv_rows * RS;  // one of K, V
    static constexpr size_t align_elems = WG ? 512 : 0;
    static constexpr size_t elems = align_elems + 2 * kv_elems + (size_t)warps * 2 * q_rows * RS;
    // Element offset of (key row i, column d) in the K or V tile.
    static __device__ __forceinline__ int kv_at(int i, int d) { return WG ? sw128_offset<kv_rows>(i, d) : i * RS + d; }
};

// Work items of one KV head (blockIdx.y): a work item is up to kEntriesPerCta entries of one
// physical sparse block, and CTA x serves items x, x + gridDim.x, ... (by default one CTA an
// item; tune_block_major_ctas: fewer CTAs, each serving several). The block's keys and values are loaded once; each warp then serves 16-row tiles
// (rows = entries x G heads of the KV head), gathering the next tile's rotated queries while it
// computes the current one. An entry's valid keys are the offsets [lo, hi] of the block: a
// selected block stops at the local window and at prompt_length; a local-window block covers
// [pos - local + 1, pos]. Each row leaves its normalised output in T and (max, sum) in float.
// WG (sm_90a, D = 128): the CTA is WG (1 or 2) warpgroups, each serving 64-row tiles together,
// S = Q K^T and O = P V as warpgroup MMAs with K and V read from shared memory once per 64 rows
// (the mma.sync tiles read them once per 16); the queries, masks, softmax and stores are the same
// code. WG = 0: the mma.sync form (four warps).
template <typename T, int D, int WG>
__global__ void __launch_bounds__(bm_threads(WG)) block_attend_kernel(const DashParams p, const Plan plan,
                                                                      Workspace ws, int t0) {
    static_assert(!WG || D == 128, "warpgroup tiles: D = 128");
    constexpr int kThreads = bm_threads(WG), kW = kThreads / 32;
    using S = BmSmem<D, WG>;
    // The query-major tiles (plan.qm_overlap) may take the SMs this grid leaves; they wait for
    // its end before they read its partials.
    grid_launch_dependents();
    const int h = blockIdx.y, stride = gridDim.x;
    const int nitems = ws.bm_work[plan.bm_num_keys];
    int w = blockIdx.x;
    if (w >= nitems) return;
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads, sbs = p.sparse_block_size;
    const int gshift = __ffs(group) - 1;  // G divides 16 (block_major_supported): row / G and row % G as bit operations
    const int per = p.block_size / sbs;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t smem_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    T* k_s = reinterpret_cast<T*>(smem + (WG ? (1024 - smem_at % 1024) % 1024 : 0));
    T* v_s = k_s + S::kv_elems;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    T* q_w = v_s + S::kv_elems + warp * 2 * S::q_rows * S::RS;  // this warp's two buffers
    constexpr int kChunk = 8;  // elements per 16-byte copy
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    const T* qrot = static_cast<const T*>(ws.bm_qrot);
    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const int quad = lane % 4, r0 = lane / 4;
    // Rows of the tiles: row r is head r % G (of KV head h's group) of entry r / G.
    const int hq = h * group;

    // The CTA serves work items w, w + stride, ... (launch_block_attend). Each entry's record (entry_record) of the item is in rec[rb]; the next item's
    // records are copied into rec[rb ^ 1] while this one's tiles run.
    __shared__ int4 rec[2][kEntriesPerCta];
    __shared__ int s_rows;  // key rows any entry may read; later rows are zero-filled
    int4 item = ws.bm_items[w];
    auto copy_records = [&](const int4& it, int buf) {
        for (int i = threadIdx.x; i < it.z; i += kThreads)
            __pipeline_memcpy_async(&rec[buf][i], ws.bm_entries + it.y + i, 16);
    };
    copy_records(item, 0);
    __pipeline_commit();
    if (threadIdx.x == 0) s_rows = 0;
    int4 next = w + stride < nitems ? ws.bm_items[w + stride] : make_int4(0, 0, 0, 0);
    __pipeline_wait_prior(0);
    __syncthreads();
    for (int rb = 0;; rb ^= 1) {
        const int key = item.x, count = item.z;
        const int4* ent = rec[rb];
        // The block's 64 keys and values (rows past every entry's range are zeroed once they land).
        const int64_t first_slot = (int64_t)(key / per) * p.block_size + (key % per) * sbs;
        for (int c = threadIdx.x; c < S::kv_rows * (D / kChunk); c += kThreads) {
            const int i = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            const int64_t off = ((first_slot + i) * hkv + h) * D + d;
            __pipeline_memcpy_async(k_s + S::kv_at(i, d), kc + off, 16);
            __pipeline_memcpy_async(v_s + S::kv_at(i, d), vc + off, 16);
        }
        __pipeline_commit();
        for (int i = threadIdx.x; i < count; i += kThreads) atomicMax(&s_rows, (ent[i].z >> 16) + 1);
        __syncthreads();

        const int tiles = (count * group + 15) / 16;
        // Rotated queries of tile `tile` (16 rows) into buffer `buf`; rows past the entries are zero.
        // Eight lanes copy a row's 128-byte lines (lane L: rows L / 8 + 4 j, chunk L % 8 of each
        // line), so that an instruction reads four whole lines, with four row addresses a lane.
        auto gather = [&](int tile, int buf) {
            const int cl = (lane & 7) * kChunk;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = (lane >> 3) + 4 * j, row = tile * 16 + r, ei = row >> gshift;
                T* dst = q_w + buf * S::q_rows * S::RS + r * S::RS + cl;
                if (ei < count) {
                    const T* src = qrot + (int64_t)(ent[ei].x + hq + (row & (group - 1))) * D + cl;
#pragma unroll
                    for (int c = 0; c < D / 64; ++c) __pipeline_memcpy_async(dst + c * 64, src + c * 64, 16);
                } else {
#pragma unroll
                    for (int c = 0; c < D / 64; ++c) *reinterpret_cast<uint4*>(dst + c * 64) = make_uint4(0, 0, 0, 0);
                }
            }
        };
        // Warp w serves 16-row tiles w, w + kW, ...; with WG the four warps of warpgroup g serve its
        // 64-row tile WG it + g of round it together (16-row tiles it * kW + warp), so a warpgroup runs
        // every round in which its first warp has a tile (rows past the entries are zero).
        const int lead = WG ? warp / 4 * 4 : warp;
        if (lead < tiles) gather(warp, 0);
        if (w + stride < nitems) copy_records(next, rb ^ 1);  // waited for with the first tile's queries
        __pipeline_commit();
        __pipeline_wait_prior(1);  // K and V (the gather and the records may still be in flight)
        // Rows past every entry's range may be unwritten slots: zero, so that a zero probability
        // never meets a NaN (their logits are masked whatever the keys hold). Each thread clears the
        // chunks it copied itself, which have landed.
        const int rows = s_rows;
        for (int c = threadIdx.x; c < S::kv_rows * (D / kChunk); c += kThreads) {
            const int i = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
            if (i < rows) continue;
            *reinterpret_cast<uint4*>(k_s + S::kv_at(i, d)) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(v_s + S::kv_at(i, d)) = make_uint4(0, 0, 0, 0);
        }
        if constexpr (WG) fence_async_smem();  // K and V are read by the wgmma (async) proxy
        __syncthreads();

        for (int it = 0; lead + it * kW < tiles; ++it) {
            const int tile = warp + it * kW;
            if (lead + (it + 1) * kW < tiles) gather(tile + kW, (it + 1) & 1);
            __pipeline_commit();
            __pipeline_wait_prior(1);
            __syncwarp();
            T* q_b = q_w + (it & 1) * S::q_rows * S::RS;
            float s[8][4];
            if constexpr (WG) {
                wg_qk_tile<T, D>(s, q_b, S::RS, k_s, lane);
            } else {
                qk_tile<T, D, S::RS>(s, q_b, k_s, lane);
            }
            // Masked softmax of rows r0 and r0 + 8 (a quad of lanes shares a row).
            // NOTE: float32 logits; masked keys are -inf and never enter the sums.
            int lo[2], hi[2];
            float bias[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int ei = (tile * 16 + r0 + half * 8) >> gshift;
                const int4 r = ei < count ? ent[ei] : make_int4(0, 0, 1, 0);  // past the entries: lo 1 > hi 0
                lo[half] = r.z & 0xffff;
                hi[half] = r.z >> 16;
                bias[half] = __int_as_float(r.w);
            }
            // Logits in the log2 domain (x log2 e: one multiply-add, then exp2), as in the query-major
            // tiles. Where every row of the warp reads its whole block or is past the entries (a
            // selected block before the window: almost every block-major entry), no per-key test.
            float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
            const float c2 = scale * kLog2e;
            bool whole = true, none[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                none[half] = lo[half] > hi[half];
                whole = whole && (none[half] || (lo[half] == 0 && hi[half] == S::kv_rows - 1));
                bias[half] *= kLog2e;
            }
            const bool fast = __all_sync(0xffffffffu, whole);
            if (fast) {
                whole_block_max(s, none, c2, bias, m);
            } else {
#pragma unroll
                for (int n = 0; n < 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int half = e / 2, i = n * 8 + quad * 2 + (e & 1);
                        const bool in = i >= lo[half] && i <= hi[half];
                        if (in) m[half] = fmaxf(m[half], fmaf(s[n][e], c2, bias[half]));
                        else s[n][e] = -INFINITY;
                    }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) m[half] = quad_max(m[half]);
            const float off[2] = {numerator_offset(none[0], bias[0], m[0]), numerator_offset(none[1], bias[1], m[1])};
            uint32_t pa[4][4];  // P as the A operand of P V: four k-steps of 16 keys
            softmax_numerators<T>(s, c2, off, l, pa);
#pragma unroll
            for (int half = 0; half < 2; ++half) l[half] = quad_sum(l[half]);
            __syncwarp();  // every lane is done reading Q: the buffer now stages the output
            // O = P V in chunks of up to 128 columns (64 accumulators per lane), normalised into q_b.
            constexpr int DC = D < 128 ? D : 128;
#pragma unroll
            for (int dc = 0; dc < D; dc += DC) {
                float o[DC / 8][4];
                if constexpr (WG) {
                    wg_pv_tile<T, D>(o, pa, v_s);
                } else {
#pragma unroll
                    for (int n = 0; n < DC / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                        for (int dp = 0; dp < DC / 16; ++dp) {
                            uint32_t b[4];
                            ldmatrix_x4_trans(b, v_s + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::RS + dc +
                                                     dp * 16 +
                                                     (lane / 16) * 8);
                            mma16816<T>(o[2 * dp], pa[kk], b[0], b[1]);
                            mma16816<T>(o[2 * dp + 1], pa[kk], b[2], b[3]);
                        }
                    }
                }
                const float inv0 = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv1 = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
#pragma unroll
                for (int n = 0; n < DC / 8; ++n) {
                    const int col = dc + n * 8 + quad * 2;
                    *reinterpret_cast<uint32_t*>(q_b + r0 * S::RS + col) = pack2<T>(o[n][0] * inv0, o[n][1] * inv0);
                    *reinterpret_cast<uint32_t*>(q_b + (r0 + 8) * S::RS + col) =
                        pack2<T>(o[n][2] * inv1, o[n][3] * inv1);
                }
            }
            if (quad == 0) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = tile * 16 + r0 + half * 8, ei = row >> gshift;
                    if (ei < count) {
                        const int at = ent[ei].y + hq + (row & (group - 1));
                        ws.bm_part_ml[at] = make_float2(m[half] * kLn2, l[half]);  // the max back to base e
                    }
                }
            }
            __syncwarp();
            // The staged rows to the partials, 16 bytes a lane, whole 128-byte lines an instruction
            // (lanes and rows as in the gather).
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = (lane >> 3) + 4 * j, row = tile * 16 + r, ei = row >> gshift, cl = (lane & 7) * kChunk;
                if (ei < count) {
                    T* dst = static_cast<T*>(ws.bm_part_o) + (int64_t)(ent[ei].y + hq + (row & (group - 1))) * D + cl;
                    const T* src = q_b + r * S::RS + cl;
#pragma unroll
                    for (int c = 0; c < D / 64; ++c)
                        *reinterpret_cast<uint4*>(dst + c * 64) = *reinterpret_cast<const uint4*>(src + c * 64);
                }
            }
            __syncwarp();  // the buffer is gathered into again two tiles on
        }
        item = next;
        w += stride;
        if (w >= nitems) break;
        next = w + stride < nitems ? ws.bm_items[w + stride] : make_int4(0, 0, 0, 0);
        if (threadIdx.x == 0) s_rows = 0;  // every thread read it before the barrier after the zero-fill
        __pipeline_wait_prior(0);          // this thread's copies of the next item's records
        __syncthreads();                   // K, V and rec[rb] free again; every thread's record copies landed
    }
}

// Shared memory of qm_attend_kernel, in elements of T: the tile's 128 rotated query rows, then
// two stages of a block's K and V (64 rows each). Rows D + 8 elements apart, as in BmSmem. With
// warpgroup MMA (WG) the same regions, from a 1024-byte boundary, hold 128-byte-swizzled tiles
// instead: the queries as two 64-row tiles (one per warpgroup), K and V as one each.
template <int D, bool WG = false>
struct QmSmem {
    static constexpr int RS = D + 8;
    static constexpr size_t align_elems = WG ? 512 : 0;
    static constexpr size_t q_elems = (size_t)kQmRows * RS;
    static constexpr size_t stage_elems = (size_t)2 * 64 * RS;
    static constexpr size_t elems = align_elems + q_elems + 2 * stage_elems;
    static_assert(!WG || ((q_elems * 2) % 1024 == 0 && (64 * RS * 2) % 1024 == 0), "swizzled tiles 1024-byte aligned");
    // Element offsets of query row r, column d, and of key / value row r, column d (d a multiple of 8).
    static __device__ __forceinline__ int q_at(int r, int d) {
        return WG ? (r / 64) * 64 * D + sw128_offset<64>(r % 64, d) : r * RS + d;
    }
    static __device__ __forceinline__ int kv_at(int r, int d) { return WG ? sw128_offset<64>(r, d) : r * RS + d; }
    // kv_at(r + k, d) - kv_at(r, d) for k a multiple of 8 (a whole swizzle period).
    static constexpr int kv_row = WG ? 64 : RS;
};
constexpr int kQmThreads = 256;  // 8 warps of 16 rows
constexpr int kQmWarps = kQmThreads / 32;
static_assert(kQmWarps * 16 == kQmRows, "a warp per 16 query rows");

// Query-major tiles, step 2. One CTA per (tile, KV head): the tile's 128 query rows (its
// qm_tile tokens x G heads) stay in shared memory while the blocks qm_serves gives it stream
// through two stages of K and V. Each warp keeps 16 rows' running max, sum and output in
// registers across the blocks (FlashAttention-2's online softmax), with per-row masks: a row
// reads a block when its token reads it (local window, or selected by enough of the tile's
// tokens), over the keys [lo, hi] of that read, with the routing's bias of that selection. At the end
// the rows merge their tokens' block-major partials (written by block_attend_kernel, launched
// first) and write the output; bm_combine_kernel serves only tokens outside such tiles.
// WG (sm_90a, D = 128): the two warpgroups of the CTA serve 64 rows each, S = Q K^T with the
// queries and keys from shared memory and O += P V as warpgroup MMAs, K and V read from shared
// memory once per 64 rows instead of once per 16; a warpgroup skips the blocks none of its rows
// reads (the mma.sync form skips per warp). Masks, softmax and merge are the same code.
template <typename T, int D, bool WG>
__global__ void __launch_bounds__(kQmThreads, 2) qm_attend_kernel(const DashParams p, const Plan plan, Workspace ws,
                                                                 int t0, int tn) {
    static_assert(!WG || D == 128, "warpgroup tiles: D = 128");
    using S = QmSmem<D, WG>;
    const int tile = blockIdx.x, h = blockIdx.y;
    const int base = ws.qm_base[tile];
    if (base < 0) {
        grid_dependency_wait();  // plan.qm_overlap: the kernels after this one rely on block_attend_kernel's end
        return;
    }
    const int group = p.num_heads / p.num_kv_heads, hkv = p.num_kv_heads, sbs = p.sparse_block_size;
    const int gshift = __ffs(group) - 1;  // G divides 16 (block_major_supported): row / G and row % G as bit operations
    const int tt = plan.qm_tile, ta = tile * tt, cnt = min(tt, tn - ta);  // chunk-relative tokens
    const int seq = ws.token_seq[t0 + ta];
    const int local = p.sparse_local_block * sbs, per = p.block_size / sbs;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t smem_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    T* q_s = reinterpret_cast<T*>(smem + (WG ? (1024 - smem_at % 1024) % 1024 : 0));
    T* kv_s = q_s + S::q_elems;  // stage s: K at kv_s + s * stage_elems, V 64 rows later
    __shared__ uint32_t mask[kQmBlocks * kQmWords];
    __shared__ int list_b[kQmBlocks], list_first[kQmBlocks];  // blocks read, ascending; first cache slot
    __shared__ uint8_t list_wg[WG ? kQmBlocks : 1];          // WG: bit g, a row of warpgroup g reads the block
    __shared__ int tok_pos[kQmRows], tok_prompt[kQmRows];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n = ws.qm_count[tile];  // the blocks qm_prep_kernel listed for the tile
    const int64_t m0 = (int64_t)tile * kQmBlocks * kQmWords;
    for (int i = threadIdx.x; i < n * kQmWords; i += kQmThreads) mask[i] = ws.qm_mask[m0 + i];
    const float* tile_bias = ws.qm_bias + (int64_t)tile * kQmBlocks * tt;  // [block of the list][token]
    for (int i = threadIdx.x; i < cnt; i += kQmThreads) {
        tok_pos[i] = ws.token_pos[t0 + ta + i];
        tok_prompt[i] = ws.token_prompt[t0 + ta + i];
    }
    for (int i = threadIdx.x; i < n; i += kQmThreads) {
        const int b = ws.qm_list[(int64_t)tile * kQmBlocks + i];
        const int64_t key = summary_index(p, seq, b, ws.error);
        list_b[i] = b;
        list_first[i] = key < 0 ? -1 : (int)((key / per) * p.block_size + (key % per) * sbs);
    }
    // The tile's rotated queries (rows past its tokens are zero).
    constexpr int kChunk = 8;  // elements per 16-byte copy
    const T* qrot = static_cast<const T*>(ws.bm_qrot);
    for (int c = threadIdx.x; c < kQmRows * (D / kChunk); c += kQmThreads) {
        const int r = c / (D / kChunk), d = (c % (D / kChunk)) * kChunk;
        const int tok = r >> gshift, g = r & (group - 1);
        const bool in = tok < cnt;
        const int64_t off = in ? ((int64_t)(ta + tok) * p.num_heads + h * group + g) * D + d : 0;
        __pipeline_memcpy_async(q_s + S::q_at(r, d), qrot + off, 16, in ? 0 : 16);
    }
    __pipeline_commit();
    __syncthreads();
    const T* kc = static_cast<const T*>(p.key_cache);
    const T* vc = static_cast<const T*>(p.value_cache);
    const int last_pos = tok_pos[cnt - 1];
    // Block i's K and V into stage `st`; rows the tile never reads (past its last token, or a
    // block the table does not map) are zero-filled, so that a zero probability never meets a NaN.
    // Thread t copies chunk t % kCpr of rows t / kCpr + k kRowStep: one cache address and one
    // shared offset a thread, stepped by whole rows (kRowStep a multiple of 8 keeps the swizzle).
    constexpr int kCpr = D / kChunk, kRowStep = kQmThreads / kCpr;
    static_assert(64 % kRowStep == 0 && kRowStep % 8 == 0, "whole swizzle periods a step");
    const int ld_r = threadIdx.x / kCpr, ld_d = (threadIdx.x % kCpr) * kChunk, ld_s = S::kv_at(ld_r, ld_d);
    const int64_t ld_step = (int64_t)kRowStep * hkv * D;
    auto load_block = [&](int i, int st) {
        T* k_d = kv_s + st * S::stage_elems + ld_s;
        T* v_d = k_d + 64 * S::RS;
        const int first = list_first[i], b = list_b[i];
        const int rows = first < 0 ? 0 : min(64, max(0, last_pos - b * sbs + 1));
        const int64_t g = (((int64_t)max(first, 0) + ld_r) * hkv + h) * D + ld_d;
#pragma unroll
        for (int k = 0; k < 64 / kRowStep; ++k) {
            const int at = k * kRowStep * S::kv_row;
            if (ld_r + k * kRowStep < rows) {
                __pipeline_memcpy_async(k_d + at, kc + g + k * ld_step, 16);
                __pipeline_memcpy_async(v_d + at, vc + g + k * ld_step, 16);
            } else {
                *reinterpret_cast<uint4*>(k_d + at) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(v_d + at) = make_uint4(0, 0, 0, 0);
            }
        }
    };
    if (n > 0) load_block(0, 0);
    __pipeline_commit();
    // What token tk reads in any block: its position and the last position a selected block may
    // give it (before its window, and before its prompt's end). Fixed across the blocks: the main
    // loop takes them once.
    struct TokRead {
        int pos, sel_last;
    };
    auto tok_read = [&](int tk) {
        const int t = tk < cnt ? tk : 0, pos = tok_pos[t], prompt = tok_prompt[t];
        return TokRead{pos, selected_last(pos, local, prompt)};
    };
    // The keys token tk (tr = tok_read(tk)) reads in block i: [0, sel_hi] as a selected block
    // (bias: the routing's for that selection) and [loc_lo, loc_hi] of its local window; both may be
    // empty. True if any.
    auto reads = [&](int i, int tk, const TokRead& tr, int& sel_hi, int& loc_lo, int& loc_hi, float& bias) {
        const int bstart = list_b[i] * sbs;
        sel_hi = -1, loc_lo = 1, loc_hi = 0, bias = 0.0f;
        if (tk < cnt && list_first[i] >= 0) {
            if (bstart + sbs > window_first(tr.pos, local) && bstart <= tr.pos) {  // the local window reaches the block
                loc_lo = max(window_first(tr.pos, local) - bstart, 0);
                loc_hi = min(tr.pos - bstart, sbs - 1);
            }
            const uint32_t bit = 1u << (tk % 32);
            if (mask[i * kQmWords + tk / 32] & bit) {  // a selection the tile serves
                sel_hi = min(tr.sel_last - bstart, sbs - 1);
                bias = tile_bias[i * tt + tk];
            }
        }
        return sel_hi >= 0 || loc_lo <= loc_hi;
    };
    if constexpr (WG) {  // which warpgroups read each block (published by the loop's first barrier)
        for (int i = threadIdx.x; i < n; i += kQmThreads) {
            unsigned bits = 0;
            for (int g = 0; g < kQmRows / 64; ++g) {
                const int tk1 = min(cnt, (g + 1) * 64 / group);
                for (int tk = g * 64 / group; tk < tk1 && !(bits >> g & 1u); ++tk) {
                    int a, b, c;
                    float f;
                    if (reads(i, tk, tok_read(tk), a, b, c, f)) bits |= 1u << g;
                }
            }
            list_wg[i] = (uint8_t)bits;
        }
    }

    const float scale = __fdiv_rn(1.0f, sqrtf((float)D));
    const int quad = lane % 4, r0 = lane / 4;
    int tok[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) tok[half] = (warp * 16 + r0 + half * 8) >> gshift;
    const TokRead tr[2] = {tok_read(tok[0]), tok_read(tok[1])};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[D / 8][4];
#pragma unroll
    for (int nn = 0; nn < D / 8; ++nn) o[nn][0] = o[nn][1] = o[nn][2] = o[nn][3] = 0.0f;
    const T* q_b = q_s + warp * 16 * S::RS;
    for (int i = 0; i < n; ++i) {
        __pipeline_wait_prior(0);
        if constexpr (WG) fence_async_smem();  // the queries, K and V are read by the wgmma (async) proxy
        __syncthreads();  // block i landed everywhere; every warp is done with block i - 1's stage
        if (i + 1 < n) load_block(i + 1, (i + 1) & 1);
        __pipeline_commit();
        int sel_hi[2], loc_lo[2], loc_hi[2];
        float bias[2];
        bool any = false;
#pragma unroll
        for (int half = 0; half < 2; ++half)
            any = reads(i, tok[half], tr[half], sel_hi[half], loc_lo[half], loc_hi[half], bias[half]) || any;
        if (WG ? !(list_wg[i] >> (warp / 4) & 1u) : !__any_sync(0xffffffffu, any))
            continue;  // no row of this warp (WG: warpgroup) reads block i
        const T* k_s = kv_s + (i & 1) * S::stage_elems;
        const T* v_s = k_s + 64 * S::RS;
        float s[8][4];
        if constexpr (WG) {
            wg_qk_tile_ss<T, D>(s, q_s + (warp / 4) * 64 * D, k_s);
        } else {
            qk_tile<T, D, S::RS>(s, q_b, k_s, lane);
        }
        // Logits in the log2 domain (x log2 e: one multiply-add, then exp2). Where every row of
        // the warp reads the whole block or none of it (a selected block before every
        // window), no per-key test.
        float mb[2] = {-INFINITY, -INFINITY};
        float add[2];
        bool whole = true, none[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            none[half] = sel_hi[half] < 0 && loc_lo[half] > loc_hi[half];
            whole = whole && (none[half] || sel_hi[half] == sbs - 1 || (loc_lo[half] == 0 && loc_hi[half] == sbs - 1));
            add[half] = sel_hi[half] >= 0 ? bias[half] * kLog2e : 0.0f;
        }
        const float c2 = scale * kLog2e;
        const bool fast = __all_sync(0xffffffffu, whole);
        if (fast) {
            whole_block_max(s, none, c2, add, mb);
        } else {
#pragma unroll
            for (int nn = 0; nn < 8; ++nn)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int half = e / 2, k = nn * 8 + quad * 2 + (e & 1);
                    const float x = k <= sel_hi[half]                        ? fmaf(s[nn][e], c2, add[half])
                                    : k >= loc_lo[half] && k <= loc_hi[half] ? s[nn][e] * c2
                                                                             : -INFINITY;
                    s[nn][e] = x;
                    mb[half] = fmaxf(mb[half], x);
                }
        }
        float alpha[2];
        online_softmax_step<true>(m, l, mb, alpha);
        if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) scale_rows(o, alpha);  // no max moved: x 1
        // The fast path's scores are raw (c2 and add - m applied per entry), the masked path's
        // logits already (- m). The two round differently, but a query-major tile's rows share a
        // warp by token order alone, so which path a row takes does not depend on the schedule.
        const float off[2] = {numerator_offset(fast && none[0], fast ? add[0] : 0.0f, m[0]),
                              numerator_offset(fast && none[1], fast ? add[1] : 0.0f, m[1])};
        uint32_t pa[4][4];
        softmax_numerators<T>(s, fast ? c2 : 1.0f, off, l, pa);
        if constexpr (WG) {
            wg_pv_tile<T, D>(o, pa, v_s, true);
        } else {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    uint32_t bb[4];
                    ldmatrix_x4_trans(bb, v_s + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::RS + dp * 16 +
                                              (lane / 16) * 8);
                    mma16816<T>(o[2 * dp], pa[kk], bb[0], bb[1]);
                    mma16816<T>(o[2 * dp + 1], pa[kk], bb[2], bb[3]);
                }
            }
        }
    }
    // The rows are complete but for their tokens' block-major entries, whose partials
    // block_attend_kernel (launched before this kernel) has written. With plan.qm_merge they
    // are merged here and the output written, so that bm_combine_kernel skips these tokens:
    // (1) each warp stages its 16 rows (unnormalised, fp32; max in base e and sum) in the K / V
    // stages, which no warp reads any more; (2) a thread per row finds the row's block-major
    // slots and their weights (normalised) and lists them where the queries were; (3) a thread
    // per 8 output columns of two rows adds the listed partials, the loads of both in flight.
    // Without it (a list too long for the space), slot kmax of the partials, for the combine.
#pragma unroll
    for (int half = 0; half < 2; ++half) l[half] = quad_sum(l[half]);
    // With plan.qm_overlap this kernel may have started before block_attend_kernel ended (its
    // CTAs free the SMs unevenly): everything above reads only what earlier launches wrote; the
    // partials below are block_attend_kernel's.
    grid_dependency_wait();
    if (!plan.qm_merge) {
        T* part_o = static_cast<T*>(ws.bm_part_o);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp * 16 + r0 + half * 8, tk = tok[half];
            if (tk >= cnt) continue;
            const int64_t at = ((int64_t)(ta + tk) * plan.bm_slots + plan.kmax) * p.num_heads + h * group + row % group;
            const float inv = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
#pragma unroll
            for (int nn = 0; nn < D / 8; ++nn)
                *reinterpret_cast<uint32_t*>(part_o + at * D + nn * 8 + quad * 2) =
                    pack2<T>(o[nn][half * 2] * inv, o[nn][half * 2 + 1] * inv);
            if (quad == 0) ws.bm_part_ml[at] = make_float2(m[half] * kLn2, l[half]);  // the max back to base e
        }
        return;
    }
    __syncthreads();  // every warp is done with the last block's K and V, and with the queries
    constexpr int ORS = D + 4;  // staged row stride in floats
    static_assert(kQmRows * ORS * sizeof(float) <= 2 * S::stage_elems * sizeof(T), "the stages hold the rows");
    float* o_s = reinterpret_cast<float*>(kv_s);
    float2* row_ml = reinterpret_cast<float2*>(o_s + kQmRows * ORS);  // then (own weight, 1 / denominator)
    static_assert(kQmRows * ORS * sizeof(float) + kQmRows * sizeof(float2) <= 2 * S::stage_elems * sizeof(T),
                  "the stages hold the rows and their (max, sum)");
    // [kQmRows][bm_slots]: (partial row's offset in 16-byte units, as float bits; weight): qm_merge_fits
    float2* list = reinterpret_cast<float2*>(q_s);
    int* row_n = tok_pos;                           // listed slots per row (the positions are done with)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + r0 + half * 8;
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn)
            *reinterpret_cast<float2*>(o_s + r * ORS + nn * 8 + quad * 2) =
                make_float2(o[nn][half * 2], o[nn][half * 2 + 1]);
        if (quad == 0) row_ml[r] = make_float2(m[half] * kLn2, l[half]);  // the max back to base e
    }
    __syncthreads();
    const float2* ml_g = ws.bm_part_ml;
    for (int row = threadIdx.x; row < kQmRows; row += kQmThreads) {
        const int tk = row >> gshift;
        if (tk >= cnt) continue;
        const int64_t row0 = (int64_t)(ta + tk) * plan.bm_slots * p.num_heads + h * group + (row & (group - 1));
        const float2 own = row_ml[row];
        float mx = own.y > 0.0f ? own.x : -INFINITY;
        float2* li = list + row * plan.bm_slots;
        const int2* kind = ws.bm_rank + (int64_t)(ta + tk) * plan.bm_slots;
        // Every slot's (max, sum) and kind, 32 of each in flight (one round trip for up to 32
        // slots; 18 at top-16 with one local block), kept in the row's list for the second pass:
        // (0, 0) where the slot is not block-major (its (max, sum) is stale).
        for (int s0 = 0; s0 < plan.bm_slots; s0 += 32) {
            float2 ml[32];
            bool bm[32];
#pragma unroll
            for (int u = 0; u < 32; ++u) {
                const bool in = s0 + u < plan.bm_slots;
                ml[u] = in ? ml_g[row0 + (int64_t)(s0 + u) * p.num_heads] : make_float2(0.0f, 0.0f);
                bm[u] = in && kind[s0 + u].x >= 0;
            }
#pragma unroll
            for (int u = 0; u < 32; ++u) {
                if (!bm[u]) ml[u] = make_float2(0.0f, 0.0f);
                if (s0 + u < plan.bm_slots) li[s0 + u] = ml[u];
                if (ml[u].y > 0.0f) mx = fmaxf(mx, ml[u].x);
            }
        }
        const float w_own = own.y > 0.0f ? partial_scale(own.x, mx) : 0.0f;  // weighs the unnormalised row
        float denom = w_own * own.y;
        int n = 0;
        for (int s = 0; s < plan.bm_slots; ++s) {  // compacted in place: entry n <= s is rewritten after s is read
            const float2 ml = li[s];
            if (!(ml.y > 0.0f)) continue;  // not a block-major entry (the query-major slots among them)
            const float wgt = partial_weight(ml, mx);
            denom += wgt;
            // The partial row's first element, in 16-byte units (qm_merge_fits: it fits 32 bits).
            const uint32_t at16 = (uint32_t)(((row0 + (int64_t)s * p.num_heads) * D) >> 3);
            li[n++] = make_float2(__uint_as_float(at16), wgt);
        }
        const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
        for (int j = 0; j < n; ++j) li[j].y *= inv;
        row_ml[row] = make_float2(w_own * inv, inv);
        row_n[row] = n;
    }
    __syncthreads();
    // (3) Pieces of 8 output columns of a row; consecutive threads, consecutive columns. A thread
    // takes two pieces at once (pi and pi + kQmThreads: rows 256 / (D / 8) apart, the same
    // columns), with up to kBatch loads of each piece's partials in flight together (a row has
    // about half its slots block-major: one piece alone would leave half the loads idle). Each
    // piece adds its partials in list order, so the bits do not depend on the pairing.
    constexpr int kChunks = D / 8, kPieces = kQmRows * kChunks;
    static_assert(kPieces % (2 * kQmThreads) == 0 && kQmThreads % kChunks == 0, "whole pairs of pieces, same columns");
    const T* part_o = static_cast<const T*>(ws.bm_part_o);
    for (int pi = threadIdx.x; pi < kPieces; pi += 2 * kQmThreads) {
        const int d0 = (pi % kChunks) * 8;
        int n[2];
        int64_t out_at[2];
        const float2* li[2];
        float acc[2][8];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int row = (pi + s * kQmThreads) / kChunks, tk = row >> gshift;
            const bool in = tk < cnt;
            n[s] = in ? row_n[row] : 0;
            out_at[s] = in ? ((int64_t)(t0 + ta + tk) * p.num_heads + h * group + (row & (group - 1))) * D + d0 : -1;
            li[s] = list + row * plan.bm_slots;
            const float w_own = in ? row_ml[row].x : 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[s][i] = in ? w_own * o_s[row * ORS + d0 + i] : 0.0f;
        }
        constexpr int kBatch = 6;  // loads in flight a piece
        const int most = max(n[0], n[1]);
        for (int u0 = 0; u0 < most; u0 += kBatch) {
            uint4 raw[2][kBatch];
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int u = 0; u < kBatch; ++u)
                    if (u0 + u < n[s])
                        raw[s][u] = *reinterpret_cast<const uint4*>(
                            part_o + (size_t)__float_as_uint(li[s][u0 + u].x) * 8 + d0);
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    if (u0 + u >= n[s]) continue;
                    const float wgt = li[s][u0 + u].y;
                    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw[s][u]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 x = Dtype<T>::unpack(w[i]);
                        acc[s][2 * i] += wgt * x.x;
                        acc[s][2 * i + 1] += wgt * x.y;
                    }
                }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if (out_at[s] < 0) continue;
            uint4 res;
            T* y = reinterpret_cast<T*>(&res);
#pragma unroll
            for (int i = 0; i < 8; ++i) y[i] = from_f<T>(acc[s][i]);
            *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + out_at[s]) = res;
        }
    }
}

// Merge the slots of each (token, head): the kmax selected blocks and the local-window blocks,
// for the tokens whose query-major tile did not merge them. CTA x of a grid of G (at most
// kCombineCtas) takes chunk tokens x, x + G, x + 2 G, ..., lists those that need the merge, then
// merges them one at a time; a lane owns 8 output columns, a CTA kCombineThreads / (D / 8) heads
// (blockIdx.y). (One CTA a token cost the launches of all the tokens the tiles merged. Tokens
// G apart, not a run of neighbours: those that need the merge come in runs, such as a mixed
// call's decode tokens, which a CTA would otherwise merge one after another.)
template <typename T, int D>
__global__ void __launch_bounds__(kCombineThreads) bm_combine_kernel(const DashParams p, const Plan plan, Workspace ws, int t0,
                                                                     int tn) {
    constexpr int kLanes = D / 8, kHeads = kCombineThreads / kLanes;
    __shared__ int s_tok[kCombineThreads], s_n;
    const int per = (tn + gridDim.x - 1) / gridDim.x;
    const int head = blockIdx.y * kHeads + threadIdx.x / kLanes, d = (threadIdx.x % kLanes) * 8;
    for (int r0 = 0; r0 < per; r0 += kCombineThreads) {
        if (threadIdx.x == 0) s_n = 0;
        __syncthreads();
        const int r = r0 + threadIdx.x, c = blockIdx.x + r * gridDim.x;  // the CTA's r-th token
        if (r < per && c < tn && ws.token_seq[t0 + c] >= 0) {
            const bool tiled = plan.qm_tile > 0 && ws.qm_base[c / plan.qm_tile] >= 0;
            if (!(plan.qm_merge && tiled)) s_tok[atomicAdd(&s_n, 1)] = tiled ? c | INT32_MIN : c;
        }
        __syncthreads();
        const int n = s_n;
        for (int i = 0; i < n && head < p.num_heads; ++i) {
            const int tl = s_tok[i] & INT32_MAX, t = t0 + tl;
            // The slots with partials: the block-major ones, and slot kmax of a query-major tile's
            // token (its row of the tile, written without the merge).
            const int2* kind = ws.bm_rank + (int64_t)tl * plan.bm_slots;
            const int own = s_tok[i] < 0 ? plan.kmax : -1;
            const int64_t row0 = (int64_t)tl * plan.bm_slots * p.num_heads + head;  // slot s: row0 + s * H
            float m = -INFINITY;
            for (int s = 0; s < plan.bm_slots; ++s) {
                if (kind[s].x < 0 && s != own) continue;
                const float2 ml = ws.bm_part_ml[row0 + (int64_t)s * p.num_heads];
                if (ml.y > 0.0f) m = fmaxf(m, ml.x);
            }
            float denom = 0.0f, num[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int s = 0; s < plan.bm_slots; ++s) {
                if (kind[s].x < 0 && s != own) continue;
                const int64_t row = row0 + (int64_t)s * p.num_heads;
                const float2 ml = ws.bm_part_ml[row];
                if (!(ml.y > 0.0f)) continue;
                const float wgt = partial_weight(ml, m);
                denom += wgt;
                const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(ws.bm_part_o) + row * D + d);
                const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int k = 0; k < 8; ++k) num[k] += wgt * to_f(x[k]);
            }
            const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
            uint4 res;
            T* y = reinterpret_cast<T*>(&res);
#pragma unroll
            for (int k = 0; k < 8; ++k) y[k] = from_f<T>(num[k] * inv);
            *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + ((int64_t)t * p.num_heads + head) * D + d) = res;
        }
        __syncthreads();  // s_tok and s_n are reused
    }
}

// block_attend_kernel in the form WG (0: mma.sync; 1 or 2 warpgroups), its shared memory allowed,
// over `items` work items (at most; the kernel reads the pass's count): per KV head one CTA a work
// item, or where plan.bm_ctas > 0 that many CTAs serving the items in turn (never more than the
// items). One CTA an item is the default: on the H200 (2026-12-03) a grid of the CTAs the device
// holds at once, each serving items in turn, took block_attend_kernel 2.53 -> 2.79 ms at 64k.
template <typename T, int D, int WG>
cudaError_t launch_block_attend(int64_t items, const DashParams& p, const Plan& plan, const Workspace& ws, int t0,
                                cudaStream_t stream) {
    const size_t smem = sizeof(T) * BmSmem<D, WG>::elems;
    cudaError_t err = allow_smem(block_attend_kernel<T, D, WG>, smem);
    if (err != cudaSuccess) return err;
    // A grid of more CTAs than the device holds at once, each serving several items, would have
    // the extra ones start only when a resident CTA has served all of its items.
    const dim3 grid((unsigned)(plan.bm_ctas > 0 ? std::min<int64_t>(items, plan.bm_ctas) : items), p.num_kv_heads);
    block_attend_kernel<T, D, WG><<<grid, bm_threads(WG), smem, stream>>>(p, plan, ws, t0);
    return cudaSuccess;
}

template <typename T>
cudaError_t launch_bm_attend(const DashParams& p, const Plan& plan, const Workspace& pass_ws, int t0, int tn,
                             cudaStream_t stream) {
    if constexpr (sizeof(T) != 2) {
        return cudaErrorInvalidValue;  // fp32 never takes this path (block_major_supported)
    } else {
        // The pass's rotated queries (bm_qrot): rows t0 .. of every token's (Workspace::q_rot), or
        // rotated now into the workspace.
        Workspace ws = pass_ws;
        if (ws.q_rot != nullptr) {
            ws.bm_qrot = static_cast<T*>(ws.q_rot) + (int64_t)t0 * p.num_heads * p.head_dim;
        } else {
            rope_q_kernel<T><<<(tn + 3) / 4, 128, 0, stream>>>(p, ws, t0, tn);
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) return err;
        }
        return DASH_DISPATCH_HEAD_DIM(p.head_dim, D, [&] {
            cudaError_t err = cudaSuccess;
            const int64_t items = block_major_items((int64_t)tn * plan.bm_slots, plan.bm_num_keys);
            const bool wg_bm = (plan.warpgroup & kWgBlockMajor) != 0, wg_qm = (plan.warpgroup & kWgQueryMajor) != 0;
            if constexpr (D == 128) {
                if (wg_bm)
                    err = plan.bm_warpgroups == 1 ? launch_block_attend<T, D, 1>(items, p, plan, ws, t0, stream)
                                                  : launch_block_attend<T, D, 2>(items, p, plan, ws, t0, stream);
            }
            if (D != 128 || !wg_bm) err = launch_block_attend<T, D, 0>(items, p, plan, ws, t0, stream);
            if (err != cudaSuccess) return err;
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
            if constexpr (D <= 128) {
                if (plan.qm_tile > 0) {
                    const unsigned tiles = (unsigned)((tn + plan.qm_tile - 1) / plan.qm_tile);
                    auto launch_qm = [&](auto kernel) {  // plan.qm_smem is the chosen form's (query_major_smem)
                        cudaError_t e = allow_smem(kernel, plan.qm_smem);
                        if (e != cudaSuccess) return e;
                        // plan.qm_overlap: a programmatic dependent launch; the kernel starts
                        // while block_attend_kernel's last CTAs run (grid_dependency_wait).
                        cudaLaunchAttribute attr[1];
                        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                        attr[0].val.programmaticStreamSerializationAllowed = 1;
                        cudaLaunchConfig_t cfg = {};
                        cfg.gridDim = dim3(tiles, p.num_kv_heads);
                        cfg.blockDim = dim3(kQmThreads);
                        cfg.dynamicSmemBytes = plan.qm_smem;
                        cfg.stream = stream;
                        cfg.attrs = attr;
                        cfg.numAttrs = plan.qm_overlap ? 1 : 0;
                        e = cudaLaunchKernelEx(&cfg, kernel, p, plan, ws, t0, tn);
                        return e != cudaSuccess ? e : cudaGetLastError();
                    };
                    err = D == 128 && wg_qm ? launch_qm(qm_attend_kernel<T, D, D == 128>)
                                            : launch_qm(qm_attend_kernel<T, D, false>);
                    if (err != cudaSuccess) return err;
                }
            }
            constexpr int kHeads = kCombineThreads / (D / 8);
            bm_combine_kernel<T, D><<<dim3(std::min(tn, kCombineCtas), (p.num_heads + kHeads - 1) / kHeads),
                                      kCombineThreads, 0, stream>>>(p, plan, ws, t0, tn);
            return cudaGetLastError();
        });
    }
}

}  // namespace

// Whether a query-major tile can list its rows' block-major slots where its queries were
// (qm_attend_kernel's merge): kQmRows x bm_slots (slot, weight) pairs.
bool qm_merge_fits(const DashParams& p, int bm_slots, int bm_chunk) {
    const size_t q_bytes = p.head_dim == 64 ? 2 * QmSmem<64>::q_elems : p.head_dim == 128 ? 2 * QmSmem<128>::q_elems : 0;
    // The list holds each partial row's offset in 16-byte units as 32 bits.
    const uint64_t units = (uint64_t)bm_chunk * bm_slots * p.num_heads * p.head_dim / 8;
    return (size_t)kQmRows * bm_slots * sizeof(float2) <= q_bytes && units <= UINT32_MAX;
}

size_t query_major_smem(const DashParams& p, bool wg) {
    if (p.dtype == DASH_FLOAT32) return 0;
    if (p.head_dim == 128) return 2 * (wg ? QmSmem<128, true>::elems : QmSmem<128>::elems);
    return p.head_dim == 64 ? 2 * QmSmem<64>::elems : 0;
}

bool block_major_supported(const DashParams& p, size_t smem_limit) {
    const int group = p.num_heads / p.num_kv_heads;
    if (p.dtype == DASH_FLOAT32 || p.sparse_block_size != 64 || 16 % group != 0 || p.topk <= 0)
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
    if ((err = cudaMemsetAsync(ws.bm_tally, 0, sizeof(int) * kTallyStride * (size_t)nbs, stream)) != cudaSuccess)
        return err;
    const int64_t entries = (int64_t)tn * plan.bm_slots;
    const int grid = (int)((entries + 255) / 256);
    if (plan.qm_tile > 0) {  // the tiles, then their tokens' counts (entry_key asks qm_serves)
        const size_t count_bytes = sizeof(uint32_t) * ((plan.max_blocks + 3) / 4);  // at most kQmMaxBlocks: no opt-in
        qm_prep_kernel<<<(tn + plan.qm_tile - 1) / plan.qm_tile, kQmPrepThreads, count_bytes, stream>>>(p, plan, ws,
                                                                                                      t0, tn);
    } else {
        count_kernel<<<grid, 256, 0, stream>>>(p, plan, ws, t0, tn);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    parts_kernel<<<(nbs + 255) / 256, 256, 0, stream>>>(plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    size_t temp = plan.bm_scan_bytes;
    // Inclusive prefix in [1, nbs]: offsets[0] = 0 is set by the memset below.
    if ((err = cudaMemsetAsync(ws.bm_offsets, 0, sizeof(int), stream)) != cudaSuccess) return err;
    if ((err = cub::DeviceScan::InclusiveSum(ws.bm_scan_temp, temp, ws.bm_counts, ws.bm_offsets + 1, nbs, stream)) !=
        cudaSuccess)
        return err;
    fill_kernel<<<grid, 256, 0, stream>>>(p, plan, ws, t0, tn);
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
