// Second argmax launch (twin of argmax_final.wgsl): one threadgroup reduces
// the parts argmax_partial wrote (largest value; ties -> lowest token
// index), then advances the decode position kept on the GPU:
// tokens[pos + 1] = the greedy token (unless that position still holds a
// prompt token, pos + 1 < fill_end) and pos += 1. Preamble (names prefixed Q3W_): WG.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

kernel void argmax_final(
    constant Params& p [[buffer(0)]],
    const device float* part_val [[buffer(1)]],
    const device uint* part_idx [[buffer(2)]],
    device uint* tokens [[buffer(3)]],
    device Step* step [[buffer(4)]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]])
{
    // One slot per simdgroup (sized for the narrowest possible simdgroup).
    threadgroup float red_v[Q3W_WG];
    threadgroup uint red_i[Q3W_WG];

    float best_v = -3.0e38f;
    uint best_i = NONE;
    for (uint k = lid; k < p.n; k += Q3W_WG) {
        const float v = part_val[k];
        const uint i = part_idx[k];
        if (i != NONE && (best_i == NONE || v > best_v || (v == best_v && i < best_i))) {
            best_v = v;
            best_i = i;
        }
    }
    // Simdgroup winner (ties -> lowest index), then lane 0 picks among the
    // simdgroups.
    const float m = simd_max(best_v);
    const uint cand = simd_min(select(NONE, best_i, best_v == m));
    if (sg_lane == 0) {
        red_v[sg_id] = m;
        red_i[sg_id] = cand;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid == 0) {
        float bv = red_v[0];
        uint best = red_i[0];
        for (uint k = 1; k < n_sg; k++) {
            if (red_v[k] > bv || (red_v[k] == bv && red_i[k] < best)) {
                bv = red_v[k];
                best = red_i[k];
            }
        }
        const uint next = step->pos + 1;
        if (next >= step->fill_end && next < p.n_tokens) {
            tokens[next] = best;
        }
        step->pos = next;
    }
}
