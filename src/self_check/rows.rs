//! The first-use proof of a batched-row matvec pipeline, on its build thread.

use bytemuck::bytes_of;

use super::products::norm_bytes_f16_other;
use super::rig::{f32s, record_launch, to_f32, to_u32, u32s};
use super::MATVEC_TOLERANCE;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::{matvec, MatvecParams, RowsMatvecCase};
use crate::reference::{
    first_mismatch, matvec_ref_for, pack_f16, poisoned, pseudo_nonzero, round_f16, Quant,
};

/// The most batch rows' outputs a first-use check compares: two
/// workgroups of matrix rows (the grid's first; every workgroup runs the
/// same code on its own rows).
const ROWS_CHECK_WORKGROUPS: u32 = 2;

/// Proves a batched-row matvec pipeline (`DECODE_ROWS` sessions' steps per
/// launch, [`Kernels::matvec_rows_pipeline`](crate::kernels::Kernels::matvec_rows_pipeline)) before its first use, on its
/// build thread: the pipeline and the one-token pipeline each row runs
/// alone run the same pseudo-random matrix rows (the grid's first
/// two workgroups, the shape compiled in) over
/// `DECODE_ROWS` distinct inputs; every row must equal its one-token run
/// bit for bit (the batch's promise: a session's tokens are those it
/// produces alone), every output must match the CPU reference, and no
/// other element of `y` may change. `Ok(None)`: proven; `Ok(Some(how))`:
/// the first difference (the caller then runs the one-token pipeline over
/// a grid of rows); `Err`: a device error. A one-token pipeline
/// specialised to a shape (`DECODE_ROWS` 0, its own `one_token`) is proven
/// the same way over 3 tokens in grid z, against the CPU reference.
pub fn rows_matvec(gpu: &Gpu, case: &RowsMatvecCase<'_>) -> Result<Option<String>> {
    let c = case.constants;
    let (Some(shape), Some(variant)) = (c.shape, case.kernel.matvec_variant()) else {
        return Ok(Some(format!("{:?} has no shape or is no matvec", case.kernel)));
    };
    // A one-token pipeline (its own `one_token`) runs 3 tokens over grid z.
    let n = if c.decode_rows == 0 { 3 } else { c.decode_rows as usize };
    let per_z = c.rows_per_z.max(1);
    let workgroups = shape.rows.div_ceil(c.split.rows_per_wg).min(ROWS_CHECK_WORKGROUPS);
    let rows = (workgroups * c.split.rows_per_wg).min(shape.rows) as usize;
    let cols = shape.n_in as usize;
    let seed = 0x5eed ^ (case.kernel as u64 * 977) ^ ((n as u64) << 20);
    let m = Quant::pseudo_in(c.format, seed + 1, rows, cols);
    if (m.k_words(), m.groups()) != (shape.k_words as usize, shape.groups as usize) {
        return Ok(Some(format!(
            "{shape:?}: {cols} inputs pad to {} words, {} groups",
            m.k_words(),
            m.groups()
        )));
    }
    let mut x = pseudo_nonzero(seed + 2, n * m.padded);
    x.chunks_mut(m.padded).for_each(|row| row[cols..].iter_mut().for_each(|v| *v = 0.0));
    let norm_w = pseudo_nonzero(seed + 3, m.padded);
    let eps = 1e-6f32;
    let row_offset = 4;
    let first_out = if variant.swiglu { row_offset / 2 } else { row_offset };
    let outs = if variant.swiglu { rows / 2 } else { rows };
    // A multiple of 4: each row's f16 copy (X16) starts at an element.
    let y_stride = (first_out + outs + 3).next_multiple_of(4);
    let y_len = n * y_stride;
    let y0 = pseudo_nonzero(seed + 4, y_len);
    let init = if variant.accumulate { f32s(&y0) } else { poisoned(y_len) };
    let p = MatvecParams {
        rows: shape.rows,
        k_words: shape.k_words,
        groups: shape.groups,
        row_offset: row_offset as u32,
        n_in: shape.n_in,
        eps,
        y_stride: y_stride as u32,
    };
    // The f16 copies of x and of the norm weights (X16) hold other values
    // than the f32 ones, so a pipeline reading the wrong slots fails the
    // reference (as in the start-up check's matvecs).
    let mut x_other = pseudo_nonzero(seed + 5, n * m.padded);
    x_other.chunks_mut(m.padded).for_each(|row| row[cols..].iter_mut().for_each(|v| *v = 0.0));
    let norm_other = pseudo_nonzero(seed + 6, m.padded);
    let norm_bytes = norm_bytes_f16_other(&norm_w, &norm_other);
    let storage = |data: &[u8]| gpu.storage_init("first-use check", data);
    let (params, xb, wb, sb, nb) = (
        gpu.uniform("first-use check", bytes_of(&p))?,
        storage(&f32s(&x))?,
        storage(&m.data())?,
        storage(&m.scale_blob())?,
        storage(&norm_bytes)?,
    );
    let (y_one, y_rows) = (storage(&init)?, storage(&init)?);
    // The residual's f16 copy (X16): a normed matvec's input, else written.
    let x16 = c.split.x16;
    let x16_init = u32s(&pack_f16(if variant.norm { &x_other } else { &y0 }));
    let (x16_one, x16_rows) = (storage(&x16_init)?, storage(&x16_init)?);
    let read_one = gpu.readback("first-use check", 4 * y_len);
    let read_rows = gpu.readback("first-use check", 4 * y_len);
    gpu.scoped(
        || {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            let runs = [
                (case.one_token, &y_one, &x16_one, n as u32),
                (case.rows, &y_rows, &x16_rows, n.div_ceil(per_z as usize) as u32),
            ];
            for (pipeline, y, y16, z) in runs {
                let buffers = [&params, &xb, &wb, &sb, y, &nb, y16];
                let buffers = matvec::decode_bindings(variant, x16, buffers).unwrap_or(buffers);
                record_launch(gpu, &mut enc, case.layout, pipeline, [workgroups, 1, z], &buffers);
            }
            enc.copy_buffer_to_buffer(&y_one, 0, &read_one, 0, read_one.size());
            enc.copy_buffer_to_buffer(&y_rows, 0, &read_rows, 0, read_rows.size());
            gpu.queue.submit([enc.finish()]);
            Ok(())
        },
        |reason| Error::GpuDeviceFailed { reason: format!("first-use check: {reason}") },
    )?;
    let one = to_f32(&gpu.read(&read_one)?[..4 * y_len]);
    let all = to_f32(&gpu.read(&read_rows)?[..4 * y_len]);
    let init = to_u32(&init);
    let norm_w = if x16 { round_f16(&norm_other) } else { norm_w };
    let norm = variant.norm.then_some((&norm_w[..], eps));
    let x = if x16 && variant.norm { round_f16(&x_other) } else { x };
    for z in 0..n {
        let yb = z * y_stride;
        for i in 0..y_stride {
            if all[yb + i].to_bits() != one[yb + i].to_bits() {
                return Ok(Some(format!(
                    "row {z} of {n}: y[{i}] {} where alone {}",
                    all[yb + i],
                    one[yb + i]
                )));
            }
        }
        if let Some(i) =
            (0..first_out).chain(first_out + outs..y_stride).find(|i| all[yb + i].to_bits() != init[yb + i])
        {
            return Ok(Some(format!("row {z} of {n}: wrote y[{i}] outside its outputs")));
        }
        let acc = variant.accumulate.then_some(&y0[yb + first_out..]);
        let x = &x[z * m.padded..(z + 1) * m.padded];
        let (want, scale) = matvec_ref_for(c.int_dot(), &m, x, norm, acc, variant.swiglu);
        let what = format!("row {z} of {n}: y");
        if let Some(m) = first_mismatch(
            &what,
            &all[yb + first_out..yb + first_out + outs],
            &want,
            &scale,
            MATVEC_TOLERANCE,
        ) {
            return Ok(Some(m));
        }
    }
    Ok(None)
}
