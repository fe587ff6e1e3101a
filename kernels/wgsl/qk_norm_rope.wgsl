// One launch per layer and token, one workgroup per head of the fused qkv
// projection output:
//   query heads:  q_out = rope(rms_norm(q_h) * q_norm)
//   key heads:    k_cache[kv_h][pos] = f16(rope(rms_norm(k_h) * k_norm))
//   value heads:  v_cache[kv_h][pos] = f16(v_h)
// RoPE is rotate-half: element d pairs with d + head_dim/2 and turns by
// pos * theta^(-2d/head_dim). The (cos, sin) pairs come from a table the
// host computes once per session in f64: GPU sin/cos of large angles are
// far less precise (Vulkan allows 2^-11 absolute error). The caches hold
// f16 pairs packed in u32, layout [kv_head][capacity][head_dim / 2].
// Batched (prefill): workgroup (h, 0, z) handles token z of the batch, at
// position step.pos + z, reading qkv[z] and writing q_out[z].
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
// The q norm weight, then the k norm weight (head_dim each).
@group(0) @binding(3) var<storage, read> qk_norm: array<f32>;
// rope[pos * head_dim / 2 + d] = (cos, sin) of pos * theta^(-2d/head_dim)
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(7) var<storage, read_write> v_cache: array<u32>;

var<workgroup> head: array<f32, MAX_HEAD_DIM>;

// KV_INT8: the caches are int8 (kv_cache.wgsl's layout): each row's
// scale is its largest magnitude, at word kv_scale_word(0, kv_head, pos)
// (pack4x8snorm(v / scale) rounds 127 v / scale to the nearest integer).
// A row of zeros has scale 0.
override KV_INT8: bool = false;

// The multiplier that maps a row of largest magnitude `absmax` into
// [-1, 1] (0 for a row of zeros).
fn kv_inv_scale(absmax: f32) -> f32 {
    return select(0.0, 1.0 / absmax, absmax > 0.0);
}

// Rotated dim d of the normed k head in `head` (rotate-half RoPE).
fn rotated(d: u32, rope_base: u32, half_dim: u32) -> f32 {
    let cs = rope[rope_base + d % half_dim];
    if d < half_dim {
        return head[d] * cs.x - head[d + half_dim] * cs.y;
    }
    return head[d] * cs.x + head[d - half_dim] * cs.y;
}

@compute @workgroup_size(WG)
fn qk_norm_rope(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let h = wg.x;
    let z = wg.z;
    let pos = step.pos + z;
    let hd = p.head_dim;
    let half_dim = hd / 2u;
    let src = z * p.qkv_stride + h * hd;
    let q_dst = (z * p.n_heads + h) * hd;
    let kv_first = p.n_heads;
    let v_first = p.n_heads + p.n_kv_heads;
    if pos >= p.capacity {
        return; // queued past the capacity: results are never read
    }
    if h >= v_first {
        // Value head: no norm, no rope; straight into the cache.
        let kv = h - v_first;
        if KV_INT8 {
            var m = 0.0;
            for (var d = lane.idx; d < hd; d += WG) {
                m = max(m, abs(qkv[src + d]));
            }
            let absmax = wg_max(m, lane);
            let inv = kv_inv_scale(absmax);
            let dst = (kv * p.capacity + pos) * (hd / 4u);
            for (var i = lane.idx; i < hd / 4u; i += WG) {
                let e = src + 4u * i;
                v_cache[dst + i] = pack4x8snorm(vec4<f32>(qkv[e], qkv[e + 1u], qkv[e + 2u], qkv[e + 3u]) * inv);
            }
            if lane.idx == 0u {
                v_cache[kv_scale_word(0u, kv, pos)] = bitcast<u32>(absmax);
            }
            return;
        }
        let dst = (kv * p.capacity + pos) * half_dim;
        for (var i = lane.idx; i < half_dim; i += WG) {
            v_cache[dst + i] = pack2x16float(vec2<f32>(qkv[src + 2u * i], qkv[src + 2u * i + 1u]));
        }
        return;
    }
    var ss = 0.0;
    for (var d = lane.idx; d < hd; d += WG) {
        let v = qkv[src + d];
        ss += v * v;
    }
    let inv = inverseSqrt(wg_sum4(vec4<f32>(ss, 0.0, 0.0, 0.0), lane).x / f32(hd) + p.eps);
    let is_q = h < kv_first;
    for (var d = lane.idx; d < hd; d += WG) {
        var nw = qk_norm[hd + d];
        if is_q {
            nw = qk_norm[d];
        }
        head[d] = qkv[src + d] * inv * nw;
    }
    workgroupBarrier();
    let rope_base = pos * half_dim;
    if is_q {
        for (var d = lane.idx; d < half_dim; d += WG) {
            let cs = rope[rope_base + d];
            let c = cs.x;
            let s = cs.y;
            let a = head[d];
            let b = head[d + half_dim];
            q_out[q_dst + d] = a * c - b * s;
            q_out[q_dst + d + half_dim] = b * c + a * s;
        }
    } else if KV_INT8 {
        // The rotated row's largest magnitude first, then each invocation
        // rotates its four dims again and writes them as one word.
        let kv = h - kv_first;
        var m = 0.0;
        for (var d = lane.idx; d < hd; d += WG) {
            m = max(m, abs(rotated(d, rope_base, half_dim)));
        }
        let absmax = wg_max(m, lane);
        let inv = kv_inv_scale(absmax);
        let dst = (kv * p.capacity + pos) * (hd / 4u);
        for (var i = lane.idx; i < hd / 4u; i += WG) {
            let d = 4u * i;
            let r = vec4<f32>(rotated(d, rope_base, half_dim), rotated(d + 1u, rope_base, half_dim),
                              rotated(d + 2u, rope_base, half_dim), rotated(d + 3u, rope_base, half_dim));
            k_cache[dst + i] = pack4x8snorm(r * inv);
        }
        if lane.idx == 0u {
            k_cache[kv_scale_word(0u, kv, pos)] = bitcast<u32>(absmax);
        }
    } else {
        // Each invocation writes the packed pair (2i, 2i+1): compute both.
        let kv = h - kv_first;
        let dst = (kv * p.capacity + pos) * half_dim;
        for (var i = lane.idx; i < half_dim; i += WG) {
            var pair: vec2<f32>;
            for (var e = 0u; e < 2u; e++) {
                let d = 2u * i + e;
                let cs = rope[rope_base + d % half_dim];
                let c = cs.x;
                let s = cs.y;
                if d < half_dim {
                    pair[e] = head[d] * c - head[d + half_dim] * s;
                } else {
                    pair[e] = head[d] * c + head[d - half_dim] * s;
                }
            }
            k_cache[dst + i] = pack2x16float(pair);
        }
    }
}
