// Decode attention, split over positions (as llama.cpp's flash_attn_ext_vec
// and MLX's sdpa_vector 2-pass): workgroup (h, c) attends query head h to
// cached positions [c*CHUNK, (c+1)*CHUNK) and writes that chunk's softmax
// statistics: its max m, its sum l = sum(exp(s - m)) and
// acc = sum(exp(s - m) * v). attention_reduce combines the chunks. GQA by
// indexing: kv_head = h / (n_heads / n_kv_heads), no K/V copies. K/V: f16
// pairs packed in u32, [kv_head][capacity][head_dim/2].
// Batched (prompt tokens): workgroup (h, c, z) serves token z of the batch,
// at position step.pos + z, over positions <= its own (causal); q comes
// normed and rotated from qk_norm_rope, which also wrote the batch's K/V.
//
// Decode steps (one token) fold in qk_norm_rope's work and, at short
// contexts, the reduce, saving two dependent launches per layer:
// - FUSED: q is read raw from the qkv projection's output and normed and
//   rotated here; the workgroup whose chunk holds the new position first
//   writes that position's k (normed, rotated) and v to the caches, then
//   reads them back like any other position. The two query heads of a KV
//   head both write it, the same values.
// - DIRECT (the context fits one chunk; grid (heads, 1, 1)): the chunk's
//   result is the output, normalised and written to part_acc's binding
//   (bound to the output), no reduce.

override FUSED: bool = false;
override DIRECT: bool = false;

// FUSED: the q norm weight, then the k norm weight (head_dim each), and
// RoPE's (cos, sin) table (rope[pos * head_dim / 2 + d], as qk_norm_rope's).
@group(0) @binding(7) var<storage, read> qk_norm: array<f32>;
@group(0) @binding(8) var<storage, read> rope: array<vec2<f32>>;

// Positions per workgroup = WG (one score per invocation).
var<workgroup> q_s: array<vec4<f32>, MAX_HEAD_DIM / 4u>;
var<workgroup> e_s: array<f32, WG>;
var<workgroup> acc_s: array<vec4<f32>, 2u * WG>;
// K row quad j (8 f16 values) dotted with q's dims 8j..8j+7.
fn dot8(a: vec4<u32>, j: u32) -> f32 {
    return dot(q_s[2u * j], lo4(a)) + dot(q_s[2u * j + 1u], hi4(a));
}

// Element d of rotate-half RoPE: a = x[d], b = x[d +- head_dim/2], cs the
// table's (cos, sin) for d mod head_dim/2; `low`: d < head_dim/2.
fn rope_at(a: f32, b: f32, cs: vec2<f32>, low: bool) -> f32 {
    if low {
        return a * cs.x - b * cs.y;
    }
    return a * cs.x + b * cs.y;
}

// FUSED: q_s = rope(rms_norm(q_h) * q_norm); with `writes_kv`, also the new
// position's k_cache = f16(rope(rms_norm(k) * k_norm)) and v_cache = f16(v).
// Every load is issued up front, so the prologue waits on memory once, and
// nothing is exchanged through workgroup memory before the one barrier that
// publishes q_s and the new K/V row:
// - each team sums the heads' squares itself (lane t: dims t, t + team
//   size, ...), so the norms need no workgroup reduction;
// - invocation d < head_dim rotates q's dim d, loading its RoPE partner
//   d +- head_dim/2 itself;
// - invocation j < head_dim/4 rotates k's dims 2j, 2j+1 and their partners
//   2j+h, 2j+1+h (h = head_dim/2) and writes them, and v's, as the two f16
//   pairs (u32 words j and j + h/2) of the new K and V rows.
fn fused_qk(h: u32, kvh: u32, pos: u32, writes_kv: bool, lane: Lane) {
    let hd = p.head_dim;
    let half_dim = hd / 2u;
    let qb = h * hd;
    let kb = (p.n_heads + kvh) * hd;
    let vb = (p.n_heads + p.n_kv_heads + kvh) * hd;
    // q: dim d and its partner.
    let d = lane.idx;
    let dd = min(d, hd - 1u); // in-range index for the inactive invocations
    let low = dd < half_dim;
    let partner = select(dd - half_dim, dd + half_dim, low);
    let qa = q[qb + dd];
    let qp = q[qb + partner];
    let nqa = qk_norm[dd];
    let nqp = qk_norm[partner];
    let cs = rope[pos * half_dim + dd % half_dim];
    // k and v: dims 2j, 2j+1 and 2j+h, 2j+1+h (h = half_dim).
    let j = min(d, half_dim / 2u - 1u);
    let kv_lane = writes_kv && d < half_dim / 2u;
    var k4 = vec4<f32>(0.0);
    var nk4 = vec4<f32>(0.0);
    var v4 = vec4<f32>(0.0);
    var cs0 = vec2<f32>(0.0);
    var cs1 = vec2<f32>(0.0);
    if kv_lane {
        let e = 2u * j;
        k4 = vec4<f32>(q[kb + e], q[kb + e + 1u], q[kb + e + half_dim], q[kb + e + 1u + half_dim]);
        nk4 = vec4<f32>(qk_norm[hd + e], qk_norm[hd + e + 1u], qk_norm[hd + e + half_dim],
                        qk_norm[hd + e + 1u + half_dim]);
        v4 = vec4<f32>(q[vb + e], q[vb + e + 1u], q[vb + e + half_dim], q[vb + e + 1u + half_dim]);
        cs0 = rope[pos * half_dim + e];
        cs1 = rope[pos * half_dim + e + 1u];
    }
    // The heads' sums of squares, q in x and k in y, in every team.
    var sq = vec4<f32>(0.0);
    for (var i = team_lane(lane); i < hd; i += team_size(lane)) {
        let a = q[qb + i];
        sq.x += a * a;
        if writes_kv {
            let b = q[kb + i];
            sq.y += b * b;
        }
    }
    let ss = team_sum4(sq, lane);
    let rq = inverseSqrt(ss.x / f32(hd) + p.eps);
    if d < hd {
        q_s[d / 4u][d % 4u] = rope_at(qa * rq * nqa, qp * rq * nqp, cs, low);
    }
    if kv_lane {
        let kn = k4 * inverseSqrt(ss.y / f32(hd) + p.eps) * nk4;
        // (2j, 2j+h) and (2j+1, 2j+1+h) are RoPE pairs.
        let lo = vec2<f32>(rope_at(kn.x, kn.z, cs0, true), rope_at(kn.y, kn.w, cs1, true));
        let hi = vec2<f32>(rope_at(kn.z, kn.x, cs0, false), rope_at(kn.w, kn.y, cs1, false));
        let row = ((kvh * p.capacity + pos) * half_dim) / 4u;
        let w_lo = j;
        let w_hi = j + half_dim / 2u;
        k_cache[row + w_lo / 4u][w_lo % 4u] = pack2x16float(lo);
        k_cache[row + w_hi / 4u][w_hi % 4u] = pack2x16float(hi);
        v_cache[row + w_lo / 4u][w_lo % 4u] = pack2x16float(v4.xy);
        v_cache[row + w_hi / 4u][w_hi % 4u] = pack2x16float(v4.zw);
    }
    // Publishes q_s, and the new K/V row that other invocations read back.
    storageBarrier();
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn attention_partial(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let z = wg.z;
    let n_chunks = nwg.y;
    let part = (z * p.n_heads + h) * n_chunks + c;
    let start = c * WG;
    let end = min(min(step.pos + z + 1u, p.capacity), start + WG);
    if start >= end {
        // An empty chunk (past the context): contributes nothing.
        if lane.idx == 0u {
            part_ml[part] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let half_dim = p.head_dim / 2u;
    let kv_base = kvh * p.capacity * half_dim;

    if FUSED {
        let pos = step.pos; // one token: z = 0
        fused_qk(h, kvh, pos, pos >= start && pos < end, lane);
    } else {
        for (var i = lane.idx; i < p.head_dim / 4u; i += WG) {
            let o = (z * p.n_heads + h) * p.head_dim + 4u * i;
            q_s[i] = vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
        }
        workgroupBarrier();
    }

    // One position per invocation; its K row in 16-byte loads, eight at a
    // time (independent loads in flight instead of a chain of one).
    let t = start + lane.idx;
    var s = -3.0e38;
    if t < end {
        let quads = half_dim / 4u;
        let row = (kv_base + t * half_dim) / 4u;
        var d = vec4<f32>(0.0);
        var j = 0u;
        for (; j + 7u < quads; j += 8u) {
            let k0 = k_cache[row + j];
            let k1 = k_cache[row + j + 1u];
            let k2 = k_cache[row + j + 2u];
            let k3 = k_cache[row + j + 3u];
            let k4 = k_cache[row + j + 4u];
            let k5 = k_cache[row + j + 5u];
            let k6 = k_cache[row + j + 6u];
            let k7 = k_cache[row + j + 7u];
            d += vec4<f32>(dot8(k0, j) + dot8(k4, j + 4u), dot8(k1, j + 1u) + dot8(k5, j + 5u),
                           dot8(k2, j + 2u) + dot8(k6, j + 6u), dot8(k3, j + 3u) + dot8(k7, j + 7u));
        }
        for (; j < quads; j++) {
            d.x += dot8(k_cache[row + j], j);
        }
        s = (d.x + d.y + d.z + d.w) * p.scale;
    }
    let ml = wg_softmax_stats(s, lane);
    let m = ml.x;
    let l = ml.y;
    var e = 0.0;
    if t < end {
        e = exp(s - m);
    }
    e_s[lane.idx] = e;
    workgroupBarrier(); // publishes e_s

    // Invocation (slice, i) sums dims 8i..8i+7 (one 16-byte load per
    // position) over positions start + slice, start + slice + n_slices, ...;
    // then the slices are added.
    let row_quads = p.head_dim / 8u;
    let n_slices = WG / row_quads;
    let slice = lane.idx / row_quads;
    let i = lane.idx % row_quads;
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    if slice < n_slices {
        // Eight positions per iteration, eight independent loads in flight;
        // the last iteration's positions past the end load the last row
        // and weigh 0 (no one-at-a-time tail: each would be a round trip).
        let vb = kv_base / 4u + i;
        let ns = n_slices;
        let last = end - 1u;
        for (var tt = start + slice; tt < end; tt += 8u * ns) {
            let t = vec4<u32>(tt, tt + ns, tt + 2u * ns, tt + 3u * ns);
            let u = t + vec4<u32>(4u * ns);
            let ta = min(t, vec4<u32>(last));
            let tb = min(u, vec4<u32>(last));
            let v0 = v_cache[vb + ta.x * row_quads];
            let v1 = v_cache[vb + ta.y * row_quads];
            let v2 = v_cache[vb + ta.z * row_quads];
            let v3 = v_cache[vb + ta.w * row_quads];
            let v4 = v_cache[vb + tb.x * row_quads];
            let v5 = v_cache[vb + tb.y * row_quads];
            let v6 = v_cache[vb + tb.z * row_quads];
            let v7 = v_cache[vb + tb.w * row_quads];
            let ea = select(vec4<f32>(0.0), vec4<f32>(e_s[ta.x - start], e_s[ta.y - start], e_s[ta.z - start],
                e_s[ta.w - start]), t < vec4<u32>(end));
            let eb = select(vec4<f32>(0.0), vec4<f32>(e_s[tb.x - start], e_s[tb.y - start], e_s[tb.z - start],
                e_s[tb.w - start]), u < vec4<u32>(end));
            lo += ea.x * lo4(v0) + ea.y * lo4(v1) + ea.z * lo4(v2) + ea.w * lo4(v3) + eb.x * lo4(v4)
                + eb.y * lo4(v5) + eb.z * lo4(v6) + eb.w * lo4(v7);
            hi += ea.x * hi4(v0) + ea.y * hi4(v1) + ea.z * hi4(v2) + ea.w * hi4(v3) + eb.x * hi4(v4)
                + eb.y * hi4(v5) + eb.z * hi4(v6) + eb.w * hi4(v7);
        }
    }
    acc_s[2u * lane.idx] = lo;
    acc_s[2u * lane.idx + 1u] = hi;
    workgroupBarrier();
    // Invocation d < head_dim adds dim d (= 8i + r) over the slices.
    if lane.idx < p.head_dim {
        let qi = lane.idx / 8u;
        let r = lane.idx % 8u;
        var total = 0.0;
        for (var sl = 0u; sl < n_slices; sl++) {
            total += acc_s[2u * (sl * row_quads + qi) + r / 4u][r % 4u];
        }
        if DIRECT {
            part_acc[h * p.head_dim + lane.idx] = total / l;
        } else {
            part_acc[part * p.head_dim + lane.idx] = total;
        }
    }
    if lane.idx == 0u && !DIRECT {
        part_ml[part] = vec2<f32>(m, l);
    }
}
