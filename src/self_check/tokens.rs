//! The token end of the step: the argmax, the embedding lookup and the
//! sampler's two paths.

use bytemuck::bytes_of;

use super::rig::{f32s, fail, step, to_f32, to_u32, u32s, Rig};
use super::Check;
use crate::error::{Error, Result};
use crate::kernels::{
    argmax, embed, grid, mask, ArgmaxFinalParams, ArgmaxPartialParams, EmbedParams, Kernel, ARGMAX_CHUNK,
};
use crate::reference::{
    argmax_ref, first_mismatch, penalize_ref, poisoned, pseudo_nonzero, round_f16, sort_key, unpack_f16,
    Quant, POISON,
};
use crate::sampling::SamplingParams;

/// `argmax_partial` over 2,500 logits (three chunks) whose maximum is tied
/// in two chunks and within one, then `argmax_final` at position 3 of a
/// 6-token sequence.
pub(super) fn argmax(rig: &mut Rig<'_>) -> Result<Check> {
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
pub(super) fn embed(rig: &mut Rig<'_>) -> Result<Check> {
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
        rig.storage(&m.scale_blob())?,
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
pub(super) fn sample(rig: &mut Rig<'_>) -> Result<Check> {
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
pub(super) fn sample_top_k(rig: &mut Rig<'_>) -> Result<Check> {
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

/// `logits_mask` over 2,500 logits (a partial last word) with every third
/// token and the first and last allowed: allowed logits unchanged, the
/// rest -inf.
pub(super) fn logits_mask(rig: &mut Rig<'_>) -> Result<Check> {
    let n = 2500u32;
    let logits = pseudo_nonzero(43, n as usize);
    let allowed = move |t: usize| t % 3 == 1 || t == 0 || t == n as usize - 1;
    let mut words = vec![0u32; mask::words(n)];
    for t in (0..n as usize).filter(|&t| allowed(t)) {
        words[t / 32] |= 1 << (t % 32);
    }
    let bufs =
        [rig.uniform(bytes_of(&mask::params(n)))?, rig.storage(&u32s(&words))?, rig.storage(&f32s(&logits))?];
    rig.dispatch(Kernel::LogitsMask, mask::grid(n), &bufs.each_ref());
    let out = rig.read(&bufs[2], 4 * n as usize);
    Ok(Box::new(move |outs| {
        let got = to_f32(&outs[out]);
        for (t, (&g, &l)) in got.iter().zip(&logits).enumerate() {
            let want = if allowed(t) { l } else { mask::MASKED_LOGIT };
            if g.to_bits() != want.to_bits() {
                return fail(Kernel::LogitsMask, format!("logit {t}: {g}, want {want}"));
            }
        }
        Vec::new()
    }))
}
