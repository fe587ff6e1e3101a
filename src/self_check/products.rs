//! The matrix products: each matvec variant's decode pipeline and its tiled
//! prompt-batch pipelines.

use bytemuck::bytes_of;

use super::rig::{f32s, fail, to_f32, to_u32, u32s, Rig};
use super::{Check, MATVEC_TOLERANCE};
use crate::converted::WeightFormat;
use crate::error::Result;
use crate::kernels::matmul::staged_bytes;
use crate::kernels::{matvec, Kernel, MatvecParams};
use crate::kernels::{record_staged, staged_bindings, staged_ranges, TiledPipeline};
use crate::reference::{
    first_mismatch, matvec_ref, matvec_ref_for, norm_weight_bytes, pack_f16, poisoned, pseudo_nonzero,
    round_f16, unpack_f16, Quant,
};

/// A matvec variant over weights in `format`, 13 rows (14 for SwiGLU: 7
/// outputs) of 200 columns (a padded tail: 4 quant groups), writing from
/// row 3 of a `y` whose other elements must stay as they were.
pub(super) fn matvec(rig: &mut Rig<'_>, kernel: Kernel, format: WeightFormat) -> Result<Check> {
    let variant = kernel.matvec_variant().expect("a matvec variant");
    let seed = kernel as u64 * 101 + format as u64 * 7919;
    let (rows, cols) = if variant.swiglu { (14, 200) } else { (13, 200) };
    let m = Quant::pseudo_in(format, seed + 1, rows, cols);
    let mut x = pseudo_nonzero(seed + 2, m.padded);
    x[cols..].iter_mut().for_each(|v| *v = 0.0);
    let norm_w = pseudo_nonzero(seed + 3, m.padded);
    let eps = 1e-6f32;
    // With the residual's f16 copy (X16) a normed matvec reads x from it,
    // and a residual add writes it, in blocks of 4 rows from a multiple of 4.
    let x16 = rig.kernels.matvec_layout.default_split().x16;
    let row_offset = if variant.swiglu || x16 { 4 } else { 3 };
    let first_out = if variant.swiglu { row_offset / 2 } else { row_offset };
    let outs = if variant.swiglu { rows / 2 } else { rows };
    let y_len = first_out + outs + 5;
    let y0 = pseudo_nonzero(seed + 4, y_len);
    let init = if variant.accumulate { f32s(&y0) } else { poisoned(y_len) };
    let p = MatvecParams {
        rows: rows as u32,
        k_words: m.k_words() as u32,
        groups: m.groups() as u32,
        row_offset: row_offset as u32,
        n_in: cols as u32,
        eps,
        y_stride: y_len as u32,
    };
    // A normed matvec's x16 holds x (as f16); a residual add's is poisoned.
    // The f16 copies hold other values than the f32 x and norm weights, so
    // an X16 pipeline reading the f32 slots (or a plain one reading the
    // copies) fails the reference.
    let mut x_other = pseudo_nonzero(seed + 5, m.padded);
    x_other[cols..].iter_mut().for_each(|v| *v = 0.0);
    let norm_other = pseudo_nonzero(seed + 6, m.padded);
    let x16_init = if variant.norm { u32s(&pack_f16(&x_other)) } else { poisoned(y_len.div_ceil(2)) };
    let norm_bytes = norm_bytes_f16_other(&norm_w, &norm_other);
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&f32s(&x))?,
        rig.storage(&m.data())?,
        rig.storage(&m.scale_blob())?,
        rig.storage(&init)?,
        rig.storage(&norm_bytes)?,
        rig.storage(&x16_init)?,
    ];
    let rows_per_wg = rig.kernels.matvec_layout.rows_per_wg();
    // (An X16 normed pipeline takes the copy at x's slot, as the engine binds it.)
    let bound = matvec::decode_bindings(variant, x16, bufs.each_ref()).unwrap_or(bufs.each_ref());
    rig.dispatch_in(kernel, format, matvec::grid(rows as u32, rows_per_wg), &bound);
    let y = rig.read(&bufs[4], 4 * y_len);
    let written16 = rig.read(&bufs[6], x16_init.len());
    let failure = move |how: String| fail(kernel, format!("{}{how}", format_label(format)));
    Ok(Box::new(move |out| {
        let got = to_f32(&out[y]);
        let init: Vec<u32> = to_u32(&init);
        for i in (0..first_out).chain(first_out + outs..y_len) {
            if got[i].to_bits() != init[i] {
                return failure(format!("wrote y[{i}] outside its rows"));
            }
        }
        let x_read = if x16 && variant.norm { round_f16(&x_other) } else { x.clone() };
        let norm_read = if x16 { round_f16(&norm_other) } else { norm_w.clone() };
        let norm = variant.norm.then_some((&norm_read[..], eps));
        let acc = variant.accumulate.then_some(&y0[first_out..]);
        let int_dot = matvec::int_dot(format, variant, x16);
        let (want, scale) = matvec_ref_for(int_dot, &m, &x_read, norm, acc, variant.swiglu);
        let what = "y";
        if let Some(m) =
            first_mismatch(what, &got[first_out..first_out + outs], &want, &scale, MATVEC_TOLERANCE)
        {
            return failure(m);
        }
        if x16 && variant.accumulate {
            // Each written row's f16 copy (1 ulp of f16 for the rounding),
            // the words outside them untouched.
            let words = to_u32(&out[written16]);
            let halves = unpack_f16(&out[written16]);
            let init16 = to_u32(&x16_init);
            for (i, h) in halves.iter().enumerate() {
                let inside = (row_offset..row_offset + rows.next_multiple_of(4)).contains(&i);
                let want = if i < row_offset + rows { got.get(i).copied() } else { Some(0.0) };
                match (inside, want) {
                    (true, Some(w)) if (h - w).abs() <= w.abs() / 1024.0 + 1e-7 => {}
                    (false, _) if words[i / 2] == init16[i / 2] => {}
                    _ => return failure(format!("x16 value {i}: {h}, y {want:?}")),
                }
            }
        }
        vec![]
    }))
}

/// What a failure's description starts with for weights in `format`:
/// nothing for int8, `int4: ` for int4.
fn format_label(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::Int8 => "",
        WeightFormat::Int4 => "int4: ",
    }
}

/// A norm weight buffer as the matvecs bind it ([`norm_weight_bytes`]:
/// `norm_w` as f32, then f16) whose f16 part holds `other`'s values
/// instead, so that a pipeline reading the wrong part fails the reference.
pub(super) fn norm_bytes_f16_other(norm_w: &[f32], other: &[f32]) -> Vec<u8> {
    let mut bytes = norm_weight_bytes(norm_w);
    bytes.truncate(4 * norm_w.len());
    bytes.extend(u32s(&pack_f16(other)));
    bytes
}

/// A matvec variant's tiled prompt-batch pipeline `tiled` (`int8_matmul`,
/// its MSL twin, or `int8_matmul_coop` in `ksplit` slices of k after its
/// staging) over weights in `format`, 13 rows (14 for SwiGLU: 7 outputs)
/// of 200 columns (a padded tail) for a tile and 5 tokens, writing from row 3 (4) of each
/// token's `y` row, whose other elements must stay as they were. The
/// product runs in whole tiles of tokens, so the buffers hold two tiles;
/// the second's spare tokens have NaN inputs, which must reach no real
/// token's output.
pub(super) fn matmul(
    rig: &mut Rig<'_>,
    kernel: Kernel,
    format: WeightFormat,
    tiled: TiledPipeline,
    ksplit: u32,
) -> Result<Check> {
    let variant = kernel.matvec_variant().expect("a matvec variant");
    let seed = kernel as u64 * 211 + format as u64 * 7919;
    let tile = tiled.tokens as usize;
    let (tokens, tiles) = (tile + 5, 2);
    let (rows, cols) = if variant.swiglu { (14, 200) } else { (13, 200) };
    let m = Quant::pseudo_in(format, seed + 1, rows, cols);
    let mut x = pseudo_nonzero(seed + 2, tiles * tile * m.padded);
    for (t, row) in x.chunks_mut(m.padded).enumerate() {
        let spare = if t < tokens { cols } else { 0 };
        row[spare..].iter_mut().for_each(|v| *v = if t < tokens { 0.0 } else { f32::NAN });
    }
    let norm_w = pseudo_nonzero(seed + 3, m.padded);
    let eps = 1e-6f32;
    let row_offset = if variant.swiglu { 4 } else { 3 };
    let first_out = if variant.swiglu { row_offset / 2 } else { row_offset };
    let outs = if variant.swiglu { rows / 2 } else { rows };
    let y_stride = first_out + outs + 5;
    let y_len = tiles * tile * y_stride;
    let y0 = pseudo_nonzero(seed + 4, y_len);
    let init = if variant.accumulate { f32s(&y0) } else { poisoned(y_len) };
    let p = MatvecParams {
        rows: rows as u32,
        k_words: m.k_words() as u32,
        groups: m.groups() as u32,
        row_offset: row_offset as u32,
        n_in: cols as u32,
        eps,
        y_stride: y_stride as u32,
    };
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&f32s(&x))?,
        rig.storage(&m.data())?,
        rig.storage(&m.scale_blob())?,
        rig.storage(&init)?,
        rig.storage(&f32s(&norm_w))?,
        rig.storage(&poisoned(1))?, // the residual's f16 copy: unused by prompt batches
    ];
    let mut workgroups = matvec::grid(rows as u32, tiled.rows);
    if let Some(staged) = &tiled.staged {
        // Cooperative matrices: the operands staged as f16 first, into a
        // poisoned buffer (a value left unwritten reads as NaN or -426).
        let (k_words, tokens) = (m.k_words(), (tiles * tile) as u32);
        let bytes = staged_bytes(rows, k_words, tiles * tile) as usize;
        let staging = rig.storage(&poisoned(bytes / 4))?;
        let ranges = staged_ranges(&staging, rows as u32, k_words as u32, tokens);
        let whole = bufs.each_ref().map(|b| b.as_entire_binding());
        let layout = rig.kernels.layout(kernel);
        let groups = staged_bindings(whole, ranges).map(|b| rig.gpu.bind_group("self-check", layout, b));
        let mut pass = rig.enc.begin_compute_pass(&Default::default());
        let shape = [rows as u32, k_words as u32];
        record_staged(&mut pass, staged, staged.product(ksplit), &groups, shape, workgroups, tokens);
        drop(pass);
        rig.note_ran(kernel, true, format);
    } else {
        workgroups[2] = tiles as u32;
        rig.dispatch_pipeline(kernel, true, format, &tiled.pipeline, workgroups, &bufs.each_ref());
    }
    let y = rig.read(&bufs[4], 4 * y_len);
    let product = if tiled.staged.is_some() { format!("cooperative, k in {ksplit}") } else { "tiled".into() };
    let label = format!("{}{product}", format_label(format));
    Ok(Box::new(move |out| {
        let got = to_f32(&out[y]);
        let init: Vec<u32> = to_u32(&init);
        let norm = variant.norm.then_some((&norm_w[..], eps));
        for t in 0..tokens {
            let yb = t * y_stride;
            for i in (0..first_out).chain(first_out + outs..y_stride) {
                if got[yb + i].to_bits() != init[yb + i] {
                    return fail(kernel, format!("{label}: token {t} wrote y[{i}] outside its rows"));
                }
            }
            let acc = variant.accumulate.then_some(&y0[yb + first_out..]);
            let xt = &x[t * m.padded..(t + 1) * m.padded];
            let (want, scale) = matvec_ref(&m, xt, norm, acc, variant.swiglu);
            let got = &got[yb + first_out..yb + first_out + outs];
            let what = format!("{label}: token {t} y");
            if let Some(m) = first_mismatch(&what, got, &want, &scale, MATVEC_TOLERANCE) {
                return fail(kernel, m);
            }
        }
        vec![]
    }))
}
