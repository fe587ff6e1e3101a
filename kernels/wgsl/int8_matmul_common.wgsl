// What the two prompt-batch programs of int8_matvec's variants (int8_matmul
// and int8_matmul_coop) share after int8_common.wgsl: the output store with
// its epilogue. Prepended to both by Rust.

// Token `t`'s output for row `r` (SWIGLU: `r` is a gate row, `up` its up
// row's value).
fn store(r: u32, t: u32, v: f32, up: f32) {
    let yb = t * p.y_stride;
    if SWIGLU {
        y[yb + (p.row_offset + r) / 2u] = silu(v) * up;
        return;
    }
    let o = yb + p.row_offset + r;
    if ACCUMULATE {
        y[o] += v;
    } else {
        y[o] = v;
    }
}
