// Workgroup reductions through workgroup memory only (adapters without
// Features::SUBGROUP). Same functions as prelude_subgroup.wgsl. `WG` must be
// a power of two.

override WG: u32;

struct Lane {
    @builtin(local_invocation_index) idx: u32,
}

// Without subgroups the whole workgroup is one team (see prelude_subgroup).
fn team_id(lane: Lane) -> u32 {
    return 0u;
}
fn team_count(lane: Lane) -> u32 {
    return 1u;
}
fn team_lane(lane: Lane) -> u32 {
    return lane.idx;
}
fn team_size(lane: Lane) -> u32 {
    return WG;
}
fn team_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    return wg_sum4(v, lane);
}

var<workgroup> red_f: array<vec4<f32>, WG>;
var<workgroup> red_u: array<u32, WG>;

fn wg_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    workgroupBarrier();
    red_f[lane.idx] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if lane.idx < s {
            red_f[lane.idx] += red_f[lane.idx + s];
        }
        workgroupBarrier();
    }
    return red_f[0];
}

// The matvec family's reductions (prelude_subgroup.wgsl's tree_
// functions): here every sum is wg_sum4's tree, in one fixed order.
fn tree_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    return wg_sum4(v, lane);
}

fn tree_sum(v: f32, lane: Lane) -> f32 {
    return wg_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), lane).x;
}

struct Rows4 {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
    s: vec4<f32>,
}

// Each component of s summed as tree_sum sums it (the same tree per
// component).
fn tree_sum_rows4(a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, s: vec4<f32>, with_s: bool,
                  lane: Lane) -> Rows4 {
    var ss = s;
    if with_s {
        ss = wg_sum4(s, lane);
    }
    return Rows4(wg_sum4(a0, lane), wg_sum4(a1, lane), wg_sum4(a2, lane), wg_sum4(a3, lane), ss);
}

struct Sum5 {
    v: vec4<f32>,
    s: f32,
}

fn tree_wg_sum5(v: vec4<f32>, s: f32, with_s: bool, lane: Lane) -> Sum5 {
    var b = s;
    if with_s {
        b = tree_sum(s, lane);
    }
    return Sum5(tree_sum4(v, lane), b);
}

fn tree_wg_sum_rows4(a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, s: vec4<f32>, with_s: bool,
                     lane: Lane) -> Rows4 {
    return tree_sum_rows4(a0, a1, a2, a3, s, with_s, lane);
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    return wg_max4(vec4<f32>(v), lane).x;
}

// Softmax statistics of two sets of scores (x and y): (m.x, m.y, l.x,
// l.y), each the max m and the sum of exp(s - m).
fn wg_softmax_stats2(s: vec2<f32>, lane: Lane) -> vec4<f32> {
    let m = wg_max4(vec4<f32>(s, s), lane).xy;
    return vec4<f32>(m, wg_sum4(vec4<f32>(exp(s - m), 0.0, 0.0), lane).xy);
}

fn wg_max4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    workgroupBarrier();
    red_f[lane.idx] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if lane.idx < s {
            red_f[lane.idx] = max(red_f[lane.idx], red_f[lane.idx + s]);
        }
        workgroupBarrier();
    }
    return red_f[0];
}

fn wg_argmax(v: f32, i: u32, lane: Lane) -> u32 {
    workgroupBarrier();
    red_f[lane.idx] = vec4<f32>(v, 0.0, 0.0, 0.0);
    red_u[lane.idx] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if lane.idx < s {
            let ov = red_f[lane.idx + s].x;
            let oi = red_u[lane.idx + s];
            let mv = red_f[lane.idx].x;
            if ov > mv || (ov == mv && oi < red_u[lane.idx]) {
                red_f[lane.idx] = vec4<f32>(ov, 0.0, 0.0, 0.0);
                red_u[lane.idx] = oi;
            }
        }
        workgroupBarrier();
    }
    return red_u[0];
}
