// The write stage's per-token pieces, shared by write.cu and by the decode-only launches that
// take its work over (route.cu's writer CTAs, attend.cu's K/V write; Plan::fused_front).
#pragma once

#include "common.cuh"

namespace dash {

// Sequence of new token t: the s with qsl[s] <= t < qsl[s + 1], by a 32-way search (one warp,
// one probe per lane per round; a round for up to 32 sequences). Unchecked: see locate_token.
__device__ __forceinline__ int find_sequence(const DashParams& p, int t) {
    const int lane = threadIdx.x % 32;
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
        const int step = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32)
        const int at = lo + lane * step;
        const unsigned ok = __ballot_sync(0xffffffffu, at <= hi && p.query_start_loc[at] <= t);
        const int last = ok == 0 ? 0 : 31 - __clz(ok);
        lo = lo + last * step;
        hi = min(hi, lo + step - 1);
    }
    return lo;
}

// Token t's sequence, position and prompt length, called by a whole warp; false (nothing
// reported: the caller flags DASH_DATA_BAD_LENGTHS) when the metadata is inconsistent: t outside
// its sequence's rows, more new tokens than the sequence holds or than max_new_tokens, or a
// length past the table. Decode-only calls (max_new_tokens == 1) nearly always hold one token per
// sequence in order, so sequence t is tried first: its rows, length and prompt length are read
// at once, and the search (a dependent round of reads more) runs only when t is not one of its
// rows.
__device__ __forceinline__ bool locate_token(const DashParams& p, int t, int& seq, int& pos, int& prompt) {
    int a = 0, b = 0, len = 0;
    bool found = false;
    if (p.max_new_tokens == 1) {
        seq = min(t, p.num_seqs - 1);
        a = p.query_start_loc[seq], b = p.query_start_loc[seq + 1], len = p.seq_lens[seq];
        prompt = p.prompt_lens[seq];
        found = a <= t && t < b;
    }
    if (!found) {  // uniform over the warp
        seq = find_sequence(p, t);
        a = p.query_start_loc[seq], b = p.query_start_loc[seq + 1], len = p.seq_lens[seq];
        prompt = p.prompt_lens[seq];
    }
    pos = len - (b - t);
    const int max_new = p.max_new_tokens > 0 ? p.max_new_tokens : p.num_tokens;
    return a <= t && t < b && b - a <= len && b - a <= max_new && len <= p.table_width * p.block_size;
}

// Publishes new token t for the later stages (one thread): its sequence (-1: every stage skips
// it), position, prompt length and cache slot in the workspace; flags DASH_DATA_BAD_LENGTHS when
// locate_token found the metadata inconsistent (ok false). Returns the slot (-1: skipped, also
// for a block-table entry outside the cache, which cache_slot flags).
__device__ __forceinline__ int64_t publish_token(const DashParams& p, const Workspace& ws, int t, bool ok, int seq,
                                                 int pos, int prompt) {
    if (!ok) atomicOr(ws.error, DASH_DATA_BAD_LENGTHS);
    const int64_t slot = ok ? cache_slot(p, seq, pos, ws.error) : -1;
    ws.token_seq[t] = slot >= 0 ? seq : -1;
    ws.token_pos[t] = pos;
    ws.token_prompt[t] = prompt;
    ws.token_slot[t] = slot;
    return slot;
}

// Pair i of an index row (ik or iq of one token) after page RoPE, nan_to_num'd, in float32.
template <typename T>
__device__ __forceinline__ float2 index_pair(float x_lo, float x_hi, float2 cs) {
    float lo, hi;
    rope_rotate<T>(x_lo, x_hi, cs.x, cs.y, lo, hi);
    return make_float2(finite_or_zero(lo), finite_or_zero(hi));
}

}  // namespace dash
