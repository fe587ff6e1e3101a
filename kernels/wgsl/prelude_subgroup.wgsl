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

// The team sum of `v` in one fixed order, the same on every device with
// this subgroup width: an xor tree over masks team_size / 2 .. 1 (a
// subgroupAdd adds in the driver's order, which may differ between
// pipelines). Every lane gets the same bits (each step adds a pair in
// either order: the same float). The matvec family reduces only through
// the tree_ functions, so its one-token and batched pipelines agree bit
// for bit.
fn tree_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    var s = v;
    for (var m = team_size(lane) / 2u; m > 0u; m >>= 1u) {
        s += subgroupShuffleXor(s, m);
    }
    return s;
}

fn tree_sum(v: f32, lane: Lane) -> f32 {
    var s = v;
    for (var m = team_size(lane) / 2u; m > 0u; m >>= 1u) {
        s += subgroupShuffleXor(s, m);
    }
    return s;
}

// Four tokens' sums over 4 rows: a_t (rows in x, y, z, w) for token t and
// s (token t's scalar in component t), each summed over the team exactly as
// tree_sum4 and tree_sum would (the same additions in the same order; s
// only `with_s`, a pipeline constant), with
// 36 + 20 shuffles at 32 lanes instead of 4 x 40. The top two masks halve
// what a lane keeps (rows 0-1 or 2-3, then one row), the lower ones are
// tree steps on the kept row's four tokens, then the rows are gathered back
// (moves only). Teams of fewer than 4 lanes: tree_sum4 per token.
struct Rows4 {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
    s: vec4<f32>,
}

fn tree_sum_rows4(a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, s: vec4<f32>, with_s: bool,
                  lane: Lane) -> Rows4 {
    let n = team_size(lane);
    var ss = s;
    if with_s {
        for (var m = n / 2u; m > 0u; m >>= 1u) {
            ss += subgroupShuffleXor(ss, m);
        }
    }
    if n < 4u {
        return Rows4(tree_sum4(a0, lane), tree_sum4(a1, lane), tree_sum4(a2, lane), tree_sum4(a3, lane), ss);
    }
    let m1 = n / 2u;
    let m2 = n / 4u;
    let tl = team_lane(lane);
    let hi1 = (tl & m1) != 0u;
    let hi2 = (tl & m2) != 0u;
    // Mask m1: keep rows 0-1 (rows 2-3 where hi1) of every token, add the
    // partner's copies of them: [t0 r, t0 r+1, t1 r, t1 r+1], [t2 .., t3 ..].
    let lo01 = vec4<f32>(a0.xy, a1.xy);
    let lo23 = vec4<f32>(a2.xy, a3.xy);
    let up01 = vec4<f32>(a0.zw, a1.zw);
    let up23 = vec4<f32>(a2.zw, a3.zw);
    let b01 = select(lo01, up01, hi1) + subgroupShuffleXor(select(up01, lo01, hi1), m1);
    let b23 = select(lo23, up23, hi1) + subgroupShuffleXor(select(up23, lo23, hi1), m1);
    // Mask m2: keep one of the two rows, the four tokens' sums of it.
    let even = vec4<f32>(b01.x, b01.z, b23.x, b23.z);
    let odd = vec4<f32>(b01.y, b01.w, b23.y, b23.w);
    var d = select(even, odd, hi2) + subgroupShuffleXor(select(odd, even, hi2), m2);
    for (var m = n / 8u; m > 0u; m >>= 1u) {
        d += subgroupShuffleXor(d, m);
    }
    // Gather: this lane holds row 2 * hi1 + hi2; its pair's other row from
    // mask m2, then the other pair from mask m1.
    let other = subgroupShuffleXor(d, m2);
    let p0 = select(d, other, hi2); // row 2 * hi1
    let p1 = select(other, d, hi2); // row 2 * hi1 + 1
    let q0 = subgroupShuffleXor(p0, m1);
    let q1 = subgroupShuffleXor(p1, m1);
    let r0 = select(p0, q0, hi1);
    let r1 = select(p1, q1, hi1);
    let r2 = select(q0, p0, hi1);
    let r3 = select(q1, p1, hi1);
    return Rows4(vec4<f32>(r0.x, r1.x, r2.x, r3.x), vec4<f32>(r0.y, r1.y, r2.y, r3.y),
                 vec4<f32>(r0.z, r1.z, r2.z, r3.z), vec4<f32>(r0.w, r1.w, r2.w, r3.w), ss);
}

// tree_sum4 of `v` and (`with_s`) tree_sum of `s` over the workgroup: the
// subgroups' sums added in workgroup memory in subgroup order (one barrier
// pair).
struct Sum5 {
    v: vec4<f32>,
    s: f32,
}

fn tree_wg_sum5(v: vec4<f32>, s: f32, with_s: bool, lane: Lane) -> Sum5 {
    let a = tree_sum4(v, lane);
    var b = s;
    if with_s {
        b = tree_sum(s, lane);
    }
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

// tree_sum_rows4 over the workgroup, each token's sums exactly
// tree_wg_sum5's, in one exchange. Workgroups of more than WG / 4
// subgroups: four tree_wg_sum5 calls.
fn tree_wg_sum_rows4(a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, s: vec4<f32>, with_s: bool,
                     lane: Lane) -> Rows4 {
    let n = lane.n_sg;
    if 4u * n > WG {
        let r0 = tree_wg_sum5(a0, s.x, with_s, lane);
        let r1 = tree_wg_sum5(a1, s.y, with_s, lane);
        let r2 = tree_wg_sum5(a2, s.z, with_s, lane);
        let r3 = tree_wg_sum5(a3, s.w, with_s, lane);
        return Rows4(r0.v, r1.v, r2.v, r3.v, vec4<f32>(r0.s, r1.s, r2.s, r3.s));
    }
    let r = tree_sum_rows4(a0, a1, a2, a3, s, with_s, lane);
    workgroupBarrier(); // earlier readers of red_f / red_u are done
    if lane.sg_lane == 0u {
        let i = lane.sg_id;
        red_f[i] = r.a0;
        red_f[n + i] = r.a1;
        red_f[2u * n + i] = r.a2;
        red_f[3u * n + i] = r.a3;
        red_u[i] = bitcast<u32>(r.s.x);
        red_u[n + i] = bitcast<u32>(r.s.y);
        red_u[2u * n + i] = bitcast<u32>(r.s.z);
        red_u[3u * n + i] = bitcast<u32>(r.s.w);
    }
    workgroupBarrier();
    var t = Rows4(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var i = 0u; i < n; i++) {
        t.a0 += red_f[i];
        t.a1 += red_f[n + i];
        t.a2 += red_f[2u * n + i];
        t.a3 += red_f[3u * n + i];
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

// Softmax statistics of two sets of scores over the workgroup (x and y):
// (m.x, m.y, l.x, l.y), each the max m and the sum of exp(s - m), to every
// invocation, in one exchange (one barrier pair): each subgroup publishes
// its own maxima and sums, rescaled to the common maxima after. Each
// component is computed on its own (a set's bits do not depend on the
// other's).
fn wg_softmax_stats2(s: vec2<f32>, lane: Lane) -> vec4<f32> {
    let m_sg = subgroupMax(s);
    let l_sg = subgroupAdd(exp(s - m_sg));
    workgroupBarrier(); // earlier readers of red_f are done
    if lane.sg_lane == 0u {
        red_f[lane.sg_id] = vec4<f32>(m_sg, l_sg);
    }
    workgroupBarrier();
    var m = red_f[0].xy;
    for (var i = 1u; i < lane.n_sg; i++) {
        m = max(m, red_f[i].xy);
    }
    var l = vec2<f32>(0.0);
    for (var i = 0u; i < lane.n_sg; i++) {
        l += red_f[i].zw * exp(red_f[i].xy - m);
    }
    return vec4<f32>(m, l);
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
