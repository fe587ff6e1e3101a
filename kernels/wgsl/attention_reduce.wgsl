// Decode attention, second launch: one workgroup per query head combines
// the chunks attention_partial wrote:
//   M = max_c m_c,  L = sum_c l_c exp(m_c - M),
//   out = sum_c acc_c exp(m_c - M) / L.
// Invocation (slice s, quad q) owns output dims 4q..4q+3 over chunks
// s, s + S, s + 2S, ... (S = WG / (head_dim / 4) slices): it issues the
// loads of eight of its chunks at once (acc as vec4s, with their (m, l)),
// keeps a running max and rescales as it goes, so a context of up to
// 8 * S chunks (16,384 positions at head_dim 128) takes one round trip to
// memory. The slices' (m, l, acc) are then combined in slice order through
// workgroup memory: a fixed order, the same for one token and a batch's.
// Batched (prefill, or a batch of sessions): workgroup (h, 0, z) combines
// token z's chunks into out[z * out_stride ..].
// Params, Step, MAX_HEAD_DIM, NONE: generated from their Rust definitions
// (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part_ml: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> part_acc: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// Each slice's running max and sum (written by its quad-0 invocation), and
// each invocation's sums, rescaled to the common max.
var<workgroup> ml_s: array<vec2<f32>, WG>;
var<workgroup> acc_s: array<vec4<f32>, WG>;

// Chunk (m, l) as loaded: (m, 0) for a chunk past the context, or past the
// last chunk (a clamped index), so it weighs nothing; its acc may hold
// anything and is never multiplied, only selected away.
fn chunk_ml(base: u32, c: u32) -> vec2<f32> {
    let ml = part_ml[base + min(c, p.n_chunks - 1u)];
    return select(vec2<f32>(-3.0e38, 0.0), ml, c < p.n_chunks && ml.y > 0.0);
}

@compute @workgroup_size(WG)
fn attention_reduce(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let z = wg.z;
    let base = (z * nwg.x + h) * p.n_chunks;
    let quads = p.head_dim / 4u;
    let n_slices = WG / quads;
    let s = lane.idx / quads;
    let q = lane.idx % quads;
    let in_slice = s < n_slices;
    // The slice's running max m and sum l, and the quad's sum o, all
    // relative to m.
    var m = -3.0e38;
    var l = 0.0;
    var o = vec4<f32>(0.0);
    if in_slice {
        let last = p.n_chunks - 1u;
        for (var c0 = s; c0 < p.n_chunks; c0 += 8u * n_slices) {
            // Eight chunks' loads in flight before any is used (written
            // out: a local array might be indexed in memory).
            let ns = n_slices;
            let ca = vec4<u32>(c0, c0 + ns, c0 + 2u * ns, c0 + 3u * ns);
            let cb = ca + vec4<u32>(4u * ns);
            let ia = (vec4<u32>(base) + min(ca, vec4<u32>(last))) * quads + vec4<u32>(q);
            let ib = (vec4<u32>(base) + min(cb, vec4<u32>(last))) * quads + vec4<u32>(q);
            let ml0 = chunk_ml(base, ca.x);
            let ml1 = chunk_ml(base, ca.y);
            let ml2 = chunk_ml(base, ca.z);
            let ml3 = chunk_ml(base, ca.w);
            let ml4 = chunk_ml(base, cb.x);
            let ml5 = chunk_ml(base, cb.y);
            let ml6 = chunk_ml(base, cb.z);
            let ml7 = chunk_ml(base, cb.w);
            let a0 = part_acc[ia.x];
            let a1 = part_acc[ia.y];
            let a2 = part_acc[ia.z];
            let a3 = part_acc[ia.w];
            let a4 = part_acc[ib.x];
            let a5 = part_acc[ib.y];
            let a6 = part_acc[ib.z];
            let a7 = part_acc[ib.w];
            let m_new = max(max(max(m, max(ml0.x, ml1.x)), max(ml2.x, ml3.x)),
                            max(max(ml4.x, ml5.x), max(ml6.x, ml7.x)));
            let r = exp(m - m_new);
            let wa = exp(vec4<f32>(ml0.x, ml1.x, ml2.x, ml3.x) - vec4<f32>(m_new));
            let wb = exp(vec4<f32>(ml4.x, ml5.x, ml6.x, ml7.x) - vec4<f32>(m_new));
            let la = vec4<f32>(ml0.y, ml1.y, ml2.y, ml3.y);
            let lb = vec4<f32>(ml4.y, ml5.y, ml6.y, ml7.y);
            l = l * r + dot(la, wa) + dot(lb, wb);
            // A chunk that weighs nothing adds nothing, whatever its acc.
            let ua = select(vec4<f32>(0.0), wa, la > vec4<f32>(0.0));
            let ub = select(vec4<f32>(0.0), wb, lb > vec4<f32>(0.0));
            o = o * r + select(vec4<f32>(0.0), a0 * ua.x, ua.x > 0.0) + select(vec4<f32>(0.0), a1 * ua.y, ua.y > 0.0)
                + select(vec4<f32>(0.0), a2 * ua.z, ua.z > 0.0) + select(vec4<f32>(0.0), a3 * ua.w, ua.w > 0.0)
                + select(vec4<f32>(0.0), a4 * ub.x, ub.x > 0.0) + select(vec4<f32>(0.0), a5 * ub.y, ub.y > 0.0)
                + select(vec4<f32>(0.0), a6 * ub.z, ub.z > 0.0) + select(vec4<f32>(0.0), a7 * ub.w, ub.w > 0.0);
            m = m_new;
        }
    }
    if in_slice && q == 0u {
        ml_s[s] = vec2<f32>(m, l);
    }
    workgroupBarrier();
    var big_m = -3.0e38;
    for (var i = 0u; i < n_slices; i++) {
        big_m = max(big_m, ml_s[i].x);
    }
    acc_s[lane.idx] = o * exp(m - big_m);
    workgroupBarrier();
    if lane.idx < quads {
        var big_l = 0.0;
        var total = vec4<f32>(0.0);
        for (var i = 0u; i < n_slices; i++) {
            big_l += ml_s[i].y * exp(ml_s[i].x - big_m);
            total += acc_s[i * quads + q];
        }
        let r = total / big_l;
        let at = z * p.out_stride + h * p.head_dim + 4u * q;
        out[at] = r.x;
        out[at + 1u] = r.y;
        out[at + 2u] = r.z;
        out[at + 3u] = r.w;
    }
}
