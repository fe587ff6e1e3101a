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
// Params, Step, NONE, SAMPLE_TOP_K_MAX: generated from their Rust
// definitions (src/kernels/), prepended by Rust.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> scratch: array<u32>;
@group(0) @binding(3) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(4) var<storage, read_write> step: Step;

// (top-p's threshold key, M's bits), from invocation 0.
var<workgroup> kept: vec2<u32>;
// Ties at theta that chunks did not write.
var<workgroup> left_out: atomic<u32>;
// The fixed-point masses of the entries above theta, in order.
var<workgroup> masses: array<u32, SAMPLE_TOP_K_MAX>;

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
    let v = l / p.temperature + gumbel_noise(p.seed_lo, p.seed_hi, pos, id);
    if best.i == NONE || v > best.v || (v == best.v && id < best.i) {
        return Best(v, id);
    }
    return best;
}

@compute @workgroup_size(WG)
fn sample_topk_final(lane: Lane) {
    let t = lane.idx;
    // (theta, candidates above it, candidates equal to it), the
    // candidates above theta (all when fewer than k) sorted in top_key /
    // top_id, `count` of them.
    let fast = merge_fast(t, p.k);
    var sel: vec3<u32>;
    var count: u32;
    if fast.w != 0u {
        sel = fast.xyz;
        count = sel.y;
        if t < count {
            top_key[t] = cand_key[t];
            top_id[t] = cand_id[t];
        }
        if t == 0u {
            atomicStore(&left_out, 0u);
        }
        workgroupBarrier();
    } else {
        sel = merge_select(t, p.k, 0u, 0u);
        // Fewer candidates than k (k >= the vocabulary): all kept.
        merge_gather(t, sel.x, sel.x == 0u && sel.z == 0u, false, 0u);
        count = merge_sort_top(t);
        if t == 0u {
            atomicStore(&left_out, 0u);
        }
        workgroupBarrier();
    }
    let theta = sel.x;
    let whole = theta == 0u && sel.z == 0u;
    // The tie group at theta: its candidates, and the ties chunks left
    // out.
    if !whole {
        for (var c = t; c < p.parts; c += WG) {
            let rec = chunk_record(c);
            if scratch[rec + 1u] == theta && scratch[rec + 2u] > scratch[rec + 3u] {
                atomicAdd(&left_out, scratch[rec + 2u] - scratch[rec + 3u]);
            }
        }
    }
    let m = select(key_value(theta), key_value(top_key[0]), count > 0u);
    if p.top_p_on != 0u && t < count {
        masses[t] = mass(key_value(top_key[t]), m);
    }
    workgroupBarrier();
    if t == 0u {
        let ties = sel.z + atomicLoad(&left_out);
        var key_p = theta;
        if p.top_p_on != 0u {
            var z = vec2<u32>(0u);
            for (var i = 0u; i < count; i++) {
                z = add_product(z, masses[i], 1u);
            }
            if !whole {
                z = add_product(z, mass(key_value(theta), m), ties);
            }
            let target_mass = p.top_p * to_f32(z.x, z.y);
            var cum = vec2<u32>(0u);
            for (var i = 0u; i < count; i++) {
                cum = add_product(cum, masses[i], 1u);
                let group_end = i + 1u == count || top_key[i + 1u] != top_key[i];
                if group_end && to_f32(cum.x, cum.y) >= target_mass {
                    key_p = top_key[i];
                    break;
                }
            }
        }
        kept = vec2<u32>(key_p, bitcast<u32>(m));
    }
    let kp = workgroupUniformLoad(&kept);
    let key_p = kp.x;
    let min_logit = bitcast<f32>(kp.y) + p.min_p_offset;
    let pos = step.pos;
    var best = Best(-3.0e38, NONE);
    if t < count {
        let l = key_value(top_key[t]);
        if top_key[t] >= key_p && (p.min_p_on == 0u || l >= min_logit) {
            best = consider(best, top_id[t], l, pos);
        }
    }
    let theta_l = key_value(theta);
    if !whole && theta >= key_p && (p.min_p_on == 0u || theta_l >= min_logit) {
        if fast.w != 0u {
            // The candidates of the tie group, ranked after those above.
            for (var r = sel.y + t; r < sel.y + sel.z; r += WG) {
                best = consider(best, cand_id[r], theta_l, pos);
            }
        } else {
            for (var idx = t; idx < p.parts * p.k; idx += WG) {
                let c = candidate(idx);
                if c.z != 0u && c.x == theta {
                    best = consider(best, c.y, theta_l, pos);
                }
            }
        }
        // Chunks that left ties out: read them (duplicates are harmless).
        if atomicLoad(&left_out) != 0u {
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
