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

// The int4 values in the low nibbles of `v`'s 4 bytes as floats (a word's
// values 0..3; `v >> 4u` gives values 4..7), exactly, as i8x4: nibble
// u = q + 8 (the sign bit flipped) in the mantissa of 2^23, less 2^23 + 8.
// The one int4 dequantisation every kernel shares.
fn i4x4(v: u32) -> vec4<f32> {
    let u = v ^ 0x88888888u;
    let m = (vec4<u32>(u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xfu);
    return bitcast<vec4<f32>>(m | vec4<u32>(0x4b000000u)) - vec4<f32>(8388616.0);
}

// Two values as one word of f16 (the residual's f16 copy, X16), each
// clamped to f16's finite range first (pack2x16float of a value past it is
// indeterminate).
fn pack_f16(a: f32, b: f32) -> u32 {
    return pack2x16float(clamp(vec2<f32>(a, b), vec2<f32>(-65504.0), vec2<f32>(65504.0)));
}
