// Decode attention, second launch (twin of attention_reduce.wgsl): one
// threadgroup per query head combines the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.
// Lane (slice s, quad q) owns output dims 4q..4q+3 over chunks s, s + S,
// ... (S = WG / (head_dim / 4) slices), issuing eight chunks' loads at once
// with a running max; the slices' (m, l, acc) are then combined in slice
// order through threadgroup memory. Batched (prefill, or a batch of
// sessions): threadgroup (h, 0, z) combines token z's chunks into
// out[z * out_stride ..]. Preamble (names prefixed Q3W_): WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

// Chunk c's (m, l): (-3e38, 0) past the context or past the last chunk (a
// clamped index), so it weighs nothing.
static inline float2 chunk_ml(const device float2* part_ml, uint base, uint c, uint n_chunks) {
    const float2 ml = part_ml[base + min(c, n_chunks - 1)];
    return (c < n_chunks && ml.y > 0.0f) ? ml : float2(-3.0e38f, 0.0f);
}

kernel void attention_reduce(
    constant Params& p [[buffer(0)]],
    const device float2* part_ml [[buffer(1)]],
    const device float4* part_acc [[buffer(2)]],
    device float* out [[buffer(3)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint lid [[thread_index_in_threadgroup]])
{
    threadgroup float2 ml_s[Q3W_WG];
    threadgroup float4 acc_s[Q3W_WG];

    const uint h = wg.x;
    const uint z = wg.z;
    const uint base = (z * nwg.x + h) * p.n_chunks;
    const uint quads = p.head_dim / 4;
    const uint ns = Q3W_WG / quads;
    const uint s = lid / quads;
    const uint q = lid % quads;
    const bool in_slice = s < ns;
    float m = -3.0e38f;
    float l = 0.0f;
    float4 o = float4(0.0f);
    if (in_slice) {
        const uint last = p.n_chunks - 1;
        for (uint c0 = s; c0 < p.n_chunks; c0 += 8 * ns) {
            float2 ml[8];
            float4 a[8];
            for (uint i = 0; i < 8; i++) {
                const uint c = c0 + i * ns;
                ml[i] = chunk_ml(part_ml, base, c, p.n_chunks);
                a[i] = part_acc[(base + min(c, last)) * quads + q];
            }
            float m_new = m;
            for (uint i = 0; i < 8; i++) {
                m_new = max(m_new, ml[i].x);
            }
            const float r = exp(m - m_new);
            l *= r;
            o *= r;
            for (uint i = 0; i < 8; i++) {
                // A chunk that weighs nothing adds nothing, whatever its acc.
                if (ml[i].y > 0.0f) {
                    const float w = exp(ml[i].x - m_new);
                    l += ml[i].y * w;
                    o += a[i] * w;
                }
            }
            m = m_new;
        }
    }
    if (in_slice && q == 0) {
        ml_s[s] = float2(m, l);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float big_m = -3.0e38f;
    for (uint i = 0; i < ns; i++) {
        big_m = max(big_m, ml_s[i].x);
    }
    acc_s[lid] = o * exp(m - big_m);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid < quads) {
        float big_l = 0.0f;
        float4 total = float4(0.0f);
        for (uint i = 0; i < ns; i++) {
            big_l += ml_s[i].y * exp(ml_s[i].x - big_m);
            total += acc_s[i * quads + q];
        }
        const float4 res = total / big_l;
        const uint at = z * p.out_stride + h * p.head_dim + 4 * q;
        out[at] = res.x;
        out[at + 1] = res.y;
        out[at + 2] = res.z;
        out[at + 3] = res.w;
    }
}
