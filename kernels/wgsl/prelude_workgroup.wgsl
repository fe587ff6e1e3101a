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

// wg_sum4 of `v` and the sum of `s` (two tree reductions here).
struct Sum5 {
    v: vec4<f32>,
    s: f32,
}

fn wg_sum5(v: vec4<f32>, s: f32, lane: Lane) -> Sum5 {
    let a = wg_sum4(v, lane);
    return Sum5(a, wg_sum4(vec4<f32>(s, 0.0, 0.0, 0.0), lane).x);
}

// wg_sum5 of four (v, s) pairs (s: their four scalars), each exactly
// wg_sum5's (prelude_subgroup.wgsl exchanges all four at once).
struct Sum5x4 {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
    s: vec4<f32>,
}

fn wg_sum5x4(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, s: vec4<f32>, lane: Lane) -> Sum5x4 {
    let r0 = wg_sum5(v0, s.x, lane);
    let r1 = wg_sum5(v1, s.y, lane);
    let r2 = wg_sum5(v2, s.z, lane);
    let r3 = wg_sum5(v3, s.w, lane);
    return Sum5x4(r0.v, r1.v, r2.v, r3.v, vec4<f32>(r0.s, r1.s, r2.s, r3.s));
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    return wg_max4(vec4<f32>(v), lane).x;
}

// Softmax statistics of `s` over the workgroup: (max m, sum of exp(s - m)).
fn wg_softmax_stats(s: f32, lane: Lane) -> vec2<f32> {
    let m = wg_max(s, lane);
    return vec2<f32>(m, wg_sum4(vec4<f32>(exp(s - m), 0.0, 0.0, 0.0), lane).x);
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
