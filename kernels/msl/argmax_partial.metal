// First of two argmax launches (twin of argmax_partial.wgsl; ties -> lowest
// index): threadgroup w scans logits[w*chunk, (w+1)*chunk) and writes its
// best (value, index) to part_val/part_idx[w]. argmax_final reduces the
// parts. Preamble (names prefixed Q3W_): WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

kernel void argmax_partial(
    constant Params& p [[buffer(0)]],
    const device float* logits [[buffer(1)]],
    device float* part_val [[buffer(2)]],
    device uint* part_idx [[buffer(3)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    // One slot per simdgroup (sized for the narrowest possible simdgroup).
    threadgroup float red_v[Q3W_WG];
    threadgroup uint red_i[Q3W_WG];

    const uint start = wg.x * p.chunk;
    const uint end = min(p.n, start + p.chunk);
    float best_v = -3.0e38f;
    uint best_i = NONE;
    // Ascending scan with strict '>' keeps the lowest index among equals.
    for (uint i = start + lid; i < end; i += Q3W_WG) {
        const float v = logits[i];
        if (v > best_v || best_i == NONE) {
            best_v = v;
            best_i = i;
        }
    }
    // Simdgroup winner (ties -> lowest index), then one lane per simdgroup
    // publishes it and lane 0 picks among the simdgroups.
    const float m = simd_max(best_v);
    const uint cand = simd_min(select(NONE, best_i, best_v == m));
    if (sg_lane == 0) {
        red_v[sg_id] = m;
        red_i[sg_id] = cand;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid == 0) {
        float bv = red_v[0];
        uint bi = red_i[0];
        for (uint k = 1; k < n_sg; k++) {
            if (red_v[k] > bv || (red_v[k] == bv && red_i[k] < bi)) {
                bv = red_v[k];
                bi = red_i[k];
            }
        }
        part_idx[wg.x] = bi;
        part_val[wg.x] = select(-3.0e38f, logits[min(bi, p.n - 1)], bi != NONE);
    }
}
