// Stage 1: write the new tokens into the paged cache, keys and index keys after page RoPE.
#include "common.cuh"

namespace dash {
namespace {

// One CTA per new token: find its sequence and position, then write k (rotated), v, ik
// (rotated, non-finite zeroed) and its image page at the token's cache slot. The token's
// indexer query takes the same rotation (same coordinates and dims as ik): it goes to the
// workspace in float32 for the routing stage.
template <typename T>
__global__ void write_kernel(const DashParams p, Workspace ws) {
    const int t = blockIdx.x;
    __shared__ int s_seq, s_pos;
    __shared__ int64_t s_slot;
    if (threadIdx.x == 0) {
        // Binary search: sequence s with qsl[s] <= t < qsl[s + 1].
        int lo = 0, hi = p.num_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (p.query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int n_new = p.query_start_loc[lo + 1] - p.query_start_loc[lo];
        const int len = p.seq_lens[lo];
        int pos = len - (p.query_start_loc[lo + 1] - t);
        int seq = lo;
        if (p.query_start_loc[lo] > t || t >= p.query_start_loc[lo + 1] || n_new > len ||
            len > p.table_width * p.block_size) {
            atomicOr(ws.error, DASH_DATA_BAD_LENGTHS);
            seq = -1;
        }
        int64_t slot = seq >= 0 ? cache_slot(p, seq, pos, ws.error) : -1;
        if (slot < 0) seq = -1;
        ws.token_seq[t] = seq;
        ws.token_pos[t] = pos;
        s_seq = seq;
        s_pos = pos;
        s_slot = slot;
    }
    __syncthreads();
    if (s_seq < 0) return;
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const RopeConfig main_rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.main_truncate,
                               p.rope_page_mod};
    const RopeConfig index_rope{p.rope_page_pairs, p.rope_tok_theta, p.rope_page_theta, p.index_truncate,
                                p.rope_page_mod};
    const int d = p.head_dim, half = d / 2, hkv = p.num_kv_heads;
    const int di = p.index_dim, ihalf = di / 2;
    // cos and sin of each pair's angle once per token (shared by the KV heads); large angles
    // take the slow path of cosf/sinf, so this is most of the stage's arithmetic.
    extern __shared__ float2 cs[];  // [D / 2] main, then [Di / 2] index
    for (int i = threadIdx.x; i < half; i += blockDim.x) cs[i] = rope_cos_sin<T>(rope_angle(i, d, tok, page, main_rope));
    for (int i = threadIdx.x; i < ihalf; i += blockDim.x)
        cs[half + i] = rope_cos_sin<T>(rope_angle(i, di, tok, page, index_rope));
    __syncthreads();
    const T* k = static_cast<const T*>(p.k) + (int64_t)t * hkv * d;
    const T* v = static_cast<const T*>(p.v) + (int64_t)t * hkv * d;
    T* kc = static_cast<T*>(p.key_cache) + s_slot * hkv * d;
    T* vc = static_cast<T*>(p.value_cache) + s_slot * hkv * d;
    for (int idx = threadIdx.x; idx < hkv * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        float lo, hi;
        rope_rotate<T>(to_f(k[h * d + i]), to_f(k[h * d + i + half]), cs[i].x, cs[i].y, lo, hi);
        kc[h * d + i] = from_f<T>(lo);
        kc[h * d + i + half] = from_f<T>(hi);
    }
    for (int idx = threadIdx.x; idx < hkv * d; idx += blockDim.x) vc[idx] = v[idx];
    const T* ik = static_cast<const T*>(p.ik) + (int64_t)t * di;
    T* ic = static_cast<T*>(p.index_cache) + s_slot * di;
    for (int i = threadIdx.x; i < ihalf; i += blockDim.x) {
        float lo, hi;
        rope_rotate<T>(to_f(ik[i]), to_f(ik[i + ihalf]), cs[half + i].x, cs[half + i].y, lo, hi);
        ic[i] = from_f<T>(finite_or_zero(lo));
        ic[i + ihalf] = from_f<T>(finite_or_zero(hi));
    }
    const T* iq = static_cast<const T*>(p.iq) + (int64_t)t * di;
    float* iq_rot = ws.iq_rot + (int64_t)t * ((di + 3) / 4 * 4);
    for (int i = threadIdx.x; i < ihalf; i += blockDim.x) {
        float lo, hi;
        rope_rotate<T>(to_f(iq[i]), to_f(iq[i + ihalf]), cs[half + i].x, cs[half + i].y, lo, hi);
        iq_rot[i] = finite_or_zero(lo);
        iq_rot[i + ihalf] = finite_or_zero(hi);
    }
    if (threadIdx.x == 0) {
        p.image_page_cache[s_slot] = p.coords[t * DASH_NUM_COORDS + DASH_COORD_IMAGE_PAGE];
    }
}

}  // namespace

cudaError_t launch_write(const DashParams& p, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        const size_t smem = sizeof(float2) * (size_t)(p.head_dim / 2 + p.index_dim / 2);
        write_kernel<T><<<p.num_tokens, 128, smem, stream>>>(p, ws);
        return cudaGetLastError();
    });
}

}  // namespace dash
