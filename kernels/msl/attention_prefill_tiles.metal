// Prompt batches on 8x8 SIMD-group matrices: the twin of
// attention_prefill_tiles.wgsl (the same partial results for
// attention_reduce). Threadgroup (h, c, z) attends query head h of the
// Q3W_TOKENS (16) tokens z * 16 .. (positions step.pos + token, causal) to
// the chunk's positions [c * WG, (c + 1) * WG):
//   S = K Q^T          (positions x tokens: 8x8 blocks, half K and q,
//                       float sums, in s_s)
//   P = exp(S * scale - m), m and l per token (float; P rounded to half
//                       once, in qp_s over q; l sums the rounded weights)
//   acc^T = V^T P^T    (dims x tokens: 8x8 blocks, in s_s again)
// Simdgroup sg (of 8) computes the S blocks of positions 8i.., i = sg,
// sg + 8, .., for both 8-token halves, and the acc blocks of dims 8d..,
// d = sg, sg + 8, ... Full 8-position blocks are read straight from the
// f16 cache; the chunk's last partial block (positions past the context,
// which may lie past the buffer, are not read) from a copy in threadgroup
// memory with zeros past the context: K's, then V's. head_dim is a
// multiple of 8 (the engine's HEAD_DIM_MULTIPLE). Over an f16 cache only.
// SIMD-group matrices need Apple GPUs (family 7 on, 32-lane simdgroups);
// elsewhere the build or the start-up self-check fails and the engine runs
// attention_prefill.
// Preamble (names prefixed Q3W_): WG (256), TOKENS (16).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

#if Q3W_WG != 256 || Q3W_TOKENS != 16
#error "16 tokens a threadgroup of 256 threads (8 simdgroups, 16 threads a token in the softmax)"
#endif

// Where the threadgroup's chunk lies.
struct Chunk {
    uint h, c, tok0, n_chunks, start;
    // Token 0's end (its position + 1); token t's is first_pos + t.
    uint first_pos;
    // Positions some token attends to; full 8-position blocks of them, and
    // blocks with the partial one.
    uint live, full, blocks;
    // The chunk's first row in the caches (half values).
    uint row0;
};

static inline bool attends(constant Params& p, Chunk at, uint t, uint o) {
    return o < at.live && at.start + o < min(at.first_pos + t, p.capacity);
}

kernel void attention_prefill_tiles(
    constant Params& p [[buffer(0)]],
    const device uint* step [[buffer(1)]],
    const device float* q [[buffer(2)]],
    device half* k16 [[buffer(3)]],
    device half* v16 [[buffer(4)]],
    device float2* part_ml [[buffer(5)]],
    device float* part_acc [[buffer(6)]],
    const device float* qk_norm [[buffer(7)]],
    const device float* rope [[buffer(8)]],
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]])
{
    // q (half): token t's dims at t * head_dim; then P: token t's weights
    // at t * WG + position.
    threadgroup half qp_s[Q3W_TOKENS * Q3W_WG];
    // S: token t's scores at t * WG + position; then the softmax's partial
    // maxima (t * WG + j) and sums (t * WG + 16 + j); then acc: token t's
    // dims at t * head_dim.
    threadgroup float s_s[Q3W_TOKENS * Q3W_WG];
    // The partial block's K (then V) rows: position o's dims at o * head_dim.
    threadgroup half t_s[8 * MAX_HEAD_DIM];

    const uint hd = p.head_dim;
    Chunk at;
    at.h = wg.x;
    at.c = wg.y;
    at.tok0 = wg.z * Q3W_TOKENS;
    at.n_chunks = nwg.y;
    at.start = wg.y * Q3W_WG;
    at.first_pos = step[0] + at.tok0 + 1;
    const uint end = min(min(at.first_pos + Q3W_TOKENS - 1, p.capacity), at.start + Q3W_WG);
    at.live = end > at.start ? end - at.start : 0;
    at.full = at.live / 8;
    at.blocks = (at.live + 7) / 8;
    const uint kvh = at.h / (p.n_heads / p.n_kv_heads);
    at.row0 = (kvh * p.capacity + at.start) * hd;
    if (at.live == 0) {
        // An empty chunk for every token: contributes nothing.
        if (lid < Q3W_TOKENS) {
            part_ml[((at.tok0 + lid) * p.n_heads + at.h) * at.n_chunks + at.c] = float2(-3.0e38f, 0.0f);
        }
        return;
    }
    for (uint e = lid; e < Q3W_TOKENS * hd; e += Q3W_WG) {
        const float x = q[((at.tok0 + e / hd) * p.n_heads + at.h) * hd + e % hd];
        qp_s[e] = half(clamp(x, -65504.0f, 65504.0f));
    }
    // The partial block's K rows (zeros past the context); the shim's
    // threadgroup arrays cannot be passed to a function.
    for (uint e = lid; at.full < at.blocks && e < 8 * hd; e += Q3W_WG) {
        const uint o = 8 * at.full + e / hd;
        t_s[e] = o < at.live ? k16[at.row0 + o * hd + e % hd] : half(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S blocks: (position r, token c) of block i at s_s[c * WG + 8i + r].
    for (uint i = sg; i < at.blocks; i += Q3W_WG / 32) {
        simdgroup_float8x8 s0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        simdgroup_float8x8 s1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint d = 0; d < hd; d += 8) {
            simdgroup_half8x8 k;
            if (i < at.full) {
                simdgroup_load(k, &k16[at.row0 + 8 * i * hd + d], hd);
            } else {
                simdgroup_load(k, &t_s[d], hd);
            }
            simdgroup_half8x8 q0;
            simdgroup_half8x8 q1;
            simdgroup_load(q0, &qp_s[d], hd, ulong2(0), true);
            simdgroup_load(q1, &qp_s[8 * hd + d], hd, ulong2(0), true);
            simdgroup_multiply_accumulate(s0, k, q0, s0);
            simdgroup_multiply_accumulate(s1, k, q1, s1);
        }
        simdgroup_store(s0, &s_s[8 * i], Q3W_WG, ulong2(0), true);
        simdgroup_store(s1, &s_s[8 * Q3W_WG + 8 * i], Q3W_WG, ulong2(0), true);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Softmax: thread (t, j) = (lid / 16, lid % 16) takes positions j,
    // j + 16, .. of token t, its scores held while s_s takes the partial
    // maxima and sums; the partial block restaged with V's rows meanwhile.
    const uint t = lid / 16;
    const uint j = lid % 16;
    float sc[16];
    float m = -3.0e38f;
    for (uint k = 0; k < 16; k++) {
        const uint o = j + 16 * k;
        sc[k] = attends(p, at, t, o) ? s_s[t * Q3W_WG + o] * p.scale : -3.0e38f;
        m = max(m, sc[k]);
    }
    for (uint e = lid; at.full < at.blocks && e < 8 * hd; e += Q3W_WG) {
        const uint o = 8 * at.full + e / hd;
        t_s[e] = o < at.live ? v16[at.row0 + o * hd + e % hd] : half(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    s_s[t * Q3W_WG + j] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    m = s_s[t * Q3W_WG];
    for (uint i = 1; i < 16; i++) {
        m = max(m, s_s[t * Q3W_WG + i]);
    }
    float l = 0.0f;
    for (uint k = 0; k < 16; k++) {
        const uint o = j + 16 * k;
        const half w = attends(p, at, t, o) ? half(exp(sc[k] - m)) : half(0.0f);
        qp_s[t * Q3W_WG + o] = w;
        l += float(w);
    }
    s_s[t * Q3W_WG + 16 + j] = l;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (j == 0) {
        l = 0.0f;
        for (uint i = 0; i < 16; i++) {
            l += s_s[t * Q3W_WG + 16 + i];
        }
        part_ml[((at.tok0 + t) * p.n_heads + at.h) * at.n_chunks + at.c] = float2(m, l);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup); // the sums read before acc overwrites s_s

    // acc blocks: (dim r, token c) of block d at s_s[c * head_dim + 8d + r].
    for (uint d = sg; d < hd / 8; d += Q3W_WG / 32) {
        simdgroup_float8x8 a0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        simdgroup_float8x8 a1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint i = 0; i < at.blocks; i++) {
            simdgroup_half8x8 v;
            if (i < at.full) {
                simdgroup_load(v, &v16[at.row0 + 8 * i * hd + 8 * d], hd, ulong2(0), true);
            } else {
                simdgroup_load(v, &t_s[8 * d], hd, ulong2(0), true);
            }
            simdgroup_half8x8 w0;
            simdgroup_half8x8 w1;
            simdgroup_load(w0, &qp_s[8 * i], Q3W_WG, ulong2(0), true);
            simdgroup_load(w1, &qp_s[8 * Q3W_WG + 8 * i], Q3W_WG, ulong2(0), true);
            simdgroup_multiply_accumulate(a0, v, w0, a0);
            simdgroup_multiply_accumulate(a1, v, w1, a1);
        }
        simdgroup_store(a0, &s_s[8 * d], hd, ulong2(0), true);
        simdgroup_store(a1, &s_s[8 * hd + 8 * d], hd, ulong2(0), true);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = lid; e < Q3W_TOKENS * hd; e += Q3W_WG) {
        const uint part = ((at.tok0 + e / hd) * p.n_heads + at.h) * at.n_chunks + at.c;
        part_acc[part * hd + e % hd] = s_s[e];
    }
}
