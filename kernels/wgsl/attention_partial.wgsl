// Decode attention, first of two launches (split over positions, as
// llama.cpp's flash_attn_ext_vec and MLX's sdpa_vector 2-pass): workgroup
// (h, c) attends query head h to cached positions [c*CHUNK, (c+1)*CHUNK)
// and writes that chunk's softmax statistics: its max m, its sum
// l = sum(exp(s - m)) and acc = sum(exp(s - m) * v). attention_reduce
// combines the chunks. GQA by indexing: kv_head = h / (n_heads / n_kv_heads),
// no K/V copies. K/V: f16 pairs packed in u32, [kv_head][capacity][head_dim/2].
// Batched (prefill): workgroup (h, c, z) serves token z of the batch, at
// position step.pos + z, over positions <= its own (causal).

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
// Read 8 f16 values (4 words) at a time: head_dim is a multiple of 8.
@group(0) @binding(3) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> v_cache: array<u32>;
// [token][head][chunk]: (m, l)
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;
// [token][head][chunk][head_dim]
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;

const MAX_HEAD_DIM: u32 = 256u;
// Positions per workgroup = WG (one score per invocation).
var<workgroup> q_s: array<vec4<f32>, MAX_HEAD_DIM / 4u>;
var<workgroup> e_s: array<f32, WG>;
var<workgroup> acc_s: array<vec2<f32>, WG>;

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

    for (var i = lane.idx; i < p.head_dim / 4u; i += WG) {
        let o = (z * p.n_heads + h) * p.head_dim + 4u * i;
        q_s[i] = vec4<f32>(q[o], q[o + 1u], q[o + 2u], q[o + 3u]);
    }
    workgroupBarrier();

    // One position per invocation; its K row in 16-byte loads, two at a
    // time (independent loads in flight instead of a chain of one).
    let t = start + lane.idx;
    var s = -3.0e38;
    if t < end {
        let quads = half_dim / 4u;
        let row = (kv_base + t * half_dim) / 4u;
        var d0 = 0.0;
        var d1 = 0.0;
        for (var j = 0u; j < quads; j += 2u) {
            let a = k_cache[row + j];
            d0 += dot(q_s[2u * j], vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)))
                + dot(q_s[2u * j + 1u], vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)));
            if j + 1u < quads {
                let b = k_cache[row + j + 1u];
                d1 += dot(q_s[2u * j + 2u], vec4<f32>(unpack2x16float(b.x), unpack2x16float(b.y)))
                    + dot(q_s[2u * j + 3u], vec4<f32>(unpack2x16float(b.z), unpack2x16float(b.w)));
            }
        }
        s = (d0 + d1) * p.scale;
    }
    let m = wg_max(s, lane);
    var e = 0.0;
    if t < end {
        e = exp(s - m);
    }
    e_s[lane.idx] = e;
    let l = wg_sum4(vec4<f32>(e, 0.0, 0.0, 0.0), lane).x; // its barriers also publish e_s

    // Invocation (slice, i) sums dims (2i, 2i+1) over positions
    // start + slice, start + slice + n_slices, ...; then the slices are added.
    let n_slices = WG / half_dim;
    let slice = lane.idx / half_dim;
    let i = lane.idx % half_dim;
    var acc = vec2<f32>(0.0);
    if slice < n_slices {
        // Four positions per iteration: four independent loads in flight.
        let vb = kv_base + i;
        var tt = start + slice;
        for (; tt + 3u * n_slices < end; tt += 4u * n_slices) {
            let t1 = tt + n_slices;
            let t2 = t1 + n_slices;
            let t3 = t2 + n_slices;
            let v0 = unpack2x16float(v_cache[vb + tt * half_dim]);
            let v1 = unpack2x16float(v_cache[vb + t1 * half_dim]);
            let v2 = unpack2x16float(v_cache[vb + t2 * half_dim]);
            let v3 = unpack2x16float(v_cache[vb + t3 * half_dim]);
            acc += e_s[tt - start] * v0 + e_s[t1 - start] * v1 + e_s[t2 - start] * v2 + e_s[t3 - start] * v3;
        }
        for (; tt < end; tt += n_slices) {
            acc += e_s[tt - start] * unpack2x16float(v_cache[vb + tt * half_dim]);
        }
    }
    acc_s[lane.idx] = acc;
    workgroupBarrier();
    if lane.idx < half_dim {
        var total = vec2<f32>(0.0);
        for (var sl = 0u; sl < n_slices; sl++) {
            total += acc_s[sl * half_dim + lane.idx];
        }
        let o = part * p.head_dim + 2u * lane.idx;
        part_acc[o] = total.x;
        part_acc[o + 1u] = total.y;
    }
    if lane.idx == 0u {
        part_ml[part] = vec2<f32>(m, l);
    }
}
