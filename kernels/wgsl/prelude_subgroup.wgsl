// Workgroup reductions built on subgroup operations (Features::SUBGROUP).
// Never assumes a subgroup size: the subgroup index and count come from the
// builtins, so this is correct for lavapipe's 8 lanes and Apple's 32 alike.
// `WG` (the workgroup size) is an override constant every kernel shares, set
// from Rust (no default: a pipeline built without it fails).

override WG: u32;

struct Lane {
    @builtin(local_invocation_index) idx: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) n_sg: u32,
}

// A "team" is a set of invocations that can reduce without a barrier: here
// one subgroup. Kernels that give each team its own rows (int8_matvec) need
// no workgroup memory and no barriers at all.
fn team_id(lane: Lane) -> u32 {
    return lane.sg_id;
}
fn team_count(lane: Lane) -> u32 {
    return lane.n_sg;
}
fn team_lane(lane: Lane) -> u32 {
    return lane.sg_lane;
}
fn team_size(lane: Lane) -> u32 {
    return min(lane.sg_size, WG); // a subgroup wider than the workgroup is partly empty
}
fn team_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    return subgroupAdd(v);
}

var<workgroup> red_f: array<vec4<f32>, WG>;
var<workgroup> red_u: array<u32, WG>;

// Sum of `v` over the workgroup, returned to every invocation.
// Must be called in workgroup-uniform control flow.
fn wg_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    let s = subgroupAdd(v);
    workgroupBarrier(); // earlier readers of red_f are done
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = s;
    }
    workgroupBarrier();
    var t = vec4<f32>(0.0);
    for (var i = 0u; i < lane.n_sg; i++) {
        t += red_f[i];
    }
    return t;
}

// wg_sum4 of `v` and the sum of `s` in one exchange (one barrier pair).
struct Sum5 {
    v: vec4<f32>,
    s: f32,
}

fn wg_sum5(v: vec4<f32>, s: f32, lane: Lane) -> Sum5 {
    let a = subgroupAdd(v);
    let b = subgroupAdd(s);
    workgroupBarrier(); // earlier readers of red_f / red_u are done
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = a;
        red_u[lane.sg_id] = bitcast<u32>(b);
    }
    workgroupBarrier();
    var t = Sum5(vec4<f32>(0.0), 0.0);
    for (var i = 0u; i < lane.n_sg; i++) {
        t.v += red_f[i];
        t.s += bitcast<f32>(red_u[i]);
    }
    return t;
}

// wg_sum5 of four (v, s) pairs (s: their four scalars) in one exchange,
// each pair's sums exactly wg_sum5's (the same subgroup sums, added in the
// same order). Subgroups narrower than 4 lanes: four wg_sum5 calls.
struct Sum5x4 {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
    s: vec4<f32>,
}

fn wg_sum5x4(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, s: vec4<f32>, lane: Lane) -> Sum5x4 {
    let n = lane.n_sg;
    if 4u * n > WG {
        let r0 = wg_sum5(v0, s.x, lane);
        let r1 = wg_sum5(v1, s.y, lane);
        let r2 = wg_sum5(v2, s.z, lane);
        let r3 = wg_sum5(v3, s.w, lane);
        return Sum5x4(r0.v, r1.v, r2.v, r3.v, vec4<f32>(r0.s, r1.s, r2.s, r3.s));
    }
    let a0 = subgroupAdd(v0);
    let a1 = subgroupAdd(v1);
    let a2 = subgroupAdd(v2);
    let a3 = subgroupAdd(v3);
    let b = vec4<f32>(subgroupAdd(s.x), subgroupAdd(s.y), subgroupAdd(s.z), subgroupAdd(s.w));
    workgroupBarrier(); // earlier readers of red_f / red_u are done
    if lane.sg_lane == 0u {
        let i = lane.sg_id;
        red_f[i] = a0;
        red_f[n + i] = a1;
        red_f[2u * n + i] = a2;
        red_f[3u * n + i] = a3;
        red_u[i] = bitcast<u32>(b.x);
        red_u[n + i] = bitcast<u32>(b.y);
        red_u[2u * n + i] = bitcast<u32>(b.z);
        red_u[3u * n + i] = bitcast<u32>(b.w);
    }
    workgroupBarrier();
    var t = Sum5x4(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var i = 0u; i < n; i++) {
        t.v0 += red_f[i];
        t.v1 += red_f[n + i];
        t.v2 += red_f[2u * n + i];
        t.v3 += red_f[3u * n + i];
        t.s.x += bitcast<f32>(red_u[i]);
        t.s.y += bitcast<f32>(red_u[n + i]);
        t.s.z += bitcast<f32>(red_u[2u * n + i]);
        t.s.w += bitcast<f32>(red_u[3u * n + i]);
    }
    return t;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    let s = subgroupMax(v);
    workgroupBarrier();
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = vec4<f32>(s, 0.0, 0.0, 0.0);
    }
    workgroupBarrier();
    var t = red_f[0].x;
    for (var i = 1u; i < lane.n_sg; i++) {
        t = max(t, red_f[i].x);
    }
    return t;
}

// Softmax statistics of `s` over the workgroup: (max m, sum of exp(s - m)),
// to every invocation, in one exchange (one barrier pair): each subgroup
// publishes its own max and sum, rescaled to the common max after.
fn wg_softmax_stats(s: f32, lane: Lane) -> vec2<f32> {
    let m_sg = subgroupMax(s);
    let l_sg = subgroupAdd(exp(s - m_sg));
    workgroupBarrier(); // earlier readers of red_f are done
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = vec4<f32>(m_sg, l_sg, 0.0, 0.0);
    }
    workgroupBarrier();
    var m = red_f[0].x;
    for (var i = 1u; i < lane.n_sg; i++) {
        m = max(m, red_f[i].x);
    }
    var l = 0.0;
    for (var i = 0u; i < lane.n_sg; i++) {
        l += red_f[i].y * exp(red_f[i].x - m);
    }
    return vec2<f32>(m, l);
}

// wg_max of four values at once (one barrier pair).
fn wg_max4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    let s = subgroupMax(v);
    workgroupBarrier();
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = s;
    }
    workgroupBarrier();
    var t = red_f[0];
    for (var i = 1u; i < lane.n_sg; i++) {
        t = max(t, red_f[i]);
    }
    return t;
}

// Index of the largest `v` over the workgroup (ties -> lowest index).
fn wg_argmax(v: f32, i: u32, lane: Lane) -> u32 {
    let m = subgroupMax(v);
    let cand = subgroupMin(select(0xffffffffu, i, v == m));
    workgroupBarrier();
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = vec4<f32>(m, 0.0, 0.0, 0.0);
        red_u[lane.sg_id] = cand;
    }
    workgroupBarrier();
    var best_v = red_f[0].x;
    var best_i = red_u[0];
    for (var k = 1u; k < lane.n_sg; k++) {
        let kv = red_f[k].x;
        let ki = red_u[k];
        if kv > best_v || (kv == best_v && ki < best_i) {
            best_v = kv;
            best_i = ki;
        }
    }
    return best_i;
}
