// Stage 1: write the new tokens into the paged cache, keys and index keys after page RoPE.
#include "token.cuh"

namespace dash {
namespace {

// One CTA per new token: find its sequence and position, then write k (rotated), v, ik
// (rotated, non-finite zeroed) and its image page at the token's cache slot. The token's
// indexer query takes the same rotation (same coordinates and dims as ik): it goes to the
// workspace in float32 for the routing stage.
template <typename T>
__global__ void write_kernel(const DashParams p, Workspace ws) {
    const int t = blockIdx.x;
    __shared__ int s_seq;
    __shared__ int64_t s_slot;
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    const RopeConfig mrope = main_rope(p), irope = index_rope(p);
    const int d = p.head_dim, half = d / 2, hkv = p.num_kv_heads;
    const int di = p.index_dim, ihalf = di / 2;
    // cos and sin of each pair's angle once per token (shared by the KV heads); large angles
    // take the slow path of cosf/sinf, so this is most of the stage's arithmetic. The other
    // warps do it while warp 0 looks the token's sequence and slot up.
    extern __shared__ float2 cs[];  // [D / 2] main, then [Di / 2] index
    if (threadIdx.x < 32) {
        int seq, pos, prompt;
        const bool ok = locate_token(p, t, seq, pos, prompt);
        if (threadIdx.x == 0) {
            const int64_t slot = publish_token(p, ws, t, ok, seq, pos, prompt);
            s_seq = slot >= 0 ? seq : -1;
            s_slot = slot;
        }
    }
    const int others = blockDim.x - 32;
    for (int i = (int)threadIdx.x - 32; i >= 0 && i < half; i += others)
        cs[i] = rope_cos_sin<T>(rope_angle(i, d, tok, page, mrope));
    for (int i = (int)threadIdx.x - 32; i >= 0 && i < ihalf; i += others)
        cs[half + i] = rope_cos_sin<T>(rope_angle(i, di, tok, page, irope));
    __syncthreads();
    // For the tensor-core attention and the block-major prefill's query rotation, which rotates
    // every token's queries (a token with bad metadata too: its output is left unspecified).
    if (ws.token_cs != nullptr)
        for (int i = threadIdx.x; i < half; i += blockDim.x) ws.token_cs[(int64_t)t * half + i] = cs[i];
    if (s_seq < 0) return;
    const T* k = static_cast<const T*>(p.k) + (int64_t)t * hkv * d;
    const T* v = static_cast<const T*>(p.v) + (int64_t)t * hkv * d;
    T* kc = static_cast<T*>(p.key_cache) + s_slot * hkv * d;
    T* vc = static_cast<T*>(p.value_cache) + s_slot * hkv * d;
    // Loads first, in batches of kBatch per thread, then the stores: the compiler may not move
    // a load above a store to another pointer, so a plain loop would wait once per element.
    constexpr int kBatch = 4;
    const int nt = blockDim.x;
    for (int base = threadIdx.x; base < hkv * half; base += kBatch * nt) {
        float xl[kBatch], xh[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int idx = base + u * nt, h = idx / half, i = idx % half;
            xl[u] = idx < hkv * half ? to_f(k[h * d + i]) : 0.0f;
            xh[u] = idx < hkv * half ? to_f(k[h * d + i + half]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int idx = base + u * nt, h = idx / half, i = idx % half;
            if (idx >= hkv * half) break;
            float lo, hi;
            rope_rotate<T>(xl[u], xh[u], cs[i].x, cs[i].y, lo, hi);
            kc[h * d + i] = from_f<T>(lo);
            kc[h * d + i + half] = from_f<T>(hi);
        }
    }
    constexpr int kVec = 16 / (int)sizeof(T);
    const bool vec = (hkv * d) % kVec == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(vc) % 16 == 0;
    if (vec) {
        for (int base = threadIdx.x; base < hkv * d / kVec; base += kBatch * nt) {
            uint4 w[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                if (base + u * nt < hkv * d / kVec) w[u] = reinterpret_cast<const uint4*>(v)[base + u * nt];
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                if (base + u * nt < hkv * d / kVec) reinterpret_cast<uint4*>(vc)[base + u * nt] = w[u];
        }
    } else {
        for (int idx = threadIdx.x; idx < hkv * d; idx += nt) vc[idx] = v[idx];
    }
    // The index key goes to the cache; the indexer query (same angles) to the workspace.
    const T* ik = static_cast<const T*>(p.ik) + (int64_t)t * di;
    const T* iq = static_cast<const T*>(p.iq) + (int64_t)t * di;
    T* ic = static_cast<T*>(p.index_key_cache) + s_slot * di;
    float* iq_rot = ws.iq_rot + (int64_t)t * ((di + 3) / 4 * 4);
    for (int i = threadIdx.x; i < ihalf; i += nt) {
        const float kl = to_f(ik[i]), kh = to_f(ik[i + ihalf]), ql = to_f(iq[i]), qh = to_f(iq[i + ihalf]);
        const float2 kr = index_pair<T>(kl, kh, cs[half + i]), qr = index_pair<T>(ql, qh, cs[half + i]);
        ic[i] = from_f<T>(kr.x);
        ic[i + ihalf] = from_f<T>(kr.y);
        iq_rot[i] = qr.x;
        iq_rot[i + ihalf] = qr.y;
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
        // 128 threads. (64, twice the CTAs an SM holds for this chain of dependent loads, measured
        // 0.293 against 0.288 ms at 64k on the H200: docs/performance.md.)
        write_kernel<T><<<p.num_tokens, 128, smem, stream>>>(p, ws);
        return cudaGetLastError();
    });
}

}  // namespace dash
