// Stage 1: write the new tokens into the paged cache, keys and index keys after page RoPE.
#include "token.cuh"

namespace dash {
namespace {

// A warp per new token (kWriteWarps tokens a CTA): find its sequence and position, then write k
// (rotated), v, ik (rotated, non-finite zeroed) and its image page at the token's cache slot. The
// token's indexer query takes the same rotation (same coordinates and dims as ik): it goes to the
// workspace in float32 for the routing stage. (A CTA a token, 128 threads, ran 65,536 CTAs at 64k:
// 0.29 ms, about what 64 threads a CTA took too.)
constexpr int kWriteWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kWriteWarps * 32, 6) write_kernel(const DashParams p, Workspace ws) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int t = blockIdx.x * kWriteWarps + warp;
    if (t >= p.num_tokens) return;  // whole warps
    const int d = p.head_dim, half = d / 2, hkv = p.num_kv_heads;
    const int di = p.index_dim, ihalf = di / 2;
    // cos and sin of each pair's angle once per token (shared by the KV heads; large angles take
    // the slow path of cosf / sinf, most of the stage's arithmetic), after the token's sequence
    // lookup and before its slot's: [D / 2] main, then [Di / 2] index, a region a warp. The other
    // warps of the SM (six CTAs of four) cover each warp's waits.
    extern __shared__ float2 cs_all[];
    float2* cs = cs_all + warp * (half + ihalf);
    const int tok = p.coords[t * DASH_NUM_COORDS + DASH_COORD_TOK];
    const int page = p.coords[t * DASH_NUM_COORDS + DASH_COORD_PAGE];
    int seq, pos, prompt;
    const bool ok = locate_token(p, t, seq, pos, prompt);
    const RopeConfig mrope = main_rope(p), irope = index_rope(p);
    for (int i = lane; i < half; i += 32) cs[i] = rope_cos_sin<T>(rope_angle(i, d, tok, page, mrope));
    for (int i = lane; i < ihalf; i += 32) cs[half + i] = rope_cos_sin<T>(rope_angle(i, di, tok, page, irope));
    int64_t slot = 0;
    if (lane == 0) slot = publish_token(p, ws, t, ok, seq, pos, prompt);
    slot = __shfl_sync(0xffffffffu, slot, 0);
    __syncwarp();  // cs
    // For the tensor-core attention and the block-major prefill's query rotation, which rotates
    // every token's queries (a token with bad metadata too: its output is left unspecified).
    if (ws.token_cs != nullptr)
        for (int i = lane; i < half; i += 32) ws.token_cs[(int64_t)t * half + i] = cs[i];
    if (slot < 0) return;
    const T* k = static_cast<const T*>(p.k) + (int64_t)t * hkv * d;
    const T* v = static_cast<const T*>(p.v) + (int64_t)t * hkv * d;
    T* kc = static_cast<T*>(p.key_cache) + slot * hkv * d;
    T* vc = static_cast<T*>(p.value_cache) + slot * hkv * d;
    warp_rope_rows<T>(k, kc, cs, hkv, d, lane);  // the queries' rotation, applied to the keys
    // V as it is: 16-byte copies, kBatch a lane in flight (the loads before the stores: the
    // compiler may not move a load above a store to another pointer).
    constexpr int kVec = 16 / (int)sizeof(T), kBatch = 4;
    const bool vec = (hkv * d) % kVec == 0 && ((reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(vc)) & 15) == 0;
    if (vec) {
        const int nv = hkv * d / kVec;
        for (int base = lane; base < nv; base += kBatch * 32) {
            uint4 w[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                if (base + u * 32 < nv) w[u] = reinterpret_cast<const uint4*>(v)[base + u * 32];
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                if (base + u * 32 < nv) reinterpret_cast<uint4*>(vc)[base + u * 32] = w[u];
        }
    } else {
        for (int idx = lane; idx < hkv * d; idx += 32) vc[idx] = v[idx];
    }
    // The index key goes to the cache; the indexer query (same angles) to the workspace.
    const T* ik = static_cast<const T*>(p.ik) + (int64_t)t * di;
    const T* iq = static_cast<const T*>(p.iq) + (int64_t)t * di;
    T* ic = static_cast<T*>(p.index_key_cache) + slot * di;
    float* iq_rot = ws.iq_rot + (int64_t)t * ((di + 3) / 4 * 4);
    for (int i = lane; i < ihalf; i += 32) {
        const float kl = to_f(ik[i]), kh = to_f(ik[i + ihalf]), ql = to_f(iq[i]), qh = to_f(iq[i + ihalf]);
        const float2 kr = index_pair<T>(kl, kh, cs[half + i]), qr = index_pair<T>(ql, qh, cs[half + i]);
        ic[i] = from_f<T>(kr.x);
        ic[i + ihalf] = from_f<T>(kr.y);
        iq_rot[i] = qr.x;
        iq_rot[i + ihalf] = qr.y;
    }
    if (lane == 0) p.image_page_cache[slot] = p.coords[t * DASH_NUM_COORDS + DASH_COORD_IMAGE_PAGE];
}

}  // namespace

cudaError_t launch_write(const DashParams& p, const Workspace& ws, cudaStream_t stream) {
    if (p.num_tokens == 0) return cudaSuccess;
    return DASH_DISPATCH_DTYPE(p.dtype, T, [&] {
        const size_t smem = kWriteWarps * sizeof(float2) * (size_t)(p.head_dim / 2 + p.index_dim / 2);
        write_kernel<T><<<(p.num_tokens + kWriteWarps - 1) / kWriteWarps, kWriteWarps * 32, smem, stream>>>(p, ws);
        return cudaGetLastError();
    });
}

}  // namespace dash
