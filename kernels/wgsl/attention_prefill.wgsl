// Prompt batches: attention_partial's batched path, tiled like a matrix
// product. Workgroup (h, c, z) attends query head h of the TOKENS (32)
// tokens z * TOKENS .. z * TOKENS + TOKENS - 1 of the batch (positions
// step.pos + token, causal) to the chunk's positions [c*WG, (c+1)*WG) and
// writes each token's chunk statistics (m, l) and acc exactly as
// attention_partial does for one token; attention_reduce combines the
// chunks.
// Invocation (g, t) = (idx / 32, idx % 32) owns tokens 4g..4g+3 (a vec4 of
// them) at positions t, t + 32, ..., t + 224 of the chunk (SPANS spans of
// 32 positions): 32 scores, each value read from workgroup memory feeding
// 4 or 8 multiply-adds. Then it sums dims 4t..4t+3 (and 128 + 4t.. for
// a head_dim over 128) of the same 4 tokens' acc over the positions.
// K is staged 8 dims of the chunk's rows at a time (each invocation loads
// one 16-byte quad of its position's row, the next quad while the current
// one is summed), V 16 positions at a time (rows read whole, side by
// side), both converted to f32 once, as they are staged.
// Positions past the group's last token are not loaded (zeros stand in),
// and whole spans of them are not summed into acc; their scores are
// computed with the others (a branch per span measured no faster). Tokens
// past the batch (its last group may be partial) are
// computed like the others, from the q rows past the batch (the batch
// buffers hold whole tiles of the tiled matmul's tokens), and never read.
// WG is 256 (checked in Rust): 8 groups of 4 tokens x 32 lanes.
// The loops over the spans are written out by Rust (a line `// for # in
// SPANS: code` becomes `code` with # = 0, 1, ...), so that every index into
// the per-span scores is a constant and they stay in registers: one index
// computed at run time into the 8 accumulators (a loop over the tokens'
// stores) cost a third of the launch on an H200 (BENCHMARKS.md).
// Measured on an H200 against the kernel it replaced (8 tokens a workgroup,
// one position an invocation): 63 instead of 89 us per 0.6B launch for a
// 256-token batch after 256 positions, 235 instead of 325 after 1,792, but
// 58 instead of 46 for a batch from the first position (128 workgroups).
// Bindings and lo4/hi4: attention_common.wgsl, prepended by Rust after the
// preamble (TOKENS, SPANS).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

// The K slab (f32 bits: dims 0-3 of position o at o, dims 4-7 at WG + o),
// then the softmax statistics' partial results (invocation (g, t)'s vec4
// at t * 8 + g), then V rows as f32 bits, 16 positions x 128 dims at a
// time (see stage_v).
var<workgroup> kv_s: array<vec4<u32>, 2u * WG>;
// 8 dims of the tokens' q: dims 0-3 of token n at n, dims 4-7 at 32 + n.
var<workgroup> q_s: array<vec4<f32>, 64>;
// The span's exp(s - m), invocation (g, t)'s vec4 at t * 8 + g: the
// prelude's red_f (WG vec4s), which this kernel does not otherwise use,
// keeps the workgroup memory within 16 KB.

// Scores of a K row staged at position o of the slab, against the 4
// tokens' 8 dims (q: lo, hi of each token).
fn scores4(o: u32, qa: vec4<f32>, qb: vec4<f32>, qc: vec4<f32>, qd: vec4<f32>, qe: vec4<f32>, qf: vec4<f32>,
           qg: vec4<f32>, qh: vec4<f32>) -> vec4<f32> {
    let klo = bitcast<vec4<f32>>(kv_s[o]);
    let khi = bitcast<vec4<f32>>(kv_s[WG + o]);
    return vec4<f32>(
        dot(qa, klo) + dot(qb, khi),
        dot(qc, klo) + dot(qd, khi),
        dot(qe, klo) + dot(qf, khi),
        dot(qg, klo) + dot(qh, khi),
    );
}

// 4 dims of token n's q from dim d: the tokens of a workgroup, past the
// batch too, lie within the batch buffers.
fn load_q(n: u32, h: u32, d: u32) -> vec4<f32> {
    let o = (n * p.n_heads + h) * p.head_dim + d;
    return vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
}

// The vec4 holding this invocation's K dims 8j..8j+7 at chunk position
// lane (zero past `live`): quad j of an f16 row, or half of vec4 j / 2 of
// an int8 one (`row_vec4s` vec4s a row).
fn load_k(row0: u32, row_vec4s: u32, j: u32, lane: u32, live: u32, int8: bool) -> vec4<u32> {
    if lane < live {
        return k_cache[row0 + lane * row_vec4s + select(j, j / 2u, int8)];
    }
    return vec4<u32>(0u);
}

// Live scores (scaled) of span k: -3e38 where position start + t + 32k is
// at or past the token's end.
fn masked(s: vec4<f32>, k: u32, t: u32, start: u32, ends: vec4<u32>) -> vec4<f32> {
    return select(vec4<f32>(-3.0e38), s * p.scale, vec4<u32>(start + t + 32u * k) < ends);
}

// exp(s - m) of span k, 0 where masked.
fn weights(s: vec4<f32>, k: u32, t: u32, start: u32, ends: vec4<u32>, m: vec4<f32>) -> vec4<f32> {
    return select(vec4<f32>(0.0), exp(s - m), vec4<u32>(start + t + 32u * k) < ends);
}

// Max (or sum) over the workgroup's 32 invocations of group g of their
// vec4s: through kv_s.
fn group_reduce(v: vec4<f32>, g: u32, t: u32, is_max: bool) -> vec4<f32> {
    workgroupBarrier(); // the previous readers of kv_s are done
    kv_s[t * 8u + g] = bitcast<vec4<u32>>(v);
    workgroupBarrier();
    var r = bitcast<vec4<f32>>(kv_s[g]);
    for (var i = 1u; i < 32u; i++) {
        let o = bitcast<vec4<f32>>(kv_s[i * 8u + g]);
        if is_max {
            r = max(r, o);
        } else {
            r += o;
        }
    }
    return r;
}

// The 4 tokens' acc over n positions from 16 * sub of the span, dims 4t..
// 4t+3 of the staged 128: the span's weights in red_f, the positions' V
// rows (f32) in kv_s.
fn span_acc(acc: array<vec4<f32>, 4>, g: u32, t: u32, sub: u32, n: u32) -> array<vec4<f32>, 4> {
    var a = acc;
    for (var o = 0u; o < n; o++) {
        let w = red_f[(16u * sub + o) * 8u + g];
        let v = bitcast<vec4<f32>>(kv_s[o * 32u + t]);
        a[0] += w.x * v;
        a[1] += w.y * v;
        a[2] += w.z * v;
        a[3] += w.w * v;
    }
    return a;
}

// Stages 128 dims (from 128 * half) of the V rows of 16 positions (from
// start + 32k + 16 sub) as f32, each converted once: position o's dims 4j..
// 4j+3 at o * 32 + j; zero past `live` positions and past the row.
fn stage_v(at: Span, k: u32, sub: u32, half: u32) {
    let o = at.idx / 16u;
    let i = 16u * half + at.idx % 16u;
    let pos = 32u * k + 16u * sub + o;
    var v = vec4<u32>(0u);
    var sc = 1.0;
    if pos < at.live && i < at.row_quads {
        v = v_cache[at.kv_base / 4u + (at.start + pos) * at.row_vec4s + select(i, i / 2u, at.int8)];
        if at.int8 {
            sc = v_step(kv_scale_word(0u, at.kvh, at.start + pos));
        }
    }
    let j = 2u * (at.idx % 16u);
    let odd = at.int8 && (i & 1u) == 1u;
    kv_s[o * 32u + j] = bitcast<vec4<u32>>(v_lo(v, odd, at.int8) * sc);
    kv_s[o * 32u + j + 1u] = bitcast<vec4<u32>>(v_hi(v, odd, at.int8) * sc);
}

// The weights of span k (every invocation's) into red_f, then the 4 tokens'
// acc over the span's live positions, 16 at a time, in both halves of the
// head.
fn span(acc: array<vec4<f32>, 8>, w: vec4<f32>, k: u32, at: Span) -> array<vec4<f32>, 8> {
    var a = acc;
    workgroupBarrier(); // the previous span's readers are done
    red_f[at.t * 8u + at.g] = w;
    for (var half = 0u; half < at.halves; half++) {
        for (var sub = 0u; sub < 2u && 32u * k + 16u * sub < at.live; sub++) {
            if half + sub > 0u {
                workgroupBarrier(); // the previous readers of kv_s are done
            }
            stage_v(at, k, sub, half);
            workgroupBarrier();
            let n = min(16u, at.live - 32u * k - 16u * sub);
            if half == 0u {
                let r = span_acc(array<vec4<f32>, 4>(a[0], a[1], a[2], a[3]), at.g, at.t, sub, n);
                a[0] = r[0];
                a[1] = r[1];
                a[2] = r[2];
                a[3] = r[3];
            } else {
                let r = span_acc(array<vec4<f32>, 4>(a[4], a[5], a[6], a[7]), at.g, at.t, sub, n);
                a[4] = r[0];
                a[5] = r[1];
                a[6] = r[2];
                a[7] = r[3];
            }
        }
    }
    return a;
}

// A token's acc for part `part`, dims d..d+3 (lo) and 128 + d.. (hi) where
// the head has them.
fn store_acc(part: u32, d: u32, lo: vec4<f32>, hi: vec4<f32>) {
    let o = part * p.head_dim + d;
    if d < p.head_dim {
        part_acc[o] = lo.x;
        part_acc[o + 1u] = lo.y;
        part_acc[o + 2u] = lo.z;
        part_acc[o + 3u] = lo.w;
    }
    if 128u + d < p.head_dim {
        part_acc[o + 128u] = hi.x;
        part_acc[o + 129u] = hi.y;
        part_acc[o + 130u] = hi.z;
        part_acc[o + 131u] = hi.w;
    }
}

// What every span's acc needs.
struct Span {
    idx: u32,
    g: u32,
    t: u32,
    kv_base: u32,
    start: u32,
    /// 8-dim quads of a row (head_dim / 8), and the vec4s a row takes.
    row_quads: u32,
    row_vec4s: u32,
    live: u32,
    halves: u32,
    kvh: u32,
    int8: bool,
}

@compute @workgroup_size(WG)
fn attention_prefill(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let tok0 = wg.z * TOKENS;
    let n_chunks = nwg.y;
    let start = c * WG;
    // Token n attends to positions below its end; the last token furthest.
    let first_pos = step[0] + tok0 + 1u;
    let end = min(min(first_pos + TOKENS - 1u, p.capacity), start + WG);
    if start >= end {
        // An empty chunk for every token: contributes nothing.
        if lane.idx < TOKENS {
            part_ml[((tok0 + lane.idx) * p.n_heads + h) * n_chunks + c] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    let live = end - start;
    let spans = (live + 31u) / 32u;
    let g = lane.idx / 32u;
    let t = lane.idx % 32u;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let int8 = KV_INT8;
    // u32 words a row: f16 pairs, or int8 quadruples.
    let row_words = select(p.head_dim / 2u, p.head_dim / 4u, int8);
    let kv_base = kvh * p.capacity * row_words;
    let row_quads = p.head_dim / 8u;
    let row_vec4s = row_words / 4u;
    let row0 = (kv_base + start * row_words) / 4u;
    // KV_INT8: this invocation's position's K scale.
    var k_sc = 1.0;
    if int8 && lane.idx < live {
        k_sc = k_step(kv_scale_word(0u, kvh, start + lane.idx));
    }

    // Scores: 8 dims a slab; the next slab's K quad and q loaded while the
    // current one is summed.
    var s: array<vec4<f32>, SPANS>;
    var kq = load_k(row0, row_vec4s, 0u, lane.idx, live, int8);
    var qv = vec4<f32>(0.0);
    if lane.idx < 64u {
        qv = load_q(tok0 + lane.idx / 2u, h, 4u * (lane.idx % 2u));
    }
    for (var j = 0u; j < row_quads; j++) {
        workgroupBarrier(); // the previous slab's readers are done
        let odd = int8 && (j & 1u) == 1u;
        kv_s[lane.idx] = bitcast<vec4<u32>>(v_lo(kq, odd, int8) * k_sc);
        kv_s[WG + lane.idx] = bitcast<vec4<u32>>(v_hi(kq, odd, int8) * k_sc);
        if lane.idx < 64u {
            q_s[(lane.idx % 2u) * 32u + lane.idx / 2u] = qv;
        }
        workgroupBarrier();
        if j + 1u < row_quads {
            kq = load_k(row0, row_vec4s, j + 1u, lane.idx, live, int8);
            if lane.idx < 64u {
                qv = load_q(tok0 + lane.idx / 2u, h, 8u * (j + 1u) + 4u * (lane.idx % 2u));
            }
        }
        let n = 4u * g;
        let qa = q_s[n];
        let qb = q_s[32u + n];
        let qc = q_s[n + 1u];
        let qd = q_s[33u + n];
        let qe = q_s[n + 2u];
        let qf = q_s[34u + n];
        let qg = q_s[n + 3u];
        let qh = q_s[35u + n];
        // for # in SPANS: s[#] += scores4(t + 32u * #u, qa, qb, qc, qd, qe, qf, qg, qh);
    }

    // Softmax statistics of the 4 tokens over the chunk.
    let ends = min(vec4<u32>(first_pos + 4u * g) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.capacity));
    // for # in SPANS: s[#] = masked(s[#], #u, t, start, ends);
    var m = vec4<f32>(-3.0e38);
    // for # in SPANS: m = max(m, s[#]);
    m = group_reduce(m, g, t, true);
    var l = vec4<f32>(0.0);
    // for # in SPANS: s[#] = weights(s[#], #u, t, start, ends, m);
    // for # in SPANS: l += s[#];
    l = group_reduce(l, g, t, false);
    let first = (tok0 + 4u * g) * p.n_heads + h;
    if t == 0u {
        part_ml[first * n_chunks + c] = vec2<f32>(m.x, l.x);
        part_ml[(first + p.n_heads) * n_chunks + c] = vec2<f32>(m.y, l.y);
        part_ml[(first + 2u * p.n_heads) * n_chunks + c] = vec2<f32>(m.z, l.z);
        part_ml[(first + 3u * p.n_heads) * n_chunks + c] = vec2<f32>(m.w, l.w);
    }

    // acc: span by span, the weights through red_f, V through kv_s.
    let halves = (row_quads + 15u) / 16u;
    let at = Span(lane.idx, g, t, kv_base, start, row_quads, row_vec4s, live, halves, kvh, int8);
    var acc: array<vec4<f32>, 8>;
    // for # in SPANS: if #u < spans { acc = span(acc, s[#], #u, at); }
    store_acc(first * n_chunks + c, 4u * t, acc[0], acc[4]);
    store_acc((first + p.n_heads) * n_chunks + c, 4u * t, acc[1], acc[5]);
    store_acc((first + 2u * p.n_heads) * n_chunks + c, 4u * t, acc[2], acc[6]);
    store_acc((first + 3u * p.n_heads) * n_chunks + c, 4u * t, acc[3], acc[7]);
}
