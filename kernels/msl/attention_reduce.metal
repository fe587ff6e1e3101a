// Decode attention, second launch (twin of attention_reduce.wgsl): one
// threadgroup per query head combines the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.
// Preamble: WG.

#include <metal_stdlib>
using namespace metal;

struct Params {
    uint head_dim;
    uint n_chunks;
};

kernel void attention_reduce(
    constant Params& p [[buffer(0)]],
    const device float2* part_ml [[buffer(1)]],
    const device float* part_acc [[buffer(2)]],
    device float* out [[buffer(3)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]])
{
    const uint h = wg.x;
    const uint base = h * p.n_chunks;
    float big_m = -3.0e38f;
    for (uint c = 0; c < p.n_chunks; c++) {
        big_m = max(big_m, part_ml[base + c].x);
    }
    float big_l = 0.0f;
    for (uint c = 0; c < p.n_chunks; c++) {
        const float2 ml = part_ml[base + c];
        if (ml.y > 0.0f) {
            big_l += ml.y * exp(ml.x - big_m);
        }
    }
    for (uint d = lid; d < p.head_dim; d += WG) {
        float o = 0.0f;
        for (uint c = 0; c < p.n_chunks; c++) {
            const float2 ml = part_ml[base + c];
            if (ml.y > 0.0f) {
                o += part_acc[(base + c) * p.head_dim + d] * exp(ml.x - big_m);
            }
        }
        out[h * p.head_dim + d] = o / big_l;
    }
}
