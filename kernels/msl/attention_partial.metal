// Decode attention, split over positions (twin of attention_partial.wgsl):
// threadgroup (h, c) attends query head h to cached positions
// [c*WG, (c+1)*WG) and writes that chunk's softmax statistics: its max m,
// its sum l = sum(exp(s - m)) and acc = sum(exp(s - m) * v).
// attention_reduce combines the chunks. GQA by indexing: kv_head =
// h / (n_heads / n_kv_heads). K/V: half pairs packed in uint,
// [kv_head][capacity][head_dim/2]. Batched (prompt tokens): threadgroup
// (h, c, z) serves token z of the batch, at position step.pos + z, over
// positions <= its own (causal), q normed and rotated by qk_norm_rope.
// Decode steps (one token):
// - FUSED: q is read raw from the qkv projection's output and normed and
//   rotated here; the threadgroup whose chunk holds the new position first
//   writes that position's k (normed, rotated) and v to the caches (both
//   query heads of a KV head write the same values), then reads them back.
// - DIRECT (one chunk, grid (heads, 1, 1)): the chunk's result is the
//   output, normalised and written to part_acc's binding (bound to the
//   output); no reduce.
// - PACKED (long contexts): from position p.pack_from on, with p.pack = 2,
//   threadgroup h (even) serves query heads h and h + 1 and h + 1 returns
//   at once, so each K and V row is loaded once for both; each head's
//   result is computed as unpacked (the same operations in the same order).
// - KV_INT8: the caches hold int8 rows (16 values a uint4; head_dim a
//   multiple of 16) and a float scale per row after them (qk_norm_rope's
//   layout, kv_scale_word): a score is the row's dot with q times its K step
//   (scale / 127), a position's weight in the V sums its e times its V step.
//   Apple GPUs convert int8 to float at full rate, so the twin reads the
//   values as floats (the WGSL kernel's integer dot products answer
//   NVIDIA's slow conversions).
// Preamble (names prefixed Q3W_): WG (= positions per chunk), FUSED, DIRECT,
// PACKED, KV_INT8.
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), between the preamble and this file.

// A K row quad (8 halves) dotted with the matching 8 dims of q (qa, qb).
static inline float dot8(float4 qa, float4 qb, uint4 a) {
    return dot(qa, float4(float2(as_type<half2>(a.x)), float2(as_type<half2>(a.y))))
        + dot(qb, float4(float2(as_type<half2>(a.z)), float2(as_type<half2>(a.w))));
}

// KV_INT8: a K row quad (16 int8 values) dotted with 16 dims of q.
static inline float dot16(float4 q0, float4 q1, float4 q2, float4 q3, uint4 a) {
    return dot(q0, float4(as_type<char4>(a.x))) + dot(q1, float4(as_type<char4>(a.y)))
        + dot(q2, float4(as_type<char4>(a.z))) + dot(q3, float4(as_type<char4>(a.w)));
}

// KV_INT8: q's dims for quads ja (a0..a3) and jb (b0..b3) of int8 rows.
struct Q16 {
    float4 a0, a1, a2, a3, b0, b1, b2, b3;
};

// KV_INT8: the partial dots of the four rows' int8 quads ja and jb (an
// int8 row has at most 2 * ATTENTION_KEY_LANES quads), each where the row
// has it.
static inline float key16(Q16 q, uint4 a, uint4 b, bool has_a, bool has_b) {
    return (has_a ? dot16(q.a0, q.a1, q.a2, q.a3, a) : 0.0f) + (has_b ? dot16(q.b0, q.b1, q.b2, q.b3, b) : 0.0f);
}

// KV_INT8: dims 0..3 (`hi`: 4..7) of the 8 dims 8i..8i+7 a V lane takes
// from the row's uint4 `a` (its first half, or `odd`, its second).
static inline float4 v8(uint4 a, bool odd, bool hi) {
    return float4(as_type<char4>(hi ? (odd ? a.w : a.y) : (odd ? a.z : a.x)));
}

// The score phase's loads for four K rows (ta: their first quads' indices):
// quads ja and jb of each.
struct KeyQuads {
    uint4 a0, a1, a2, a3, b0, b1, b2, b3;
};

static inline KeyQuads key_quads(const device uint4* k_cache, uint4 ta, uint ja, uint jb) {
    return KeyQuads{k_cache[ta.x + ja], k_cache[ta.y + ja], k_cache[ta.z + ja], k_cache[ta.w + ja],
                    k_cache[ta.x + jb], k_cache[ta.y + jb], k_cache[ta.z + jb], k_cache[ta.w + jb]};
}

// The partial dots of the four rows' quads ja (q dims qa, qb) and jb (qc,
// qd), each where the row has it.
static inline float4 key_dots(KeyQuads k, float4 qa, float4 qb, float4 qc, float4 qd, bool has_a, bool has_b) {
    float4 d = float4(0.0f);
    if (has_a) {
        d = float4(dot8(qa, qb, k.a0), dot8(qa, qb, k.a1), dot8(qa, qb, k.a2), dot8(qa, qb, k.a3));
    }
    if (has_b) {
        d += float4(dot8(qc, qd, k.b0), dot8(qc, qd, k.b1), dot8(qc, qd, k.b2), dot8(qc, qd, k.b3));
    }
    return d;
}

// KV_INT8: key_dots of int8 rows.
static inline float4 key_dots16(KeyQuads k, Q16 q, bool has_a, bool has_b) {
    return float4(key16(q, k.a0, k.b0, has_a, has_b), key16(q, k.a1, k.b1, has_a, has_b),
        key16(q, k.a2, k.b2, has_a, has_b), key16(q, k.a3, k.b3, has_a, has_b));
}

// The first and last 4 of the 8 halves of a V row quad.
static inline float4 lo4(uint4 a) {
    return float4(float2(as_type<half2>(a.x)), float2(as_type<half2>(a.y)));
}
static inline float4 hi4(uint4 a) {
    return float4(float2(as_type<half2>(a.z)), float2(as_type<half2>(a.w)));
}

// Four consecutive dims e..e+3 of one head of the qkv output (at `base`),
// their rotate-half RoPE partners (e +- head_dim/2: head_dim is a multiple
// of 8, so the four lie on one side of head_dim/2 and so do their
// partners), both norm weights (at `nbase`) and the table's (cos, sin).
struct Dims4 {
    float4 a;
    float4 b;
    float4 na;
    float4 nb;
    float4 cosine;
    float4 sine;
    bool low;
};

static inline Dims4 load_dims4(const device float* q, const device float* qk_norm,
    const device float2* rope, uint head_dim, uint base, uint nbase, uint e, uint pos)
{
    const uint half_dim = head_dim / 2;
    const bool low = e < half_dim;
    const uint f = low ? e + half_dim : e - half_dim;
    const uint c = pos * half_dim + e % half_dim;
    const float2 r0 = rope[c];
    const float2 r1 = rope[c + 1];
    const float2 r2 = rope[c + 2];
    const float2 r3 = rope[c + 3];
    Dims4 x;
    x.a = float4(q[base + e], q[base + e + 1], q[base + e + 2], q[base + e + 3]);
    x.b = float4(q[base + f], q[base + f + 1], q[base + f + 2], q[base + f + 3]);
    x.na = float4(qk_norm[nbase + e], qk_norm[nbase + e + 1], qk_norm[nbase + e + 2], qk_norm[nbase + e + 3]);
    x.nb = float4(qk_norm[nbase + f], qk_norm[nbase + f + 1], qk_norm[nbase + f + 2], qk_norm[nbase + f + 3]);
    x.cosine = float4(r0.x, r1.x, r2.x, r3.x);
    x.sine = float4(r0.y, r1.y, r2.y, r3.y);
    x.low = low;
    return x;
}

// rope(rms_norm(x) * norm) of the four dims, `inv` the head's 1/rms.
static inline float4 rope4(Dims4 x, float inv) {
    const float4 a = x.a * inv * x.na;
    const float4 b = x.b * inv * x.nb;
    return x.low ? a * x.cosine - b * x.sine : a * x.cosine + b * x.sine;
}

// 8 floats as a K/V row quad of half pairs.
static inline uint4 pack8(float4 lo, float4 hi) {
    return uint4(as_type<uint>(half2(float2(lo.x, lo.y))), as_type<uint>(half2(float2(lo.z, lo.w))),
        as_type<uint>(half2(float2(hi.x, hi.y))), as_type<uint>(half2(float2(hi.z, hi.w))));
}

kernel void attention_partial(
    constant Params& p [[buffer(0)]],
    const device Step* step [[buffer(1)]],
    // FUSED: the qkv projection's output (q, k, v heads); else each
    // token's normed, rotated q.
    const device float* q [[buffer(2)]],
    device uint4* k_cache [[buffer(3)]], // 8 halves per load (head_dim % 8 == 0)
    device uint4* v_cache [[buffer(4)]], // 8 halves per load
    device float2* part_ml [[buffer(5)]],  // [token][head][chunk]: (m, l)
    // [token][head][chunk][head_dim]; DIRECT: the output, [head][head_dim]
    device float* part_acc [[buffer(6)]],
    const device float* qk_norm [[buffer(7)]], // FUSED: q norm weight, then k norm weight
    const device float2* rope [[buffer(8)]],   // FUSED: rope[pos * head_dim / 2 + d] = (cos, sin)
    uint3 wg [[threadgroup_position_in_grid]],
    uint3 nwg [[threadgroups_per_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint sg_lane [[thread_index_in_simdgroup]],
    uint sg_id [[simdgroup_index_in_threadgroup]],
    uint n_sg [[simdgroups_per_threadgroup]],
    uint sg_size [[threads_per_simdgroup]])
{
    // The threadgroup's (at most two) heads' q, head_dim / 4 float4s each.
    threadgroup float4 q_s[MAX_HEAD_DIM / 2];
    // Each position's weight for both heads.
    threadgroup float2 e_s[Q3W_WG];
    // The scores' partial dots (ATTENTION_KEY_LANES per position, at most
    // 8), then the V sums' slices (8 per lane), one head at a time:
    // scalars, each written by one lane.
    threadgroup float acc_s[8 * Q3W_WG];
    threadgroup float4 red4[Q3W_WG];

    const uint h = wg.x;
    const uint c = wg.y;
    const uint z = wg.z;
    const uint n_chunks = nwg.y;
    const uint start = c * Q3W_WG;
    const uint pos = step->pos + z;
    // Heads served: np from h (see the header).
    const uint np = (Q3W_PACKED && p.pack == 2 && pos >= p.pack_from) ? 2 : 1;
    if (h % np != 0) {
        return; // threadgroup h - 1 serves this head (uniform)
    }
    // The partial results' slot of head h + g: part + g * n_chunks.
    const uint part = (z * p.n_heads + h) * n_chunks + c;
    const uint end = min(min(pos + 1, p.capacity), start + Q3W_WG);
    if (start >= end) {
        // An empty chunk (past the context): contributes nothing.
        if (lid < np) {
            part_ml[part + lid * n_chunks] = float2(-3.0e38f, 0.0f);
        }
        return; // whole threadgroup: uniform
    }
    const uint kvh = h / (p.n_heads / p.n_kv_heads);
    const bool int8 = Q3W_KV_INT8;
    // uints a K/V row: half pairs, or int8 quadruples.
    const uint row_words = int8 ? p.head_dim / 4 : p.head_dim / 2;
    const uint kv_base = kvh * p.capacity * row_words;
    const uint qw = p.head_dim / 4;
    // KV_INT8: this lane's position's K and V steps, loaded before anything
    // else (the fused step's new position takes the maxima it computes).
    device uint* k_words = reinterpret_cast<device uint*>(k_cache);
    device uint* v_words = reinterpret_cast<device uint*>(v_cache);
    const uint own = start + lid;
    float2 steps = float2(0.0f);
    if (int8 && own < end) {
        const uint w = kv_scale_word(p, kvh, own);
        steps = float2(as_type<float>(k_words[w]), as_type<float>(v_words[w])) * (1.0f / 127.0f);
    }

    if (Q3W_FUSED) {
        // q_s = rope(rms_norm(q_h) * q_norm) for the np heads from h; the
        // chunk holding the new position also writes its k =
        // rope(rms_norm(k) * k_norm) and v. Every load is issued up front,
        // and nothing is exchanged through threadgroup memory before the one
        // barrier that publishes q_s and the new K/V row: each simdgroup sums
        // the heads' squares itself (lane t: dims t, t + width, ...); lane
        // i < np * head_dim / 4 rotates dims 4i..4i+3 of the heads' q (head
        // i / (head_dim / 4)), loading their RoPE partners itself, and writes
        // q_s[i]; lane j < head_dim / 8 rotates k's dims 8j..8j+7 likewise
        // and writes them, and v's, as quad j of the new K and V rows. Each
        // vector in threadgroup or device memory is written whole by one
        // lane: lanes writing different components of one vector could be
        // compiled to read-modify-writes of the whole vector that lose each
        // other's components.
        const bool writes_kv = pos >= start && pos < end;
        const uint hd = p.head_dim;
        const uint qb = h * hd;
        const uint kb = (p.n_heads + kvh) * hd;
        const uint vb = (p.n_heads + p.n_kv_heads + kvh) * hd;
        // q: head g's dims 4i..4i+3, in range for the other lanes too.
        const uint gi = min(lid, np * qw - 1);
        const uint g = gi / qw;
        const Dims4 qd = load_dims4(q, qk_norm, rope, hd, qb + g * hd, 0, 4 * (gi % qw), pos);
        // k and v: dims 8j..8j+7 (KV_INT8: 16j..16j+15, a quad of the
        // int8 row).
        const uint per_lane = int8 ? 16 : 8;
        const uint j = min(lid, hd / per_lane - 1);
        const bool kv_lane = writes_kv && lid < hd / per_lane;
        Dims4 kd[4] = {};
        float4 vd[4] = {float4(0.0f), float4(0.0f), float4(0.0f), float4(0.0f)};
        if (kv_lane) {
            for (uint c = 0; c < per_lane / 4; c++) {
                const uint e = per_lane * j + 4 * c;
                kd[c] = load_dims4(q, qk_norm, rope, hd, kb, hd, e, pos);
                vd[c] = float4(q[vb + e], q[vb + e + 1], q[vb + e + 2], q[vb + e + 3]);
            }
        }
        // The heads' sums of squares (q's heads in x and y, k in z), in
        // every simdgroup.
        float3 sq = float3(0.0f);
        for (uint t = sg_lane; t < hd; t += sg_size) {
            const float a = q[qb + t];
            sq.x += a * a;
            if (np == 2) {
                const float a1 = q[qb + hd + t];
                sq.y += a1 * a1;
            }
            if (writes_kv) {
                const float b = q[kb + t];
                sq.z += b * b;
            }
        }
        const float3 ss = float3(simd_sum(sq.x), simd_sum(sq.y), simd_sum(sq.z));
        if (lid < np * qw) {
            q_s[lid] = rope4(qd, rsqrt((g == 0 ? ss.x : ss.y) / float(hd) + p.eps));
        }
        const float rk = rsqrt(ss.z / float(hd) + p.eps);
        float4 rd[4] = {float4(0.0f), float4(0.0f), float4(0.0f), float4(0.0f)};
        if (kv_lane) {
            for (uint c = 0; c < per_lane / 4; c++) {
                rd[c] = rope4(kd[c], rk);
            }
        }
        if (int8) {
            // The new rows' largest magnitudes (their scales) in one exchange,
            // which every lane takes (the chunk holding the position is not
            // known to be uniform).
            const float4 km = max(max(abs(rd[0]), abs(rd[1])), max(abs(rd[2]), abs(rd[3])));
            const float4 vm = max(max(abs(vd[0]), abs(vd[1])), max(abs(vd[2]), abs(vd[3])));
            const float2 mine = float2(max(max(km.x, km.y), max(km.z, km.w)), max(max(vm.x, vm.y), max(vm.z, vm.w)));
            const float2 sg_m = float2(simd_max(mine.x), simd_max(mine.y));
            if (sg_lane == 0) {
                red4[sg_id] = float4(sg_m.x, sg_m.y, 0.0f, 0.0f);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            float2 mx = float2(red4[0].x, red4[0].y);
            for (uint i = 1; i < n_sg; i++) {
                mx = max(mx, float2(red4[i].x, red4[i].y));
            }
            if (kv_lane) {
                const float ik = mx.x > 0.0f ? 1.0f / mx.x : 0.0f;
                const float iv = mx.y > 0.0f ? 1.0f / mx.y : 0.0f;
                const uint row = ((kvh * p.capacity + pos) * (hd / 4)) / 4 + j;
                k_cache[row] = uint4(snorm8x4(rd[0] * ik), snorm8x4(rd[1] * ik), snorm8x4(rd[2] * ik), snorm8x4(rd[3] * ik));
                v_cache[row] = uint4(snorm8x4(vd[0] * iv), snorm8x4(vd[1] * iv), snorm8x4(vd[2] * iv), snorm8x4(vd[3] * iv));
                if (j == 0) {
                    const uint w = kv_scale_word(p, kvh, pos);
                    k_words[w] = as_type<uint>(mx.x);
                    v_words[w] = as_type<uint>(mx.y);
                }
            }
            if (own == pos) {
                steps = mx * (1.0f / 127.0f);
            }
        } else if (kv_lane) {
            const uint row = ((kvh * p.capacity + pos) * (hd / 2)) / 4 + j;
            k_cache[row] = pack8(rd[0], rd[1]);
            v_cache[row] = pack8(vd[0], vd[1]);
        }
        // Publishes q_s, and the new row that other lanes read back below.
        threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
    } else {
        for (uint i = lid; i < np * qw; i += Q3W_WG) {
            const uint o = (z * p.n_heads + h) * p.head_dim + 4 * i;
            q_s[i] = float4(q[o], q[o + 1], q[o + 2], q[o + 3]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // The scores, K rows read coalesced (as attention_partial.wgsl): lane
    // (row_in, r) of L = ATTENTION_KEY_LANES lanes per row takes quads r,
    // r + L, ... of rows start + row_in, + rows_per_pass, ... (eight rows:
    // 8 * rows_per_pass = WG, the chunk in one pass), each row's dots with
    // every head served; then, a head at a time, the partial dots are parked
    // in acc_s and lane t adds position t's.
    const uint quads = row_words / 4;
    const uint n = end - start;
    const uint rows_per_pass = Q3W_WG / ATTENTION_KEY_LANES;
    const uint r = lid % ATTENTION_KEY_LANES;
    const uint row_in = lid / ATTENTION_KEY_LANES;
    // (head_dim < 8 * L: lanes past the row's quads add zeros.)
    const uint ja = min(r, quads - 1);
    const uint jb = min(r + ATTENTION_KEY_LANES, quads - 1);
    const bool has_a = r < quads;
    const bool has_b = r + ATTENTION_KEY_LANES < quads;
    const uint kv_row0 = kv_base / 4 + start * quads;
    const uint4 tv = uint4(row_in, row_in + rows_per_pass, row_in + 2 * rows_per_pass, row_in + 3 * rows_per_pass);
    const uint4 tu = tv + uint4(4 * rows_per_pass);
    const uint4 ta = min(tv, uint4(n - 1)) * quads + uint4(kv_row0);
    const uint4 tb = min(tu, uint4(n - 1)) * quads + uint4(kv_row0);
    const KeyQuads ka = key_quads(k_cache, ta, ja, jb);
    const KeyQuads kb = key_quads(k_cache, tb, ja, jb);
    float4 da[2] = {float4(0.0f), float4(0.0f)};
    float4 db[2] = {float4(0.0f), float4(0.0f)};
    for (uint g = 0; int8 && g < np; g++) {
        // (An int8 row has at most 2 * ATTENTION_KEY_LANES quads.)
        const uint qa = g * qw + 4 * ja;
        const uint qb = g * qw + 4 * jb;
        const Q16 q16 = {q_s[qa], q_s[qa + 1], q_s[qa + 2], q_s[qa + 3], q_s[qb], q_s[qb + 1], q_s[qb + 2], q_s[qb + 3]};
        da[g] = key_dots16(ka, q16, has_a, has_b);
        db[g] = key_dots16(kb, q16, has_a, has_b);
    }
    for (uint g = 0; !int8 && g < np; g++) {
        const uint qo = g * qw;
        da[g] = key_dots(ka, q_s[qo + 2 * ja], q_s[qo + 2 * ja + 1], q_s[qo + 2 * jb], q_s[qo + 2 * jb + 1], has_a, has_b);
        db[g] = key_dots(kb, q_s[qo + 2 * ja], q_s[qo + 2 * ja + 1], q_s[qo + 2 * jb], q_s[qo + 2 * jb + 1], has_a, has_b);
        // Quads past 2 * ATTENTION_KEY_LANES (head_dim > 128).
        for (uint j = r + 2 * ATTENTION_KEY_LANES; j < quads; j += ATTENTION_KEY_LANES) {
            const float4 qj = q_s[qo + 2 * j];
            const float4 qk = q_s[qo + 2 * j + 1];
            da[g] += float4(dot8(qj, qk, k_cache[ta.x + j]), dot8(qj, qk, k_cache[ta.y + j]),
                            dot8(qj, qk, k_cache[ta.z + j]), dot8(qj, qk, k_cache[ta.w + j]));
            db[g] += float4(dot8(qj, qk, k_cache[tb.x + j]), dot8(qj, qk, k_cache[tb.y + j]),
                            dot8(qj, qk, k_cache[tb.z + j]), dot8(qj, qk, k_cache[tb.w + j]));
        }
    }
    const uint t = start + lid;
    float2 s = float2(-3.0e38f);
    for (uint g = 0; g < np; g++) {
        if (g > 0) {
            threadgroup_barrier(mem_flags::mem_threadgroup); // the last head's readers are done
        }
        for (uint i = 0; i < 4; i++) {
            if (tv[i] < n) {
                acc_s[tv[i] * ATTENTION_KEY_LANES + r] = da[g][i];
            }
            if (tu[i] < n) {
                acc_s[tu[i] * ATTENTION_KEY_LANES + r] = db[g][i];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup); // publishes the partial dots
        if (t < end) {
            float d = 0.0f;
            for (uint i = 0; i < ATTENTION_KEY_LANES; i++) {
                d += acc_s[lid * ATTENTION_KEY_LANES + i];
            }
            s[g] = (int8 ? d * steps.x : d) * p.scale;
        }
    }
    // Softmax statistics in one exchange: each simdgroup publishes its max
    // and its sum of exp(s - its max) for each head; every lane rescales
    // them to the common max. (A simdgroup with no position left sums
    // exp(0), weighed by exp(-3e38 - m) = 0.)
    const float2 m_sg = float2(simd_max(s.x), simd_max(s.y));
    const float2 l_sg = float2(simd_sum(exp(s.x - m_sg.x)), simd_sum(exp(s.y - m_sg.y)));
    if (sg_lane == 0) {
        red4[sg_id] = float4(m_sg, l_sg);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float2 m = float2(red4[0].x, red4[0].y);
    for (uint i = 1; i < n_sg; i++) {
        m = max(m, float2(red4[i].x, red4[i].y));
    }
    float2 l = float2(0.0f);
    for (uint i = 0; i < n_sg; i++) {
        l += float2(red4[i].z, red4[i].w) * exp(float2(red4[i].x, red4[i].y) - m);
    }
    // KV_INT8: l (the softmax's sum) is e's; the V sums weigh the int8 row
    // by its step.
    e_s[lid] = t < end ? exp(s - m) * (int8 ? steps.y : 1.0f) : float2(0.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Lane (slice, i) sums dims 8i..8i+7 (one 16-byte load per position)
    // over positions start + slice, start + slice + n_slices, ..., for every
    // head served; then the slices are added, a head at a time.
    const uint row_quads = p.head_dim / 8;
    const uint n_slices = Q3W_WG / row_quads;
    const uint slice = lid / row_quads;
    const uint i = lid % row_quads;
    float4 lo[2] = {float4(0.0f), float4(0.0f)};
    float4 hi[2] = {float4(0.0f), float4(0.0f)};
    if (slice < n_slices) {
        // Eight positions per iteration, eight independent loads in flight;
        // the last iteration's positions past the end load the last row
        // and weigh 0 (no one-at-a-time tail: each would be a round trip).
        // KV_INT8: dims 8i..8i+7 are half of a uint4 (words 2i, 2i+1).
        const uint vb = kv_base / 4 + (int8 ? i / 2 : i);
        const bool odd = int8 && (i & 1) == 1;
        const uint row_vec4s = row_words / 4;
        const uint ns = n_slices;
        const uint last = end - 1;
        for (uint tt = start + slice; tt < end; tt += 8 * ns) {
            const uint4 ta = min(uint4(tt, tt + ns, tt + 2 * ns, tt + 3 * ns), uint4(last));
            const uint4 tb = min(uint4(tt + 4 * ns, tt + 5 * ns, tt + 6 * ns, tt + 7 * ns), uint4(last));
            const uint4 v0 = v_cache[vb + ta.x * row_vec4s];
            const uint4 v1 = v_cache[vb + ta.y * row_vec4s];
            const uint4 v2 = v_cache[vb + ta.z * row_vec4s];
            const uint4 v3 = v_cache[vb + ta.w * row_vec4s];
            const uint4 v4 = v_cache[vb + tb.x * row_vec4s];
            const uint4 v5 = v_cache[vb + tb.y * row_vec4s];
            const uint4 v6 = v_cache[vb + tb.z * row_vec4s];
            const uint4 v7 = v_cache[vb + tb.w * row_vec4s];
            for (uint g = 0; g < np; g++) {
                const float4 ea = float4(e_s[ta.x - start][g], tt + ns < end ? e_s[ta.y - start][g] : 0.0f,
                    tt + 2 * ns < end ? e_s[ta.z - start][g] : 0.0f, tt + 3 * ns < end ? e_s[ta.w - start][g] : 0.0f);
                const float4 eb = float4(tt + 4 * ns < end ? e_s[tb.x - start][g] : 0.0f,
                    tt + 5 * ns < end ? e_s[tb.y - start][g] : 0.0f, tt + 6 * ns < end ? e_s[tb.z - start][g] : 0.0f,
                    tt + 7 * ns < end ? e_s[tb.w - start][g] : 0.0f);
                if (int8) {
                    lo[g] += ea.x * v8(v0, odd, false) + ea.y * v8(v1, odd, false) + ea.z * v8(v2, odd, false)
                        + ea.w * v8(v3, odd, false) + eb.x * v8(v4, odd, false) + eb.y * v8(v5, odd, false)
                        + eb.z * v8(v6, odd, false) + eb.w * v8(v7, odd, false);
                    hi[g] += ea.x * v8(v0, odd, true) + ea.y * v8(v1, odd, true) + ea.z * v8(v2, odd, true)
                        + ea.w * v8(v3, odd, true) + eb.x * v8(v4, odd, true) + eb.y * v8(v5, odd, true)
                        + eb.z * v8(v6, odd, true) + eb.w * v8(v7, odd, true);
                } else {
                    lo[g] += ea.x * lo4(v0) + ea.y * lo4(v1) + ea.z * lo4(v2) + ea.w * lo4(v3) + eb.x * lo4(v4)
                        + eb.y * lo4(v5) + eb.z * lo4(v6) + eb.w * lo4(v7);
                    hi[g] += ea.x * hi4(v0) + ea.y * hi4(v1) + ea.z * hi4(v2) + ea.w * hi4(v3) + eb.x * hi4(v4)
                        + eb.y * hi4(v5) + eb.z * hi4(v6) + eb.w * hi4(v7);
                }
            }
        }
    }
    for (uint g = 0; g < np; g++) {
        // (The first head's: the partial dots' readers finished before the
        // statistics' barrier.)
        if (g > 0) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        for (uint c = 0; c < 4; c++) {
            acc_s[8 * lid + c] = lo[g][c];
            acc_s[8 * lid + 4 + c] = hi[g][c];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // Lane d < head_dim adds dim d (= 8i + r) over the slices.
        if (lid < p.head_dim) {
            const uint qi = lid / 8;
            const uint r = lid % 8;
            float total = 0.0f;
            for (uint sl = 0; sl < n_slices; sl++) {
                total += acc_s[8 * (sl * row_quads + qi) + r];
            }
            if (Q3W_DIRECT) {
                part_acc[(h + g) * p.head_dim + lid] = total / l[g];
            } else {
                part_acc[(part + g * n_chunks) * p.head_dim + lid] = total;
            }
        }
    }
    if (lid < np && !Q3W_DIRECT) {
        part_ml[part + lid * n_chunks] = float2(m[lid], l[lid]);
    }
}
