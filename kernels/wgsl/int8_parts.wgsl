// Values in 16-bit fixed point as two int8 parts, for integer dot
// products (dot4I8Packed) against int8 data: the int4 matvec's inputs
// (int8_matvec.wgsl, IDOT) and an int8 KV cache's query and V weights
// (attention_partial.wgsl). Prepended to both by Rust.

// 1.5 * 2^23: t + MAGIC rounds t to the nearest integer (ties to even) in
// the low mantissa bits for |t| < 2^22, whose low byte is the integer in
// two's complement.
const MAGIC: f32 = 12582912.0;

// The parts of 4 values (`inv` = 127 / absmax, `scale` its inverse):
// (h words, l words, their sums).
struct Parts4 {
    h: u32,
    l: u32,
    sum: i32,
}

fn parts4(v: vec4<f32>, inv: f32, scale: f32) -> Parts4 {
    let hm = fma(v, vec4<f32>(inv), vec4<f32>(MAGIC));
    // h as an integer first: (t + MAGIC) - MAGIC may be folded to t.
    let hf = vec4<f32>(bitcast<vec4<i32>>(hm) - vec4<i32>(0x4b400000));
    let r = fma(-hf, vec4<f32>(scale), v);
    let lm = fma(r, vec4<f32>(inv * 254.0), vec4<f32>(MAGIC));
    let h = pack4xU8(bitcast<vec4<u32>>(hm));
    let l = pack4xU8(bitcast<vec4<u32>>(lm));
    return Parts4(h, l, 254 * dot4I8Packed(h, 0x01010101u) + dot4I8Packed(l, 0x01010101u));
}
