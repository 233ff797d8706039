// The C ABI: validation, the launch plan (workspace, split-K) and dash_run over the stages.
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "../kernels/common.cuh"
#include "dash/dash.h"

namespace {

// The routing rule the kernels implement (route.cu): Unlimited-OCR-2's, the reference's
// (dash_routing_rule; the Python binding loads no library that reports another).
constexpr int32_t kKernelRouting = DASH_ROUTING_UNLIMITED_OCR2;

thread_local std::string g_last_error;

DashStatus fail(DashStatus status, const std::string& message) {
    g_last_error = message;
    return status;
}

constexpr int kSupportedHeadDims[] = DASH_HEAD_DIMS;
constexpr int kMaxIndexDim = dash::kMaxIndexDimDevice;
constexpr size_t kAlign = 256;
constexpr size_t kMaxSmem = 200 * 1024;  // below the 227 KB opt-in limit of sm_90 / sm_80
constexpr long kTargetCtas = 256;        // split-K aims for this many attention CTAs (swept on the H200)
constexpr size_t kStaticSmemAllowance = 8 * 1024;  // static shared memory beside a kernel's dynamic part
constexpr int kFusedRouteTokens = 264;   // from this many tokens on, fused routing (about 2 CTAs per SM)
constexpr int kBlockMajorMinTokens = 1024;  // prefill attention goes block-major from here (if supported)
constexpr int kBlockMajorChunk = 16384;     // tokens per block-major pass (bounds the partials; H200 sweep at b94d373)
constexpr double kBmTwoWgRows = 1024;       // expected rows per block from which a block-major CTA is two warpgroups

// The tuning fields of DashParams (params.h), 0 meaning the default above. No getenv: every
// knob is a parameter the caller passes, so a plan depends on its params alone.
int block_major_min_tokens(const DashParams& p) {
    const int v = p.tune_block_major_min_tokens;
    return v == 0 ? kBlockMajorMinTokens : v < 0 ? INT32_MAX : v;
}

int block_major_chunk(const DashParams& p) {
    return p.tune_block_major_chunk > 0 ? p.tune_block_major_chunk : kBlockMajorChunk;
}

bool fused_front_allowed(const DashParams& p) { return p.tune_fused_front >= 0; }

long attend_target_ctas(const DashParams& p) { return p.tune_attend_ctas > 0 ? p.tune_attend_ctas : kTargetCtas; }

// An attribute of the current device, or `fallback` where it cannot be asked (no device) or is
// not positive; the (non-sticky) error of a failed query is cleared for the caller's next check.
int device_attribute(cudaDeviceAttr attr, int fallback) {
    int dev = 0, value = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess ||
        value <= 0) {
        (void)cudaGetLastError();
        return fallback;
    }
    return value;
}

// Shared memory a block may opt in to on the current device (sm_90: 227 KB, sm_80: 163 KB,
// sm_86 / sm_89: 99 KB). Where it cannot be asked (no device), the sm_90 figure: nothing runs
// there, and a plan must not turn a path off on a query failure alone.
size_t device_smem_optin() { return (size_t)device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 * 1024); }

// Streaming multiprocessors of the current device (132 where it cannot be asked: an H200).
int device_sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount, 132); }

// Compute capability major of the current device (9 where it cannot be asked: nothing runs there).
int device_cc_major() { return device_attribute(cudaDevAttrComputeCapabilityMajor, 9); }

// Which prefill tiles run as warpgroup MMAs (wgmma.cuh; dash::Plan::warpgroup bits): where the
// library carries sm_90a code (DASH_SM90A: CMake architecture 90a), the current device is an
// sm_90 GPU (which runs that code) and the head dim is 128, tune_warpgroup_mma picks: 1 the
// block-major tiles only, 2 the query-major ones only, < 0 neither, any other value (0, the
// default) both. The one place the kernels choose by architecture; everywhere else (sm_80,
// sm_89, sm_90 without the 90a build, newer GPUs through PTX) the mma.sync tiles run.
int warpgroup_tiles(const DashParams& p) {
#if DASH_SM90A
    const int t = p.tune_warpgroup_mma;
    if (t < 0 || p.head_dim != 128) return 0;
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;  // no device: nothing runs
    }
    if (major != 9 || minor != 0) return 0;
    return t == 1 ? dash::kWgBlockMajor : t == 2 ? dash::kWgQueryMajor : dash::kWgBlockMajor | dash::kWgQueryMajor;
#else
    (void)p;
    return 0;
#endif
}

// Warpgroups per block-major CTA where its tiles are warpgroup MMAs (tune_block_major_warpgroups
// 1 or 2; 0: by the rows a block can expect per pass). Two warpgroups share one block's keys and
// values (16 warps an SM in 2 CTAs); one warpgroup holds half the shared memory (12 warps in 3
// CTAs). Where a pass spreads few rows over many blocks (a 2048-token chunk late in a long
// context) the second warpgroup idles: on the H200, 31 decode tokens + a 2048-token chunk at
// 128k took 17% longer with two, at 32k 10%; a 64k and a 128k prompt ran as fast with one, a
// 16k prompt 1-2% slower (docs/performance.md). The expectation, chunk tokens x kmax x G rows
// over a full-length sequence's blocks, is the rows per block if every block were read alike;
// where the block table is wider than the sequences it underestimates, which picks one.
int block_major_warpgroups(const DashParams& p, const dash::Plan& plan) {
    if (p.tune_block_major_warpgroups == 1 || p.tune_block_major_warpgroups == 2) return p.tune_block_major_warpgroups;
    const double rows = (double)plan.bm_chunk * plan.kmax * (p.num_heads / p.num_kv_heads) / plan.max_blocks;
    return rows >= kBmTwoWgRows ? 2 : 1;
}

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

bool supported_head_dim(int d) {
    for (int s : kSupportedHeadDims)
        if (s == d) return true;
    return false;
}

size_t lay_out(const DashParams& p, const dash::Plan& plan, char* base, dash::Workspace* ws);

DashStatus make_plan(const DashParams& p, dash::Plan& plan) {
    std::memset(&plan, 0, sizeof(plan));
    plan.max_blocks = (int)((long)p.table_width * p.block_size / p.sparse_block_size);
    plan.kmax = std::min({p.topk, (int32_t)DASH_ROUTE_TOP_M, (int32_t)plan.max_blocks});
    if (plan.kmax < 1) plan.kmax = 1;  // keep rows non-empty; -1 padded
    plan.route_m = std::max(1, std::min((int)DASH_ROUTE_TOP_M, plan.max_blocks));
    // The reference multiplies the float32 scores by the Python float scale / sqrt(Di), which
    // torch rounds to float32 once.
    plan.route_factor = (float)((double)p.route_scale / std::sqrt((double)p.index_dim));
    plan.pieces = plan.kmax + p.sparse_local_block;
    const long units = (long)p.num_tokens * p.num_kv_heads;
    const long target = attend_target_ctas(p);
    long splits = units >= target || units == 0 ? 1 : (target + units - 1) / units;
    if (splits > plan.pieces) splits = plan.pieces;
    plan.pieces_per_split = (int)((plan.pieces + splits - 1) / splits);
    plan.splits = (plan.pieces + plan.pieces_per_split - 1) / plan.pieces_per_split;
    const int route_warps = dash::route_split_threads() / 32;
    const size_t rank_slots = (size_t)plan.route_m;  // the keys routing ranks (the top M)
    // Split routing: route_split_rows() blocks per CTA, each CTA keeps its best
    // min(route_m, route_split_rows()) keys as candidates.
    const int per_cta = dash::route_split_rows();
    const int split_ctas = std::max(1, (plan.max_blocks + per_cta - 1) / per_cta);
    plan.route_cand = split_ctas * (int)std::min<size_t>(rank_slots, (size_t)per_cta);
    // Few tokens (decode) take the split routing when a token has more blocks than one CTA
    // scores, and always on decode-only calls of the tensor-core path: the write and summary
    // stages then ride in the routing launch's writer CTAs and the attention launch, since no
    // token can route over a block completed in the same call (Plan::fused_front).
    // (Not with the block-major attention, which writes no K and V: reachable only when
    // tune_block_major_min_tokens is below kFusedRouteTokens.)
    const size_t smem_limit = device_smem_optin();
    plan.block_major =
        p.num_tokens >= block_major_min_tokens(p) && dash::block_major_supported(p, smem_limit) ? 1 : 0;
    const bool few_tokens = p.num_tokens < kFusedRouteTokens;
    plan.fused_front = few_tokens && !plan.block_major && p.max_new_tokens == 1 && p.dtype != DASH_FLOAT32 &&
                               fused_front_allowed(p) ? 1 : 0;
    plan.route_split = few_tokens && (split_ctas > 1 || plan.fused_front) ? 1 : 0;
    plan.route_splits = plan.route_split ? split_ctas : 1;
    // The writer gets a CTA of its own where the routing grid still runs in one wave with it
    // (tune_front_writer 1 / 2 forces one placement: tests and the benchmark's A/B).
    const bool one_wave = (long)p.num_tokens * (plan.route_splits + 1) <=
                          (long)dash::route_split_ctas_per_sm() * device_sm_count();
    const bool own_cta = p.tune_front_writer == 1 ? true : p.tune_front_writer == 2 ? false : one_wave;
    plan.front_writer_cta = plan.fused_front && own_cta ? 1 : 0;
    // Fused: the blocks are scored route_chunk at a time (512, never past the table), each chunk
    // merged into the tokens' running top M. Shared memory: the
    // indexer queries of route_max_tile() tokens, then per token of the tile a chunk's keys
    // (route_key_stride: with room for its running best appended) and its running best.
    const size_t max_blocks32 = ((size_t)plan.max_blocks + 31) / 32 * 32;
    plan.route_chunk = (int)std::max<size_t>(32, std::min(max_blocks32, std::max<size_t>(512, (4 * rank_slots + 31) / 32 * 32)));
    const size_t tile_iq = sizeof(float) * (size_t)((p.index_dim + 3) / 4 * 4) * dash::route_max_tile();
    const size_t per_token = sizeof(uint64_t) * ((size_t)dash::route_key_stride(plan.route_chunk, plan.max_blocks,
                                                                                (int)rank_slots) + rank_slots);
    // Tokens per fused routing CTA: up to route_max_tile() while kFusedRouteTokens CTAs remain.
    const size_t want_tile =
        std::max<size_t>(1, std::min<size_t>(dash::route_max_tile(), (size_t)p.num_tokens / kFusedRouteTokens));
    const size_t tile_fixed = tile_iq + dash::route_tile_stage_bytes();  // queries and staged rows
    plan.route_tile = (int)std::min<size_t>(want_tile, (kMaxSmem - tile_fixed) / per_token);
    // Split: the last CTA of a token holds every candidate, then the best k (or select_topk's
    // per-warp lists and their merge).
    const size_t split_smem = dash::route_split_stage_bytes() +
                              sizeof(uint64_t) * ((size_t)plan.route_cand + (route_warps + 1) * rank_slots);
    plan.route_smem = plan.route_split ? split_smem : tile_fixed + per_token * (size_t)plan.route_tile;
    plan.summarize_smem = sizeof(int64_t) * (size_t)p.sparse_block_size +                 // slots
                          sizeof(float) * (size_t)p.sparse_block_size * (p.index_dim + 2) +  // keys, logits
                          sizeof(float) * (size_t)p.index_dim +                              // head_cls
                          sizeof(int) * (size_t)p.sparse_block_size +                        // pages
                          sizeof(unsigned) * (size_t)((p.sparse_block_size + 31) / 32);      // page bitmap
    const int dtype_bytes = p.dtype == DASH_FLOAT32 ? 4 : 2;
    // Three stages where they fit the device's opt-in shared memory (less what the kernel
    // declares statically), else two.
    plan.attend_stages = 3;
    plan.attend_smem = dash::attend_smem_bytes(dtype_bytes, p.num_heads / p.num_kv_heads, p.head_dim, 3);
    if (plan.attend_smem + kStaticSmemAllowance > smem_limit) {
        plan.attend_stages = 2;
        plan.attend_smem = dash::attend_smem_bytes(dtype_bytes, p.num_heads / p.num_kv_heads, p.head_dim, 2);
    }
    // Both routing shapes must fit, whatever T is: the same context works for prefill and decode.
    if (plan.route_tile < 1)
        return fail(DASH_ERR_UNSUPPORTED, "index dim " + std::to_string(p.index_dim) +
                                              " too large for the routing stage's shared memory");
    const size_t split_keys = (kMaxSmem - dash::route_split_stage_bytes()) / 8;  // beside the staged rows
    if (split_smem > kMaxSmem)  // the split routing's candidates: min(topk, per_cta) per CTA of per_cta blocks
        return fail(DASH_ERR_UNSUPPORTED,
                    "context too long for the routing stage: " + std::to_string(plan.max_blocks) +
                        " sparse blocks per sequence (table_width * block_size / sparse_block_size); at most " +
                        std::to_string((split_keys - std::min(split_keys, (route_warps + 1) * rank_slots)) /
                                       std::min<size_t>(rank_slots, per_cta) * per_cta));
    if (plan.summarize_smem > kMaxSmem)
        return fail(DASH_ERR_UNSUPPORTED, "sparse_block_size * index_dim too large for the summary stage");
    if (plan.fused_front) plan.route_smem = std::max(plan.route_smem, plan.summarize_smem);  // writer CTAs
    if (plan.block_major) {
        plan.bm_chunk = (int)std::min(p.num_tokens, block_major_chunk(p));
        // The fused routing rotates its tokens' queries into the output buffer, hiding the
        // rotation's memory traffic behind the scoring (the split routing leaves it to a kernel a pass).
        plan.rope_routed = plan.route_split ? 0 : 1;
        plan.bm_slots = plan.kmax + p.sparse_local_block + 1;  // selected + blocks the local window touches
        plan.bm_num_keys = p.num_blocks * (p.block_size / p.sparse_block_size);
        plan.bm_scan_bytes = dash::block_major_scan_bytes(plan.bm_num_keys);
        plan.bm_ctas = p.tune_block_major_ctas;  // 0: one CTA a work item (launch_block_attend)
        plan.warpgroup = warpgroup_tiles(p);
        if (plan.warpgroup & dash::kWgBlockMajor) plan.bm_warpgroups = block_major_warpgroups(p, plan);
        // Query-major tiles where their kernel is compiled for the head dim and fits the device.
        const size_t qm_smem = dash::query_major_smem(p, (plan.warpgroup & dash::kWgQueryMajor) != 0);
        const int group = p.num_heads / p.num_kv_heads;
        if (p.tune_tile_share_min >= 0 && qm_smem > 0 && qm_smem + kStaticSmemAllowance <= smem_limit &&
            dash::kQmRows % group == 0 && plan.max_blocks <= dash::kQmMaxBlocks) {
            plan.qm_tile = dash::kQmRows / group;
            // 5/8 of the tile: a tile pays for all its rows on every block it reads, so a block few of
            // them select is cheaper block-major (H200, 64k, G 4, page-correlated indexer: 9.73 ms of
            // kernels at 20 of 32 tokens, 10.00 at 12, 12.59 at 4; independent queries the same).
            plan.qm_min = p.tune_tile_share_min > 0 ? p.tune_tile_share_min : std::max(1, plan.qm_tile * 5 / 8);
            plan.qm_tiles = (plan.bm_chunk + plan.qm_tile - 1) / plan.qm_tile;
            plan.qm_smem = qm_smem;
            plan.qm_merge = dash::qm_merge_fits(p, plan.bm_slots, plan.bm_chunk) ? 1 : 0;
            plan.qm_overlap = p.tune_tile_overlap >= 0 && device_cc_major() >= 9 ? 1 : 0;
        }
    }
    plan.bytes = lay_out(p, plan, nullptr, nullptr);
    return DASH_OK;
}

// The workspace layout, in one place: with base == nullptr it only measures (the size
// query), else it also points each of ws's buffers into base (the carve). Every buffer
// starts on a 256-byte boundary. Returns the bytes used.
size_t lay_out(const DashParams& p, const dash::Plan& plan, char* base, dash::Workspace* ws) {
    size_t off = 0;
    auto take = [&](auto*& dst, size_t bytes) {
        using T = std::remove_reference_t<decltype(*dst)>;
        if (base != nullptr) dst = reinterpret_cast<T*>(base + off);
        off += align_up(bytes);
    };
    dash::Workspace scratch{};
    dash::Workspace& w = ws != nullptr ? *ws : scratch;
    const size_t t = (size_t)p.num_tokens;
    // Header, zeroed by dash_run: the error word, then (split routing) a counter per token.
    take(w.error, sizeof(int32_t) + (plan.route_split ? t * sizeof(int32_t) : 0));
    if (plan.route_split && base != nullptr) w.route_count = reinterpret_cast<int32_t*>(base + sizeof(int32_t));
    take(w.token_seq, t * sizeof(int32_t));
    take(w.token_pos, t * sizeof(int32_t));
    take(w.token_prompt, t * sizeof(int32_t));
    take(w.token_slot, t * sizeof(int64_t));
    if (p.dtype != DASH_FLOAT32)  // the tensor-core attention's angles, or the block-major prefill's
        take(w.token_cs, t * sizeof(float2) * (size_t)(p.head_dim / 2));
    take(w.selected, t * plan.kmax * sizeof(int32_t));
    take(w.bias, t * plan.kmax * sizeof(float));
    take(w.iq_rot, t * sizeof(float) * (size_t)((p.index_dim + 3) / 4 * 4));
    if (plan.splits > 1) {
        const size_t rows = t * p.num_heads * plan.splits;
        take(w.part_acc, rows * p.head_dim * sizeof(float));
        take(w.part_ml, rows * sizeof(float2));
    }
    if (plan.route_split) take(w.route_keys, t * plan.route_cand * sizeof(uint64_t));
    if (plan.block_major) {
        const size_t chunk = (size_t)plan.bm_chunk;
        const size_t elt = 2;  // fp16 / bf16: the block-major path's only dtypes
        char* bytes = nullptr;
        take(w.bm_tally, sizeof(int32_t) * dash::kTallyStride * plan.bm_num_keys);
        take(w.bm_counts, sizeof(int32_t) * plan.bm_num_keys);
        take(w.bm_offsets, sizeof(int32_t) * (plan.bm_num_keys + 1));
        take(w.bm_entries, sizeof(int4) * chunk * plan.bm_slots);
        take(bytes, elt * chunk * p.num_heads * p.head_dim);
        w.bm_qrot = bytes;
        take(bytes, elt * chunk * p.num_heads * plan.bm_slots * p.head_dim);
        w.bm_part_o = bytes;
        take(w.bm_part_ml, sizeof(float2) * chunk * p.num_heads * plan.bm_slots);
        take(w.bm_rank, sizeof(int2) * chunk * plan.bm_slots);
        take(bytes, plan.bm_scan_bytes);
        w.bm_scan_temp = bytes;
        take(w.bm_parts, sizeof(int32_t) * plan.bm_num_keys);
        take(w.bm_work, sizeof(int32_t) * (plan.bm_num_keys + 1));
        take(w.bm_items, 16 * (size_t)dash::block_major_items((int64_t)chunk * plan.bm_slots, plan.bm_num_keys));
        if (plan.qm_tile > 0) {
            const size_t words = (size_t)plan.qm_tiles * dash::kQmBlocks * dash::kQmWords;
            take(w.qm_base, sizeof(int32_t) * plan.qm_tiles);
            take(w.qm_count, sizeof(int32_t) * plan.qm_tiles);
            take(w.qm_list, sizeof(int32_t) * plan.qm_tiles * dash::kQmBlocks);
            take(w.qm_mask, sizeof(uint32_t) * words);
            take(w.qm_bias, sizeof(float) * plan.qm_tiles * dash::kQmBlocks * plan.qm_tile);
            take(w.qm_sel, chunk * plan.kmax);
        }
    }
    return off;
}

// What a DashPlan holds: the plan and the params it was made for (pointers cleared), so a run
// can check that its params have the same sizes, configuration and tuning.
struct PlanRecord {
    uint32_t magic;
    DashParams params;
    dash::Plan plan;
};
constexpr uint32_t kPlanMagic = 0x44415348u;  // "DASH"
static_assert(sizeof(PlanRecord) <= sizeof(DashPlan), "DashPlan too small for the plan record");

// The fields a plan depends on: every SIZE, CONFIG and TUNE field of dash/params.def.
#define DASH_PLAN_KEY_SIZE 1
#define DASH_PLAN_KEY_CONFIG 1
#define DASH_PLAN_KEY_TUNE 1
#define DASH_PLAN_KEY_INPUT 0
#define DASH_PLAN_KEY_CACHE 0
#define DASH_PLAN_KEY_OUTPUT 0
#define DASH_PLAN_KEY_SCRATCH 0
#define DASH_PLAN_KEY_DEBUG 0
DashParams plan_key(const DashParams& p) {
    DashParams k{};
#define DASH_PARAM(type, name, group, doc) \
    if (DASH_PLAN_KEY_##group) std::memcpy(&k.name, &p.name, sizeof(k.name));
#include "dash/params.def"
#undef DASH_PARAM
    return k;
}

// The type code of a field for dash_params_field: the C type's kind and size.
template <typename T>
constexpr int32_t field_type_code() {
    return std::is_pointer<T>::value          ? DASH_FIELD_POINTER
           : std::is_floating_point<T>::value ? DASH_FIELD_FLOAT32
           : sizeof(T) == 8                   ? DASH_FIELD_UINT64
                                              : DASH_FIELD_INT32;
}

struct FieldRow {
    const char* name;
    int32_t type;
    int64_t offset;
    int32_t group;
};

const FieldRow kFieldRows[] = {
#define DASH_PARAM(type, name, group, doc) \
    {#name, field_type_code<type>(), (int64_t)offsetof(DashParams, name), DASH_GROUP_##group},
#include "dash/params.def"
#undef DASH_PARAM
};
constexpr int32_t kNbFieldRows = (int32_t)(sizeof(kFieldRows) / sizeof(kFieldRows[0]));

bool same_key(const DashParams& a, const DashParams& b) {
    const DashParams ka = plan_key(a), kb = plan_key(b);
    return std::memcmp(&ka, &kb, sizeof(DashParams)) == 0;
}

// Every tensor a call with tokens reads or writes must be there (selected_out is optional).
DashStatus check_pointers(const DashParams& p) {
    if (p.num_tokens == 0) return DASH_OK;
    const void* needed[] = {p.q, p.k, p.v, p.iq, p.ik, p.coords, p.head_cls, p.block_tables,
                            p.seq_lens, p.query_start_loc, p.prompt_lens, p.key_cache, p.value_cache,
                            p.index_key_cache, p.image_page_cache, p.summary_cache, p.summary_pages_cache, p.out};
    for (const void* ptr : needed)
        if (ptr == nullptr) return fail(DASH_ERR_INVALID_ARGUMENT, "a tensor pointer is NULL");
    return DASH_OK;
}

DashStatus launch(const DashParams& p, const dash::Plan& plan, void* stream_ptr) {
    if (p.num_tokens == 0) return DASH_OK;  // nothing is computed, so no rule is applied
    if (p.workspace == nullptr || p.workspace_size < plan.bytes)
        return fail(DASH_ERR_WORKSPACE, "workspace of " + std::to_string(p.workspace_size) + " bytes, need " +
                                            std::to_string(plan.bytes));
    if (reinterpret_cast<uintptr_t>(p.workspace) % kAlign != 0)
        return fail(DASH_ERR_WORKSPACE, "workspace must be 256-byte aligned");
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    dash::Workspace ws{};
    lay_out(p, plan, static_cast<char*>(p.workspace), &ws);
    // Every token's rotated queries go to the output buffer, which the block-major passes read
    // before they write a token's output (q itself works: a token's rotation reads its row before
    // writing it; an output that partly overlaps the queries takes the rotation a pass at a time).
    const size_t q_bytes = (size_t)p.num_tokens * p.num_heads * p.head_dim * 2;  // fp16 / bf16 (block-major)
    const char *q0 = static_cast<const char*>(p.q), *o0 = static_cast<const char*>(p.out);
    if (plan.rope_routed && (o0 == q0 || o0 + q_bytes <= q0 || q0 + q_bytes <= o0)) ws.q_rot = p.out;
    // The data-error word describes this run only; the routing counters start at 0.
    const size_t header = align_up(sizeof(int32_t) + (plan.route_split ? (size_t)p.num_tokens * sizeof(int32_t) : 0));
    cudaError_t err = cudaMemsetAsync(ws.error, 0, header, stream);
    if (err == cudaSuccess && !plan.fused_front) err = dash::launch_write(p, ws, stream);
    if (err == cudaSuccess && !plan.fused_front) err = dash::launch_summarize(p, plan, ws, stream);
    if (err == cudaSuccess) err = dash::launch_route(p, plan, ws, stream);
    if (err == cudaSuccess && !plan.block_major) err = dash::launch_attend(p, plan, ws, stream);
    for (int t0 = 0; plan.block_major && err == cudaSuccess && t0 < p.num_tokens; t0 += plan.bm_chunk)
        err = dash::launch_block_major(p, plan, ws, t0, std::min(plan.bm_chunk, p.num_tokens - t0), stream);
    if (err != cudaSuccess) return fail(DASH_ERR_CUDA, std::string("CUDA launch failed: ") + cudaGetErrorString(err));
    return DASH_OK;
}

}  // namespace

extern "C" {

int32_t dash_abi_version(void) { return DASH_ABI_VERSION; }

int32_t dash_routing_rule(void) { return kKernelRouting; }

#ifndef DASH_CUDA_ARCHITECTURES
#define DASH_CUDA_ARCHITECTURES "unknown"
#endif
const char* dash_cuda_architectures(void) { return DASH_CUDA_ARCHITECTURES; }

size_t dash_params_size(void) { return sizeof(DashParams); }

int64_t dash_params_offset(const char* field) {
    if (field == nullptr) return -1;
    for (const FieldRow& r : kFieldRows)
        if (std::strcmp(field, r.name) == 0) return r.offset;
    return -1;
}

int32_t dash_params_field(int32_t index, const char** name, int32_t* type, int64_t* offset, int32_t* group) {
    if (index < 0 || index >= kNbFieldRows) return kNbFieldRows;
    if (name != nullptr) *name = kFieldRows[index].name;
    if (type != nullptr) *type = kFieldRows[index].type;
    if (offset != nullptr) *offset = kFieldRows[index].offset;
    if (group != nullptr) *group = kFieldRows[index].group;
    return kNbFieldRows;
}

int32_t dash_supported_head_dims(int32_t* dims, int32_t cap) {
    int32_t n = 0;
    for (int d : kSupportedHeadDims) {
        if (dims != nullptr && n < cap) dims[n] = d;
        ++n;
    }
    return n;
}

// Sizes, configuration and tuning (what a plan depends on); no pointer is looked at.
static DashStatus validate_sizes(const DashParams* p) {
    if (p == nullptr) return fail(DASH_ERR_INVALID_ARGUMENT, "params is NULL");
    auto positive = [&](const char* name, long v) -> DashStatus {
        if (v <= 0) return fail(DASH_ERR_INVALID_ARGUMENT, std::string(name) + " must be positive, got " + std::to_string(v));
        return DASH_OK;
    };
    DashStatus s;
    if ((s = positive("num_seqs", p->num_seqs)) || (s = positive("num_heads", p->num_heads)) ||
        (s = positive("num_kv_heads", p->num_kv_heads)) || (s = positive("head_dim", p->head_dim)) ||
        (s = positive("index_dim", p->index_dim)) || (s = positive("num_blocks", p->num_blocks)) ||
        (s = positive("block_size", p->block_size)) || (s = positive("table_width", p->table_width)) ||
        (s = positive("sparse_block_size", p->sparse_block_size)) ||
        (s = positive("sparse_local_block", p->sparse_local_block)))
        return s;
    if (!(p->rope_tok_theta > 0.0f) || !(p->rope_page_theta > 0.0f) || p->rope_tok_theta > 3.0e38f ||
        p->rope_page_theta > 3.0e38f)
        return fail(DASH_ERR_INVALID_ARGUMENT, "rope_tok_theta and rope_page_theta must be finite and > 0");
    if (p->num_tokens < 0) return fail(DASH_ERR_INVALID_ARGUMENT, "num_tokens must not be negative");
    if (p->topk < 1) return fail(DASH_ERR_INVALID_ARGUMENT, "topk (dash_topk_blocks) must be >= 1, got " +
                                                        std::to_string(p->topk));
    auto finite = [](float x) { return x == x && x <= 3.0e38f && x >= -3.0e38f; };
    if (!finite(p->route_scale)) return fail(DASH_ERR_INVALID_ARGUMENT, "route_scale must be finite");
    if (!finite(p->prior_floor) || !(p->prior_floor > 0.0f))
        return fail(DASH_ERR_INVALID_ARGUMENT, "prior_floor must be finite and > 0");
    if (!finite(p->sigma) || !(p->sigma > 0.0f)) return fail(DASH_ERR_INVALID_ARGUMENT, "sigma must be finite and > 0");
    if (p->rope_page_pairs < 0 || p->rope_page_mod < 0)
        return fail(DASH_ERR_INVALID_ARGUMENT, "rope_page_pairs and rope_page_mod must not be negative");
    if (p->dtype != DASH_FLOAT32 && p->dtype != DASH_FLOAT16 && p->dtype != DASH_BFLOAT16)
        return fail(DASH_ERR_UNSUPPORTED, "unsupported dtype code: " + std::to_string(p->dtype));
    if (p->num_heads % p->num_kv_heads != 0)
        return fail(DASH_ERR_INVALID_ARGUMENT, "query heads (" + std::to_string(p->num_heads) +
                                                   ") must be a multiple of KV heads (" +
                                                   std::to_string(p->num_kv_heads) + ")");
    if (p->num_heads / p->num_kv_heads > dash::attend_max_group())
        return fail(DASH_ERR_UNSUPPORTED, "unsupported GQA group size: " +
                                              std::to_string(p->num_heads / p->num_kv_heads) + " (at most " +
                                              std::to_string(dash::attend_max_group()) + ")");
    if (!supported_head_dim(p->head_dim))
        return fail(DASH_ERR_UNSUPPORTED, "unsupported head dim: " + std::to_string(p->head_dim) +
                                              " (supported: 64, 128, 256)");
    if (p->index_dim % 2 != 0 || p->index_dim > kMaxIndexDim)
        return fail(DASH_ERR_UNSUPPORTED, "unsupported index dim: " + std::to_string(p->index_dim) +
                                              " (even, at most " + std::to_string(kMaxIndexDim) + ")");
    if (p->head_dim / 2 <= p->rope_page_pairs || p->index_dim / 2 <= p->rope_page_pairs)
        return fail(DASH_ERR_INVALID_ARGUMENT, "head dims must be larger than twice sparse_rope_page_pairs");
    if (p->block_size % p->sparse_block_size != 0)
        return fail(DASH_ERR_UNSUPPORTED, "KV block size " + std::to_string(p->block_size) +
                                              " is not a whole multiple of the sparse block size " +
                                              std::to_string(p->sparse_block_size));
    if (p->tune_block_major_warpgroups < 0 || p->tune_block_major_warpgroups > 2)
        return fail(DASH_ERR_INVALID_ARGUMENT, "tune_block_major_warpgroups must be 0 (the plan picks), 1 or 2, got " +
                                                   std::to_string(p->tune_block_major_warpgroups));
    if (p->tune_block_major_ctas < 0)
        return fail(DASH_ERR_INVALID_ARGUMENT, "tune_block_major_ctas must be 0 (one CTA a work item) or > 0, got " +
                                                   std::to_string(p->tune_block_major_ctas));
    dash::Plan plan;
    return make_plan(*p, plan);
}

DashStatus dash_validate(const DashParams* p) {
    const DashStatus s = validate_sizes(p);
    return s != DASH_OK ? s : check_pointers(*p);
}

int32_t dash_max_selected(const DashParams* p) {
    dash::Plan plan;
    if (p == nullptr || validate_sizes(p) != DASH_OK || make_plan(*p, plan) != DASH_OK) return -1;
    return plan.kmax;
}

DashStatus dash_workspace_size(const DashParams* p, size_t* bytes) {
    DashStatus s = validate_sizes(p);
    if (s != DASH_OK) return s;
    if (bytes == nullptr) return fail(DASH_ERR_INVALID_ARGUMENT, "bytes is NULL");
    dash::Plan plan;
    s = make_plan(*p, plan);
    if (s == DASH_OK) *bytes = plan.bytes;
    return s;
}

DashStatus dash_run(const DashParams* p, void* stream_ptr) {
    DashStatus s = dash_validate(p);
    if (s != DASH_OK) return s;
    dash::Plan plan;
    if ((s = make_plan(*p, plan)) != DASH_OK) return s;
    return launch(*p, plan, stream_ptr);
}

DashStatus dash_plan(const DashParams* p, DashPlan* out) {
    if (out == nullptr) return fail(DASH_ERR_INVALID_ARGUMENT, "plan is NULL");
    std::memset(out, 0, sizeof(DashPlan));
    DashStatus s = validate_sizes(p);
    if (s != DASH_OK) return s;
    PlanRecord rec{};
    if ((s = make_plan(*p, rec.plan)) != DASH_OK) return s;
    rec.magic = kPlanMagic;
    rec.params = plan_key(*p);
    std::memcpy(out, &rec, sizeof(rec));
    return DASH_OK;
}

size_t dash_plan_workspace_size(const DashPlan* plan) {
    if (plan == nullptr) return 0;
    PlanRecord rec;
    std::memcpy(&rec, plan, sizeof(rec));
    return rec.magic == kPlanMagic ? rec.plan.bytes : 0;
}

DashStatus dash_run_plan(const DashParams* p, const DashPlan* plan, void* stream_ptr) {
    if (p == nullptr || plan == nullptr) return fail(DASH_ERR_INVALID_ARGUMENT, "params and plan must not be NULL");
    PlanRecord rec;
    std::memcpy(&rec, plan, sizeof(rec));
    if (rec.magic != kPlanMagic) return fail(DASH_ERR_INVALID_ARGUMENT, "plan was not filled by dash_plan");
    if (!same_key(rec.params, *p))
        return fail(DASH_ERR_INVALID_ARGUMENT, "params differ from the plan's in a size, configuration or tuning field "
                                               "(plan again for these params)");
    if (DashStatus s = check_pointers(*p); s != DASH_OK) return s;
    return launch(*p, rec.plan, stream_ptr);
}

int32_t dash_plan_matches(const DashParams* p, const DashPlan* plan) {
    if (p == nullptr || plan == nullptr) return 0;
    PlanRecord rec;
    std::memcpy(&rec, plan, sizeof(rec));
    return rec.magic == kPlanMagic && same_key(rec.params, *p) ? 1 : 0;
}

DashStatus dash_read_data_errors(const DashParams* p, void* stream_ptr, int32_t* mask) {
    if (p == nullptr || p->workspace == nullptr || mask == nullptr)
        return fail(DASH_ERR_INVALID_ARGUMENT, "params, workspace and mask must not be NULL");
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    int32_t* flag = static_cast<int32_t*>(p->workspace);
    cudaError_t err = cudaMemcpyAsync(mask, flag, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(flag, 0, sizeof(int32_t), stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return fail(DASH_ERR_CUDA, std::string("reading the error flag: ") + cudaGetErrorString(err));
    return DASH_OK;
}

const char* dash_status_string(DashStatus status) {
    switch (status) {
        case DASH_OK: return "DASH_OK";
        case DASH_ERR_INVALID_ARGUMENT: return "DASH_ERR_INVALID_ARGUMENT";
        case DASH_ERR_UNSUPPORTED: return "DASH_ERR_UNSUPPORTED";
        case DASH_ERR_WORKSPACE: return "DASH_ERR_WORKSPACE";
        case DASH_ERR_CUDA: return "DASH_ERR_CUDA";
    }
    return "DASH_ERR_UNKNOWN";
}

const char* dash_last_error_message(void) { return g_last_error.c_str(); }

#ifdef DASH_TRACE
// Bench only (CMake -DDASH_TRACE=ON; bench/trace_step.py): copies the phase trace of the last
// routing (kernel 0) or attention (kernel 1) launch into host, [CTA][timer slots, clock slots]
// (dash::kTraceCtas x 2 * dash::kTraceSlots values), and clears it. With host NULL it only
// reports that count in *count. Synchronous. Not declared in dash.h: plain builds lack it.
DASH_API DashStatus dash_debug_trace(int32_t kernel, unsigned long long* host, int64_t* count) {
    const int64_t need = (int64_t)dash::kTraceCtas * 2 * dash::kTraceSlots;
    if (count == nullptr || (kernel != 0 && kernel != 1))
        return fail(DASH_ERR_INVALID_ARGUMENT, "dash_debug_trace: kernel must be 0 or 1 and count not NULL");
    if (host == nullptr) {
        *count = need;
        return DASH_OK;
    }
    if (*count < need)
        return fail(DASH_ERR_INVALID_ARGUMENT, "dash_debug_trace: the host buffer holds " + std::to_string(*count) +
                                                   " values, the trace " + std::to_string(need));
    const cudaError_t err = kernel == 0 ? dash::read_route_trace(host) : dash::read_attend_trace(host);
    if (err != cudaSuccess) return fail(DASH_ERR_CUDA, std::string("reading the trace: ") + cudaGetErrorString(err));
    return DASH_OK;
}
#endif

}  // extern "C"
