// Shared by the sampler kernels (sample_penalty, sample_max, sample_select):
// the order-preserving key of a logit and the counter-based random draw.
// The sampler runs as WGSL on every backend (no MSL twins).

// The u32 whose unsigned order is the f32 order of `x` (for finite values
// and infinities; -0.0 sorts just below +0.0): positives get the sign bit
// set, negatives are inverted.
fn sort_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// The value of a sort key (the inverse of sort_key, bit for bit).
fn key_value(key: u32) -> f32 {
    return bitcast<f32>(select(~key, key & 0x7fffffffu, (key & 0x80000000u) != 0u));
}

// pcg4d (Jarzynski and Olano, "Hash Functions for GPU Rendering", 2020): a
// counter-based hash, so a draw depends on (seed, position, token id) only,
// never on how many steps ran before or were queued together.
fn pcg4d(input: vec4<u32>) -> vec4<u32> {
    var v = input * 1664525u + vec4<u32>(1013904223u);
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    v = v ^ (v >> vec4<u32>(16u));
    v.x += v.y * v.w;
    v.y += v.z * v.x;
    v.z += v.x * v.y;
    v.w += v.y * v.z;
    return v;
}

// A uniform draw in (0, 1) (24 bits, never 0 or 1) for token `id` at
// position `pos`.
fn uniform_draw(seed_lo: u32, seed_hi: u32, pos: u32, id: u32) -> f32 {
    let h = pcg4d(vec4<u32>(seed_lo, seed_hi, pos, id)).x;
    return (f32(h >> 8u) + 0.5) * (1.0 / 16777216.0);
}
