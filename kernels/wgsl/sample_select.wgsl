// Sampling with temperature T > 0, after sample_max (and sample_penalty):
// launches select_pass = 0 ..= p.passes of this kernel, p.chunk logits
// per workgroup.
//
// Passes below p.passes find the filters' thresholds by radix select over
// the logits' sort keys, 8 bits per pass from the top: top-k's (the k-th
// largest key; passes 0..k_passes) then top-p's (the largest key whose
// mass from the top reaches p times the mass of the top-k set). Each
// workgroup histograms the keys of its chunk that pass the earlier filter
// and match the prefix chosen so far: for top-k counts, for top-p the
// masses exp((l - M) / T) in 64-bit fixed point (2^31 = the top token's), summed
// with integer atomics so the sums, and so the draws, are the same on
// every run whatever the order. The next pass's workgroups each reduce
// those per-chunk histograms redundantly (no single-workgroup launch in
// between) and pick the next digit by a suffix sum over the bins;
// workgroup 0 records the state it used in state slot `select_pass` for
// the pass after it.
//
// The last pass (select_pass == passes) draws, Gumbel-max: among the kept logits
// (key >= the threshold, and l >= M + T ln(min_p) when min-p is on), the
// token maximising l / T - ln(-ln u), u a counter-based draw of (seed,
// position, token id); ties go to the lowest id. Each workgroup's winner
// goes to part_val/part_idx, and argmax_final picks the token.
// Params, Step: generated from their Rust definitions (src/kernels/),
// prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> scratch: array<u32>;
@group(0) @binding(3) var<storage, read> step: Step;
@group(0) @binding(4) var<storage, read_write> part_val: array<f32>;
@group(0) @binding(5) var<storage, read_write> part_idx: array<u32>;

const BINS: u32 = 256u;
// Words of one state slot, and slots (one per pass, up to 8 select passes
// and the draw).
const STATE_WORDS: u32 = 8u;
const STATE_SLOTS: u32 = 9u;

// What the select passes carry from one to the next.
struct Select {
    // Key bits chosen so far in the current stage (lower bits zero).
    prefix: u32,
    // Count and mass (lo, hi) of the filtered keys above the prefix's bucket.
    above_count: u32,
    above_lo: u32,
    above_hi: u32,
    // Keys below this are filtered out (0: none).
    theta: u32,
    // Mass of the top-k set (top-p's total), once known.
    z_lo: u32,
    z_hi: u32,
}

var<workgroup> h_count: array<atomic<u32>, BINS>;
var<workgroup> h_lo: array<atomic<u32>, BINS>;
var<workgroup> h_hi: array<atomic<u32>, BINS>;
var<workgroup> r_count: array<u32, BINS>;
var<workgroup> r_lo: array<u32, BINS>;
var<workgroup> r_hi: array<u32, BINS>;
var<workgroup> shared_state: Select;

fn state_at(slot: u32) -> u32 {
    return p.parts + slot * STATE_WORDS;
}

// Pass `sp`'s per-chunk histograms, in one of two regions (pass i reads
// i - 1's while writing its own): three planes of parts x BINS words,
// counts, then masses' low and high words (chunk-major, so the reducing
// invocations, one per bin, read adjacent words).
fn hist_at(sp: u32) -> u32 {
    return p.parts + STATE_SLOTS * STATE_WORDS + (sp % 2u) * p.parts * BINS * 3u;
}

// The bit offset of select pass `sp`'s digit.
fn digit_shift(sp: u32) -> u32 {
    let d = select(sp - p.k_passes, sp, sp < p.k_passes);
    return 24u - 8u * d;
}

fn to_f32(lo: u32, hi: u32) -> f32 {
    return f32(hi) * 4294967296.0 + f32(lo);
}

// The fixed-point mass of logit l (0 ..= 2^31).
fn mass(l: f32, m: f32) -> u32 {
    let e = min(exp((l - m) / p.temperature), 1.0);
    return u32(e * 2147483648.0);
}

// Whether a cumulative count or mass from the top reaches the stage's
// target: top-k's k, or top-p's p times the mass `z` of the top-k set.
fn reaches(k_stage: bool, count: u32, lo: u32, hi: u32, target_mass: f32) -> bool {
    return select(to_f32(lo, hi) >= target_mass, count >= p.top_k, k_stage);
}

// State `s` with pass `prev`'s digit `b` chosen, `count`/`lo`/`hi` the
// filtered keys of the bucket above bin b (the stage's threshold once its
// last digit is chosen).
fn advance(prev: u32, s_in: Select, b: u32, count: u32, lo: u32, hi: u32) -> Select {
    var s = s_in;
    let shift = digit_shift(prev);
    s.prefix = s.prefix | (b << shift);
    s.above_count = count;
    s.above_lo = lo;
    s.above_hi = hi;
    if shift == 0u {
        // The stage's last digit: its threshold is exact.
        s.theta = s.prefix;
        s.prefix = 0u;
        s.above_count = 0u;
        s.above_lo = 0u;
        s.above_hi = 0u;
    }
    return s;
}

// Picks pass `prev`'s digit from `s_in` and the reduced histogram in
// r_count/r_lo/r_hi (one bin per invocation: WG == BINS): a suffix sum
// over the bins from the top, then the one bin where the cumulative count
// (top-k) or mass (top-p) first reaches the target claims the digit. Must
// be called in workgroup-uniform control flow; the result is in
// shared_state.
fn choose_digit(prev: u32, s_in: Select, t: u32) {
    for (var d = 1u; d < BINS; d = d * 2u) {
        var c = r_count[t];
        var lo = r_lo[t];
        var hi = r_hi[t];
        if t + d < BINS {
            let add = r_lo[t + d];
            c += r_count[t + d];
            lo += add;
            hi += r_hi[t + d] + select(0u, 1u, lo < add);
        }
        workgroupBarrier();
        r_count[t] = c;
        r_lo[t] = lo;
        r_hi[t] = hi;
        workgroupBarrier();
    }
    var s = s_in;
    let k_stage = prev < p.k_passes;
    if !k_stage && prev == p.k_passes {
        // Top-p's first pass saw the whole top-k set: its mass is the total.
        s.z_lo = r_lo[0];
        s.z_hi = r_hi[0];
    }
    let target_mass = p.top_p * to_f32(s.z_lo, s.z_hi);
    // Cumulative from the top through bin t (inclusive) and above it.
    let incl_c = s.above_count + r_count[t];
    let incl_lo = s.above_lo + r_lo[t];
    let incl_hi = s.above_hi + r_hi[t] + select(0u, 1u, incl_lo < r_lo[t]);
    var ex_c = s.above_count;
    var ex_lo = s.above_lo;
    var ex_hi = s.above_hi;
    if t + 1u < BINS {
        ex_c += r_count[t + 1u];
        ex_lo += r_lo[t + 1u];
        ex_hi += r_hi[t + 1u] + select(0u, 1u, ex_lo < r_lo[t + 1u]);
    }
    if t == 0u {
        // Unreachable for valid parameters (the whole bucket reaches the
        // target): the lowest bin, rather than no state at all.
        shared_state = advance(prev, s, 0u, ex_c, ex_lo, ex_hi);
    }
    workgroupBarrier();
    if reaches(k_stage, incl_c, incl_lo, incl_hi, target_mass)
        && !reaches(k_stage, ex_c, ex_lo, ex_hi, target_mass) {
        shared_state = advance(prev, s, t, ex_c, ex_lo, ex_hi);
    }
}

@compute @workgroup_size(WG)
fn sample_select(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let t = lane.idx;
    // M, from sample_max's per-chunk maxima (every invocation alike).
    var m = -3.0e38;
    if p.need_max != 0u {
        for (var k = 0u; k < p.parts; k++) {
            m = max(m, bitcast<f32>(scratch[k]));
        }
    }
    if t == 0u {
        shared_state = Select(0u, 0u, 0u, 0u, 0u, 0u, 0u);
    }
    if p.select_pass > 0u {
        let prev = p.select_pass - 1u;
        let base = hist_at(prev);
        let plane = p.parts * BINS;
        // Top-k's passes histogram counts alone (their masses stay zero).
        let masses = prev >= p.k_passes;
        for (var b = t; b < BINS; b += WG) {
            var c = 0u;
            var lo = 0u;
            var hi = 0u;
            for (var k = 0u; k < p.parts; k++) {
                let o = base + k * BINS + b;
                c += scratch[o];
                if masses {
                    let add = scratch[o + plane];
                    lo += add;
                    hi += scratch[o + 2u * plane] + select(0u, 1u, lo < add);
                }
            }
            r_count[b] = c;
            r_lo[b] = lo;
            r_hi[b] = hi;
        }
        workgroupBarrier();
        let o = state_at(prev);
        let s = Select(
            scratch[o],
            scratch[o + 1u],
            scratch[o + 2u],
            scratch[o + 3u],
            scratch[o + 4u],
            scratch[o + 5u],
            scratch[o + 6u],
        );
        choose_digit(prev, s, t);
    }
    let s = workgroupUniformLoad(&shared_state);
    if wg.x == 0u && t == 0u {
        let o = state_at(p.select_pass);
        scratch[o] = s.prefix;
        scratch[o + 1u] = s.above_count;
        scratch[o + 2u] = s.above_lo;
        scratch[o + 3u] = s.above_hi;
        scratch[o + 4u] = s.theta;
        scratch[o + 5u] = s.z_lo;
        scratch[o + 6u] = s.z_hi;
    }
    let start = wg.x * p.chunk;
    let end = min(p.n, start + p.chunk);
    if p.select_pass < p.passes {
        let shift = digit_shift(p.select_pass);
        let k_stage = p.select_pass < p.k_passes;
        for (var b = t; b < BINS; b += WG) {
            atomicStore(&h_count[b], 0u);
            atomicStore(&h_lo[b], 0u);
            atomicStore(&h_hi[b], 0u);
        }
        workgroupBarrier();
        for (var i = start + t; i < end; i += WG) {
            let l = logits[i];
            let key = sort_key(l);
            if key < s.theta {
                continue;
            }
            if shift < 24u && (key >> (shift + 8u)) != (s.prefix >> (shift + 8u)) {
                continue;
            }
            let b = (key >> shift) & (BINS - 1u);
            if k_stage {
                atomicAdd(&h_count[b], 1u);
            } else {
                // Top-p's digits are chosen by mass alone: no counts, and
                // a zero mass adds nothing (the histogram atomics
                // serialise where keys share a bin).
                let v = mass(l, m);
                if v != 0u {
                    let old = atomicAdd(&h_lo[b], v);
                    if old > 0xffffffffu - v {
                        atomicAdd(&h_hi[b], 1u);
                    }
                }
            }
        }
        workgroupBarrier();
        let out = hist_at(p.select_pass) + wg.x * BINS;
        let plane = p.parts * BINS;
        for (var b = t; b < BINS; b += WG) {
            scratch[out + b] = atomicLoad(&h_count[b]);
            if !k_stage {
                scratch[out + plane + b] = atomicLoad(&h_lo[b]);
                scratch[out + 2u * plane + b] = atomicLoad(&h_hi[b]);
            }
        }
    } else {
        let min_logit = m + p.min_p_offset;
        let pos = step.pos;
        var best_v = -3.0e38;
        var best_i = NONE;
        for (var i = start + t; i < end; i += WG) {
            let l = logits[i];
            if sort_key(l) < s.theta || (p.min_p_on != 0u && l < min_logit) {
                continue;
            }
            let v = l / p.temperature + gumbel_noise(p.seed_lo, p.seed_hi, pos, i);
            if v > best_v || best_i == NONE {
                best_v = v;
                best_i = i;
            }
        }
        let best = wg_argmax(best_v, best_i, lane);
        if t == 0u {
            part_idx[wg.x] = best;
            var v = -3.0e38;
            if best != NONE {
                v = logits[best] / p.temperature + gumbel_noise(p.seed_lo, p.seed_hi, pos, best);
            }
            part_val[wg.x] = v;
        }
    }
}
