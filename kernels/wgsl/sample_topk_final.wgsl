// The second launch of the sampler's top-k path (one workgroup, after
// sample_topk): merges the chunks' candidates into the exact top-k set,
// applies temperature, top-p and min-p, draws, writes the token and
// advances the position as argmax_final does.
//
// The vocabulary's k-th largest key theta is the candidates' k-th largest
// (every chunk wrote its own top k). Top-k keeps every logit >= theta: the
// candidates above theta (fewer than k, gathered and sorted here) and the
// whole tie group at theta, whose members a chunk did not write are counted
// from its record and, when drawn among, read from the logits. Then, as in
// sample_select: top-p walks the kept logits from the top in groups of
// equal keys, summing the fixed-point masses exp((l - M) / T) (2^31 = the
// top token's) exactly, to the first group where the sum reaches p times
// the whole; min-p keeps l >= M + T ln(min_p); the draw is Gumbel-max over
// what is kept, keyed by (seed, position, token id), ties to the lowest id.
// Same thresholds, same draws: the same token as the radix path for the
// same seed.
//
// With p.nucleus (top-k off, top-p on; sample_topk ran with k =
// SAMPLE_TOP_K_MAX): top-p's total is the mass of the whole vocabulary
// (summed here, one pass over the logits), and the walk over the top
// candidates finds top-p's threshold when the nucleus lies within them
// (the usual case); otherwise a radix select over the logits below them
// (8 bits per round, as sample_select's passes, in this workgroup) finds it
// and the draw reads every logit.
// Params, Step, NONE, SAMPLE_TOP_K_MAX: generated from their Rust
// definitions (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> scratch: array<u32>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> step: Step;

// (top-p's threshold key, M's bits, 1 when the nucleus reaches below the
// candidates, the mass from the top through the candidates' low word),
// from invocation 0; then its high word.
var<workgroup> kept: vec4<u32>;
var<workgroup> kept_hi: u32;
// 64-bit sums per invocation or bin: low and high words.
var<workgroup> sum_lo: array<u32, 256>;
var<workgroup> sum_hi: array<u32, 256>;
var<workgroup> bin_lo: array<atomic<u32>, 256>;
var<workgroup> bin_hi: array<atomic<u32>, 256>;
// The nucleus's radix select: (prefix, mass above its bucket lo, hi).
var<workgroup> below: vec3<u32>;

// The fixed-point mass of logit l (0 ..= 2^31), as sample_select's.
fn mass(l: f32, m: f32) -> u32 {
    let e = min(exp((l - m) / p.temperature), 1.0);
    return u32(e * 2147483648.0);
}

fn to_f32(lo: u32, hi: u32) -> f32 {
    return f32(hi) * 4294967296.0 + f32(lo);
}

// (lo, hi) += a * b, 64-bit.
fn add_product(acc: vec2<u32>, a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (p00 & 0xffffu) | (mid << 16u);
    let hi = a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    let sum_lo = acc.x + lo;
    return vec2<u32>(sum_lo, acc.y + hi + select(0u, 1u, sum_lo < lo));
}

struct Best {
    v: f32,
    i: u32,
}

// The Gumbel-max candidate `best` with token `id` (logit `l`) considered.
fn consider(best: Best, id: u32, l: f32, pos: u32) -> Best {
    let u = uniform_draw(p.seed_lo, p.seed_hi, pos, id);
    let v = l / p.temperature - log(-log(u));
    if best.i == NONE || v > best.v || (v == best.v && id < best.i) {
        return Best(v, id);
    }
    return best;
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < b.x));
}

// sum_lo/sum_hi[t] = the sum of entries t.. (`suffix`) or of all entries
// into entry 0 (tree); uniform control flow.
fn suffix_sums64(t: u32) {
    workgroupBarrier();
    for (var d = 1u; d < 256u; d = d * 2u) {
        var v = vec2<u32>(sum_lo[t], sum_hi[t]);
        if t + d < 256u {
            v = add64(v, vec2<u32>(sum_lo[t + d], sum_hi[t + d]));
        }
        workgroupBarrier();
        sum_lo[t] = v.x;
        sum_hi[t] = v.y;
        workgroupBarrier();
    }
}

// The mass of the whole vocabulary (after M is known): every invocation
// sums its share, then the workgroup (uniform control flow).
fn vocabulary_mass(t: u32, m: f32) -> vec2<u32> {
    var z = vec2<u32>(0u);
    for (var i = t; i < p.n; i += WG) {
        z = add64(z, vec2<u32>(mass(logits[i], m), 0u));
    }
    sum_lo[t] = z.x;
    sum_hi[t] = z.y;
    suffix_sums64(t);
    return vec2<u32>(sum_lo[0], sum_hi[0]);
}

// Top-p's threshold below the candidates (keys < `theta`): the largest key
// whose mass from the top, starting at `above` (the candidates' and the
// tie group's), reaches `target_mass`; as sample_select's passes, where no
// bin reaches (not for valid parameters) the lowest. Uniform control flow.
fn nucleus_below(t: u32, theta: u32, m: f32, above_in: vec2<u32>, target_mass: f32) -> u32 {
    var prefix = 0u;
    var above = above_in;
    for (var round = 0u; round < 4u; round++) {
        let shift = 24u - 8u * round;
        atomicStore(&bin_lo[t], 0u);
        atomicStore(&bin_hi[t], 0u);
        workgroupBarrier();
        for (var i = t; i < p.n; i += WG) {
            let l = logits[i];
            let key = sort_key(l);
            if key >= theta || (round > 0u && (key >> (shift + 8u)) != (prefix >> (shift + 8u))) {
                continue;
            }
            let v = mass(l, m);
            if v == 0u {
                // Nothing to add (most of a vocabulary, at usual
                // temperatures): spares the atomics.
                continue;
            }
            let b = (key >> shift) & 255u;
            let old = atomicAdd(&bin_lo[b], v);
            if old > 0xffffffffu - v {
                atomicAdd(&bin_hi[b], 1u);
            }
        }
        workgroupBarrier();
        sum_lo[t] = atomicLoad(&bin_lo[t]);
        sum_hi[t] = atomicLoad(&bin_hi[t]);
        suffix_sums64(t);
        let incl = add64(above, vec2<u32>(sum_lo[t], sum_hi[t]));
        var excl = above;
        if t < 255u {
            excl = add64(excl, vec2<u32>(sum_lo[t + 1u], sum_hi[t + 1u]));
        }
        if t == 0u {
            below = vec3<u32>(prefix, excl.x, excl.y);
        }
        workgroupBarrier();
        if to_f32(incl.x, incl.y) >= target_mass && !(to_f32(excl.x, excl.y) >= target_mass) {
            below = vec3<u32>(prefix | (t << shift), excl.x, excl.y);
        }
        let c = workgroupUniformLoad(&below);
        prefix = c.x;
        above = vec2<u32>(c.y, c.z);
    }
    return prefix;
}

@compute @workgroup_size(WG)
fn sample_topk_final(lane: Lane) {
    let t = lane.idx;
    let sel = merge_select(t, p.k, 0u, 0u);
    let theta = sel.x;
    // Fewer candidates than k (k >= the vocabulary): all kept.
    let whole = theta == 0u && sel.z == 0u;
    merge_gather(t, theta, whole, false, 0u);
    let count = merge_sort_top(t);
    let m = select(key_value(theta), key_value(top_key[0]), count > 0u);
    var z_all = vec2<u32>(0u);
    if p.nucleus != 0u {
        z_all = vocabulary_mass(t, m);
    }
    if t == 0u {
        // The tie group at theta: its candidates, and the ties chunks
        // left out.
        var ties = sel.z;
        if !whole {
            for (var c = 0u; c < p.parts; c++) {
                let rec = chunk_record(c);
                if scratch[rec + 1u] == theta && scratch[rec + 2u] > scratch[rec + 3u] {
                    ties += scratch[rec + 2u] - scratch[rec + 3u];
                }
            }
        }
        var key_p = theta;
        var reaches_below = 0u;
        var cum = vec2<u32>(0u);
        if p.top_p_on != 0u {
            var z = z_all;
            if p.nucleus == 0u {
                for (var i = 0u; i < count; i++) {
                    z = add_product(z, mass(key_value(top_key[i]), m), 1u);
                }
                if !whole {
                    z = add_product(z, mass(key_value(theta), m), ties);
                }
            }
            let target_mass = p.top_p * to_f32(z.x, z.y);
            var found = false;
            for (var i = 0u; i < count; i++) {
                cum = add_product(cum, mass(key_value(top_key[i]), m), 1u);
                let group_end = i + 1u == count || top_key[i + 1u] != top_key[i];
                if group_end && to_f32(cum.x, cum.y) >= target_mass {
                    key_p = top_key[i];
                    found = true;
                    break;
                }
            }
            if !found && !whole {
                cum = add_product(cum, mass(key_value(theta), m), ties);
                if p.nucleus != 0u && !(to_f32(cum.x, cum.y) >= target_mass) {
                    reaches_below = 1u;
                }
            }
        }
        kept = vec4<u32>(key_p, bitcast<u32>(m), reaches_below, cum.x);
        kept_hi = cum.y;
    }
    let kp = workgroupUniformLoad(&kept);
    var key_p = kp.x;
    let wide = kp.z != 0u;
    if wide {
        let above = vec2<u32>(kp.w, workgroupUniformLoad(&kept_hi));
        let target_mass = p.top_p * to_f32(z_all.x, z_all.y);
        key_p = nucleus_below(t, theta, m, above, target_mass);
    }
    let min_logit = m + p.min_p_offset;
    let pos = step.pos;
    var best = Best(-3.0e38, NONE);
    if wide {
        // Every logit at or above the threshold.
        for (var i = t; i < p.n; i += WG) {
            let l = logits[i];
            if sort_key(l) >= key_p && (p.min_p_on == 0u || l >= min_logit) {
                best = consider(best, i, l, pos);
            }
        }
    } else if t < count {
        let l = key_value(top_key[t]);
        if top_key[t] >= key_p && (p.min_p_on == 0u || l >= min_logit) {
            best = consider(best, top_id[t], l, pos);
        }
    }
    let theta_l = key_value(theta);
    if !wide && !whole && theta >= key_p && (p.min_p_on == 0u || theta_l >= min_logit) {
        for (var idx = t; idx < p.parts * p.k; idx += WG) {
            let c = candidate(idx);
            if c.z != 0u && c.x == theta {
                best = consider(best, c.y, theta_l, pos);
            }
        }
        // Chunks that left ties out: read them (duplicates are harmless).
        for (var c = 0u; c < p.parts; c++) {
            let rec = chunk_record(c);
            if scratch[rec + 1u] == theta && scratch[rec + 2u] > scratch[rec + 3u] {
                let end = min(p.n, (c + 1u) * p.chunk);
                for (var i = c * p.chunk + t; i < end; i += WG) {
                    if sort_key(logits[i]) == theta {
                        best = consider(best, i, theta_l, pos);
                    }
                }
            }
        }
    }
    let token = wg_argmax(best.v, best.i, lane);
    if t == 0u {
        let next = step.pos + 1u;
        if next >= step.fill_end && next < p.n_tokens {
            tokens[next] = token;
        }
        step.pos = next;
    }
}
