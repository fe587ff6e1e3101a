// Decode attention for one new query over the KV cache, one workgroup per
// query head. GQA by indexing: kv_head = head / (n_heads / n_kv_heads), no
// K/V copies. Scores go through a global scratch row per head so any
// context length works; softmax is the max-subtracted exp.

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
}

struct Step {
    pos: u32,
    seq_len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<u32>;
@group(0) @binding(4) var<storage, read> v_cache: array<u32>;
@group(0) @binding(5) var<storage, read_write> scores: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const MAX_HEAD_DIM: u32 = 256u;
var<workgroup> q_s: array<vec2<f32>, MAX_HEAD_DIM / 2u>;
var<workgroup> acc_s: array<vec2<f32>, WG>;

@compute @workgroup_size(WG)
fn gqa_attention(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let h = wg.x;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let half_dim = p.head_dim / 2u;
    let n = step.seq_len;
    let kv_base = kvh * p.capacity * half_dim;
    let s_base = h * p.capacity;

    for (var i = lane.idx; i < half_dim; i += WG) {
        q_s[i] = vec2<f32>(q[h * p.head_dim + 2u * i], q[h * p.head_dim + 2u * i + 1u]);
    }
    workgroupBarrier();

    // Scores: one position per invocation.
    var m = -3.0e38;
    for (var t = lane.idx; t < n; t += WG) {
        let row = kv_base + t * half_dim;
        var s = 0.0;
        for (var i = 0u; i < half_dim; i++) {
            let k2 = unpack2x16float(k_cache[row + i]);
            s += dot(q_s[i], k2);
        }
        s *= p.scale;
        scores[s_base + t] = s;
        m = max(m, s);
    }
    m = wg_max(m, lane);
    var l = 0.0;
    for (var t = lane.idx; t < n; t += WG) {
        let e = exp(scores[s_base + t] - m);
        scores[s_base + t] = e;
        l += e;
    }
    l = wg_sum4(vec4<f32>(l, 0.0, 0.0, 0.0), lane).x;
    storageBarrier();

    // Output: invocation (slice, i) sums dims (2i, 2i+1) over positions
    // t = slice, slice + n_slices, ...; then the slices are added.
    let n_slices = WG / half_dim;
    let slice = lane.idx / half_dim;
    let i = lane.idx % half_dim;
    var acc = vec2<f32>(0.0);
    if slice < n_slices {
        for (var t = slice; t < n; t += n_slices) {
            acc += scores[s_base + t] * unpack2x16float(v_cache[kv_base + t * half_dim + i]);
        }
    }
    acc_s[lane.idx] = acc;
    workgroupBarrier();
    if lane.idx < half_dim {
        var total = vec2<f32>(0.0);
        for (var sl = 0u; sl < n_slices; sl++) {
            total += acc_s[sl * half_dim + lane.idx];
        }
        total /= l;
        out[h * p.head_dim + 2u * lane.idx] = total.x;
        out[h * p.head_dim + 2u * lane.idx + 1u] = total.y;
    }
}
