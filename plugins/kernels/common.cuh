// Shared device helpers for the DASH stages: dtype traits, reference-exact RoPE, dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dash/dash.h"

namespace dash {

// ------------------------------------------------------------------ dtype traits
template <typename T>
struct Dtype;

template <>
struct Dtype<float> {
    static __device__ __forceinline__ float to_f(float x) { return x; }
    static __device__ __forceinline__ float from_f(float x) { return x; }
};
template <>
struct Dtype<__half> {
    using pair = __half2;  // two values in one register
    static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ __half2 pair_of(float a, float b) { return __floats2half2_rn(a, b); }
    // Two values packed in a 32-bit word (the lower address in the low half), exactly.
    static __device__ __forceinline__ float2 unpack(uint32_t w) {
        return __half22float2(*reinterpret_cast<const __half2*>(&w));
    }
};
template <>
struct Dtype<__nv_bfloat16> {
    using pair = __nv_bfloat162;
    static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ __nv_bfloat162 pair_of(float a, float b) { return __floats2bfloat162_rn(a, b); }
    // bf16 is float32's upper half: one shift or mask a value.
    static __device__ __forceinline__ float2 unpack(uint32_t w) {
        return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    }
};

template <typename T>
__device__ __forceinline__ float to_f(T x) { return Dtype<T>::to_f(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x) { return Dtype<T>::from_f(x); }
// x rounded to T and back: what a torch op producing a T tensor stores.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_f<T>(from_f<T>(x)); }

// ------------------------------------------------------------------ RoPE
// Frequency and angle exactly as dash_trt.reference.page_rope computes them in float32:
//   exponent = i / (truncate ? dim/2 : ntok); inv = 1 / theta**exponent; angle = coord * inv.
// NOTE: no fused multiply-add (the reference rounds every product), hence the _rn intrinsics.
struct RopeConfig {
    int pairs;        // sparse_rope_page_pairs
    float tok_theta;
    float page_theta;
    int truncate;     // for this tensor kind (main or index)
    int page_mod;
};

// The two RoPE configurations of a call, built from DashParams in one place: the main one (queries
// and keys) and the index one (indexer queries and keys); they differ only in the truncation.
__host__ __device__ __forceinline__ RopeConfig main_rope(const DashParams& p) {
    return RopeConfig{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate, p.rope_page_mod};
}
__host__ __device__ __forceinline__ RopeConfig index_rope(const DashParams& p) {
    return RopeConfig{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.index_truncate, p.rope_page_mod};
}

__device__ __forceinline__ float rope_angle(int i, int dim, int tok, int page, const RopeConfig& c) {
    const int ntok = dim / 2 - c.pairs;
    if (i < ntok) {
        const float denom = c.truncate ? (float)dim / 2.0f : (float)ntok;
        const float inv = __fdiv_rn(1.0f, powf(c.tok_theta, __fdiv_rn((float)i, denom)));
        return __fmul_rn((float)tok, inv);
    }
    const int j = i - ntok;
    const float inv = __fdiv_rn(1.0f, powf(c.page_theta, __fdiv_rn((float)j, (float)c.pairs)));
    int pg = page;
    if (c.page_mod > 0) {
        pg = ((pg % c.page_mod) + c.page_mod) % c.page_mod;  // Python's % for negatives
    }
    return __fmul_rn((float)pg, inv);
}

// Rotates the pair (x[i], x[i + dim/2]) as the reference does in T precision:
//   out_lo = x_lo * cos - x_hi * sin,  out_hi = x_hi * cos + x_lo * sin, each op rounded to T;
// c and s are cos and sin of the angle already rounded to T (rope_cos_sin).
template <typename T>
__device__ __forceinline__ void rope_rotate(float x_lo, float x_hi, float c, float s, float& out_lo, float& out_hi) {
    out_lo = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x_lo, c)), round_to<T>(__fmul_rn(-x_hi, s))));
    out_hi = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x_hi, c)), round_to<T>(__fmul_rn(x_lo, s))));
}
template <typename T>
__device__ __forceinline__ float2 rope_cos_sin(float angle) {
    return make_float2(round_to<T>(cosf(angle)), round_to<T>(sinf(angle)));
}
template <typename T>
__device__ __forceinline__ void rope_pair(float x_lo, float x_hi, float angle, float& out_lo,
                                          float& out_hi) {
    const float2 cs = rope_cos_sin<T>(angle);
    rope_rotate<T>(x_lo, x_hi, cs.x, cs.y, out_lo, out_hi);
}

// Page RoPE of one token's rows by one warp (its queries [H][D], or its keys [Hkv][D]): q and dst
// (dst may be q itself), cs the token's D / 2 (cos, sin) pairs (Workspace::token_cs, or the write
// stage's). Lane l takes the pairs 8c .. 8c + 7, c = l % (D / 16), of heads l / (D / 16), +
// 32 / (D / 16), ...: one 16-byte load of a head's low half and one of its high half, kHeads
// heads' loads in flight; the per-element form where the rows are not 16-byte aligned, and for
// float32. 32 % (D / 16) == 0 (D = 64, 128, 256).
template <typename T, int kHeads = 4>
__device__ __forceinline__ void warp_rope_rows(const T* q, T* dst, const float2* cs, int num_heads, int dim, int lane) {
    const int half = dim / 2;
    if (sizeof(T) != 2 || ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(dst)) & 15) != 0 ||
        (dim & 15) != 0 || 32 % (dim / 16) != 0) {
        for (int idx = lane; idx < num_heads * half; idx += 32) {
            const int h = idx / half, i = idx % half;
            float lo, hi;
            rope_rotate<T>(to_f(q[h * dim + i]), to_f(q[h * dim + i + half]), cs[i].x, cs[i].y, lo, hi);
            dst[h * dim + i] = from_f<T>(lo);
            dst[h * dim + i + half] = from_f<T>(hi);
        }
        return;
    }
    if constexpr (sizeof(T) == 2) {  // 8 elements a 16-byte load
        // As packed pairs of T (two columns a register), each operation rounded once to T
        // (__h*2_rn: no contraction into an FMA): the same bits as rope_rotate, which rounds each
        // float32 product and sum to T, since float32's 24 bits are at least twice T's precision
        // plus two (bf16 8, fp16 11): rounding twice through float32 is then rounding once for +, -, x.
        using T2 = typename Dtype<T>::pair;
        const int cpr = dim / 16, step = 32 / cpr, col = (lane % cpr) * 8;
        T2 c2[4], s2[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 a = cs[col + 2 * j], b = cs[col + 2 * j + 1];
            c2[j] = Dtype<T>::pair_of(a.x, b.x);  // exact: token_cs holds values rounded to T
            s2[j] = Dtype<T>::pair_of(a.y, b.y);
        }
        for (int h0 = lane / cpr; h0 < num_heads; h0 += kHeads * step) {
            uint4 lo[kHeads], hi[kHeads];
#pragma unroll
            for (int u = 0; u < kHeads; ++u) {
                const int h = h0 + u * step;
                if (h < num_heads) {
                    lo[u] = *reinterpret_cast<const uint4*>(q + h * dim + col);
                    hi[u] = *reinterpret_cast<const uint4*>(q + h * dim + half + col);
                }
            }
#pragma unroll
            for (int u = 0; u < kHeads; ++u) {
                const int h = h0 + u * step;
                if (h >= num_heads) break;
                const T2* xl = reinterpret_cast<const T2*>(&lo[u]);
                const T2* xh = reinterpret_cast<const T2*>(&hi[u]);
                uint4 ol, oh;
                T2* yl = reinterpret_cast<T2*>(&ol);
                T2* yh = reinterpret_cast<T2*>(&oh);
#pragma unroll
                for (int j = 0; j < 4; ++j) {  // lo c - hi s, hi c + lo s
                    yl[j] = __hsub2_rn(__hmul2_rn(xl[j], c2[j]), __hmul2_rn(xh[j], s2[j]));
                    yh[j] = __hadd2_rn(__hmul2_rn(xh[j], c2[j]), __hmul2_rn(xl[j], s2[j]));
                }
                *reinterpret_cast<uint4*>(dst + h * dim + col) = ol;
                *reinterpret_cast<uint4*>(dst + h * dim + half + col) = oh;
            }
        }
    }
}

// torch.nan_to_num(x, 0, 0, 0)
__device__ __forceinline__ float finite_or_zero(float x) { return isfinite(x) ? x : 0.0f; }

// ------------------------------------------------------------------ reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ------------------------------------------------------------------ programmatic dependent launch
// sm_90 and later (no-ops before): a kernel launched with cudaLaunchAttributeProgrammaticStream-
// Serialization may start once every CTA of the kernel before it in the stream has called
// grid_launch_dependents (or exited); grid_dependency_wait then holds the calling thread until
// that kernel has completed and its writes are visible. A kernel so launched waits in every
// thread before its first read of the earlier kernel's output and before it exits, so that the
// kernels after it, launched normally, find the earlier kernel complete too.
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ------------------------------------------------------------------ indexing
// Flat cache slot of position `pos` of sequence `seq`, or -1 (and a data-error flag) when the
// block table does not map it inside the cache. In two halves for callers that issue the
// block-table read early and use it later: table_entry (the read; kNoEntry when pos is outside
// the table) and slot_of_entry (the checks).
constexpr int32_t kNoEntry = INT32_MIN;
__device__ __forceinline__ int32_t table_entry(const DashParams& p, int seq, int pos) {
    const int blk = pos / p.block_size;
    if (pos < 0 || blk >= p.table_width) return kNoEntry;
    return p.block_tables[(int64_t)seq * p.table_width + blk];
}
__device__ __forceinline__ int64_t slot_of_entry(const DashParams& p, int pos, int32_t phys, int32_t* err) {
    if (phys == kNoEntry) {
        atomicOr(err, DASH_DATA_BAD_LENGTHS);
        return -1;
    }
    if (phys < 0 || phys >= p.num_blocks) {
        atomicOr(err, DASH_DATA_BAD_BLOCK_TABLE);
        return -1;
    }
    return (int64_t)phys * p.block_size + pos % p.block_size;
}
__device__ __forceinline__ int64_t cache_slot(const DashParams& p, int seq, int pos, int32_t* err) {
    return slot_of_entry(p, pos, table_entry(p, seq, pos), err);
}

// The keys a token at position pos reads (docs/spec.md), `local` = sparse_local_block x sbs: its
// selected blocks' keys up to selected_last (before its local window, and before its prompt's
// end where it has one: prompt >= 0), and its local window [window_first, pos]. Every attention
// path (token-major, block-major, query-major) takes its key ranges from these two.
__device__ __forceinline__ int selected_last(int pos, int local, int prompt) {
    return min(pos - local, prompt >= 0 ? prompt - 1 : INT32_MAX);
}
__device__ __forceinline__ int window_first(int pos, int local) { return pos - local + 1; }

// Where the summary of sparse block `b` of a sequence lives: the KV block of its first token.
__device__ __forceinline__ int64_t summary_index(const DashParams& p, int seq, int b, int32_t* err) {
    const int64_t slot = cache_slot(p, seq, b * p.sparse_block_size, err);
    if (slot < 0) return -1;
    const int per = p.block_size / p.sparse_block_size;
    return (slot / p.block_size) * per + (slot % p.block_size) / p.sparse_block_size;
}

// ------------------------------------------------------------------ workspace layout
// Everything dash_run needs besides the caller's tensors, carved from one buffer.
struct Workspace {
    int32_t* error;       // [1] data-error mask
    int32_t* token_seq;   // [T] sequence of each new token (-1: bad metadata)
    int32_t* token_pos;   // [T] position of each new token
    int32_t* token_prompt;// [T] its sequence's prompt length (-1: none)
    int64_t* token_slot;  // [T] its cache slot (-1 with token_seq -1)
    float2* token_cs;     // [T, D / 2] cos / sin of its main RoPE angles (T precision; fp16 / bf16:
                          // the tensor-core attention, and the block-major prefill's query rotation)
    int32_t* selected;    // [T, kmax] selected sparse blocks, -1 padded
    float* bias;          // [T, kmax] their logit bias (the routing's centred log prior over sigma), 0 at -1
    float* iq_rot;        // [T, Di rounded up to 4] rotated, finite indexer queries (write stage;
                          // unused with Plan::fused_front)
    float* part_acc;      // [T, H, splits, D] unnormalised partial outputs (splits > 1)
    float2* part_ml;      // [T, H, splits] running max and sum of each split
    int32_t* route_count; // [T] split-routing CTAs finished per token (zeroed by dash_run)
    uint64_t* route_keys; // [T, route_cand] each CTA's best keys (split routing)
    // Block-major prefill (plan.block_major), per chunk of plan.bm_chunk tokens:
    int32_t* bm_tally;    // [bm_num_keys * kTallyStride] count_entry's counter of each physical sparse
                          // block, one a 128-byte line (kTallyStride)
    int32_t* bm_counts;   // [bm_num_keys] entries per physical sparse block (the tally, compacted)
    int32_t* bm_offsets;  // [bm_num_keys + 1] exclusive prefix of the counts
    int4* bm_entries;     // [bm_chunk * bm_slots] entries grouped by block: their records (entry_record)
    int32_t* bm_parts;    // [bm_num_keys] CTAs serving each block
    int32_t* bm_work;     // [bm_num_keys + 1] exclusive prefix of bm_parts
    int4* bm_items;       // [block_major_items(...)] each work item's block, first entry and count
    void* bm_qrot;        // [bm_chunk, H, D] rotated queries (T) of a pass, where q_rot is not set
    void* q_rot;          // [T, H, D] every token's rotated queries (T), written by the fused routing
                          // (Plan::rope_routed): the output buffer, which the tiles overwrite with
                          // each pass's outputs only after reading that pass's rows; else nullptr
    void* bm_part_o;      // [bm_chunk, bm_slots, H, D] normalised partial outputs (T)
    float2* bm_part_ml;   // [bm_chunk, bm_slots, H] max and sum where bm_rank says the entry is
                          // block-major (not cleared: other slots hold stale values); sum 0 = no key
    int2* bm_rank;        // [bm_chunk, bm_slots] per entry (count_entry writes each): the physical
                          // sparse block it reads block-major and its rank among that block's
                          // entries, or (-1, 0): not block-major
    void* bm_scan_temp;   // cub scan scratch
    // Query-major tiles of the block-major prefill (plan.qm_tile > 0), per pass:
    int32_t* qm_base;     // [qm_tiles] the tile's last token's own sparse block, -1: no tile here
    int32_t* qm_count;    // [qm_tiles] blocks the tile reads (at most kQmBlocks)
    int32_t* qm_list;     // [qm_tiles, kQmBlocks] those blocks, ascending
    uint32_t* qm_mask;    // [qm_tiles, kQmBlocks, kQmWords] bit i: the tile serves token i's selection of list block u
    float* qm_bias;       // [qm_tiles, kQmBlocks, qm_tile] the logit bias of that selection (where the bit is set)
    uint8_t* qm_sel;      // [bm_chunk, kmax] 1: the token's query-major tile serves its j-th selected block
};

// Ints between two blocks' counters in Workspace::bm_tally: a 128-byte line each. The counts'
// atomics (count_entry) wait on their return; with the counters packed, a pass's atomics met on a
// few lines (a 16k prompt's 256 blocks: 8 lines) and qm_prep_kernel spent two thirds of its stall
// samples on them (Nsight Compute, H200, 2026-12-04).
constexpr int kTallyStride = 32;

// Query-major tiles (block_attend.cu): a tile is 128 / G consecutive tokens of one sequence,
// 128 query rows of a KV head; it reads up to kQmBlocks blocks: those enough of its tokens
// select, anywhere before it, and those its local windows reach.
constexpr int kQmRows = 128;
constexpr int kWgBlockMajor = 1, kWgQueryMajor = 2;  // Plan::warpgroup bits
constexpr int kQmBlocks = 128;
// qm_prep_kernel counts a tile's selectors of every sparse block of the sequence in a byte of
// shared memory each: query-major tiles need plan.max_blocks at most this.
constexpr int kQmMaxBlocks = DASH_QUERY_MAJOR_MAX_BLOCKS;
constexpr int kQmWords = kQmRows / 32;  // mask words per (tile, block): up to 128 tokens a tile

constexpr int kMaxIndexDimDevice = 512;

// Fused routing: keys a token of the tile holds in shared memory, a chunk of route_chunk blocks'
// and, where the blocks take more than one chunk, room for its running best of route_m appended
// (route.cu's merge_chunk). The plan sizes the shared memory by it, the kernel lays it out.
__host__ __device__ constexpr int route_key_stride(int chunk, int max_blocks, int best) {
    return chunk + (chunk < max_blocks ? best : 0);
}

struct Plan {
    int kmax;             // selected row width: min(topk, DASH_ROUTE_TOP_M, max_blocks)
    int route_m;          // blocks ranked before the entmax prior: min(DASH_ROUTE_TOP_M, max_blocks)
    float route_factor;   // x = score * route_factor: route_scale / sqrt(index_dim), rounded once to float
    int max_blocks;       // sparse blocks a sequence can have: W * block_size / sbs
    int pieces;           // key pieces per token: kmax remote blocks + local window blocks
    int splits;           // split-K factor of the attention stage
    int pieces_per_split;
    int route_split;      // 1: split routing (route_split_kernel), else fused tiles (route_tile_kernel)
    int route_splits;     // split routing: CTAs scoring one token's blocks (1 with fused tiles)
    int route_cand;       // candidates per token (split routing): CTAs * min(route_m, blocks per CTA)
    int route_tile;       // tokens per fused routing CTA
    int route_chunk;      // fused routing: blocks scored between two merges into the running top-k
    int fused_front;      // 1: decode-only call; no write / summary launches: the routing launch's
                          // writer CTAs and the attention's local-window CTAs do that work
    int front_writer_cta; // fused_front: 1 = an extra CTA (y = 0) per token writes, 0 = routing CTA 0
    int block_major;      // 1: prefill attention by block (block_attend.cu)
    int rope_routed;      // 1: route_tile_kernel also rotates its tokens' queries (block-major with the
                          // fused routing; Workspace::q_rot), else rope_q_kernel does, a pass at a time
    int bm_chunk;         // tokens per block-major pass
    int bm_slots;         // partial slots per (token, head): kmax + sparse_local_block + 1
    int bm_num_keys;      // physical sparse blocks: NB * block_size / sbs
    int qm_tile;          // tokens per query-major tile (kQmRows / G), 0: no query-major tiles
    int qm_min;           // a tile reads a block query-major when this many of its tokens read it
    int qm_tiles;         // tiles per pass: ceil(bm_chunk / qm_tile)
    size_t qm_smem;       // dynamic shared memory of the query-major kernel
    int qm_merge;         // 1: query-major tiles merge their tokens' block-major partials (no combine for them)
    int warpgroup;        // which tiles run as warpgroup MMAs (sm_90a; warpgroup_tiles): kWgBlockMajor | kWgQueryMajor
    int bm_warpgroups;    // warpgroup block-major tiles: warpgroups per CTA (1 or 2; block_major_warpgroups)
    int bm_ctas;          // block-major CTAs per KV head (tune_block_major_ctas; 0: one a work item)
    int qm_overlap;       // 1: qm_attend_kernel is a programmatic dependent launch behind block_attend_kernel
    size_t bm_scan_bytes;
    size_t route_smem;    // dynamic shared memory of the routing kernel
    size_t summarize_smem;
    int attend_stages;    // pipeline stages per warp of the tensor-core attention (2 or 3)
    size_t attend_smem;
    size_t bytes;         // workspace size (lay_out in dash_capi.cu places every buffer)
};

// ------------------------------------------------------------------ phase trace (bench only)
// Built with -DDASH_TRACE=ON (CMake), the routing and attention kernels record, per CTA, the
// global timer and the SM clock at fixed points (DASH_MARK), for bench/trace_step.py; the plain
// build compiles the marks away. kTraceSlots points per CTA, the clocks in slots + kTraceSlots.
constexpr int kTraceCtas = 4096;
constexpr int kTraceSlots = 8;
#ifdef DASH_TRACE
#define DASH_MARK(table, slot)                                                              \
    do {                                                                                    \
        if (threadIdx.x == 0) {                                                             \
            unsigned long long ns_;                                                         \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns_));                         \
            const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \
            if (cta_ < (unsigned)kTraceCtas) {                                              \
                table[cta_][slot] = ns_;                                                    \
                table[cta_][(slot) + kTraceSlots] = (unsigned long long)clock64();          \
            }                                                                               \
        }                                                                                   \
    } while (0)
#else
#define DASH_MARK(table, slot) \
    do {                       \
    } while (0)
#endif
using TraceTable = unsigned long long[kTraceCtas][2 * kTraceSlots];
#ifdef DASH_TRACE
// Copies one kernel's table (a __device__ TraceTable of the calling file) to the host and
// clears it, so the next read holds one launch's marks.
inline cudaError_t read_and_clear_trace(const TraceTable& table, unsigned long long* host) {
    cudaError_t err = cudaMemcpyFromSymbol(host, table, sizeof(TraceTable));
    void* at = nullptr;
    if (err == cudaSuccess) err = cudaGetSymbolAddress(&at, table);
    return err == cudaSuccess ? cudaMemset(at, 0, sizeof(TraceTable)) : err;
}
// Copy the last routing / attention launch's trace into host (a TraceTable's worth) and clear it.
cudaError_t read_route_trace(unsigned long long* host);
cudaError_t read_attend_trace(unsigned long long* host);
#endif

// ------------------------------------------------------------------ launch helpers
// Lets `kernel` use `bytes` of dynamic shared memory (an opt-in above 48 KB).
template <typename K>
cudaError_t allow_smem(K kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

// ------------------------------------------------------------------ stage launchers
cudaError_t launch_write(const DashParams& p, const Workspace& ws, cudaStream_t stream);
cudaError_t launch_summarize(const DashParams& p, const Plan& plan, const Workspace& ws,
                             cudaStream_t stream);
cudaError_t launch_route(const DashParams& p, const Plan& plan, const Workspace& ws,
                         cudaStream_t stream);
cudaError_t launch_attend(const DashParams& p, const Plan& plan, const Workspace& ws,
                          cudaStream_t stream);
int route_split_threads();  // split routing CTA
int route_split_ctas_per_sm();
int route_split_rows();     // blocks one split routing CTA scores
int route_max_tile();
size_t route_tile_stage_bytes();   // dynamic shared memory of a fused routing CTA's staged rows
size_t route_split_stage_bytes();  // and of a split routing CTA's (before its candidates)
bool block_major_supported(const DashParams& p, size_t smem_limit);  // limit: the device's opt-in bytes
bool qm_merge_fits(const DashParams& p, int bm_slots, int bm_chunk);  // a query-major tile merges its rows' partials itself
// 0 where the query-major tiles are not compiled (head dim); wg: their warpgroup form
size_t query_major_smem(const DashParams& p, bool wg);
size_t block_major_scan_bytes(int num_items);
int64_t block_major_items(int64_t entries, int num_keys);  // work items of a pass, at most
cudaError_t launch_block_major(const DashParams& p, const Plan& plan, const Workspace& ws, int t0, int tn,
                               cudaStream_t stream);
size_t attend_smem_bytes(int dtype_bytes, int group, int head_dim, int stages);
int attend_max_group();

}  // namespace dash

// ------------------------------------------------------------------ dispatch
// The one place dtype and head dim are dispatched (FlashAttention's static_switch pattern).
#define DASH_DISPATCH_DTYPE(DTYPE, T, ...)        \
    [&]() -> cudaError_t {                        \
        switch (DTYPE) {                          \
            case DASH_FLOAT32: {                  \
                using T = float;                  \
                return __VA_ARGS__();             \
            }                                     \
            case DASH_FLOAT16: {                  \
                using T = __half;                 \
                return __VA_ARGS__();             \
            }                                     \
            case DASH_BFLOAT16: {                 \
                using T = __nv_bfloat16;          \
                return __VA_ARGS__();             \
            }                                     \
            default:                              \
                return cudaErrorInvalidValue;     \
        }                                         \
    }()

// Head dims the attention stage is compiled for. Keep DASH_HEAD_DIMS and the switch in step.
#define DASH_HEAD_DIMS {64, 128, 256}
#define DASH_DISPATCH_HEAD_DIM(DIM, D, ...)       \
    [&]() -> cudaError_t {                        \
        switch (DIM) {                            \
            case 64: {                            \
                constexpr int D = 64;             \
                return __VA_ARGS__();             \
            }                                     \
            case 128: {                           \
                constexpr int D = 128;            \
                return __VA_ARGS__();             \
            }                                     \
            case 256: {                           \
                constexpr int D = 256;            \
                return __VA_ARGS__();             \
            }                                     \
            default:                              \
                return cudaErrorInvalidValue;     \
        }                                         \
    }()
