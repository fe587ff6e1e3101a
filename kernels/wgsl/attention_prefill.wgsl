// Prompt batches: attention_partial's batched path for TOKENS consecutive
// tokens per workgroup, so that each K and V row read from memory serves
// TOKENS queries instead of one. Workgroup (h, c, z) attends query head h of
// tokens z * TOKENS .. z * TOKENS + TOKENS - 1 of the batch (positions
// step.pos + token, causal) to positions [c*WG, (c+1)*WG) and writes each
// token's chunk statistics (m, l) and acc exactly as attention_partial does
// for one token; attention_reduce combines the chunks. One score per
// invocation and token; vec4s carry the TOKENS (= 4) tokens side by side.
// q comes normed and rotated from qk_norm_rope, which also wrote the batch's
// K/V. Tokens past the batch (its last group may be partial) are computed
// like the others, from the rows past the batch, and never read.
// Bindings and lo4/hi4: attention_common.wgsl, prepended by Rust after the
// preamble (TOKENS).
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

const QUADS: u32 = MAX_HEAD_DIM / 4u;
// Token n's q at q_s[n * QUADS ..].
var<workgroup> q_s: array<vec4<f32>, TOKENS * QUADS>;
// Per position, the 4 tokens' exp(s - m).
var<workgroup> e_s: array<vec4<f32>, WG>;
var<workgroup> acc_s: array<vec4<f32>, 2u * WG>;

// K row quad j (8 f16 values) dotted with the 4 tokens' dims 8j..8j+7.
fn dot8x4(a: vec4<u32>, j: u32) -> vec4<f32> {
    let lo = lo4(a);
    let hi = hi4(a);
    var r = vec4<f32>(0.0);
    for (var n = 0u; n < 4u; n++) {
        r[n] = dot(q_s[n * QUADS + 2u * j], lo) + dot(q_s[n * QUADS + 2u * j + 1u], hi);
    }
    return r;
}

@compute @workgroup_size(WG)
fn attention_prefill(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let tok0 = wg.z * TOKENS;
    let n_chunks = nwg.y;
    let start = c * WG;
    // Token n attends to positions below ends[n]; the last token furthest.
    let first_pos = step[0] + tok0 + 1u;
    let ends = min(min(vec4<u32>(first_pos) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.capacity)),
                   vec4<u32>(start + WG));
    let end = ends.w;
    if start >= end {
        // An empty chunk for every token: contributes nothing.
        if lane.idx < TOKENS {
            part_ml[((tok0 + lane.idx) * p.n_heads + h) * n_chunks + c] = vec2<f32>(-3.0e38, 0.0);
        }
        return; // whole workgroup: uniform
    }
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let half_dim = p.head_dim / 2u;
    let kv_base = kvh * p.capacity * half_dim;
    let hq = p.head_dim / 4u;
    for (var i = lane.idx; i < TOKENS * hq; i += WG) {
        let n = i / hq;
        let o = ((tok0 + n) * p.n_heads + h) * p.head_dim + 4u * (i % hq);
        q_s[n * QUADS + i % hq] = vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
    }
    workgroupBarrier();

    // One position per invocation; its K row in 16-byte loads, four at a
    // time, each dotted with the 4 tokens' q.
    let t = start + lane.idx;
    let live = vec4<u32>(t) < ends;
    var s = vec4<f32>(-3.0e38);
    if t < end {
        let quads = half_dim / 4u;
        let row = (kv_base + t * half_dim) / 4u;
        var d = vec4<f32>(0.0);
        var j = 0u;
        for (; j + 3u < quads; j += 4u) {
            let k0 = k_cache[row + j];
            let k1 = k_cache[row + j + 1u];
            let k2 = k_cache[row + j + 2u];
            let k3 = k_cache[row + j + 3u];
            d += dot8x4(k0, j) + dot8x4(k1, j + 1u) + dot8x4(k2, j + 2u) + dot8x4(k3, j + 3u);
        }
        for (; j < quads; j++) {
            d += dot8x4(k_cache[row + j], j);
        }
        s = select(vec4<f32>(-3.0e38), d * p.scale, live);
    }
    let m = wg_max4(s, lane);
    let e = select(vec4<f32>(0.0), exp(s - m), live);
    e_s[lane.idx] = e;
    let l = wg_sum4(e, lane); // its barriers also publish e_s

    // Invocation (slice, i) sums dims 8i..8i+7 (one 16-byte load per
    // position, shared by the 4 tokens) over positions start + slice,
    // start + slice + n_slices, ...; then the slices are added, token by
    // token.
    let row_quads = p.head_dim / 8u;
    let n_slices = WG / row_quads;
    let slice = lane.idx / row_quads;
    let i = lane.idx % row_quads;
    var lo0 = vec4<f32>(0.0);
    var lo1 = vec4<f32>(0.0);
    var lo2 = vec4<f32>(0.0);
    var lo3 = vec4<f32>(0.0);
    var hi0 = vec4<f32>(0.0);
    var hi1 = vec4<f32>(0.0);
    var hi2 = vec4<f32>(0.0);
    var hi3 = vec4<f32>(0.0);
    if slice < n_slices {
        let vb = kv_base / 4u + i;
        for (var tt = start + slice; tt < end; tt += n_slices) {
            let v = v_cache[vb + tt * row_quads];
            let ev = e_s[tt - start];
            let a = lo4(v);
            let b = hi4(v);
            lo0 += ev.x * a;
            hi0 += ev.x * b;
            lo1 += ev.y * a;
            hi1 += ev.y * b;
            lo2 += ev.z * a;
            hi2 += ev.z * b;
            lo3 += ev.w * a;
            hi3 += ev.w * b;
        }
    }
    for (var n = 0u; n < TOKENS; n++) {
        let lo = select(select(select(lo0, lo1, n == 1u), lo2, n == 2u), lo3, n == 3u);
        let hi = select(select(select(hi0, hi1, n == 1u), hi2, n == 2u), hi3, n == 3u);
        workgroupBarrier(); // the previous token's readers are done
        acc_s[2u * lane.idx] = lo;
        acc_s[2u * lane.idx + 1u] = hi;
        workgroupBarrier();
        // Invocation d < head_dim adds dim d (= 8i + r) over the slices.
        let part = ((tok0 + n) * p.n_heads + h) * n_chunks + c;
        if lane.idx < p.head_dim {
            let qi = lane.idx / 8u;
            let r = lane.idx % 8u;
            var total = 0.0;
            for (var sl = 0u; sl < n_slices; sl++) {
                total += acc_s[2u * (sl * row_quads + qi) + r / 4u][r % 4u];
            }
            part_acc[part * p.head_dim + lane.idx] = total;
        }
        if lane.idx == 0u {
            part_ml[part] = vec2<f32>(m[n], l[n]);
        }
    }
}
