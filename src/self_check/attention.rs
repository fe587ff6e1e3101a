//! Attention: the q/k norm with RoPE, the prompt and prompt-batch attention
//! with the reduce, and the decode step's fused attention, over a KV cache
//! in either format (the f16 cache's pipelines at start-up, the int8
//! cache's before a session first uses them).

use bytemuck::bytes_of;

use super::rig::{f16s, f32s, fail, step, to_f32, Rig};
use super::{Check, ATTENTION_TOLERANCE, F16_TOLERANCE};
use crate::converted::WeightFormat;
use crate::error::{Error, Result};
use crate::kernels::{
    attention, norm_rope, HeadParams, Kernel, ReduceParams, ATTENTION_CHUNK, PREFILL_ATTENTION_TOKENS,
};
use crate::kv_cache::{KvFormat, KvLayout};
use crate::qwen3::rope_table;
use crate::reference::{
    attention_ref_values, first_mismatch, kv_int8_decode, kv_int8_encode, poisoned, pseudo_nonzero,
    qk_norm_rope_ref, unpack_f16, POISON,
};

/// Attention's head shape for the checks: 4 query heads over 2 KV heads of
/// 64 dims (GQA), and the uniform for `capacity`, packing two heads a
/// workgroup from position `pack_from` on.
const HEADS: (usize, usize, usize) = (4, 2, 64);

fn head_params(capacity: usize, pack_from: u32) -> HeadParams {
    let (nh, nkv, hd) = HEADS;
    HeadParams {
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        capacity: capacity as u32,
        eps: 1e-6,
        qkv_stride: ((nh + 2 * nkv) * hd + 8) as u32,
        scale: 1.0 / (hd as f32).sqrt(),
        pack: attention::heads_per_workgroup(nh, nkv),
        pack_from,
    }
}

/// `pack_from` for a check of the packed pipeline (every position packed),
/// and for the others (whose pipelines never pack).
const PACKED: u32 = 0;
const UNPACKED: u32 = u32::MAX;

const THETA: f32 = 1_000_000.0;

/// The layout of a check's K or V cache of `capacity` positions in `kv`.
fn layout(capacity: usize, kv: KvFormat) -> KvLayout {
    let (_, nkv, hd) = HEADS;
    KvLayout { format: kv, kv_heads: nkv, head_dim: hd, capacity }
}

/// A K or V cache of `capacity` positions in `kv` holding values from
/// `seed`: its bytes, and the values they stand for.
fn cache(seed: u64, capacity: usize, kv: KvFormat) -> (Vec<u8>, Vec<f64>) {
    let (_, nkv, hd) = HEADS;
    let values = pseudo_nonzero(seed, nkv * capacity * hd);
    match kv {
        KvFormat::Int8 => kv_int8_encode(&values, nkv, capacity, hd),
        _ => {
            let bytes = bytemuck::cast_slice(&f16s(&values)).to_vec();
            let values = cache_values(&bytes, capacity, kv);
            (bytes, values)
        }
    }
}

/// The values a K or V cache's bytes stand for, `[kv_head][capacity][hd]`.
fn cache_values(bytes: &[u8], capacity: usize, kv: KvFormat) -> Vec<f64> {
    let (_, nkv, hd) = HEADS;
    match kv {
        KvFormat::Int8 => kv_int8_decode(bytes, nkv, capacity, hd),
        _ => unpack_f16(bytes).into_iter().map(f64::from).collect(),
    }
}

/// Compares KV cache `got` (in `kv`'s layout) with `before` byte for byte
/// except row `pos` of each KV head (and its scale), whose values must
/// match `want(kv_head)`: within the f16 tolerance, or half an int8 step
/// (the row's largest magnitude / 254, plus rounding).
#[allow(clippy::too_many_arguments)]
fn check_cache_row(
    what: &str,
    got: &[u8],
    before: &[u8],
    capacity: usize,
    pos: usize,
    kv: KvFormat,
    want: &dyn Fn(usize) -> Vec<f64>,
) -> Option<String> {
    let (_, nkv, hd) = HEADS;
    let l = layout(capacity, kv);
    let values = cache_values(got, capacity, kv);
    let row_bytes = l.row_bytes() as usize;
    let mut written = vec![false; got.len()];
    for g in 0..nkv {
        let at = (g * capacity + pos) * row_bytes;
        written[at..at + row_bytes].fill(true);
        if let Some(scales) = l.scales_at(g) {
            let at = scales as usize + 4 * pos;
            written[at..at + 4].fill(true);
        }
        let want = want(g);
        let (scale, tolerance): (Vec<f64>, f64) = match kv {
            KvFormat::Int8 => {
                let step = want.iter().fold(0f64, |m, v| m.max(v.abs())) / 127.0;
                (vec![step; hd], 0.51)
            }
            _ => (want.iter().map(|v| v.abs() + 1.0).collect(), F16_TOLERANCE),
        };
        let row = (g * capacity + pos) * hd;
        let got: Vec<f32> = values[row..row + hd].iter().map(|&v| v as f32).collect();
        if let Some(m) = first_mismatch(&format!("{what} kv head {g}"), &got, &want, &scale, tolerance) {
            return Some(m);
        }
    }
    let changed = (0..got.len()).find(|&i| !written[i] && got[i] != before[i]);
    changed.map(|i| format!("{what}: byte {i} (not row {pos}'s) changed"))
}

/// `kernel`'s pipeline over a KV cache in `kv`: its decode one, or
/// (`prompt_batch`) its prompt-batch program.
fn pipeline(
    rig: &Rig<'_>,
    kernel: Kernel,
    kv: KvFormat,
    prompt_batch: bool,
) -> Result<wgpu::ComputePipeline> {
    let launch = rig.kernels.launch_pipelines_kv(kernel, WeightFormat::Int8, kv);
    if !prompt_batch {
        return Ok(launch.decode);
    }
    launch.per_token.ok_or_else(|| Error::internal(format!("{kernel:?} has no prompt-batch program")))
}

/// Records one launch of `kernel` over a KV cache in `kv`.
fn dispatch(
    rig: &mut Rig<'_>,
    kernel: Kernel,
    kv: KvFormat,
    workgroups: [u32; 3],
    buffers: &[&wgpu::Buffer],
) -> Result<()> {
    let p = pipeline(rig, kernel, kv, false)?;
    rig.dispatch_pipeline(kernel, false, WeightFormat::Int8, &p, workgroups, buffers);
    Ok(())
}

/// `qk_norm_rope` for one token at position 5 of a capacity of 8, writing a
/// KV cache in `kv`.
pub(super) fn qk_norm_rope(rig: &mut Rig<'_>, kv: KvFormat) -> Result<Check> {
    let kernel = Kernel::QkNormRope;
    let (nh, nkv, hd) = HEADS;
    let (cap, pos) = (8, 5);
    let p = head_params(cap, UNPACKED);
    let qkv = pseudo_nonzero(11, p.qkv_stride as usize);
    let norms = pseudo_nonzero(12, 2 * hd);
    let rope = rope_table(hd, cap, THETA);
    let cache_words = layout(cap, kv).bytes() as usize / 4;
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
    dispatch(rig, kernel, kv, norm_rope::grid(nh as u32, nkv as u32), &bufs.each_ref())?;
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
        check_cache_row("k_cache", &out[k], &k0, cap, pos, kv, &want_k)
            .or_else(|| check_cache_row("v_cache", &out[v], &v0, cap, pos, kv, &want_v))
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
/// capacity of 300) of a KV cache in `kv`, then `attention_reduce`.
pub(super) fn attention_prompt(rig: &mut Rig<'_>, kv: KvFormat) -> Result<Check> {
    let kernel = Kernel::AttentionPartial;
    let (nh, nkv, hd) = HEADS;
    let (cap, seq) = (300, 290);
    let p = head_params(cap, UNPACKED);
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let q = pseudo_nonzero(21, nh * hd);
    let (k, kvals) = cache(22, cap, kv);
    let (v, vvals) = cache(23, cap, kv);
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(seq - 1, 0))?,
        rig.storage(&f32s(&q))?,
        rig.storage(&k)?,
        rig.storage(&v)?,
        rig.storage(&poisoned(2 * nh * chunks))?,
        rig.storage(&poisoned(nh * chunks * hd))?,
        rig.storage(&f32s(&[1.0; 4]))?,
        rig.storage(&f32s(&[2.0; 4]))?,
    ];
    dispatch(rig, kernel, kv, attention::partial_grid(nh as u32, chunks as u32), &bufs.each_ref())?;
    let out = reduce(rig, &bufs[5], &bufs[6], chunks, 1)?;
    Ok(Box::new(move |outs| {
        let want = attention_ref_values(&q, &kvals, &vvals, nh, nkv, hd, cap, seq, p.scale as f64);
        check_attention(kernel, &to_f32(&outs[out]), &want)
    }))
}

/// The prompt-batch program of `attention_partial` a model of the check's
/// heads runs over a KV cache in `kv` (`attention_prefill`, or its tile
/// program: [`Kernels::attention_prefill_for`]) over 5 tokens at contexts
/// 254..258 of a capacity of 300 (the last group of tokens short, the
/// contexts across the chunk edge, a partial 16-position tile), then
/// `attention_reduce` per token.
pub(super) fn attention_prompt_batch(rig: &mut Rig<'_>, kv: KvFormat) -> Result<Check> {
    let program = rig.kernels.attention_prefill_for(kv, HEADS.2);
    attention_prompt_batch_on(rig, kv, program)
}

/// [`attention_prompt_batch`] on `attention_prefill` itself where the set
/// runs the tile program for such a model: what a model whose head_dim the
/// tile program does not take runs.
pub(super) fn attention_prompt_batch_f32(rig: &mut Rig<'_>) -> Result<Option<Check>> {
    if !rig.kernels.attention_tiles {
        return Ok(None);
    }
    let program = (rig.kernels.attention_prefill_f32(KvFormat::F16), PREFILL_ATTENTION_TOKENS);
    attention_prompt_batch_on(rig, KvFormat::F16, program).map(Some)
}

/// [`attention_prompt_batch`] on `program` (a pipeline and its tokens per
/// workgroup).
fn attention_prompt_batch_on(
    rig: &mut Rig<'_>,
    kv: KvFormat,
    (batch_pipeline, tokens_per_wg): (wgpu::ComputePipeline, u32),
) -> Result<Check> {
    let kernel = Kernel::AttentionPartial;
    let (nh, nkv, hd) = HEADS;
    let (cap, seq, tokens) = (300, 254, 5);
    // The engine's activation rows come in multiples of 64 tokens, which
    // every group size divides; the spare rows' queries are never read.
    let rows = 64;
    let p = head_params(cap, UNPACKED);
    let chunks = cap.div_ceil(ATTENTION_CHUNK as usize);
    let q = pseudo_nonzero(24, rows * nh * hd);
    let (k, kvals) = cache(25, cap, kv);
    let (v, vvals) = cache(26, cap, kv);
    let bufs = [
        rig.uniform(bytes_of(&p))?,
        rig.storage(&step(seq - 1, 0))?,
        rig.storage(&f32s(&q))?,
        rig.storage(&k)?,
        rig.storage(&v)?,
        rig.storage(&poisoned(rows * 2 * nh * chunks))?,
        rig.storage(&poisoned(rows * nh * chunks * hd))?,
        rig.storage(&f32s(&[1.0; 4]))?,
        rig.storage(&f32s(&[2.0; 4]))?,
    ];
    let [x, y, _] = attention::partial_grid(nh as u32, chunks as u32);
    let groups = (tokens as u32).div_ceil(tokens_per_wg);
    rig.dispatch_pipeline(
        kernel,
        true,
        WeightFormat::Int8,
        &batch_pipeline,
        [x, y, groups],
        &bufs.each_ref(),
    );
    let out = reduce(rig, &bufs[5], &bufs[6], chunks, tokens)?;
    Ok(Box::new(move |outs| {
        let got = to_f32(&outs[out]);
        let row = nh * hd + 3;
        (0..tokens)
            .flat_map(|z| {
                let qz = &q[z * nh * hd..(z + 1) * nh * hd];
                let want =
                    attention_ref_values(qz, &kvals, &vvals, nh, nkv, hd, cap, seq + z, p.scale as f64);
                check_attention(kernel, &got[z * row..(z + 1) * row], &want)
            })
            .collect()
    }))
}

/// A decode step's attention with the q/k norm, RoPE and KV write folded
/// in, at `pos` of `capacity`: [`Kernel::AttentionStepDirect`] within one
/// chunk, [`Kernel::AttentionStep`] over the chunks plus the reduce; over
/// a KV cache in `kv`.
pub(super) fn attention_step(
    rig: &mut Rig<'_>,
    kernel: Kernel,
    capacity: usize,
    pos: usize,
    kv: KvFormat,
) -> Result<Check> {
    let pipeline = pipeline(rig, kernel, kv, false)?;
    attention_step_on(rig, kernel, pipeline, UNPACKED, capacity, pos, kv)
}

/// [`attention_step`] over the chunks on the packed pipeline
/// ([`crate::kernels::Kernels::attention_packed_pipeline`]), every position
/// packed: two query heads a workgroup.
pub(super) fn attention_step_packed(
    rig: &mut Rig<'_>,
    capacity: usize,
    pos: usize,
    kv: KvFormat,
) -> Result<Check> {
    let pipeline = rig.kernels.attention_packed_step_pipeline(rig.gpu, kv)?;
    attention_step_on(rig, Kernel::AttentionStep, pipeline, PACKED, capacity, pos, kv)
}

/// [`attention_step`] on `pipeline`, packing heads from `pack_from` on.
fn attention_step_on(
    rig: &mut Rig<'_>,
    kernel: Kernel,
    pipeline: wgpu::ComputePipeline,
    pack_from: u32,
    capacity: usize,
    pos: usize,
    kv: KvFormat,
) -> Result<Check> {
    let (_, direct) = kernel.attention_variant().expect("an attention variant");
    let (nh, nkv, hd) = HEADS;
    let p = head_params(capacity, pack_from);
    let seed = kernel as u64 * 31;
    let qkv = pseudo_nonzero(seed + 1, p.qkv_stride as usize);
    let norms = pseudo_nonzero(seed + 2, 2 * hd);
    let rope = rope_table(hd, capacity, THETA);
    let (k0, _) = cache(seed + 3, capacity, kv);
    let (v0, _) = cache(seed + 4, capacity, kv);
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
    let grid = attention::partial_grid(nh as u32, chunks as u32);
    rig.dispatch_pipeline(kernel, false, WeightFormat::Int8, &pipeline, grid, &bufs.each_ref());
    let (kr, vr) = (rig.read(&bufs[3], k0.len()), rig.read(&bufs[4], v0.len()));
    let out =
        if direct { rig.read(&bufs[6], 4 * out_len) } else { reduce(rig, &bufs[5], &bufs[6], chunks, 1)? };
    Ok(Box::new(move |outs| {
        let head = |h: usize| &qkv[h * hd..(h + 1) * hd];
        let (qn, kn) = norms.split_at(hd);
        let eps = p.eps as f64;
        let want_k = |g: usize| qk_norm_rope_ref(head(nh + g), Some(kn), pos, THETA as f64, eps);
        let want_v = |g: usize| qk_norm_rope_ref(head(nh + nkv + g), None, pos, THETA as f64, eps);
        if let Some(m) = check_cache_row("k_cache", &outs[kr], &k0, capacity, pos, kv, &want_k)
            .or_else(|| check_cache_row("v_cache", &outs[vr], &v0, capacity, pos, kv, &want_v))
        {
            return fail(kernel, m);
        }
        // The reference attention: q normed and rotated in f64, over the
        // caches as the kernel wrote them.
        let q: Vec<f32> = (0..nh)
            .flat_map(|h| qk_norm_rope_ref(head(h), Some(qn), pos, THETA as f64, eps))
            .map(|x| x as f32)
            .collect();
        let (k, v) = (cache_values(&outs[kr], capacity, kv), cache_values(&outs[vr], capacity, kv));
        let want = attention_ref_values(&q, &k, &v, nh, nkv, hd, capacity, pos + 1, p.scale as f64);
        check_attention(kernel, &to_f32(&outs[out]), &want)
    }))
}
