// The matvec family's epilogue flags and arithmetic, without bindings:
// after int8_common.wgsl in int8_matvec and int8_matmul, and alone in the
// cooperative-matrix prompt-batch programs (f16_stage.wgsl,
// int8_matmul_coop.wgsl), which bind the same layout with other types.

// x' = x * rsqrt(mean(x^2) + eps) * norm_w instead of x.
override NORM: bool = false;
// true: y += W x' (fused residual add); false: y = W x'.
override ACCUMULATE: bool = false;
// Rows interleave gate (2i) and up (2i + 1): y[i] = silu(gate_i) * up_i.
override SWIGLU: bool = false;

fn silu(g: f32) -> f32 {
    return g / (1.0 + exp(-g));
}

// The weights are int4 (the layers of an int4 model): each u32 word holds
// 8 consecutive values as two's-complement nibbles, byte b value b in its
// low nibble and value b + 4 in its high one (`int4_position`,
// src/converted.rs); otherwise int8, 4 values a word.
override INT4: bool = false;

// Scales: int8's one f32 a group; int4's one bf16 a group, two a word
// (group i in the low half of word i / 2 for even i, the high half for odd
// i; `scale_bytes`, src/converted.rs). The programs that bind them read
// group i as word_scale(scales[scale_word(i)], i) (`group_scale`).
fn scale_word(i: u32) -> u32 {
    return select(i, i >> 1u, INT4);
}
fn word_scale(word: f32, i: u32) -> f32 {
    if INT4 {
        let u = bitcast<u32>(word);
        return bitcast<f32>(select(u << 16u, u & 0xffff0000u, (i & 1u) == 1u));
    }
    return word;
}

// The 4 int8 values of `v` as floats, exactly, without int-to-float
// conversions (a quarter-rate instruction on many GPUs, and the bulk of a
// matvec's arithmetic): byte u = q + 128 (the sign bit flipped) set into
// the mantissa of 2^23 is the float 2^23 + u, and subtracting 2^23 + 128
// leaves q.
fn i8x4(v: u32) -> vec4<f32> {
    let u = v ^ 0x80808080u;
    let m = vec4<u32>(u & 0xffu, (u >> 8u) & 0xffu, (u >> 16u) & 0xffu, u >> 24u) | vec4<u32>(0x4b000000u);
    return bitcast<vec4<f32>>(m) - vec4<f32>(8388736.0);
}

// The 8 int4 values of one word: values 0..3 (low nibbles of bytes 0..3)
// and 4..7 (high nibbles).
struct I4x8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// The one int4 dequantisation every kernel shares, exactly, with no
// int-to-float conversion and no shift per value: nibble n = q + 8 (the
// sign bit flipped) masked in place at bit s <= 16 and set under
// 2^(23 - s)'s exponent is the float 2^(23 - s) + n, since the field's
// lowest bit is then worth 1; less 2^(23 - s) + 8 leaves q. Bits 20..31
// do not fit under the exponent, so the word's upper half is shifted once.
// (Shifting every nibble down instead cost 26% of the 4B's int4 decode
// speed on an H100: BENCHMARKS.md 2026-12-05.)
fn i4x8(v: u32) -> I4x8 {
    let m = v ^ 0x88888888u;
    let t = m >> 16u;
    let lo = (vec4<u32>(m, m, m, t) & vec4<u32>(0xfu, 0xf00u, 0xf0000u, 0xf00u))
        | vec4<u32>(0x4b000000u, 0x47000000u, 0x43000000u, 0x47000000u);
    let hi = (vec4<u32>(m, m, t, t) & vec4<u32>(0xf0u, 0xf000u, 0xf0u, 0xf000u))
        | vec4<u32>(0x49000000u, 0x45000000u, 0x49000000u, 0x45000000u);
    return I4x8(bitcast<vec4<f32>>(lo) - vec4<f32>(8388616.0, 32776.0, 136.0, 32776.0),
                bitcast<vec4<f32>>(hi) - vec4<f32>(524296.0, 2056.0, 524296.0, 2056.0));
}

// The int4 values in the low nibbles of `v`'s 4 bytes (a word's values
// 0..3; `v >> 4u` gives values 4..7): i4x8's first half.
fn i4x4(v: u32) -> vec4<f32> {
    return i4x8(v).lo;
}

// Two values as one word of f16 (the residual's f16 copy, X16), each
// clamped to f16's finite range first (pack2x16float of a value past it is
// indeterminate).
fn pack_f16(a: f32, b: f32) -> u32 {
    return pack2x16float(clamp(vec2<f32>(a, b), vec2<f32>(-65504.0), vec2<f32>(65504.0)));
}
