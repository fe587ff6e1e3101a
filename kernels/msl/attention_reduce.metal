// Decode attention, second launch (twin of attention_reduce.wgsl): one
// threadgroup per query head combines the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.
// M and L are reduced over the threadgroup (one chunk per lane), so each
// lane's output loop is a single pass over the chunks, four independent
// loads at a time. Batched (prefill): threadgroup (h, 0, z) combines token
// z's chunks into out[z * out_stride ..]. Preamble (names prefixed Q3W_): WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

// a * exp(m_c - M), or 0 for a chunk past the context (whose acc was never
// written and may hold anything).
static inline float term(float a, float2 ml, float big_m) {
    return ml.y > 0.0f ? a * exp(ml.x - big_m) : 0.0f;
}

kernel void attention_reduce(
    constant Params& p [[buffer(0)]],
    const device float2* part_ml [[buffer(1)]],
    const device float* part_acc [[buffer(2)]],
    device float* out [[buffer(3)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    threadgroup float red[Q3W_WG]; // one slot per simdgroup

    const uint h = wg.x;
    const uint z = wg.z;
    const uint base = (z * nwg.x + h) * p.n_chunks;
    float m = -3.0e38f;
    for (uint c = lid; c < p.n_chunks; c += Q3W_WG) {
        m = max(m, part_ml[base + c].x);
    }
    const float sm = simd_max(m);
    if (sg_lane == 0) {
        red[sg_id] = sm;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float big_m = red[0];
    for (uint i = 1; i < n_sg; i++) {
        big_m = max(big_m, red[i]);
    }
    float l = 0.0f;
    for (uint c = lid; c < p.n_chunks; c += Q3W_WG) {
        const float2 ml = part_ml[base + c];
        l += term(ml.y, ml, big_m);
    }
    // Every lane has read the maxima before red is reused.
    const float sl = simd_sum(l);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg_lane == 0) {
        red[sg_id] = sl;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float big_l = 0.0f;
    for (uint i = 0; i < n_sg; i++) {
        big_l += red[i];
    }
    for (uint d = lid; d < p.head_dim; d += Q3W_WG) {
        const uint a = base * p.head_dim + d;
        float o = 0.0f;
        uint c = 0;
        for (; c + 3 < p.n_chunks; c += 4) {
            const float a0 = part_acc[a + c * p.head_dim];
            const float a1 = part_acc[a + (c + 1) * p.head_dim];
            const float a2 = part_acc[a + (c + 2) * p.head_dim];
            const float a3 = part_acc[a + (c + 3) * p.head_dim];
            o += term(a0, part_ml[base + c], big_m) + term(a1, part_ml[base + c + 1], big_m)
                + term(a2, part_ml[base + c + 2], big_m) + term(a3, part_ml[base + c + 3], big_m);
        }
        for (; c < p.n_chunks; c++) {
            o += term(part_acc[a + c * p.head_dim], part_ml[base + c], big_m);
        }
        out[z * p.out_stride + h * p.head_dim + d] = o / big_l;
    }
}
