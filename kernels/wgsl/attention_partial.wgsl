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

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    eps: f32,        // FUSED: rms_norm_eps of the q/k norms
    qkv_stride: u32, // (qk_norm_rope's; unused here)
    scale: f32,      // softmax scale, 1/sqrt(head_dim)
}

override FUSED: bool = false;
override DIRECT: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: Step;
// FUSED: the qkv projection's output (q heads, then k heads, then v heads);
// otherwise each token's normed, rotated q.
@group(0) @binding(2) var<storage, read> q: array<f32>;
// K and V rows are read 8 f16 values (4 words) at a time: head_dim is a
// multiple of 8.
@group(0) @binding(3) var<storage, read_write> k_cache: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<vec4<u32>>;
// [token][head][chunk]: (m, l)
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;
// [token][head][chunk][head_dim]; DIRECT: the attention output,
// [head][head_dim] (one binding for both keeps the kernel within 8 storage
// buffers, the default limit a host application's device may have).
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;
// FUSED: the q norm weight, then the k norm weight (head_dim each), and
// RoPE's (cos, sin) table (rope[pos * head_dim / 2 + d], as qk_norm_rope's).
@group(0) @binding(7) var<storage, read> qk_norm: array<f32>;
@group(0) @binding(8) var<storage, read> rope: array<vec2<f32>>;

const MAX_HEAD_DIM: u32 = 256u;
// Positions per workgroup = WG (one score per invocation).
var<workgroup> q_s: array<vec4<f32>, MAX_HEAD_DIM / 4u>;
var<workgroup> e_s: array<f32, WG>;
var<workgroup> acc_s: array<vec4<f32>, 2u * WG>;
// K row quad j (8 f16 values) dotted with q's dims 8j..8j+7.
fn dot8(a: vec4<u32>, j: u32) -> f32 {
    return dot(q_s[2u * j], vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)))
        + dot(q_s[2u * j + 1u], vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)));
}

// The first and last 4 of the 8 f16 values of a V row quad.
fn lo4(a: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y));
}
fn hi4(a: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w));
}

// FUSED: the normed q and k heads, before rotation.
var<workgroup> qh: array<f32, MAX_HEAD_DIM>;
var<workgroup> kh: array<f32, MAX_HEAD_DIM>;

// Element d of rope(x) at the RoPE table's row `base` (rotate-half: d
// pairs with d +- head_dim/2), x = qh (is_q) or kh.
fn rotated(is_q: bool, d: u32, base: u32) -> f32 {
    let half_dim = p.head_dim / 2u;
    let cs = rope[base + d % half_dim];
    var a: f32;
    var b: f32;
    if is_q {
        a = qh[d];
        b = qh[(d + half_dim) % p.head_dim];
    } else {
        a = kh[d];
        b = kh[(d + half_dim) % p.head_dim];
    }
    if d < half_dim {
        return a * cs.x - b * cs.y;
    }
    return a * cs.x + b * cs.y;
}

// FUSED: q_s = rope(rms_norm(q_h) * q_norm); with `writes_kv`, also the new
// position's k_cache = f16(rope(rms_norm(k) * k_norm)) and v_cache = f16(v).
fn fused_qk(h: u32, kvh: u32, pos: u32, writes_kv: bool, lane: Lane) {
    let hd = p.head_dim;
    let half_dim = hd / 2u;
    let q_src = h * hd;
    let k_src = (p.n_heads + kvh) * hd;
    let v_src = (p.n_heads + p.n_kv_heads + kvh) * hd;
    var sq = vec4<f32>(0.0);
    for (var d = lane.idx; d < hd; d += WG) {
        let a = q[q_src + d];
        sq.x += a * a;
        if writes_kv {
            let b = q[k_src + d];
            sq.y += b * b;
        }
    }
    let ss = wg_sum4(sq, lane);
    let inv_q = inverseSqrt(ss.x / f32(hd) + p.eps);
    let inv_k = inverseSqrt(ss.y / f32(hd) + p.eps);
    for (var d = lane.idx; d < hd; d += WG) {
        qh[d] = q[q_src + d] * inv_q * qk_norm[d];
        if writes_kv {
            kh[d] = q[k_src + d] * inv_k * qk_norm[hd + d];
        }
    }
    workgroupBarrier();
    let base = pos * half_dim;
    for (var i = lane.idx; i < hd / 4u; i += WG) {
        q_s[i] = vec4<f32>(rotated(true, 4u * i, base), rotated(true, 4u * i + 1u, base),
                           rotated(true, 4u * i + 2u, base), rotated(true, 4u * i + 3u, base));
    }
    if writes_kv {
        let row = (kvh * p.capacity + pos) * half_dim;
        for (var i = lane.idx; i < hd / 8u; i += WG) {
            var w: vec4<u32>;
            for (var e = 0u; e < 4u; e++) {
                let d = 8u * i + 2u * e;
                w[e] = pack2x16float(vec2<f32>(rotated(false, d, base), rotated(false, d + 1u, base)));
            }
            k_cache[row / 4u + i] = w;
        }
        for (var i = lane.idx; i < hd / 8u; i += WG) {
            let v = v_src + 8u * i;
            v_cache[row / 4u + i] = vec4<u32>(pack2x16float(vec2<f32>(q[v], q[v + 1u])),
                pack2x16float(vec2<f32>(q[v + 2u], q[v + 3u])), pack2x16float(vec2<f32>(q[v + 4u], q[v + 5u])),
                pack2x16float(vec2<f32>(q[v + 6u], q[v + 7u])));
        }
    }
    // The new row is read back below by other invocations.
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

    // One position per invocation; its K row in 16-byte loads, four at a
    // time (independent loads in flight instead of a chain of one).
    let t = start + lane.idx;
    var s = -3.0e38;
    if t < end {
        let quads = half_dim / 4u;
        let row = (kv_base + t * half_dim) / 4u;
        var d = vec4<f32>(0.0);
        var j = 0u;
        for (; j + 3u < quads; j += 4u) {
            let a = k_cache[row + j];
            let b = k_cache[row + j + 1u];
            let c = k_cache[row + j + 2u];
            let e = k_cache[row + j + 3u];
            d += vec4<f32>(dot8(a, j), dot8(b, j + 1u), dot8(c, j + 2u), dot8(e, j + 3u));
        }
        for (; j < quads; j++) {
            d.x += dot8(k_cache[row + j], j);
        }
        s = (d.x + d.y + d.z + d.w) * p.scale;
    }
    let m = wg_max(s, lane);
    var e = 0.0;
    if t < end {
        e = exp(s - m);
    }
    e_s[lane.idx] = e;
    let l = wg_sum4(vec4<f32>(e, 0.0, 0.0, 0.0), lane).x; // its barriers also publish e_s

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
        // Four positions per iteration: four independent loads in flight.
        let vb = kv_base / 4u + i;
        var tt = start + slice;
        for (; tt + 3u * n_slices < end; tt += 4u * n_slices) {
            let t1 = tt + n_slices;
            let t2 = t1 + n_slices;
            let t3 = t2 + n_slices;
            let v0 = v_cache[vb + tt * row_quads];
            let v1 = v_cache[vb + t1 * row_quads];
            let v2 = v_cache[vb + t2 * row_quads];
            let v3 = v_cache[vb + t3 * row_quads];
            let e0 = e_s[tt - start];
            let e1 = e_s[t1 - start];
            let e2 = e_s[t2 - start];
            let e3 = e_s[t3 - start];
            lo += e0 * lo4(v0) + e1 * lo4(v1) + e2 * lo4(v2) + e3 * lo4(v3);
            hi += e0 * hi4(v0) + e1 * hi4(v1) + e2 * hi4(v2) + e3 * hi4(v3);
        }
        for (; tt < end; tt += n_slices) {
            let v = v_cache[vb + tt * row_quads];
            lo += e_s[tt - start] * lo4(v);
            hi += e_s[tt - start] * hi4(v);
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
