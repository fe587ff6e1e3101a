//! The start-up self-check: every pipeline the engine built for the decode
//! step, the tiled prompt-batch products (`int8_matmul`, an MSL twin on
//! Metal) and the prompt-batch attention (`attention_prefill`, WGSL
//! everywhere), runs once on small known-answer inputs and is compared with the
//! CPU references ([`crate::reference`]) before the engine is returned. It
//! proves the hand-written MSL twins on the device they run on (a shifted
//! buffer slot, a compiler difference, a fast-math surprise or another
//! SIMD-group matrix layout shows up as a mismatch, and the engine falls
//! back to WGSL); the same code checks the WGSL pipelines, which is how it
//! runs on every backend.
//!
//! A wrong binding cannot pass: every binding holds distinct non-trivial
//! data, outputs start as NaN, the accumulating matvec starts from a
//! non-zero `y`, row counts are not multiples of 4, attention runs over two
//! chunks plus the reduce and within one chunk, the new KV row is compared
//! value by value with every other row compared bit for bit, and the
//! argmax's maximum is tied across chunks; the tiled products run over two
//! token tiles whose spare tokens are NaN, which must reach no real
//! token's output; the prompt-batch attention serves a short last group of
//! tokens whose contexts cross a chunk edge. One submit and one wait.
//!
//! The batched-row matvecs (several sessions' steps per launch) are built
//! per row count and matrix shape when a batch first needs them, on a
//! thread of their own; [`rows_matvec`] proves each there before its first
//! use, bit for bit against the one-token pipeline its rows run alone.

use std::time::Instant;

use bytemuck::bytes_of;
use half::f16;

use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::matmul::{staged_bytes, COOP_KSPLITS};
use crate::kernels::{
    argmax, attention, embed, grid, matvec, norm_rope, ArgmaxFinalParams, ArgmaxPartialParams, EmbedParams,
    HeadParams, Kernel, Kernels, MatvecParams, ReduceParams, RowsMatvecCase, SelfCheck, SelfChecker, Step,
    ARGMAX_CHUNK, ATTENTION_CHUNK,
};
use crate::kernels::{record_staged, staged_bindings, staged_ranges, TiledPipeline};
use crate::qwen3::rope_table;
use crate::reference::{
    argmax_ref, attention_ref, first_mismatch, matvec_ref, norm_weight_bytes, pack_f16, penalize_ref,
    poisoned, pseudo_nonzero, qk_norm_rope_ref, round_f16, sort_key, unpack_f16, Quant, POISON,
};
use crate::sampling::SamplingParams;

/// The engine's checks: [`run`] at start-up, [`rows_matvec`] before a
/// batched-row pipeline's first use.
pub const CHECKER: SelfChecker = SelfChecker { set: run, rows_matvec };

/// Relative tolerance of the matvecs: well above f32 rounding (the kernel
/// tests use 1e-5), low enough that a wrong weight, scale or input fails.
const MATVEC_TOLERANCE: f64 = 1e-3;
/// Attention outputs and rotated heads: Metal's fast exp and rsqrt.
const ATTENTION_TOLERANCE: f64 = 2e-3;
/// A value rounded to f16 in the KV cache.
const F16_TOLERANCE: f64 = 4e-3;

/// Runs every decode pipeline of `kernels`, every tiled prompt-batch
/// pipeline and the prompt-batch attention once and compares with the CPU references. A device error
/// during the check is an `Err`; a wrong result is a [`SelfCheck`] with
/// `ok: false`.
pub fn run(gpu: &Gpu, kernels: &Kernels) -> Result<SelfCheck> {
    let t0 = Instant::now();
    let mut rig = Rig::new(gpu, kernels);
    let checks = gpu.scoped(
        || {
            let mut checks = vec![
                matvec(&mut rig, Kernel::Int8MatvecAccumulate)?,
                matvec(&mut rig, Kernel::Int8MatvecNorm)?,
                matvec(&mut rig, Kernel::Int8MatvecNormSwiglu)?,
                qk_norm_rope(&mut rig)?,
                attention_prompt(&mut rig)?,
                attention_prompt_batch(&mut rig)?,
                attention_step(&mut rig, Kernel::AttentionStepDirect, 16, 9)?,
                attention_step(&mut rig, Kernel::AttentionStep, 300, 270)?,
                argmax(&mut rig)?,
                embed(&mut rig)?,
                sample(&mut rig)?,
                sample_top_k(&mut rig)?,
            ];
            for kernel in Kernel::ALL.into_iter().filter(|k| k.prefill_tiled()) {
                let pipelines = rig.kernels.launch_pipelines(kernel);
                let tiled = pipelines.tiled.expect("a tiled prefill pipeline");
                checks.push(matmul(&mut rig, kernel, tiled, 1)?);
                if let Some(coop) = pipelines.coop {
                    // Every slicing of k a launch may take.
                    for ksplit in COOP_KSPLITS {
                        checks.push(matmul(&mut rig, kernel, coop.clone(), ksplit)?);
                    }
                }
            }
            Ok(checks)
        },
        |reason| Error::GpuDeviceFailed { reason: format!("self-check: {reason}") },
    )?;
    let outputs = rig.finish()?;
    let mut failures = Vec::new();
    for check in checks {
        failures.extend(check(&outputs));
    }
    let pipelines = rig.ran.len();
    Ok(SelfCheck { ok: failures.is_empty(), pipelines, ms: t0.elapsed().as_secs_f64() * 1e3, failures })
}

/// Compares the read-back outputs: each failure as (kernel, how).
type Check = Box<dyn FnOnce(&[Vec<u8>]) -> Vec<(String, String)>>;

/// Records launches of the engine's pipelines into one encoder and the
/// copies of their outputs into readback buffers.
struct Rig<'a> {
    gpu: &'a Gpu,
    kernels: &'a Kernels,
    enc: wgpu::CommandEncoder,
    /// Readback buffers and the bytes each holds.
    readbacks: Vec<(wgpu::Buffer, usize)>,
    /// The pipelines launched: each kernel's decode pipeline, and its
    /// prompt-batch one (`true`: the tiled product, `attention_prefill`).
    ran: Vec<(Kernel, bool)>,
}

impl<'a> Rig<'a> {
    fn new(gpu: &'a Gpu, kernels: &'a Kernels) -> Self {
        let enc =
            gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("self-check") });
        Rig { gpu, kernels, enc, readbacks: Vec::new(), ran: Vec::new() }
    }

    fn storage(&self, data: &[u8]) -> Result<wgpu::Buffer> {
        self.gpu.storage_init("self-check", data)
    }

    fn uniform(&self, data: &[u8]) -> Result<wgpu::Buffer> {
        self.gpu.uniform("self-check", data)
    }

    /// One launch of `kernel`'s engine pipeline with `buffers` in binding order.
    fn dispatch(&mut self, kernel: Kernel, workgroups: [u32; 3], buffers: &[&wgpu::Buffer]) {
        let pipeline = self.kernels.get(kernel).pipeline;
        self.dispatch_pipeline(kernel, false, &pipeline, workgroups, buffers);
    }

    /// One launch of `pipeline`, one of `kernel`'s (`tiled`: its tiled
    /// prompt-batch one), with `buffers` in binding order.
    fn dispatch_pipeline(
        &mut self,
        kernel: Kernel,
        tiled: bool,
        pipeline: &wgpu::ComputePipeline,
        workgroups: [u32; 3],
        buffers: &[&wgpu::Buffer],
    ) {
        record_launch(self.gpu, &mut self.enc, self.kernels.layout(kernel), pipeline, workgroups, buffers);
        self.note_ran(kernel, tiled);
    }

    /// Notes that `kernel`'s decode (or, `tiled`, prompt-batch) pipeline ran.
    fn note_ran(&mut self, kernel: Kernel, tiled: bool) {
        if !self.ran.contains(&(kernel, tiled)) {
            self.ran.push((kernel, tiled));
        }
    }

    /// Copies `buf`'s first `bytes` back after the launches; returns the
    /// index of its contents in [`Self::finish`]'s result.
    fn read(&mut self, buf: &wgpu::Buffer, bytes: usize) -> usize {
        let staging = self.gpu.readback("self-check", bytes);
        self.enc.copy_buffer_to_buffer(buf, 0, &staging, 0, staging.size());
        self.readbacks.push((staging, bytes));
        self.readbacks.len() - 1
    }

    /// Submits everything, waits once, and returns every read buffer.
    fn finish(&mut self) -> Result<Vec<Vec<u8>>> {
        let enc = std::mem::replace(
            &mut self.enc,
            self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
        );
        self.gpu.scoped(
            || {
                self.gpu.queue.submit([enc.finish()]);
                Ok(())
            },
            |reason| Error::GpuDeviceFailed { reason: format!("self-check submit: {reason}") },
        )?;
        self.readbacks
            .iter()
            .map(|(b, bytes)| {
                let mut out = self.gpu.read(b)?;
                out.truncate(*bytes);
                Ok(out)
            })
            .collect()
    }
}

/// Records one launch of `pipeline` into `enc`, with `buffers` bound in
/// binding order on `layout`.
fn record_launch(
    gpu: &Gpu,
    enc: &mut wgpu::CommandEncoder,
    layout: &wgpu::BindGroupLayout,
    pipeline: &wgpu::ComputePipeline,
    workgroups: [u32; 3],
    buffers: &[&wgpu::Buffer],
) {
    let bind_group = bind_group(gpu, layout, buffers);
    let mut pass = enc.begin_compute_pass(&Default::default());
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
}

/// A bind group of `buffers` (whole, in binding order) on `layout`.
fn bind_group(gpu: &Gpu, layout: &wgpu::BindGroupLayout, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
    gpu.bind_group("self-check", layout, buffers.iter().map(|b| b.as_entire_binding()))
}

fn f32s(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn u32s(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}

fn to_u32(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

fn f16s(v: &[f32]) -> Vec<f16> {
    v.iter().map(|x| f16::from_f32(*x)).collect()
}

/// The GPU decode state.
fn step(pos: usize, fill_end: usize) -> Vec<u8> {
    bytes_of(&Step { pos: pos as u32, fill_end: fill_end as u32 }).to_vec()
}

fn fail(kernel: Kernel, how: impl Into<String>) -> Vec<(String, String)> {
    vec![(format!("{kernel:?}"), how.into())]
}

/// A matvec variant over 13 rows (14 for SwiGLU: 7 outputs) of 200
/// columns (a padded tail), writing from row 3 of a `y` whose other
/// elements must stay as they were.
fn matvec(rig: &mut Rig<'_>, kernel: Kernel) -> Result<Check> {
    let variant = kernel.matvec_variant().expect("a matvec variant");
    let seed = kernel as u64 * 101;
    let (rows, cols) = if variant.swiglu { (14, 200) } else { (13, 200) };
    let m = Quant::pseudo(seed + 1, rows, cols);
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
        rig.storage(&f32s(&m.scales))?,
        rig.storage(&init)?,
        rig.storage(&norm_bytes)?,
        rig.storage(&x16_init)?,
    ];
    let rows_per_wg = rig.kernels.matvec_layout.rows_per_wg();
    // (An X16 normed pipeline takes the copy at x's slot, as the engine binds it.)
    let bound = matvec::decode_bindings(variant, x16, bufs.each_ref()).unwrap_or(bufs.each_ref());
    rig.dispatch(kernel, matvec::grid(rows as u32, rows_per_wg), &bound);
    let y = rig.read(&bufs[4], 4 * y_len);
    let written16 = rig.read(&bufs[6], x16_init.len());
    Ok(Box::new(move |out| {
        let got = to_f32(&out[y]);
        let init: Vec<u32> = to_u32(&init);
        for i in (0..first_out).chain(first_out + outs..y_len) {
            if got[i].to_bits() != init[i] {
                return fail(kernel, format!("wrote y[{i}] outside its rows"));
            }
        }
        let x_read = if x16 && variant.norm { round_f16(&x_other) } else { x.clone() };
        let norm_read = if x16 { round_f16(&norm_other) } else { norm_w.clone() };
        let norm = variant.norm.then_some((&norm_read[..], eps));
        let acc = variant.accumulate.then_some(&y0[first_out..]);
        let (want, scale) = matvec_ref(&m, &x_read, norm, acc, variant.swiglu);
        let what = "y";
        if let Some(m) =
            first_mismatch(what, &got[first_out..first_out + outs], &want, &scale, MATVEC_TOLERANCE)
        {
            return fail(kernel, m);
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
                    _ => return fail(kernel, format!("x16 value {i}: {h}, y {want:?}")),
                }
            }
        }
        vec![]
    }))
}

/// A norm weight buffer as the matvecs bind it ([`norm_weight_bytes`]:
/// `norm_w` as f32, then f16) whose f16 part holds `other`'s values
/// instead, so that a pipeline reading the wrong part fails the reference.
fn norm_bytes_f16_other(norm_w: &[f32], other: &[f32]) -> Vec<u8> {
    let mut bytes = norm_weight_bytes(norm_w);
    bytes.truncate(4 * norm_w.len());
    bytes.extend(u32s(&pack_f16(other)));
    bytes
}

/// A matvec variant's tiled prompt-batch pipeline `tiled` (`int8_matmul`,
/// its MSL twin, or `int8_matmul_coop` in `ksplit` slices of k after its
/// staging) over 13 rows (14 for SwiGLU: 7 outputs) of 200 columns
/// (a padded tail) for a tile and 5 tokens, writing from row 3 (4) of each
/// token's `y` row, whose other elements must stay as they were. The
/// product runs in whole tiles of tokens, so the buffers hold two tiles;
/// the second's spare tokens have NaN inputs, which must reach no real
/// token's output.
fn matmul(rig: &mut Rig<'_>, kernel: Kernel, tiled: TiledPipeline, ksplit: u32) -> Result<Check> {
    let variant = kernel.matvec_variant().expect("a matvec variant");
    let seed = kernel as u64 * 211;
    let tile = tiled.tokens as usize;
    let (tokens, tiles) = (tile + 5, 2);
    let (rows, cols) = if variant.swiglu { (14, 200) } else { (13, 200) };
    let m = Quant::pseudo(seed + 1, rows, cols);
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
        rig.storage(&f32s(&m.scales))?,
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
        rig.note_ran(kernel, true);
    } else {
        workgroups[2] = tiles as u32;
        rig.dispatch_pipeline(kernel, true, &tiled.pipeline, workgroups, &bufs.each_ref());
    }
    let y = rig.read(&bufs[4], 4 * y_len);
    let label = if tiled.staged.is_some() { format!("cooperative, k in {ksplit}") } else { "tiled".into() };
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

/// The most batch rows' outputs a first-use check compares: two
/// workgroups of matrix rows (the grid's first; every workgroup runs the
/// same code on its own rows).
const ROWS_CHECK_WORKGROUPS: u32 = 2;

/// Proves a batched-row matvec pipeline (`DECODE_ROWS` sessions' steps per
/// launch, [`Kernels::matvec_rows_pipeline`]) before its first use, on its
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
    let m = Quant::pseudo(seed + 1, rows, cols);
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
        storage(&f32s(&m.scales))?,
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
        let (want, scale) = matvec_ref(&m, &x[z * m.padded..(z + 1) * m.padded], norm, acc, variant.swiglu);
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

/// Attention's head shape for the checks: 4 query heads over 2 KV heads of
/// 64 dims (GQA), and the uniform for `capacity`.
const HEADS: (usize, usize, usize) = (4, 2, 64);

fn head_params(capacity: usize) -> HeadParams {
    let (nh, nkv, hd) = HEADS;
    HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: capacity as u32,
        eps: 1e-6,
        qkv_stride: ((nh + 2 * nkv) * hd + 8) as u32,
        scale: 1.0 / (hd as f32).sqrt(),
    }
}

const THETA: f32 = 1_000_000.0;

/// Compares KV cache `got` (f16 words) with `before` bit for bit except row
/// `pos` of each KV head, which must match `want(kv_head)` within the f16
/// tolerance.
fn check_cache_row(
    what: &str,
    got: &[u8],
    before: &[u8],
    capacity: usize,
    pos: usize,
    want: &dyn Fn(usize) -> Vec<f64>,
) -> Option<String> {
    let (_, nkv, hd) = HEADS;
    let (words, before_words) = (to_u32(got), to_u32(before));
    let values = unpack_f16(got);
    for g in 0..nkv {
        for t in 0..capacity {
            let row = (g * capacity + t) * hd;
            if t == pos {
                let want = want(g);
                let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
                let got = &values[row..row + hd];
                if let Some(m) =
                    first_mismatch(&format!("{what} kv head {g}"), got, &want, &scale, F16_TOLERANCE)
                {
                    return Some(m);
                }
            } else if words[row / 2..(row + hd) / 2] != before_words[row / 2..(row + hd) / 2] {
                return Some(format!("{what}: row {t} of kv head {g} changed"));
            }
        }
    }
    None
}

/// `qk_norm_rope` for one token at position 5 of a capacity of 8.
fn qk_norm_rope(rig: &mut Rig<'_>) -> Result<Check> {
    let kernel = Kernel::QkNormRope;
    let (nh, nkv, hd) = HEADS;
    let (cap, pos) = (8, 5);
    let p = head_params(cap);
    let qkv = pseudo_nonzero(11, p.qkv_stride as usize);
    let norms = pseudo_nonzero(12, 2 * hd);
    let rope = rope_table(hd, cap, THETA);
    let cache_words = nkv * cap * hd / 2;
    let (k0, v0) = (poisoned(cache_words), poisoned(cache_words));
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(pos, 0))?,
        rig.storage(&f32s(&qkv))?,
        rig.storage(&f32s(&norms))?,
        rig.storage(&f32s(&rope))?,
        rig.storage(&poisoned(nh * hd))?,
        rig.storage(&k0)?,
        rig.storage(&v0)?,
    ];
    rig.dispatch(kernel, norm_rope::grid(nh as u32, nkv as u32), &bufs.each_ref());
    let (q, k, v) = (
        rig.read(&bufs[5], 4 * nh * hd),
        rig.read(&bufs[6], 4 * cache_words),
        rig.read(&bufs[7], 4 * cache_words),
    );
    Ok(Box::new(move |out| {
        let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
        let (qn, kn) = norms.split_at(hd);
        let eps = p.eps as f64;
        let got = to_f32(&out[q]);
        for h in 0..nh {
            let want = qk_norm_rope_ref(head(h), Some(qn), pos, THETA as f64, eps);
            let scale: Vec<f64> = want.iter().map(|v| v.abs() + 1.0).collect();
            if let Some(m) = first_mismatch(
                &format!("q head {h}"),
                &got[h * hd..(h + 1) * hd],
                &want,
                &scale,
                ATTENTION_TOLERANCE,
            ) {
                return fail(kernel, m);
            }
        }
        let want_k = |g: usize| qk_norm_rope_ref(head(nh + g), Some(kn), pos, THETA as f64, eps);
        let want_v = |g: usize| qk_norm_rope_ref(head(nh + nkv + g), None, pos, THETA as f64, eps);
        check_cache_row("k_cache", &out[k], &k0, cap, pos, &want_k)
            .or_else(|| check_cache_row("v_cache", &out[v], &v0, cap, pos, &want_v))
            .map_or(vec![], |m| fail(kernel, m))
    }))
}

/// Records `attention_reduce` over `chunks` chunks of `parts` for
/// `tokens` tokens (grid z); returns the readback index of its output, per
/// token `nh * hd` values and 3 that must stay poisoned.
fn reduce(
    rig: &mut Rig<'_>,
    part_ml: &wgpu::Buffer,
    part_acc: &wgpu::Buffer,
    chunks: usize,
    tokens: usize,
) -> Result<usize> {
    let (nh, _, hd) = HEADS;
    let row = nh * hd + 3;
    let p = ReduceParams { head_dim: hd as u32, n_chunks: chunks as u32, out_stride: row as u32 };
    let params = rig.uniform(bytes_of(&p))?;
    let out = rig.storage(&poisoned(tokens * row))?;
    let [x, y, _] = attention::reduce_grid(nh as u32);
    rig.dispatch(Kernel::AttentionReduce, [x, y, tokens as u32], &[&params, part_ml, part_acc, &out]);
    Ok(rig.read(&out, 4 * tokens * row))
}

/// The attention output (`nh * hd` values, then a poisoned tail) against
/// the reference.
fn check_attention(kernel: Kernel, got: &[f32], want: &[f64]) -> Vec<(String, String)> {
    let n = want.len();
    if got[n..].iter().any(|v| v.to_bits() != POISON) {
        return fail(kernel, "wrote past the attention output");
    }
    match first_mismatch("attention output", &got[..n], want, &vec![1.0; n], ATTENTION_TOLERANCE) {
        Some(m) => fail(kernel, m),
        None => vec![],
    }
}

/// The prompt-batch `attention_partial` over two chunks (context 290 of a
/// capacity of 300), then `attention_reduce`.
fn attention_prompt(rig: &mut Rig<'_>) -> Result<Check> {
    let kernel = Kernel::AttentionPartial;
    let (nh, nkv, hd) = HEADS;
    let (cap, seq) = (300, 290);
    let p = head_params(cap);
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let q = pseudo_nonzero(21, nh * hd);
    let k = f16s(&pseudo_nonzero(22, nkv * cap * hd));
    let v = f16s(&pseudo_nonzero(23, nkv * cap * hd));
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(seq - 1, 0))?,
        rig.storage(&f32s(&q))?,
        rig.storage(bytemuck::cast_slice(&k))?,
        rig.storage(bytemuck::cast_slice(&v))?,
        rig.storage(&poisoned(2 * nh * chunks))?,
        rig.storage(&poisoned(nh * chunks * hd))?,
        rig.storage(&f32s(&[1.0; 4]))?,
        rig.storage(&f32s(&[2.0; 4]))?,
    ];
    rig.dispatch(kernel, attention::partial_grid(nh as u32, chunks as u32), &bufs.each_ref());
    let out = reduce(rig, &bufs[5], &bufs[6], chunks, 1)?;
    Ok(Box::new(move |outs| {
        let want = attention_ref(&q, &k, &v, nh, nkv, hd, cap, seq, p.scale as f64);
        check_attention(kernel, &to_f32(&outs[out]), &want)
    }))
}

/// The prompt-batch program of `attention_partial` (`attention_prefill`,
/// its tokens per workgroup as the engine's) over 5 tokens at contexts
/// 254..258 of a capacity of 300 (the last group of tokens short, the
/// contexts across the chunk edge), then `attention_reduce` per token.
fn attention_prompt_batch(rig: &mut Rig<'_>) -> Result<Check> {
    let kernel = Kernel::AttentionPartial;
    let (nh, nkv, hd) = HEADS;
    let (cap, seq, tokens) = (300, 254, 5);
    // The engine's activation rows come in multiples of 64 tokens, which
    // every group size divides; the spare rows' queries are never read.
    let rows = 64;
    let p = head_params(cap);
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let q = pseudo_nonzero(24, rows * nh * hd);
    let k = f16s(&pseudo_nonzero(25, nkv * cap * hd));
    let v = f16s(&pseudo_nonzero(26, nkv * cap * hd));
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(seq - 1, 0))?,
        rig.storage(&f32s(&q))?,
        rig.storage(bytemuck::cast_slice(&k))?,
        rig.storage(bytemuck::cast_slice(&v))?,
        rig.storage(&poisoned(rows * 2 * nh * chunks))?,
        rig.storage(&poisoned(rows * nh * chunks * hd))?,
        rig.storage(&f32s(&[1.0; 4]))?,
        rig.storage(&f32s(&[2.0; 4]))?,
    ];
    let launch = rig.kernels.launch_pipelines(kernel);
    let pipeline =
        launch.per_token.ok_or_else(|| Error::internal("attention_partial has no prompt-batch program"))?;
    let [x, y, _] = attention::partial_grid(nh as u32, chunks as u32);
    let groups = (tokens as u32).div_ceil(launch.per_token_tokens);
    rig.dispatch_pipeline(kernel, true, &pipeline, [x, y, groups], &bufs.each_ref());
    let out = reduce(rig, &bufs[5], &bufs[6], chunks, tokens)?;
    Ok(Box::new(move |outs| {
        let got = to_f32(&outs[out]);
        let row = nh * hd + 3;
        (0..tokens)
            .flat_map(|z| {
                let qz = &q[z * nh * hd..(z + 1) * nh * hd];
                let want = attention_ref(qz, &k, &v, nh, nkv, hd, cap, seq + z, p.scale as f64);
                check_attention(kernel, &got[z * row..(z + 1) * row], &want)
            })
            .collect()
    }))
}

/// A decode step's attention with the q/k norm, RoPE and KV write folded
/// in, at `pos` of `capacity`: [`Kernel::AttentionStepDirect`] within one
/// chunk, [`Kernel::AttentionStep`] over the chunks plus the reduce.
fn attention_step(rig: &mut Rig<'_>, kernel: Kernel, capacity: usize, pos: usize) -> Result<Check> {
    let (_, direct) = kernel.attention_variant().expect("an attention variant");
    let (nh, nkv, hd) = HEADS;
    let p = head_params(capacity);
    let seed = kernel as u64 * 31;
    let qkv = pseudo_nonzero(seed + 1, p.qkv_stride as usize);
    let norms = pseudo_nonzero(seed + 2, 2 * hd);
    let rope = rope_table(hd, capacity, THETA);
    let k = f16s(&pseudo_nonzero(seed + 3, nkv * capacity * hd));
    let v = f16s(&pseudo_nonzero(seed + 4, nkv * capacity * hd));
    let (k0, v0) =
        (bytemuck::cast_slice::<f16, u8>(&k).to_vec(), bytemuck::cast_slice::<f16, u8>(&v).to_vec());
    let chunks = if direct { 1 } else { capacity.div_ceil(ATTENTION_CHUNK as usize) };
    let out_len = nh * hd + 3;
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(pos, 0))?,
        rig.storage(&f32s(&qkv))?,
        rig.storage(&k0)?,
        rig.storage(&v0)?,
        rig.storage(&poisoned(2 * nh * chunks))?,
        rig.storage(&poisoned(if direct { out_len } else { nh * chunks * hd }))?,
        rig.storage(&f32s(&norms))?,
        rig.storage(&f32s(&rope))?,
    ];
    rig.dispatch(kernel, attention::partial_grid(nh as u32, chunks as u32), &bufs.each_ref());
    let (kr, vr) = (rig.read(&bufs[3], k0.len()), rig.read(&bufs[4], v0.len()));
    let out =
        if direct { rig.read(&bufs[6], 4 * out_len) } else { reduce(rig, &bufs[5], &bufs[6], chunks, 1)? };
    Ok(Box::new(move |outs| {
        let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
        let (qn, kn) = norms.split_at(hd);
        let eps = p.eps as f64;
        let want_k = |g: usize| qk_norm_rope_ref(head(nh + g), Some(kn), pos, THETA as f64, eps);
        let want_v = |g: usize| qk_norm_rope_ref(head(nh + nkv + g), None, pos, THETA as f64, eps);
        if let Some(m) = check_cache_row("k_cache", &outs[kr], &k0, capacity, pos, &want_k)
            .or_else(|| check_cache_row("v_cache", &outs[vr], &v0, capacity, pos, &want_v))
        {
            return fail(kernel, m);
        }
        // The reference attention: q normed and rotated in f64, over the
        // caches as the kernel wrote them.
        let q: Vec<f32> = (0..nh)
            .flat_map(|h| qk_norm_rope_ref(head(h), Some(qn), pos, THETA as f64, eps))
            .map(|x| x as f32)
            .collect();
        let (k, v) = (f16s(&unpack_f16(&outs[kr])), f16s(&unpack_f16(&outs[vr])));
        let want = attention_ref(&q, &k, &v, nh, nkv, hd, capacity, pos + 1, p.scale as f64);
        check_attention(kernel, &to_f32(&outs[out]), &want)
    }))
}

/// `argmax_partial` over 2,500 logits (three chunks) whose maximum is tied
/// in two chunks and within one, then `argmax_final` at position 3 of a
/// 6-token sequence.
fn argmax(rig: &mut Rig<'_>) -> Result<Check> {
    let n = 2500;
    let mut logits = pseudo_nonzero(41, n);
    for i in [2100, 1500, 1501, 1533] {
        logits[i] = 5.0;
    }
    let parts = argmax::parts(n as u32, ARGMAX_CHUNK) as usize;
    let bufs = [
        rig.uniform(bytes_of(&ArgmaxPartialParams { n: n as u32, chunk: ARGMAX_CHUNK }))?,
        rig.storage(&f32s(&logits))?,
        rig.storage(&poisoned(parts))?,
        rig.storage(&poisoned(parts))?,
    ];
    rig.dispatch(Kernel::ArgmaxPartial, grid(parts as u32), &bufs.each_ref());
    let final_params = rig.uniform(bytes_of(&ArgmaxFinalParams { n: parts as u32, n_tokens: 6 }))?;
    let tokens = rig.storage(&poisoned(6))?;
    let state = rig.storage(&step(3, 0))?;
    rig.dispatch(
        Kernel::ArgmaxFinal,
        argmax::FINAL_GRID,
        &[&final_params, &bufs[2], &bufs[3], &tokens, &state],
    );
    let (idx, tok, st) = (rig.read(&bufs[3], 4 * parts), rig.read(&tokens, 24), rig.read(&state, 8));
    Ok(Box::new(move |outs| {
        let idx = to_u32(&outs[idx]);
        for (c, got) in idx.iter().enumerate() {
            let lo = c * ARGMAX_CHUNK as usize;
            let want = lo + argmax_ref(&logits[lo..n.min(lo + ARGMAX_CHUNK as usize)]);
            if *got as usize != want {
                return fail(Kernel::ArgmaxPartial, format!("chunk {c}: index {got}, want {want}"));
            }
        }
        let want = argmax_ref(&logits) as u32;
        let tokens = to_u32(&outs[tok]);
        let expected: Vec<u32> = (0..6).map(|i| if i == 4 { want } else { POISON }).collect();
        if tokens != expected || to_u32(&outs[st]) != [4, 0] {
            return fail(
                Kernel::ArgmaxFinal,
                format!(
                    "tokens {tokens:?} and step {:?}, want token {want} at 4 and step [4, 0]",
                    to_u32(&outs[st])
                ),
            );
        }
        vec![]
    }))
}

/// `embed_lookup` of token 5 (the sequence's position 1) from a 7-row
/// table bound from row 2.
fn embed(rig: &mut Rig<'_>) -> Result<Check> {
    let (rows, cols, row_start) = (7, 200, 2);
    let m = Quant::pseudo(51, rows, cols);
    let token = 5u32;
    let p = EmbedParams {
        k_words: m.k_words() as u32,
        groups: m.groups() as u32,
        row_start,
        row_end: row_start + rows as u32,
    };
    let x_len = m.padded + 4;
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(1, 0))?,
        rig.storage(&u32s(&[3, token, 4]))?,
        rig.storage(&m.data())?,
        rig.storage(&f32s(&m.scales))?,
        rig.storage(&poisoned(x_len))?,
        rig.storage(&poisoned(x_len / 2))?,
    ];
    rig.dispatch(Kernel::EmbedLookup, embed::grid(m.k_words() as u32), &bufs.each_ref());
    let x = rig.read(&bufs[5], 4 * x_len);
    let x16 = rig.read(&bufs[6], 2 * x_len);
    Ok(Box::new(move |outs| {
        let got = to_f32(&outs[x]);
        let r = (token - row_start) as usize;
        let want: Vec<f64> = (0..m.padded).map(|c| if c < cols { m.w(r, c) } else { 0.0 }).collect();
        let words16 = to_u32(&outs[x16]);
        if got[m.padded..].iter().any(|v| v.to_bits() != POISON)
            || words16[m.padded / 2..].iter().any(|w| *w != POISON)
        {
            return fail(Kernel::EmbedLookup, "wrote past the row");
        }
        if let Some(msg) = first_mismatch("x", &got[..m.padded], &want, &vec![1.0; m.padded], 1e-6) {
            return fail(Kernel::EmbedLookup, msg);
        }
        // The f16 copy: x rounded to f16.
        let want16: Vec<f64> = round_f16(&got[..m.padded]).iter().map(|v| *v as f64).collect();
        let got16 = unpack_f16(&outs[x16]);
        match first_mismatch("x16", &got16[..m.padded], &want16, &vec![1.0; m.padded], 1e-6) {
            Some(msg) => fail(Kernel::EmbedLookup, msg),
            None => vec![],
        }
    }))
}

/// The sampler's radix path over 5,000 logits (two chunks) with every launch: the
/// penalties over a window with a repeat, top-k 5, top-p 0.01 and min-p
/// 0.5, so the draw can only pick the penalised maximum (a repeated token
/// that was the largest before its penalty is not). Also checks the edited
/// logits and top-k's threshold (the 5th largest key, in state slot 4).
fn sample(rig: &mut Rig<'_>) -> Result<Check> {
    use crate::kernels::sample::parts;
    use crate::sampling::plan_radix as plan;
    let n = 5000u32;
    let mut logits = pseudo_nonzero(43, n as usize);
    logits[4100] = 3.0;
    logits[700] = 3.2;
    logits[1500] = -0.5;
    let recent = [700u32, 1500, 700, 33, 34];
    let params = SamplingParams::default()
        .temperature(0.7)
        .top_k(5)
        .top_p(0.01)
        .min_p(0.5)
        .repetition_penalty(2.0)
        .presence_penalty(0.25)
        .frequency_penalty(0.125)
        .seed(3);
    let chunk = crate::kernels::SAMPLE_CHUNK;
    let parts = parts(n, chunk) as usize;
    let n_tokens = 8usize;
    let mut tokens = vec![POISON; n_tokens];
    tokens[..recent.len()].copy_from_slice(&recent);
    let logits_buf = rig.storage(&f32s(&logits))?;
    let tokens_buf = rig.storage(&u32s(&tokens))?;
    let state = rig.storage(&step(recent.len() - 1, 0))?;
    let scratch = rig.storage(&poisoned(crate::kernels::sample::scratch_words(n, chunk)))?;
    let (part_val, part_idx) = (rig.storage(&poisoned(parts))?, rig.storage(&poisoned(parts))?);
    for l in plan(&params, n, n_tokens as u32, chunk) {
        let u = rig.uniform(&l.params)?;
        let bufs: Vec<&wgpu::Buffer> = match l.kernel {
            Kernel::SamplePenalty => vec![&u, &tokens_buf, &state, &logits_buf],
            Kernel::SampleMax => vec![&u, &logits_buf, &scratch],
            Kernel::SampleSelect => vec![&u, &logits_buf, &scratch, &state, &part_val, &part_idx],
            Kernel::ArgmaxFinal => vec![&u, &part_val, &part_idx, &tokens_buf, &state],
            other => return Err(Error::internal(format!("{other:?} in the sampler's plan"))),
        };
        rig.dispatch(l.kernel, l.workgroups, &bufs);
    }
    let slot4 = parts + 4 * 8;
    let (edited, tok, sc) = (
        rig.read(&logits_buf, 4 * n as usize),
        rig.read(&tokens_buf, 4 * n_tokens),
        rig.read(&scratch, 4 * (slot4 + 8)),
    );
    Ok(Box::new(move |outs| {
        let want = penalize_ref(&logits, &recent, 2.0, 0.25, 0.125);
        let got = to_f32(&outs[edited]);
        if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits().abs_diff(want[i].to_bits()) > 1) {
            return fail(Kernel::SamplePenalty, format!("logit {i}: {}, want {}", got[i], want[i]));
        }
        let mut sorted = want.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let theta = to_u32(&outs[sc])[slot4 + 4];
        if theta != sort_key(sorted[4]) {
            return fail(
                Kernel::SampleSelect,
                format!("top-k threshold key {theta:#x}, want {:#x}", sort_key(sorted[4])),
            );
        }
        let tokens = to_u32(&outs[tok]);
        if tokens[recent.len()] != 4100 {
            return fail(
                Kernel::SampleSelect,
                format!("drew {}, want 4100 (tokens {tokens:?})", tokens[recent.len()]),
            );
        }
        vec![]
    }))
}

/// The sampler's top-k path and the log-probabilities over the logits of
/// [`sample`] (two chunks), with the same parameters: the same drawn token
/// (the penalised maximum), and the 3 most likely tokens of the logits
/// before the penalties, with the chosen token's log-probability, against
/// log_softmax in f64.
fn sample_top_k(rig: &mut Rig<'_>) -> Result<Check> {
    use crate::kernels::sample::{LOGPROB_RECORD_WORDS, MAX_LOGPROBS};
    use crate::sampling::plan_with_logprobs;
    let n = 5000u32;
    let mut logits = pseudo_nonzero(43, n as usize);
    logits[4100] = 3.0;
    logits[700] = 3.2;
    logits[1500] = -0.5;
    let recent = [700u32, 1500, 700, 33, 34];
    let params = SamplingParams::default()
        .temperature(0.7)
        .top_k(5)
        .top_p(0.01)
        .min_p(0.5)
        .repetition_penalty(2.0)
        .presence_penalty(0.25)
        .frequency_penalty(0.125)
        .seed(3);
    let chunk = crate::kernels::SAMPLE_CHUNK;
    let n_tokens = 8usize;
    let mut tokens = vec![POISON; n_tokens];
    tokens[..recent.len()].copy_from_slice(&recent);
    let logits_buf = rig.storage(&f32s(&logits))?;
    let tokens_buf = rig.storage(&u32s(&tokens))?;
    let state = rig.storage(&step(recent.len() - 1, 0))?;
    let scratch = rig.storage(&poisoned(crate::kernels::sample::scratch_words(n, chunk)))?;
    let raw = rig.storage(&poisoned(n as usize))?;
    let records = rig.storage(&poisoned(n_tokens * LOGPROB_RECORD_WORDS as usize))?;
    let top_n = 3usize;
    const _: () = assert!(MAX_LOGPROBS >= 3);
    for l in plan_with_logprobs(&params, n, n_tokens as u32, chunk, top_n as u32) {
        let u = rig.uniform(&l.params)?;
        let bufs: Vec<&wgpu::Buffer> = match l.kernel {
            Kernel::SamplePenalty => vec![&u, &tokens_buf, &state, &logits_buf],
            Kernel::SampleTopk => vec![&u, &logits_buf, &scratch, &raw],
            Kernel::SampleTopkFinal => vec![&u, &logits_buf, &scratch, &tokens_buf, &state],
            Kernel::LogprobFinal => vec![&u, &raw, &scratch, &tokens_buf, &state, &records],
            other => return Err(Error::internal(format!("{other:?} in the top-k path's plan"))),
        };
        rig.dispatch(l.kernel, l.workgroups, &bufs);
    }
    let (tok, rec) = (rig.read(&tokens_buf, 4 * n_tokens), rig.read(&records, records.size() as usize));
    Ok(Box::new(move |outs| {
        let tokens = to_u32(&outs[tok]);
        if tokens[recent.len()] != 4100 {
            return fail(
                Kernel::SampleTopkFinal,
                format!("drew {}, want 4100 (tokens {tokens:?})", tokens[recent.len()]),
            );
        }
        let words = to_u32(&outs[rec]);
        let r = &words[recent.len() * LOGPROB_RECORD_WORDS as usize..][..LOGPROB_RECORD_WORDS as usize];
        let max = logits.iter().fold(f64::MIN, |m, &l| m.max(l as f64));
        let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
        let mut order: Vec<u32> = (0..n).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let close = |bits: u32, id: u32| {
            (f32::from_bits(bits) as f64 - (logits[id as usize] as f64 - lse)).abs() < 1e-4
        };
        if r[0] != 4100 || !close(r[1], 4100) || r[2] != top_n as u32 {
            return fail(
                Kernel::LogprobFinal,
                format!("record head {:?}, want token 4100, {top_n} entries", &r[..4]),
            );
        }
        for (i, &id) in order[..top_n].iter().enumerate() {
            if r[4 + 2 * i] != id || !close(r[5 + 2 * i], id) {
                return fail(
                    Kernel::LogprobFinal,
                    format!(
                        "entry {i}: ({}, {}), want ({id}, {})",
                        r[4 + 2 * i],
                        f32::from_bits(r[5 + 2 * i]),
                        logits[id as usize] as f64 - lse
                    ),
                );
            }
        }
        vec![]
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::AdapterPolicy;
    use crate::kernels::{compile_for_layout, KernelChoice};

    fn wgsl_kernels() -> (Gpu, Kernels) {
        let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
        let kernels = Kernels::new(&gpu, KernelChoice::Wgsl, None, CHECKER).expect("the WGSL kernels build");
        (gpu, kernels)
    }

    /// `kernel`'s WGSL with the source edited by `edit`, on its layout.
    fn edited(
        gpu: &Gpu,
        kernels: &Kernels,
        kernel: Kernel,
        edit: impl Fn(String) -> String,
    ) -> wgpu::ComputePipeline {
        let src = edit(kernel.source(gpu.subgroups));
        let constants = kernel.constants(kernels.matvec_layout);
        let layout = Some(kernels.layout(kernel));
        compile_for_layout(gpu, "edited", &src, kernel.entry(), kernel.bindings(), &constants, layout)
            .expect("the edited kernel compiles")
            .0
    }

    /// Every decode pipeline, the tiled prompt-batch pipeline of each
    /// variant that has one, and `attention_prefill`.
    fn pipelines_checked() -> usize {
        Kernel::ALL.len() + Kernel::ALL.iter().filter(|k| k.prefill_tiled()).count() + 1
    }

    #[test]
    fn every_pipeline_of_a_correct_set_passes() {
        let (gpu, kernels) = wgsl_kernels();
        let check = run(&gpu, &kernels).unwrap();
        assert!(check.ok, "{}", check.describe_failures());
        assert_eq!(check.pipelines, pipelines_checked());
        assert_eq!(pipelines_checked(), Kernel::ALL.len() + 3 + 1, "every matvec variant runs tiled");
        // Engine construction ran it too.
        assert!(kernels.report.self_check.ok && kernels.report.self_check.pipelines == pipelines_checked());
    }

    /// A tiled prompt-batch pipeline that computes a wrong value (here: the
    /// RMSNorm's scale left out of the outputs) is caught, and only it.
    #[test]
    fn a_wrong_tiled_prompt_batch_pipeline_is_caught() {
        let (gpu, mut kernels) = wgsl_kernels();
        let kernel = Kernel::Int8MatvecNormSwiglu;
        let (src, constants) = kernel.matmul_source().unwrap();
        let unnormed = src.replace("inv = inverseSqrt(s / f32(p.n_in) + p.eps);", "inv = vec4<f32>(1.0);");
        assert_ne!(src, unnormed, "the substitution applies");
        let layout = Some(kernels.layout(kernel));
        let wrong = compile_for_layout(
            &gpu,
            "edited",
            &unnormed,
            "int8_matmul",
            kernel.bindings(),
            &constants,
            layout,
        )
        .expect("the edited kernel compiles")
        .0;
        kernels.replace_tiled_pipeline(kernel, wrong);
        let check = run(&gpu, &kernels).unwrap();
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(failed, ["Int8MatvecNormSwiglu"], "{}", check.describe_failures());
        assert!(check.failures[0].1.starts_with("tiled:"), "{}", check.describe_failures());
    }

    /// A tiled pipeline that reads the wrong tokens' inputs (here: every
    /// tile reads the first tile's, so the second tile's real tokens get
    /// other tokens' outputs) is caught: the check runs two tiles.
    #[test]
    fn a_tiled_pipeline_reading_the_wrong_tokens_is_caught() {
        let (gpu, mut kernels) = wgsl_kernels();
        let kernel = Kernel::Int8MatvecNorm;
        let (src, constants) = kernel.matmul_source().unwrap();
        let shifted = src.replace("let xb = (t0 + 4u * tq) * p.k_words", "let xb = (4u * tq) * p.k_words");
        assert_ne!(src, shifted, "the substitution applies");
        let layout = Some(kernels.layout(kernel));
        let wrong = compile_for_layout(
            &gpu,
            "edited",
            &shifted,
            "int8_matmul",
            kernel.bindings(),
            &constants,
            layout,
        )
        .expect("the edited kernel compiles")
        .0;
        kernels.replace_tiled_pipeline(kernel, wrong);
        let check = run(&gpu, &kernels).unwrap();
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
    }

    #[test]
    fn a_swapped_buffer_slot_is_caught() {
        let (gpu, mut kernels) = wgsl_kernels();
        // x and norm_w trade slots: both are f32 vectors of the input length.
        let swap = |s: String| {
            s.replace("@binding(1) var<storage, read> x:", "@binding(9) var<storage, read> x:")
                .replace("@binding(5) var<storage, read> norm_w:", "@binding(1) var<storage, read> norm_w:")
                .replace("@binding(9) var<storage, read> x:", "@binding(5) var<storage, read> x:")
        };
        let wrong = edited(&gpu, &kernels, Kernel::Int8MatvecNorm, swap);
        kernels.replace_pipeline(Kernel::Int8MatvecNorm, wrong);
        let check = run(&gpu, &kernels).unwrap();
        assert!(!check.ok);
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
    }

    /// On the split-K layout (the residual's f16 copy), a normed matvec
    /// that reads the f32 x and norm weights instead of their f16 copies
    /// is caught: the check gives the copies other values.
    #[test]
    fn a_normed_matvec_not_reading_the_f16_copies_is_caught() {
        let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
        let mut kernels =
            Kernels::new(&gpu, KernelChoice::Wgsl, Some(crate::kernels::MatvecLayout::SplitK), CHECKER)
                .expect("the WGSL kernels build");
        assert!(kernels.matvec_layout.x16() && run(&gpu, &kernels).unwrap().ok);
        let f32_reads =
            |s: String| s.replace("if X16 && NORM {", "if false {").replace("if X16 {", "if false {");
        assert_ne!(
            f32_reads(Kernel::Int8MatvecNorm.source(gpu.subgroups)),
            Kernel::Int8MatvecNorm.source(gpu.subgroups)
        );
        let wrong = edited(&gpu, &kernels, Kernel::Int8MatvecNorm, f32_reads);
        kernels.replace_pipeline(Kernel::Int8MatvecNorm, wrong);
        let check = run(&gpu, &kernels).unwrap();
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(failed, ["Int8MatvecNorm"], "{}", check.describe_failures());
    }

    /// On the split-K layout, a normed matvec pipeline specialised to a
    /// shape, or one of batched rows, that reads the f32 x and norm weights
    /// instead of their f16 copies fails its proof (which gives the copies
    /// other values) and is not used.
    #[test]
    fn a_shaped_matvec_not_reading_the_f16_copies_is_not_used() {
        use crate::kernels::{MatvecLayout, MatvecShape};
        let gpu = Gpu::new(AdapterPolicy::Portable).expect("a Vulkan adapter (lavapipe in CI)");
        let mut kernels = Kernels::new(&gpu, KernelChoice::Wgsl, Some(MatvecLayout::SplitK), CHECKER)
            .expect("the WGSL kernels build");
        let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
        for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu] {
            let split = MatvecLayout::SplitK.split(70, 48, true);
            assert!(split.x16);
            assert!(kernels.matvec_pipeline(&gpu, kernel, split, shape).is_some(), "{kernel:?}");
            assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, 3).is_some(), "{kernel:?}");
        }
        // The f32 norm weights (the f16 x still read; this one passed the
        // proof while the copies held the f32 values), then the f32 x: each
        // on shapes and row counts not built yet.
        type Edit = fn(&str) -> String;
        let f32_norm_weights: Edit = |s| s.replace("if X16 {", "if false {");
        let f32_x: Edit = |s| s.replace("if X16 && NORM {", "if false {");
        for (edit, n_in, rows) in [(f32_norm_weights, 170, 5), (f32_x, 150, 6)] {
            kernels.edit_rows_source(edit);
            let shaped = MatvecShape { n_in, ..shape };
            for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecNormSwiglu] {
                let split = MatvecLayout::SplitK.split(70, 48, true);
                assert!(kernels.matvec_pipeline(&gpu, kernel, split, shaped).is_none(), "{kernel:?} {n_in}");
                assert!(
                    kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, rows).is_none(),
                    "{kernel:?} {n_in}"
                );
            }
        }
    }

    #[test]
    fn a_wrong_epilogue_and_a_wrong_attention_are_caught() {
        let (gpu, mut kernels) = wgsl_kernels();
        // The accumulate slot runs the plain normed matvec: y is overwritten.
        let plain = kernels.get(Kernel::Int8MatvecNorm).pipeline.clone();
        kernels.replace_pipeline(Kernel::Int8MatvecAccumulate, plain);
        // The chunked decode attention runs the direct variant's pipeline.
        let direct = kernels.get(Kernel::AttentionStepDirect).pipeline.clone();
        kernels.replace_pipeline(Kernel::AttentionStep, direct);
        let check = run(&gpu, &kernels).unwrap();
        let failed: Vec<&str> = check.failures.iter().map(|(k, _)| k.as_str()).collect();
        assert!(failed.contains(&"Int8MatvecAccumulate"), "{}", check.describe_failures());
        assert!(failed.contains(&"AttentionStep"), "{}", check.describe_failures());
    }

    /// A batched-row pipeline is used only once proven against the
    /// one-token pipeline its rows run alone: correct ones are (every
    /// variant, asked for with and without waiting, row counts a workgroup
    /// runs whole or in grid z groups); one that differs in the last bit of
    /// its outputs is not, in either route, and is never built again (the
    /// caller runs the one-token pipeline per row). A specialised one-token
    /// pipeline that computes a wrong value is not used either.
    #[test]
    fn a_batched_row_pipeline_is_used_only_once_proven() {
        use crate::kernels::{MatvecLayout, MatvecShape};
        let (gpu, mut kernels) = wgsl_kernels();
        let shape = MatvecShape { rows: 70, k_words: 48, groups: 3, n_in: 190 };
        // Asks without waiting until the pipeline comes or its build failed.
        let wait = |kernels: &Kernels, kernel: Kernel, split, rows: u32| {
            let t0 = Instant::now();
            loop {
                if let Some(p) = kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, rows) {
                    return Some(p);
                }
                if kernels.rows_failed(kernel, split, shape, rows) {
                    return None;
                }
                assert!(t0.elapsed().as_secs() < 120, "the build never finished");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let splits = [MatvecLayout::RowsPerTeam.splits()[0], MatvecLayout::SplitK.splits()[0]];
        for split in splits {
            for kernel in [Kernel::Int8MatvecNorm, Kernel::Int8MatvecAccumulate, Kernel::Int8MatvecNormSwiglu]
            {
                let what = format!("{kernel:?} {split:?}");
                // What a session runs the launch with alone (the forward
                // builds it before any batch).
                assert!(kernels.matvec_pipeline(&gpu, kernel, split, shape).is_some(), "{what}");
                assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, 3).is_some(), "{what}");
                assert!(wait(&kernels, kernel, split, 6).is_some(), "{what}");
                assert!(!kernels.rows_failed(kernel, split, shape, 6), "{what}");
            }
        }
        // Where no pipeline is specialised to the shape, a session runs the
        // kernel's default pipeline alone; rows of the other layout's split
        // (another order of additions) differ from it, and are not used.
        let other = MatvecShape { n_in: 150, ..shape };
        let kernel = Kernel::Int8MatvecNorm;
        let foreign = splits.into_iter().find(|s| s.layout != kernels.matvec_layout).unwrap();
        assert!(kernels.matvec_rows_pipeline(&gpu, kernel, foreign, other, 4).is_none(), "{foreign:?}");
        // A wrong specialised one-token pipeline is not used either (the
        // general one serves), nor built again.
        kernels.edit_rows_source(|s| s.replace("y[o] = v;", "y[o] = v * 2.0 + 1.0;"));
        let shaped = MatvecShape { n_in: 170, ..shape };
        for split in splits {
            assert!(
                kernels.matvec_pipeline(&gpu, Kernel::Int8MatvecAccumulate, split, shaped).is_none(),
                "{split:?}"
            );
            assert!(
                kernels.matvec_pipeline(&gpu, Kernel::Int8MatvecAccumulate, split, shaped).is_none(),
                "{split:?}"
            );
        }
        kernels.edit_rows_source(|s| s.replace("y[o] = v;", "y[o] = v + v * 1e-6;"));
        let (kernel, split) = (Kernel::Int8MatvecAccumulate, splits[1]);
        assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, 7).is_none());
        assert!(kernels.rows_failed(kernel, split, shape, 7));
        assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, 7).is_none(), "not tried again");
        assert!(wait(&kernels, kernel, split, 9).is_none());
        assert!(
            kernels.matvec_rows_pipeline_or_start(&gpu, kernel, split, shape, 9).is_none(),
            "not tried again"
        );
        assert!(kernels.matvec_rows_pipeline(&gpu, kernel, split, shape, 9).is_none());
    }
}
