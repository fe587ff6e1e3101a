// Decode attention, first of two launches (split over positions, as
// llama.cpp's flash_attn_ext_vec and MLX's sdpa_vector 2-pass): workgroup
// (h, c) attends query head h to cached positions [c*CHUNK, (c+1)*CHUNK)
// and writes that chunk's softmax statistics: its max m, its sum
// l = sum(exp(s - m)) and acc = sum(exp(s - m) * v). attention_reduce
// combines the chunks. GQA by indexing: kv_head = h / (n_heads / n_kv_heads),
// no K/V copies. K/V: f16 pairs packed in u32, [kv_head][capacity][head_dim/2].

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
}

// The decode position, kept on the GPU (see qk_norm_rope).
struct Step {
    pos: u32,
    fill_end: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> step: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<u32>;
@group(0) @binding(4) var<storage, read> v_cache: array<u32>;
// [head][chunk]: (m, l)
@group(0) @binding(5) var<storage, read_write> part_ml: array<vec2<f32>>;
// [head][chunk][head_dim]
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;

const MAX_HEAD_DIM: u32 = 256u;
// Positions per workgroup = WG (one score per invocation).
var<workgroup> q_s: array<vec2<f32>, MAX_HEAD_DIM / 2u>;
var<workgroup> e_s: array<f32, WG>;
var<workgroup> acc_s: array<vec2<f32>, WG>;

@compute @workgroup_size(WG)
fn attention_partial(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = wg.x;
    let c = wg.y;
    let n_chunks = nwg.y;
    let part = h * n_chunks + c;
    let start = c * WG;
    let end = min(min(step.pos + 1u, p.capacity), start + WG);
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

    for (var i = lane.idx; i < half_dim; i += WG) {
        q_s[i] = vec2<f32>(q[h * p.head_dim + 2u * i], q[h * p.head_dim + 2u * i + 1u]);
    }
    workgroupBarrier();

    // One position per invocation.
    let t = start + lane.idx;
    var s = -3.0e38;
    if t < end {
        let row = kv_base + t * half_dim;
        var dot_qk = 0.0;
        for (var i = 0u; i < half_dim; i++) {
            dot_qk += dot(q_s[i], unpack2x16float(k_cache[row + i]));
        }
        s = dot_qk * p.scale;
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
        for (var tt = start + slice; tt < end; tt += n_slices) {
            acc += e_s[tt - start] * unpack2x16float(v_cache[kv_base + tt * half_dim + i]);
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
