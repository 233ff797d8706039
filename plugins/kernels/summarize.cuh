// Stage 2's work for one block: the summary of sparse block `b` of sequence `seq` (every token
// of it already in the cache) and its image-page range. Shared by summarize_kernel and by the
// decode-only routing launch's writer CTAs (route.cu); any CTA size.
//
// A block's summary is the head_cls-softmax-weighted mean of its index keys; it is taken once,
// when the block's last token is written, and never changes afterwards, so decode reads one
// summary per block instead of every index key (dash_trt.reference.block_summaries).
#pragma once

#include "common.cuh"

namespace dash {

// The indexer's scale 1 / sqrt(Di), rounded once, and its clamp of a scaled dot product to
// +-1e4 (as the reference clamps): what the summaries' logits and the routing scores share.
__device__ __forceinline__ float index_inv_sqrt(int di) { return __fdiv_rn(1.0f, sqrtf((float)di)); }
__device__ __forceinline__ float clamp_index_logit(float x) { return fminf(fmaxf(x, -1e4f), 1e4f); }

// Dynamic shared memory: Plan::summarize_smem bytes at smem_raw.
template <typename T>
__device__ void summarize_block(const DashParams& p, const Workspace& ws, int seq, int b, unsigned char* smem_raw) {
    const int sbs = p.sparse_block_size, di = p.index_dim;
    const int prompt = p.prompt_lens[seq];

    // Shared memory: slots [sbs] int64, keys [sbs, Di + 1] float (an odd row stride: a thread
    // per row reads conflict-free), logit [sbs], head_cls [Di] float, pages [sbs], a bitmap of
    // sbs bits (see the end).
    const int ks = di + 1;
    int64_t* slots = reinterpret_cast<int64_t*>(smem_raw);
    float* keys = reinterpret_cast<float*>(slots + sbs);
    float* logit = keys + sbs * ks;
    float* hcs = logit + sbs;
    int* pages = (int*)(hcs + di);
    unsigned* seen = reinterpret_cast<unsigned*>(pages + sbs);
    __shared__ int64_t s_sum_index;
    __shared__ int s_bad;
    __shared__ int s_lo, s_hi, s_distinct;
    if (threadIdx.x == 0) s_lo = INT32_MAX, s_hi = -1, s_distinct = 0, s_bad = 0;
    for (int w = threadIdx.x; w < (sbs + 31) / 32; w += blockDim.x) seen[w] = 0;
    const T* hc = static_cast<const T*>(p.head_cls);
    for (int i = threadIdx.x; i < di; i += blockDim.x) hcs[i] = to_f(hc[i]);
    __syncthreads();
    // Every token's cache slot at once (one block-table read each, in parallel), then every
    // key row in 16-byte loads, all independent: two memory round trips, not one per row.
    for (int j = threadIdx.x; j < sbs; j += blockDim.x) {
        const int64_t slot = cache_slot(p, seq, b * sbs + j, ws.error);
        slots[j] = slot;
        if (slot < 0) s_bad = 1;
        else pages[j] = p.image_page_cache[slot];
        if (j == 0 && slot >= 0) {  // summary_index of the block: the KV block of its first token
            const int per = p.block_size / sbs;
            s_sum_index = (slot / p.block_size) * per + (slot % p.block_size) / sbs;
        }
    }
    __syncthreads();
    if (s_bad) return;
    // Loads into registers first, kBatch per thread, then the shared-memory stores: the
    // compiler may not move a slot read (shared) above a key store (shared), so a plain loop
    // would wait for one global load per iteration.
    constexpr int kVec = 16 / (int)sizeof(T);  // elements per 16-byte load
    constexpr int kBatch = 8;
    const int nt = blockDim.x;
    if (di % kVec == 0 && reinterpret_cast<uintptr_t>(p.index_key_cache) % 16 == 0) {
        const int per_row = di / kVec;
        for (int base = threadIdx.x; base < sbs * per_row; base += kBatch * nt) {
            uint4 w[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int c = base + u * nt;
                if (c < sbs * per_row)
                    w[u] = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.index_key_cache) +
                                                           slots[c / per_row] * di + (c % per_row) * kVec);
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int c = base + u * nt;
                if (c >= sbs * per_row) break;
                const T* e = reinterpret_cast<const T*>(&w[u]);
#pragma unroll
                for (int x = 0; x < kVec; ++x) keys[(c / per_row) * ks + (c % per_row) * kVec + x] = to_f(e[x]);
            }
        }
    } else {
        for (int c = threadIdx.x; c < sbs * di; c += nt) {
            const int j = c / di, i = c % di;
            keys[j * ks + i] = to_f(static_cast<const T*>(p.index_key_cache)[slots[j] * di + i]);
        }
    }
    __syncthreads();
    // Indexer logit of each token: (ik . head_cls) / sqrt(Di), clamped to +-1e4; a thread per
    // row (in turn for more rows than threads), the row's elements in order.
    const float inv_sqrt = index_inv_sqrt(di);
    for (int j = threadIdx.x; j < sbs; j += nt) {
        float acc = 0.0f;
        for (int i = 0; i < di; ++i) acc += keys[j * ks + i] * hcs[i];
        logit[j] = clamp_index_logit(acc * inv_sqrt);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float m = -INFINITY;  // the reference's finfo.min where nothing counts; see below
        for (int j = threadIdx.x; j < sbs; j += 32) {
            const bool real = prompt < 0 || b * sbs + j < prompt;
            if (real) m = fmaxf(m, logit[j]);
        }
        m = warp_max(m);
        if (m == -INFINITY) m = -3.402823466e38f;
        // NOTE: exactly the reference's formula: tokens that do not count still go through
        // exp(logit - max) and are then multiplied by 0, so an overflow gives inf * 0 = NaN and
        // the whole summary becomes 0 (nan_to_num). Do not "fix" this here alone.
        float s = 0.0f;
        for (int j = threadIdx.x; j < sbs; j += 32) {
            const bool real = prompt < 0 || b * sbs + j < prompt;
            float e = expf(logit[j] - m);
            e = e * (real ? 1.0f : 0.0f);
            logit[j] = e;
            s += e;
        }
        s = warp_sum(s);
        const float total = (s < 1e-6f) ? 1e-6f : s;  // clamp(min=1e-6), NaN stays NaN
        for (int j = threadIdx.x; j < sbs; j += 32) logit[j] = logit[j] / total;  // the weights
    }
    __syncthreads();
    float* out = p.summary_cache + s_sum_index * di;
    for (int i = threadIdx.x; i < di; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < sbs; ++j) acc += logit[j] * keys[j * ks + i];
        out[i] = finite_or_zero(acc);
    }
    // Image-page range of the block, and whether every page in it has an image token here: the
    // distinct pages are counted in a bitmap over the range (a range wider than the block has
    // more pages than tokens, so it cannot be dense).
    for (int j = threadIdx.x; j < sbs; j += nt) {
        const int pg = pages[j];
        if (pg >= 0) atomicMin(&s_lo, pg), atomicMax(&s_hi, pg);
    }
    __syncthreads();
    const int lo = s_lo, range = s_hi - s_lo + 1;
    if (s_hi >= 0 && range <= sbs) {
        for (int j = threadIdx.x; j < sbs; j += nt) {
            const int pg = pages[j];
            if (pg >= 0) atomicOr(&seen[(pg - lo) / 32], 1u << ((pg - lo) % 32));
        }
        __syncthreads();
        for (int w = threadIdx.x; w < (sbs + 31) / 32; w += nt) atomicAdd(&s_distinct, __popc(seen[w]));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t* dst = p.summary_pages_cache + s_sum_index * 3;
        if (s_hi < 0) {
            dst[DASH_PAGE_LO] = -1, dst[DASH_PAGE_HI] = -1, dst[DASH_PAGE_DENSE] = 1;
        } else {
            dst[DASH_PAGE_LO] = s_lo, dst[DASH_PAGE_HI] = s_hi;
            dst[DASH_PAGE_DENSE] = s_distinct == s_hi - s_lo + 1 ? 1 : 0;
        }
    }
}

}  // namespace dash
