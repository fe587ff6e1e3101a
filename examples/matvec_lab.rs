//! Decode matvec designs beside the engine's and beside a read-only floor,
//! at the shapes of a Qwen3 size, each launched 28 times in a row
//! (dependent launches, one copy of the matrix per launch), timed with
//! timestamps: what bounds a matvec, measured by taking parts away.
//!
//! Configs: `engine` (the engine's split-K matvec on f32 x); `engine x16`
//! (the engine's decode split: the normed ones read the residual's f16 copy
//! at x's slot); `floor` (the same bytes read and XOR-ed, nothing else: the
//! limit of a dependent launch); `bis` (rows per subgroup, 4 rows each)
//! with MODE 0 the real arithmetic, 1 no loads of x and norm weights, 2 no
//! int8 conversion, 3 neither, 4 `unpack4x8snorm` conversion, 5 x read as
//! f16 through the x binding (no norm, no int8 conversion), 6 as 5 with
//! the norm's squares and f16 norm weights, 7 x times the norm weights as
//! f16 and the squares of its blocks of 4 as f32 (one 16-byte load), 8 as
//! 6 with the int8 conversion (what `engine x16` computes), 9 as 8
//! converting pairs of bytes through f16, 10 as 8 converting to 1 + u/256
//! without a subtraction (one correction per row and quad); `eng` the
//! engine's decode body called from a lab entry (ENG_Z: x at grid z's
//! token, ENG_LOOP: no peeled first step); `r8` 8 rows per subgroup;
//! `xs`/`xh` x staged in workgroup memory as f32/f16; `splitT` split K with
//! 4 or 8 rows and the workgroup sized to K. Modes 1-3 and 5-10, `eng` and
//! `engine x16` read data that is not the engine's (timing only): their
//! check against `engine` prints WRONG; the others must match it.
//!
//! `engine x16 halfwg` halves a split-K launch's workgroup (two steps a
//! lane); `xs4` is `xs` over int4 weights (`--weights int4` only);
//! `engine x16 wg64|wg128` runs the rows-per-team launches with 2 or 4
//! teams a workgroup, `pf` loads a lane's steps before any arithmetic,
//! `nodq` skips the int4 dequantisation and `x16in` reads f16 x in the
//! launches without a norm (the last two timing only); `idot` is int4
//! against x quantised to one int8 part (llama.cpp's scheme; f16 x unless
//! `f32x`, `r8` 8 rows a team). `--weights int4`
//! runs the engine configs and the floor on int4 matrices (the lab's own
//! kernels read int8 only).
//!
//! `cargo run --release --example matvec_lab -- --size 0.6b|1.7b|4b|8b
//! [--repeat N] [--only LABEL,LABEL] [--no-lm] [--weights int4]` (portable policy).

use qwen3_wgpu::internals::converted::QUANT_GROUP;
use qwen3_wgpu::internals::kernels::{
    compile, Kernel, MatvecConstants, MatvecLayout, MatvecParams, MatvecShape, MatvecSplit,
};
use qwen3_wgpu::{AdapterPolicy, Gpu, WeightFormat};

const LAYERS: u32 = 28;

const LAB: &str = r#"
// ---- lab kernels ----
// The old finish: the sum of squares as a vec4 of partials.
fn lab_finish(sums: vec4<f32>, ss: vec4<f32>) -> vec4<f32> {
    return finish(sums, ss.x + ss.y + ss.z + ss.w);
}
// The old all-reduce's name: the prelude's tree reduction with the sum of squares.
fn wg_sum5(v: vec4<f32>, s: f32, lane: Lane) -> Sum5 {
    return tree_wg_sum5(v, s, true, lane);
}
override UNROLL: u32 = 4u;
override PERSIST: u32 = 0u;

@compute @workgroup_size(WG)
fn lab_floor(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = arrayLength(&w);
    let stride = nwg.x * WG;
    var acc = vec4<u32>(0u);
    var i = g.x;
    for (; i + 3u * stride < n; i += 4u * stride) {
        let a = w[i];
        let b = w[i + stride];
        let c = w[i + 2u * stride];
        let d = w[i + 3u * stride];
        acc ^= a ^ b ^ c ^ d;
    }
    for (; i < n; i += stride) {
        acc ^= w[i];
    }
    let ns = arrayLength(&scales);
    for (var s = g.x; s < ns; s += stride) {
        acc.x ^= bitcast<u32>(scales[s]);
    }
    if all(acc == vec4<u32>(0x12345678u)) {
        y[0] = 1.0;
    }
}

struct W4 {
    a: vec4<u32>,
    b: vec4<u32>,
    c: vec4<u32>,
    d: vec4<u32>,
    s: vec4<f32>,
}

fn load4(rows: vec4<u32>, j: u32) -> W4 {
    let kq = n_k_words() / 4u;
    let g = j / (GROUP_WORDS / 4u);
    return W4(w[rows.x * kq + j], w[rows.y * kq + j], w[rows.z * kq + j], w[rows.w * kq + j],
              vec4<f32>(scales[rows.x * n_groups() + g], scales[rows.y * n_groups() + g],
                        scales[rows.z * n_groups() + g], scales[rows.w * n_groups() + g]));
}

fn use4(o: ptr<function, Partial>, v: W4, j: u32) {
    let q = xq(4u * j, j);
    (*o).acc += rows4(v.a, v.b, v.c, v.d, q) * v.s;
    (*o).ss += q.sq;
}

// Rows per team, each team's 4 rows with 4 steps' loads issued before use.
fn lab_rows_block(lane: Lane, row0: u32) {
    let kq = n_k_words() / 4u;
    let rows = vec4<u32>(row0, min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
    let ts = team_size(lane);
    let tl = team_lane(lane);
    var o = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    var j = tl;
    if UNROLL >= 4u {
        for (; j + 3u * ts < kq; j += 4u * ts) {
            let v0 = load4(rows, j);
            let v1 = load4(rows, j + ts);
            let v2 = load4(rows, j + 2u * ts);
            let v3 = load4(rows, j + 3u * ts);
            use4(&o, v0, j);
            use4(&o, v1, j + ts);
            use4(&o, v2, j + 2u * ts);
            use4(&o, v3, j + 3u * ts);
        }
    }
    if UNROLL >= 2u {
        for (; j + ts < kq; j += 2u * ts) {
            let v0 = load4(rows, j);
            let v1 = load4(rows, j + ts);
            use4(&o, v0, j);
            use4(&o, v1, j + ts);
        }
    }
    for (; j < kq; j += ts) {
        let v0 = load4(rows, j);
        use4(&o, v0, j);
    }
    let sums = team_sum4(o.acc, lane);
    var ss = vec4<f32>(0.0);
    if NORM {
        ss = team_sum4(o.ss, lane);
    }
    store4(row0, lab_finish(sums, ss), tl, 0u);
}

@compute @workgroup_size(WG)
fn lab_rows(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    if PERSIST > 0u {
        // Persistent: workgroup `flat` takes blocks flat, flat + nwg, ...
        let blocks = (n_rows() + ROWS_PER_WG - 1u) / ROWS_PER_WG;
        for (var b = flat; b < blocks; b += nwg.x * nwg.y) {
            for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
                let row0 = b * ROWS_PER_WG + rb;
                if row0 < n_rows() {
                    lab_rows_block(lane, row0);
                }
            }
        }
        return;
    }
    for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            lab_rows_block(lane, row0);
        }
    }
}

// Split K over the workgroup for 4 rows, each lane's steps (up to UNROLL
// of them) loaded before use.
@compute @workgroup_size(WG)
fn lab_split(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * ROWS_PER_WG;
    if row0 >= n_rows() {
        return;
    }
    let kq = n_k_words() / 4u;
    let rows = vec4<u32>(row0, min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
    var o = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    var j = lane.idx;
    for (; j + WG < kq; j += 2u * WG) {
        let v0 = load4(rows, j);
        let v1 = load4(rows, j + WG);
        use4(&o, v0, j);
        use4(&o, v1, j + WG);
    }
    for (; j < kq; j += WG) {
        let v0 = load4(rows, j);
        use4(&o, v0, j);
    }
    let ss = o.ss;
    let r = wg_sum5(o.acc, ss.x + ss.y + ss.z + ss.w, lane);
    store4(row0, lab_finish(r.v, vec4<f32>(r.s, 0.0, 0.0, 0.0)), lane.idx, 0u);
}

// ---- bisection ----
override MODE: u32 = 0u; // 0 full, 1 no x loads, 2 no int8 conversion, 3 neither, 4 snorm conversion
override R8: bool = false; // 8 rows per team (two blocks of 4 sharing each x quad)

fn cvt(v: u32) -> vec4<f32> {
    if MODE == 4u {
        return unpack4x8snorm(v);
    }
    if MODE == 9u {
        // Pairs of bytes set into f16 1024 + u, widened, less 1152.
        let u = v ^ 0x80808080u;
        let a = unpack2x16float((u & 0x00ff00ffu) | 0x64006400u);
        let b = unpack2x16float(((u >> 8u) & 0x00ff00ffu) | 0x64006400u);
        return vec4<f32>(a.x, b.x, a.y, b.y) - vec4<f32>(1152.0);
    }
    if MODE == 10u {
        // 1 + u / 256 (u = q + 128), no subtraction: rows4m corrects.
        let u = v ^ 0x80808080u;
        let m = (vec4<u32>(u << 15u, u << 7u, u >> 1u, u >> 9u) & vec4<u32>(0x7f8000u)) | vec4<u32>(0x3f800000u);
        return bitcast<vec4<f32>>(m);
    }
    if MODE == 2u || MODE == 3u || (MODE >= 5u && MODE <= 7u) {
        return bitcast<vec4<f32>>(vec4<u32>(v, v >> 8u, v >> 16u, v >> 24u));
    }
    return i8x4(v);
}
fn dotm(wv: vec4<u32>, q: Quad) -> f32 {
    return dot(cvt(wv.x), q.x0) + dot(cvt(wv.y), q.x1) + dot(cvt(wv.z), q.x2) + dot(cvt(wv.w), q.x3);
}
fn rows4m(v: W4, q: Quad) -> vec4<f32> {
    var s = v.s;
    if MODE == 4u {
        s *= 127.0;
    }
    if MODE == 10u {
        // q = 256 (f - 1.5): one correction per row for the quad's 16 x.
        let sx = dot(q.x0 + q.x1 + q.x2 + q.x3, vec4<f32>(1.0));
        return (vec4<f32>(dotm(v.a, q), dotm(v.b, q), dotm(v.c, q), dotm(v.d, q)) - vec4<f32>(1.5 * sx)) * (256.0 * s);
    }
    return vec4<f32>(dotm(v.a, q), dotm(v.b, q), dotm(v.c, q), dotm(v.d, q)) * s;
}
fn quad_g(j: u32) -> Quad {
    if MODE == 5u {
        let a = bitcast<vec4<u32>>(x[2u * j]);
        let b = bitcast<vec4<u32>>(x[2u * j + 1u]);
        return Quad(vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)), vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)),
                    vec4<f32>(unpack2x16float(b.x), unpack2x16float(b.y)), vec4<f32>(unpack2x16float(b.z), unpack2x16float(b.w)),
                    vec4<f32>(0.0));
    }
    if MODE >= 6u {
        // x as f16 (8 values per 16-byte element) from the read-only binding.
        let a = bitcast<vec4<u32>>(x[2u * j]);
        let b = bitcast<vec4<u32>>(x[2u * j + 1u]);
        var q = Quad(vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)), vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)),
                     vec4<f32>(unpack2x16float(b.x), unpack2x16float(b.y)), vec4<f32>(unpack2x16float(b.z), unpack2x16float(b.w)),
                     vec4<f32>(0.0));
        if MODE != 7u {
            // The norm as the engine's X16 path does it: squares, then the
            // norm weights' f16 copy (two 16-byte loads).
            q.sq = q.x0 * q.x0 + q.x1 * q.x1 + q.x2 * q.x2 + q.x3 * q.x3;
            let g0 = norm_w[n_k_words() + 2u * j];
            let g1 = norm_w[n_k_words() + 2u * j + 1u];
            q.x0 *= vec4<f32>(unpack2x16float(g0.x), unpack2x16float(g0.y));
            q.x1 *= vec4<f32>(unpack2x16float(g0.z), unpack2x16float(g0.w));
            q.x2 *= vec4<f32>(unpack2x16float(g1.x), unpack2x16float(g1.y));
            q.x3 *= vec4<f32>(unpack2x16float(g1.z), unpack2x16float(g1.w));
        } else {
            // x already times the norm weights, and the squares of x's
            // blocks of 4 (one 16-byte load).
            q.sq = bitcast<vec4<f32>>(x[n_k_words() / 2u + j]);
        }
        return q;
    }
    if MODE == 1u || MODE == 3u {
        let c = f32(j) * 1e-3;
        return Quad(vec4<f32>(c), vec4<f32>(c + 0.5), vec4<f32>(0.25), vec4<f32>(2.0), vec4<f32>(0.0));
    }
    return xq(4u * j, j);
}

struct Acc8 {
    a: vec4<f32>,
    b: vec4<f32>,
    ss: vec4<f32>,
}

fn store_team(lane: Lane, row0: u32, o: Acc8, ssum: f32, have_ssum: bool) {
    let tl = team_lane(lane);
    var sa = team_sum4(o.a, lane);
    var sb = vec4<f32>(0.0);
    if R8 {
        sb = team_sum4(o.b, lane);
    }
    if NORM {
        var t = ssum;
        if !have_ssum {
            let ss = team_sum4(o.ss, lane);
            t = ss.x + ss.y + ss.z + ss.w;
        }
        let r = inverseSqrt(t / f32(n_inputs()) + p.eps);
        sa *= r;
        sb *= r;
    }
    store4(row0, sa, tl, 0u);
    if R8 && row0 + 4u < n_rows() {
        store4(row0 + 4u, sb, tl, 0u);
    }
}

fn rows_of(row0: u32) -> vec4<u32> {
    return vec4<u32>(min(row0, n_rows() - 1u), min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
}

@compute @workgroup_size(WG)
fn lab_bis(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    let per_team = select(4u, 8u, R8);
    let kq = n_k_words() / 4u;
    for (var rb = team_id(lane) * per_team; rb < ROWS_PER_WG; rb += team_count(lane) * per_team) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            let ra = rows_of(row0);
            let rbb = rows_of(row0 + 4u);
            var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
            for (var j = team_lane(lane); j < kq; j += team_size(lane)) {
                let va = load4(ra, j);
                let q = quad_g(j);
                o.a += rows4m(va, q);
                o.ss += q.sq;
                if R8 {
                    let vb = load4(rbb, j);
                    o.b += rows4m(vb, q);
                }
            }
            store_team(lane, row0, o, 0.0, false);
        }
    }
}

// The engine's decode body (partial4: first step peeled, then the loop)
// per block of 4 rows; ENG_Z: x from grid z's token (as the engine), else 0;
// ENG_LOOP: no peeled step (one loop over step4).
override ENG_Z: bool = false;
override ENG_LOOP: bool = false;

@compute @workgroup_size(WG)
fn lab_eng(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    let xb = select(0u, wg.z * n_k_words(), ENG_Z);
    let tl = team_lane(lane);
    for (var rb = team_id(lane) * 4u; rb < ROWS_PER_WG; rb += team_count(lane) * 4u) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            var part = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
            if ENG_LOOP {
                let rows = rows_of(row0);
                for (var j = tl; j < n_k_words() / 4u; j += team_size(lane)) {
                    let a = step4(rows, xb, j);
                    part.acc += a.acc;
                    part.ss += a.ss;
                }
            } else {
                part = partial4(row0, xb, tl, team_size(lane));
            }
            let sums = team_sum4(part.acc, lane);
            var ss = vec4<f32>(0.0);
            if NORM {
                ss = team_sum4(part.ss, lane);
            }
            store4(row0, lab_finish(sums, ss), tl, 0u);
        }
    }
}

// x (normed, with NORM) staged in workgroup memory first.
var<workgroup> xs: array<vec4<f32>, XQ_LEN>;

@compute @workgroup_size(WG)
fn lab_xs(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    if flat * ROWS_PER_WG >= n_rows() {
        return;
    }
    var ssl = 0.0;
    for (var i = lane.idx; i < n_k_words(); i += WG) {
        var v = x[i];
        if NORM {
            ssl += dot(v, v);
            v *= bitcast<vec4<f32>>(norm_w[i]);
        }
        xs[i] = v;
    }
    let ssum = wg_sum5(vec4<f32>(0.0), ssl, lane).s; // its barriers publish xs
    let per_team = select(4u, 8u, R8);
    let kq = n_k_words() / 4u;
    for (var rb = team_id(lane) * per_team; rb < ROWS_PER_WG; rb += team_count(lane) * per_team) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            let ra = rows_of(row0);
            let rbb = rows_of(row0 + 4u);
            var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
            for (var j = team_lane(lane); j < kq; j += team_size(lane)) {
                let va = load4(ra, j);
                let q = Quad(xs[4u * j], xs[4u * j + 1u], xs[4u * j + 2u], xs[4u * j + 3u], vec4<f32>(0.0));
                o.a += rows4m(va, q);
                if R8 {
                    let vb = load4(rbb, j);
                    o.b += rows4m(vb, q);
                }
            }
            store_team(lane, row0, o, ssum, true);
        }
    }
}

// lab_xs over int4 weights (INT4): x (normed with NORM) staged in
// workgroup memory as f32 once per workgroup, each subgroup taking 4 rows
// (8 with R8) per pass; a step is 32 values, x quads 2j and 2j + 1.
@compute @workgroup_size(WG)
fn lab_xs4(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    if flat * ROWS_PER_WG >= n_rows() {
        return;
    }
    var ssl = 0.0;
    for (var i = lane.idx; i < n_k_words(); i += WG) {
        var v = x[i];
        if NORM {
            ssl += dot(v, v);
            v *= bitcast<vec4<f32>>(norm_w[i]);
        }
        xs[i] = v;
    }
    let ssum = wg_sum5(vec4<f32>(0.0), ssl, lane).s; // its barriers publish xs
    let per_team = select(4u, 8u, R8);
    let kq = k_steps();
    for (var rb = team_id(lane) * per_team; rb < ROWS_PER_WG; rb += team_count(lane) * per_team) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            let ra = rows_of(row0);
            let rbb = rows_of(row0 + 4u);
            var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
            for (var j = team_lane(lane); j < kq; j += team_size(lane)) {
                let z = vec4<f32>(0.0);
                let a = Quad(xs[8u * j], xs[8u * j + 1u], xs[8u * j + 2u], xs[8u * j + 3u], z);
                let b = Quad(xs[8u * j + 4u], xs[8u * j + 5u], xs[8u * j + 6u], xs[8u * j + 7u], z);
                let g = step_group(j);
                o.a += rows4_i4(w[ra.x * kq + j], w[ra.y * kq + j], w[ra.z * kq + j], w[ra.w * kq + j], a, b)
                    * scales4(ra, g);
                if R8 {
                    o.b += rows4_i4(w[rbb.x * kq + j], w[rbb.y * kq + j], w[rbb.z * kq + j], w[rbb.w * kq + j], a, b)
                        * scales4(rbb, g);
                }
            }
            store_team(lane, row0, o, ssum, true);
        }
    }
}

// x staged in workgroup memory as f16 pairs (8 values per vec4<u32>).
var<workgroup> xh: array<vec4<u32>, XH_LEN>;

fn h8(a: vec4<f32>, b: vec4<f32>) -> vec4<u32> {
    return vec4<u32>(pack2x16float(a.xy), pack2x16float(a.zw), pack2x16float(b.xy), pack2x16float(b.zw));
}

@compute @workgroup_size(WG)
fn lab_xh(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    if flat * ROWS_PER_WG >= n_rows() {
        return;
    }
    var ssl = 0.0;
    for (var i = lane.idx; i < n_k_words() / 2u; i += WG) {
        var v0 = x[2u * i];
        var v1 = x[2u * i + 1u];
        if NORM {
            ssl += dot(v0, v0) + dot(v1, v1);
            v0 *= bitcast<vec4<f32>>(norm_w[2u * i]);
            v1 *= bitcast<vec4<f32>>(norm_w[2u * i + 1u]);
        }
        xh[i] = h8(v0, v1);
    }
    let ssum = wg_sum5(vec4<f32>(0.0), ssl, lane).s; // its barriers publish xh
    let per_team = select(4u, 8u, R8);
    let kq = n_k_words() / 4u;
    for (var rb = team_id(lane) * per_team; rb < ROWS_PER_WG; rb += team_count(lane) * per_team) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            let ra = rows_of(row0);
            let rbb = rows_of(row0 + 4u);
            var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
            for (var j = team_lane(lane); j < kq; j += team_size(lane)) {
                let va = load4(ra, j);
                let a = xh[2u * j];
                let b = xh[2u * j + 1u];
                let q = Quad(vec4<f32>(unpack2x16float(a.x), unpack2x16float(a.y)), vec4<f32>(unpack2x16float(a.z), unpack2x16float(a.w)),
                             vec4<f32>(unpack2x16float(b.x), unpack2x16float(b.y)), vec4<f32>(unpack2x16float(b.z), unpack2x16float(b.w)),
                             vec4<f32>(0.0));
                o.a += rows4m(va, q);
                if R8 {
                    let vb = load4(rbb, j);
                    o.b += rows4m(vb, q);
                }
            }
            store_team(lane, row0, o, ssum, true);
        }
    }
}

// Split K over the workgroup for 4 or 8 (R8) rows; each lane loads its x
// quad once for all rows.
@compute @workgroup_size(WG)
fn lab_splitT(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row0 = (wg.x + wg.y * nwg.x) * ROWS_PER_WG;
    if row0 >= n_rows() {
        return;
    }
    let kq = n_k_words() / 4u;
    let ra = rows_of(row0);
    let rbb = rows_of(row0 + 4u);
    var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var j = lane.idx; j < kq; j += WG) {
        let q = quad_g(j);
        let va = load4(ra, j);
        o.a += rows4m(va, q);
        o.ss += q.sq;
        if R8 {
            let vb = load4(rbb, j);
            o.b += rows4m(vb, q);
        }
    }
    let ss = o.ss;
    let r = wg_sum5(o.a, ss.x + ss.y + ss.z + ss.w, lane);
    store4(row0, lab_finish(r.v, vec4<f32>(r.s, 0.0, 0.0, 0.0)), lane.idx, 0u);
    if R8 {
        let rb2 = wg_sum4(o.b, lane);
        if row0 + 4u < n_rows() {
            store4(row0 + 4u, lab_finish(rb2, vec4<f32>(r.s, 0.0, 0.0, 0.0)), lane.idx, 0u);
        }
    }
}

// ---- int4 x int8 integer dot products (llama.cpp's mmvq scheme) ----
// Each lane quantises its step's 32 values of x (normed with NORM) to int8
// with one f32 scale (absmax / 127), then each row's step is 8
// dot4I8Packed of its nibbles (biased by 8) against them. IDOT_F32X: x read
// as f32 (checkable); otherwise the f16 copy at x's slot (timing only).
override IDOT_F32X: bool = false;

struct LabXi8 {
    a: vec4<u32>,
    b: vec4<u32>,
    scale: f32,
    bias: i32,
    ss: f32,
}

fn lab_qpack(v: vec4<f32>, inv: f32) -> u32 {
    // round(v * inv) in the low byte of 1.5 * 2^23 + v * inv.
    return pack4xU8(bitcast<vec4<u32>>(fma(v, vec4<f32>(inv), vec4<f32>(12582912.0))));
}

fn lab_xi8(xb: u32, j: u32) -> LabXi8 {
    let b = xb + 8u * j;
    var v0: vec4<f32>; var v1: vec4<f32>; var v2: vec4<f32>; var v3: vec4<f32>;
    var v4: vec4<f32>; var v5: vec4<f32>; var v6: vec4<f32>; var v7: vec4<f32>;
    if IDOT_F32X {
        v0 = x[b]; v1 = x[b + 1u]; v2 = x[b + 2u]; v3 = x[b + 3u];
        v4 = x[b + 4u]; v5 = x[b + 5u]; v6 = x[b + 6u]; v7 = x[b + 7u];
    } else {
        let e0 = bitcast<vec4<u32>>(x[b / 2u]);
        let e1 = bitcast<vec4<u32>>(x[b / 2u + 1u]);
        let e2 = bitcast<vec4<u32>>(x[b / 2u + 2u]);
        let e3 = bitcast<vec4<u32>>(x[b / 2u + 3u]);
        v0 = h4(e0.x, e0.y); v1 = h4(e0.z, e0.w); v2 = h4(e1.x, e1.y); v3 = h4(e1.z, e1.w);
        v4 = h4(e2.x, e2.y); v5 = h4(e2.z, e2.w); v6 = h4(e3.x, e3.y); v7 = h4(e3.z, e3.w);
    }
    var ss = 0.0;
    if NORM {
        ss = dot(v0, v0) + dot(v1, v1) + dot(v2, v2) + dot(v3, v3) + dot(v4, v4) + dot(v5, v5) + dot(v6, v6) + dot(v7, v7);
        if IDOT_F32X {
            let n = 8u * j;
            v0 *= bitcast<vec4<f32>>(norm_w[n]); v1 *= bitcast<vec4<f32>>(norm_w[n + 1u]);
            v2 *= bitcast<vec4<f32>>(norm_w[n + 2u]); v3 *= bitcast<vec4<f32>>(norm_w[n + 3u]);
            v4 *= bitcast<vec4<f32>>(norm_w[n + 4u]); v5 *= bitcast<vec4<f32>>(norm_w[n + 5u]);
            v6 *= bitcast<vec4<f32>>(norm_w[n + 6u]); v7 *= bitcast<vec4<f32>>(norm_w[n + 7u]);
        } else {
            let g0 = norm_w[n_k_words() + 4u * j];
            let g1 = norm_w[n_k_words() + 4u * j + 1u];
            let g2 = norm_w[n_k_words() + 4u * j + 2u];
            let g3 = norm_w[n_k_words() + 4u * j + 3u];
            v0 *= h4(g0.x, g0.y); v1 *= h4(g0.z, g0.w); v2 *= h4(g1.x, g1.y); v3 *= h4(g1.z, g1.w);
            v4 *= h4(g2.x, g2.y); v5 *= h4(g2.z, g2.w); v6 *= h4(g3.x, g3.y); v7 *= h4(g3.z, g3.w);
        }
    }
    let m = max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))), max(max(abs(v4), abs(v5)), max(abs(v6), abs(v7))));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    let qa = vec4<u32>(lab_qpack(v0, inv), lab_qpack(v1, inv), lab_qpack(v2, inv), lab_qpack(v3, inv));
    let qb = vec4<u32>(lab_qpack(v4, inv), lab_qpack(v5, inv), lab_qpack(v6, inv), lab_qpack(v7, inv));
    let one = 0x01010101u;
    let bias = dot4I8Packed(qa.x, one) + dot4I8Packed(qa.y, one) + dot4I8Packed(qa.z, one) + dot4I8Packed(qa.w, one)
        + dot4I8Packed(qb.x, one) + dot4I8Packed(qb.y, one) + dot4I8Packed(qb.z, one) + dot4I8Packed(qb.w, one);
    return LabXi8(qa, qb, amax / 127.0, 8 * bias, ss);
}

// One row's step: its 32 nibbles (word k: values 8k..8k+3 low, 8k+4..8k+7
// high) against the quantised x, as an exact integer.
fn lab_idot_row(wv: vec4<u32>, q: LabXi8) -> i32 {
    let m = wv ^ vec4<u32>(0x88888888u);
    let lo = m & vec4<u32>(0x0f0f0f0fu);
    let hi = (m >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
    return dot4I8Packed(lo.x, q.a.x) + dot4I8Packed(hi.x, q.a.y) + dot4I8Packed(lo.y, q.a.z) + dot4I8Packed(hi.y, q.a.w)
        + dot4I8Packed(lo.z, q.b.x) + dot4I8Packed(hi.z, q.b.y) + dot4I8Packed(lo.w, q.b.z) + dot4I8Packed(hi.w, q.b.w)
        - q.bias;
}

fn lab_idot4(ra: vec4<u32>, j: u32, kq: u32, q: LabXi8) -> vec4<f32> {
    let d = vec4<i32>(lab_idot_row(w[ra.x * kq + j], q), lab_idot_row(w[ra.y * kq + j], q),
                      lab_idot_row(w[ra.z * kq + j], q), lab_idot_row(w[ra.w * kq + j], q));
    return vec4<f32>(d) * scales4(ra, step_group(j)) * q.scale;
}

@compute @workgroup_size(WG)
fn lab_idot(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = wg.x + wg.y * nwg.x;
    let per_team = select(4u, 8u, R8);
    let kq = k_steps();
    for (var rb = team_id(lane) * per_team; rb < ROWS_PER_WG; rb += team_count(lane) * per_team) {
        let row0 = flat * ROWS_PER_WG + rb;
        if row0 < n_rows() {
            let ra = rows_of(row0);
            let rbb = rows_of(row0 + 4u);
            var o = Acc8(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
            for (var j = team_lane(lane); j < kq; j += team_size(lane)) {
                let q = lab_xi8(0u, j);
                o.a += lab_idot4(ra, j, kq, q);
                o.ss.x += q.ss;
                if R8 {
                    o.b += lab_idot4(rbb, j, kq, q);
                }
            }
            store_team(lane, row0, o, 0.0, false);
        }
    }
}
"#;

struct Shape {
    name: String,
    rows: u32,
    cols: u32,
    kernel: Kernel,
}

/// A config: label, entry ("" = the engine's kernel and split), workgroup
/// size, rows per workgroup, extra constants, fixed workgroup count (0: one
/// per block of rows).
struct Config {
    label: &'static str,
    entry: &'static str,
    wg: u32,
    rows_per_wg: u32,
    consts: Vec<(&'static str, f64)>,
    fixed_groups: u32,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let gpu = Gpu::new(AdapterPolicy::Portable)?;
    println!("adapter: {} ({:?}), subgroups: {}", gpu.info.name, gpu.info.backend, gpu.subgroups);
    let arg = |name: &str| args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone());
    let size = arg("--size").unwrap_or("0.6b".into());
    let repeat: u32 = arg("--repeat").and_then(|r| r.parse().ok()).unwrap_or(5);
    let only = arg("--only");
    let format = match arg("--weights").as_deref() {
        Some("int4") => WeightFormat::Int4,
        _ => WeightFormat::Int8,
    };
    let bits = format.bits();
    let mut shapes = shapes_of(&size);
    if args.iter().any(|a| a == "--no-lm") {
        shapes.pop();
    }
    let c = |label, entry, wg, rows_per_wg, consts: &[(&'static str, f64)], fixed_groups| Config {
        label,
        entry,
        wg,
        rows_per_wg,
        consts: consts.to_vec(),
        fixed_groups,
    };
    let configs = vec![
        c("engine", "", 0, 4, &[], 0),
        c("engine x16", "", 0, 4, &[], 0),
        c("floor wg256 x1", "lab_floor", 256, 4, &[], u32::MAX),
        c("bis wg32 m0", "lab_bis", 32, 4, &[("MODE", 0.0)], 0),
        c("bis wg32 m1 nox", "lab_bis", 32, 4, &[("MODE", 1.0)], 0),
        c("bis wg32 m5 xf16", "lab_bis", 32, 4, &[("MODE", 5.0)], 0),
        c("bis wg32 r8 xf16", "lab_bis", 32, 8, &[("R8", 1.0), ("MODE", 5.0)], 0),
        c("bis wg32 m6 x16 g16", "lab_bis", 32, 4, &[("MODE", 6.0)], 0),
        c("bis wg32 m7 xg16 ss", "lab_bis", 32, 4, &[("MODE", 7.0)], 0),
        c("bis wg32 m8 x16 g16 cvt", "lab_bis", 32, 4, &[("MODE", 8.0)], 0),
        c("bis wg32 m9 x16 g16 cvth", "lab_bis", 32, 4, &[("MODE", 9.0)], 0),
        c("bis wg32 m10 x16 g16 cvt1", "lab_bis", 32, 4, &[("MODE", 10.0)], 0),
        c("eng x16", "lab_eng", 32, 4, &[("X16", 1.0)], 0),
        c("eng x16 z", "lab_eng", 32, 4, &[("X16", 1.0), ("ENG_Z", 1.0)], 0),
        c("eng x16 loop", "lab_eng", 32, 4, &[("X16", 1.0), ("ENG_LOOP", 1.0)], 0),
        c("xs wg256", "lab_xs", 256, 32, &[], 0),
        c("xs wg256 r8", "lab_xs", 256, 64, &[("R8", 1.0)], 0),
        c("xh wg128", "lab_xh", 128, 16, &[], 0),
        c("xh wg256", "lab_xh", 256, 32, &[], 0),
        c("xh wg256 r8", "lab_xh", 256, 64, &[("R8", 1.0)], 0),
        c("xh wg512 r8", "lab_xh", 512, 128, &[("R8", 1.0)], 0),
        c("splitT auto r4", "lab_splitT", 0, 4, &[], 0),
        c("splitT auto r8", "lab_splitT", 0, 8, &[("R8", 1.0)], 0),
        c("splitT auto r8 xf16", "lab_splitT", 0, 8, &[("R8", 1.0), ("MODE", 5.0)], 0),
        c("splitT auto r4 nox", "lab_splitT", 0, 4, &[("MODE", 1.0)], 0),
        c("engine x16 halfwg", "", 0, 4, &[], 0),
        c("xs4 wg128", "lab_xs4", 128, 16, &[], 0),
        c("xs4 wg256", "lab_xs4", 256, 32, &[], 0),
        c("xs4 wg256 r8", "lab_xs4", 256, 64, &[("R8", 1.0)], 0),
        c("xs4 wg512", "lab_xs4", 512, 64, &[], 0),
        c("xs4 wg512 r8", "lab_xs4", 512, 128, &[("R8", 1.0)], 0),
        c("idot wg32", "lab_idot", 32, 4, &[], 0),
        c("idot wg32 f32x", "lab_idot", 32, 4, &[("IDOT_F32X", 1.0)], 0),
        c("idot wg32 r8", "lab_idot", 32, 8, &[("R8", 1.0)], 0),
        c("idot wg32 r8 f32x", "lab_idot", 32, 8, &[("R8", 1.0), ("IDOT_F32X", 1.0)], 0),
        c("idot wg64 r8", "lab_idot", 64, 16, &[("R8", 1.0)], 0),
        c("idot wg128", "lab_idot", 128, 16, &[], 0),
        c("engine x16 unpaired", "", 0, 4, &[], 0),
        c("engine x16 paired", "", 0, 4, &[], 0),
        c("engine x16 wg64", "", 0, 4, &[], 0),
        c("engine x16 wg128", "", 0, 4, &[], 0),
        c("engine x16 pf", "", 0, 4, &[], 0),
        c("engine x16 pf wg64", "", 0, 4, &[], 0),
        c("engine x16 nodq", "", 0, 4, &[], 0),
        c("engine x16 x16in", "", 0, 4, &[], 0),
        c("engine x16 pf x16in", "", 0, 4, &[], 0),
    ];

    let mut seed = 0x9e3779b9u32;
    let mut rand_words = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed
            })
            .collect()
    };
    let max_cols = shapes.iter().map(|s| s.cols as usize).max().unwrap_or(0);
    let max_rows = shapes.iter().map(|s| s.rows as usize).max().unwrap_or(0);
    let x = gpu.storage_init("x", bytemuck::cast_slice(&vec![0.01f32; max_cols]))?;
    // f32 norm weights, then room for their f16 copy (X16 reads it).
    let norm_w = gpu.storage_init("norm_w", bytemuck::cast_slice(&vec![1.0f32; 2 * max_cols]))?;
    let y = gpu.storage_init("y", bytemuck::cast_slice(&vec![0.0f32; 2 * max_rows]))?;
    let x16 = gpu.storage("x16", 2 * max_cols);
    let mut mats = Vec::new();
    for s in &shapes {
        let words = s.rows as usize * s.cols as usize * bits / 32;
        let groups = (s.rows * s.cols) as usize / QUANT_GROUP;
        let data = rand_words(words);
        // int4: bf16 scales, two a word (1e-3 in each half).
        let scale_words = if bits == 4 {
            vec![f32::from_bits(0x3a83_3a83); groups.div_ceil(2)]
        } else {
            vec![1e-3f32; groups]
        };
        let n_copies = if s.rows > 100_000 { 1 } else { LAYERS };
        let mut copies = Vec::new();
        for _ in 0..n_copies {
            let w = gpu.storage_init(&s.name, bytemuck::cast_slice(&data))?;
            let sc = gpu.storage_init(&s.name, bytemuck::cast_slice(&scale_words))?;
            copies.push((w, sc));
        }
        mats.push(copies);
    }
    let ts = qwen3_wgpu::internals::gpu::Timestamps::new(&gpu, "lab", 2);
    println!("µs per launch, {LAYERS} dependent launches, best of {repeat}; TB/s of weights + scales");
    print!("{:22}", "config");
    for s in &shapes {
        print!(" {:>24}", s.name);
    }
    println!();
    let mut want: Vec<Vec<f32>> = vec![Vec::new(); shapes.len()];
    for cfg in &configs {
        if let Some(o) = &only {
            if !o.split(',').any(|o| cfg.label == o) {
                continue;
            }
        }
        print!("{:22}", cfg.label);
        for (i, s) in shapes.iter().enumerate() {
            let mut variant = s.kernel.matvec_variant().expect("a matvec variant");
            variant.norm &= !s.name.ends_with("plain");
            // `engine`: f32 x, split K; `engine x16`: the engine's decode split (the
            // normed ones read x's slot as the f16 copy: here the f32 x, timing only).
            let engine_split = if cfg.label.starts_with("engine x16") {
                let mut split =
                    MatvecLayout::SplitK.split_for(variant, s.rows as usize, s.cols as usize / 4, format);
                // `unpaired`: teams of 4 rows throughout; `paired`: teams of 8 in every
                // rows-per-team launch.
                if cfg.label.contains(" unpaired") {
                    split = split.unpaired();
                } else if cfg.label.contains(" paired") && split.layout == MatvecLayout::RowsPerTeam {
                    split = MatvecSplit { rows_per_wg: 8, paired: true, ..split };
                }
                if cfg.label.ends_with("halfwg") && split.layout == MatvecLayout::SplitK {
                    split.workgroup_size = (split.workgroup_size / 2).max(64);
                }
                // `wg64`, `wg128`: the rows-per-team launches with 2 or 4 teams a workgroup.
                for (tag, wg) in [(" wg64", 64), (" wg128", 128)] {
                    if cfg.label.contains(tag) && split.layout == MatvecLayout::RowsPerTeam {
                        split.rows_per_wg *= wg / split.workgroup_size;
                        split.workgroup_size = wg;
                    }
                }
                split
            } else {
                MatvecSplit {
                    x16: false,
                    ..MatvecLayout::SplitK.split(
                        s.rows as usize,
                        s.cols as usize / 4,
                        false,
                        WeightFormat::Int8,
                    )
                }
            };
            let kq = s.cols / 16;
            let auto_wg = kq.div_ceil(kq.div_ceil(256)).div_ceil(32) * 32;
            let split = if cfg.entry.is_empty() {
                engine_split
            } else {
                MatvecSplit {
                    layout: MatvecLayout::RowsPerTeam,
                    workgroup_size: if cfg.wg == 0 { auto_wg } else { cfg.wg },
                    rows_per_wg: cfg.rows_per_wg,
                    x16: false,
                    paired: false,
                }
            };
            let groups = s.cols / QUANT_GROUP as u32;
            let shape = MatvecShape { rows: s.rows, k_words: s.cols / 4, groups, n_in: s.cols };
            let mut constants =
                MatvecConstants { shape: Some(shape), format, ..MatvecConstants::decode(variant, split) }
                    .render();
            let mut src = s.kernel.source(gpu.subgroups);
            if cfg.label.starts_with("engine x16") {
                src = lab_edits(&src, cfg.label);
            }
            let entry = if cfg.entry.is_empty() {
                constants.extend(cfg.consts.iter().cloned());
                s.kernel.entry()
            } else {
                src.push_str(
                    &LAB.replace("XQ_LEN", &(s.cols / 4).to_string())
                        .replace("XH_LEN", &(s.cols / 8).to_string()),
                );
                constants.retain(|(n, _)| !cfg.consts.iter().any(|(m, _)| m == n));
                constants.extend(cfg.consts.iter().cloned());
                cfg.entry
            };
            let (pipeline, layout) = compile(&gpu, &s.name, &src, entry, s.kernel.bindings(), &constants)?;
            let params = MatvecParams {
                rows: s.rows,
                k_words: s.cols / 4,
                groups,
                row_offset: 0,
                n_in: s.cols,
                eps: 1e-6,
                y_stride: 2 * max_rows as u32,
            };
            let u = gpu.uniform("p", bytemuck::bytes_of(&params))?;
            let bgs: Vec<_> = (0..LAYERS as usize)
                .map(|l| {
                    let m = &mats[i][l % mats[i].len()];
                    let entries = [
                        u.as_entire_binding(),
                        x.as_entire_binding(),
                        m.0.as_entire_binding(),
                        m.1.as_entire_binding(),
                        y.as_entire_binding(),
                        norm_w.as_entire_binding(),
                        x16.as_entire_binding(),
                    ];
                    let entries: Vec<_> = entries
                        .into_iter()
                        .enumerate()
                        .map(|(b, resource)| wgpu::BindGroupEntry { binding: b as u32, resource })
                        .collect();
                    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &layout,
                        entries: &entries,
                    })
                })
                .collect();
            let n_groups = match cfg.fixed_groups {
                0 => s.rows.div_ceil(split.rows_per_wg),
                u32::MAX => (s.rows * s.cols / (128 / bits as u32)).div_ceil(cfg.wg),
                n => n,
            };
            let (gx, gy) = if n_groups > 65535 { (65535, n_groups.div_ceil(65535)) } else { (n_groups, 1) };
            let time = || -> Result<f64, qwen3_wgpu::Error> {
                let mut best = f64::MAX;
                for _ in 0..repeat {
                    let mut enc = gpu.device.create_command_encoder(&Default::default());
                    {
                        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: None,
                            timestamp_writes: Some(ts.pass_writes()),
                        });
                        pass.set_pipeline(&pipeline);
                        for bg in &bgs {
                            pass.set_bind_group(0, bg, &[]);
                            pass.dispatch_workgroups(gx, gy, 1);
                        }
                    }
                    ts.resolve(&mut enc);
                    gpu.queue.submit([enc.finish()]);
                    best = best.min(ts.intervals_us(&gpu)?[0]);
                }
                Ok(best)
            };
            // Check: one launch on zeroed y, against the engine's output.
            if !cfg.label.starts_with("floor") {
                gpu.queue.write_buffer(&y, 0, bytemuck::cast_slice(&vec![0.0f32; 2 * max_rows]));
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, &bgs[0], &[]);
                    pass.dispatch_workgroups(gx, gy, 1);
                }
                gpu.queue.submit([enc.finish()]);
                let out: Vec<f32> = bytemuck::cast_slice(&gpu.download(&y, s.rows as usize * 4)?).to_vec();
                if cfg.label == "engine" {
                    want[i] = out;
                } else {
                    let err = out.iter().zip(&want[i]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                    let scale = want[i].iter().map(|a| a.abs()).fold(0.0f32, f32::max);
                    if err.is_nan() || err > 1e-4 * scale.max(1e-6) {
                        print!(" [WRONG err {err:e} of {scale:e} {:?} {:?}]", &out[..3], &want[i][..3]);
                    }
                }
            }
            let t0 = std::time::Instant::now();
            while t0.elapsed().as_secs_f64() < 0.15 {
                time()?;
            }
            let us = time()? / LAYERS as f64;
            let scale_bytes = if bits == 4 { 2.0 } else { 4.0 };
            let bytes =
                s.rows as f64 * s.cols as f64 * (bits as f64 / 8.0 + scale_bytes / QUANT_GROUP as f64);
            print!(" {:>14.2} {:>5.2}TB/s", us, bytes / us / 1e6);
        }
        println!();
    }
    Ok(())
}

/// The engine's kernel with a lab edit, by config label: `pf` issues a
/// lane's weight and scale loads for up to 4 steps before any arithmetic;
/// `nodq` skips the int4 dequantisation (timing only); `x16in` reads f16 x
/// in the launches without a norm too (timing only).
fn lab_edits(src: &str, label: &str) -> String {
    let mut s = src.to_string();
    if label.contains(" pf") {
        let head = "fn partial4(row0: u32, xb: u32, first: u32, stride: u32) -> Partial {";
        assert!(s.contains(head));
        s = s.replace(
            head,
            &format!(
                "{PREFETCH}\nfn partial4_unused(row0: u32, xb: u32, first: u32, stride: u32) -> Partial {{"
            ),
        );
    }
    if label.contains(" nodq") {
        let head = "fn i4x8(v: u32) -> I4x8 {";
        assert!(s.contains(head));
        s = s.replace(
            head,
            "fn i4x8(v: u32) -> I4x8 {\n    if true { return I4x8(bitcast<vec4<f32>>(vec4<u32>(v, v ^ 1u, v ^ 2u, v ^ 3u)), bitcast<vec4<f32>>(vec4<u32>(v ^ 4u, v ^ 5u, v ^ 6u, v ^ 7u))); }",
        );
    }
    if label.contains(" x16in") {
        let head = "if X16 && NORM {";
        assert!(s.contains(head));
        s = s.replacen(head, "if X16 {", 1);
    }
    s
}

const PREFETCH: &str = r#"
fn partial4(row0: u32, xb: u32, first: u32, stride: u32) -> Partial {
    let k_quads = k_steps();
    let rows = vec4<u32>(row0, min(row0 + 1u, n_rows() - 1u), min(row0 + 2u, n_rows() - 1u), min(row0 + 3u, n_rows() - 1u));
    var wv: array<vec4<u32>, 16>;
    var sv: array<vec4<f32>, 4>;
    for (var t = 0u; t < 4u; t++) {
        let j = first + t * stride;
        if j < k_quads {
            wv[4u * t] = w[rows.x * k_quads + j];
            wv[4u * t + 1u] = w[rows.y * k_quads + j];
            wv[4u * t + 2u] = w[rows.z * k_quads + j];
            wv[4u * t + 3u] = w[rows.w * k_quads + j];
            sv[t] = scales4(rows, step_group(j));
        }
    }
    var o = Partial(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var t = 0u; t < 4u; t++) {
        let j = first + t * stride;
        if j < k_quads {
            if INT4 {
                let xx = xq2(xb, j);
                o.acc += rows4_i4(wv[4u * t], wv[4u * t + 1u], wv[4u * t + 2u], wv[4u * t + 3u], xx.a, xx.b) * sv[t];
                o.ss += xx.a.sq + xx.b.sq;
            } else {
                let q = xq(xb + 4u * j, j);
                o.acc += rows4(wv[4u * t], wv[4u * t + 1u], wv[4u * t + 2u], wv[4u * t + 3u], q) * sv[t];
                o.ss += q.sq;
            }
        }
    }
    return o;
}
"#;

fn shapes_of(size: &str) -> Vec<Shape> {
    let (hidden, inter, heads, kv_heads) = match size {
        "0.6b" => (1024, 3072, 16, 8),
        "1.7b" => (2048, 6144, 16, 8),
        "4b" => (2560, 9728, 32, 8),
        _ => (4096, 12288, 32, 8),
    };
    let q_dim = heads * 128;
    let qkv = q_dim + 2 * kv_heads * 128;
    let s = |what: &str, rows: u32, cols: u32, kernel| Shape {
        name: format!("{what} {rows}x{cols}"),
        rows,
        cols,
        kernel,
    };
    vec![
        s("qkv", qkv, hidden, Kernel::Int8MatvecNorm),
        s("o", hidden, q_dim, Kernel::Int8MatvecAccumulate),
        s("gate_up", 2 * inter, hidden, Kernel::Int8MatvecNormSwiglu),
        s("down", hidden, inter, Kernel::Int8MatvecAccumulate),
        s("lm_head", 151936, hidden, Kernel::Int8MatvecNorm),
    ]
}
