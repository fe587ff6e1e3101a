//! 4-bit layer weights end to end: a checkpoint whose layer weights are
//! int4-exact (each group of 64 inputs `q * s` with `q` in [-8, 7], both
//! extremes present) and whose embedding and LM head are int8-exact
//! converts without loss, and an int4 model decodes greedily what a CPU
//! forward pass (f64) over the checkpoint's own values computes, through
//! one-token steps and both kinds of prompt batch (per token, tiled), and
//! its sessions decode in a batch what they decode alone.

use std::path::Path;

use qwen3_wgpu::internals::checkpoint::expected_tensors;
use qwen3_wgpu::internals::convert::dequantize;
use qwen3_wgpu::internals::converted::{QuantMatrix, QUANT_GROUP};
use qwen3_wgpu::internals::load::{load_model_with, Progress};
use qwen3_wgpu::internals::reference::rope_ref;
use qwen3_wgpu::{
    AdapterPolicy, BatchOptions, CachePolicy, Engine, GenerateOptions, LoadOptions, MatvecLayout,
    ShapeProfile, WeightFormat,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;
use serde_json::json;

use crate::tiny_checkpoint::{by_name, cfg_of, write_checkpoint, Tensor};

/// Hidden 128, 4 heads over 2 kv heads of 32 dims, intermediate 160 (a
/// short last group), 2 layers, vocab 64, an untied LM head, no
/// end-of-text token (greedy decoding runs its whole budget).
fn config() -> serde_json::Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 64,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": false,
        "eos_token_id": []
    })
}

/// A row of `cols` values, each group of [`QUANT_GROUP`] `q * s` with `q`
/// in `[min, max]`, both present, and `s` a bf16 value (8 significant
/// bits, so every value is exact in f32), as a bf16 checkpoint's are:
/// int4-exact for (-8, 7), int8-exact for (-127, 127) (the scale
/// `absmax / 127` is then `s`, exactly).
fn exact_row(rng: &mut StdRng, cols: usize, (min, max): (i32, i32), magnitude: f32) -> Vec<f32> {
    let mut row = Vec::with_capacity(cols);
    for start in (0..cols).step_by(QUANT_GROUP) {
        let len = QUANT_GROUP.min(cols - start);
        let s = half::bf16::from_f32(rng.random_range(128..=255) as f32 / 256.0 * magnitude / max as f32)
            .to_f32();
        let mut q: Vec<i32> = (0..len).map(|_| rng.random_range(min..=max)).collect();
        let at = rng.random_range(0..len);
        q[at] = if max == 7 { min } else { max };
        q[(at + 1) % len] = if max == 7 { max } else { min };
        row.extend(q.iter().map(|&v| v as f32 * s));
    }
    row
}

/// The checkpoint's tensors: layer matrices int4-exact, the embedding and
/// the LM head int8-exact, norms 1 + k / 64.
fn tensors(cfg: &serde_json::Value, seed: u64) -> Vec<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let c = cfg_of(cfg);
    let mut out = Vec::new();
    for (name, shape) in expected_tensors(&c) {
        let values = if shape.len() == 1 {
            (0..shape[0]).map(|_| 1.0 + rng.random_range(-16i32..=16) as f32 / 64.0).collect()
        } else {
            let (rows, cols) = (shape[0], shape[1]);
            let layer = name.starts_with("model.layers.");
            let (range, magnitude) =
                if layer { ((-8, 7), 2.0 / (cols as f32).sqrt()) } else { ((-127, 127), 0.5) };
            (0..rows).flat_map(|_| exact_row(&mut rng, cols, range, magnitude)).collect()
        };
        out.push(Tensor { name, shape, values });
    }
    out
}

/// Writes the checkpoint (f32 tensors) into `dir`.
fn write(dir: &Path) -> Vec<Tensor> {
    let cfg = config();
    let tensors = tensors(&cfg, 35);
    write_checkpoint(dir, &cfg, &tensors, Dtype::F32);
    tensors
}

/// Every matrix of the int4 conversion dequantises to the checkpoint's
/// values exactly (the layers int4, the embedding and the LM head int8).
#[test]
fn int4_exact_weights_convert_without_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = write(tmp.path());
    let (model, _) = load_model_with(
        tmp.path(),
        ShapeProfile::AnyQwen3,
        &CachePolicy::Disabled,
        WeightFormat::Int4,
        &Progress::none(),
    )
    .unwrap();
    let t = by_name(&tensors);
    let exact = |m: &QuantMatrix, names: &[&str], interleaved: bool| {
        let mut base = 0;
        for (p, name) in names.iter().enumerate() {
            let t = t[name];
            let (rows, cols) = (t.shape[0], t.shape[1]);
            for r in 0..rows {
                let row = if interleaved { 2 * r + p } else { base + r };
                for c in 0..cols {
                    let got = dequantize(&model, m, row, c).unwrap();
                    assert_eq!(got, t.values[r * cols + c], "{name}[{r}][{c}]");
                }
            }
            base += rows;
        }
    };
    let ix = &model.index;
    assert_eq!(ix.weights, WeightFormat::Int4);
    exact(&ix.embed, &["model.embed_tokens.weight"], false);
    exact(ix.lm_head.as_ref().unwrap(), &["lm_head.weight"], false);
    for (i, l) in ix.layers.iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let (q, k, v) =
            (n("self_attn.q_proj.weight"), n("self_attn.k_proj.weight"), n("self_attn.v_proj.weight"));
        exact(&l.qkv, &[&q, &k, &v], false);
        exact(&l.o_proj, &[&n("self_attn.o_proj.weight")], false);
        exact(&l.gate_up, &[&n("mlp.gate_proj.weight"), &n("mlp.up_proj.weight")], true);
        exact(&l.down, &[&n("mlp.down_proj.weight")], false);
        assert!([l.qkv, l.o_proj, l.gate_up, l.down].iter().all(|m| m.format == WeightFormat::Int4));
    }
}

/// The checkpoint's values in f64, by name.
struct Weights<'a>(std::collections::HashMap<&'a str, &'a Tensor>);

impl Weights<'_> {
    fn get(&self, name: &str) -> &Tensor {
        self.0[name]
    }

    /// `W x` for the matrix `name`.
    fn matvec(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let t = self.get(name);
        let cols = t.shape[1];
        t.values.chunks(cols).map(|row| row.iter().zip(x).map(|(w, x)| *w as f64 * x).sum()).collect()
    }

    fn rms_norm(&self, name: &str, x: &[f64], eps: f64) -> Vec<f64> {
        let w = &self.get(name).values;
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * inv * *w as f64).collect()
    }
}

/// The logits after each of `tokens` (a CPU forward pass in f64, Qwen3 as
/// mlx-lm's `qwen3.py`).
fn reference_logits(w: &Weights<'_>, cfg: &serde_json::Value, tokens: &[u32]) -> Vec<Vec<f64>> {
    let c = cfg_of(cfg);
    let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
    let (eps, theta) = (c.rms_norm_eps as f64, c.rope_theta as f64);
    // keys[layer][pos][kv head], values alike.
    let mut keys = vec![Vec::<Vec<Vec<f64>>>::new(); c.num_hidden_layers];
    let mut values = keys.clone();
    let embed = &w.get("model.embed_tokens.weight").values;
    let mut out = Vec::new();
    for (pos, &token) in tokens.iter().enumerate() {
        let mut x: Vec<f64> =
            embed[token as usize * h..(token as usize + 1) * h].iter().map(|v| *v as f64).collect();
        for l in 0..c.num_hidden_layers {
            let n = |s: &str| format!("model.layers.{l}.{s}");
            let a = w.rms_norm(&n("input_layernorm.weight"), &x, eps);
            let q = w.matvec(&n("self_attn.q_proj.weight"), &a);
            let k = w.matvec(&n("self_attn.k_proj.weight"), &a);
            let v = w.matvec(&n("self_attn.v_proj.weight"), &a);
            let head = |v: &[f64], i: usize, norm: &str| {
                rope_ref(&w.rms_norm(&n(norm), &v[i * hd..(i + 1) * hd], eps), pos, theta)
            };
            keys[l].push((0..nkv).map(|i| head(&k, i, "self_attn.k_norm.weight")).collect());
            values[l].push((0..nkv).map(|i| v[i * hd..(i + 1) * hd].to_vec()).collect());
            let mut attn = vec![0.0; nh * hd];
            for i in 0..nh {
                let qi = head(&q, i, "self_attn.q_norm.weight");
                let g = i / (nh / nkv);
                let scores: Vec<f64> = keys[l]
                    .iter()
                    .map(|k| qi.iter().zip(&k[g]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (p, e) in e.iter().enumerate() {
                    for d in 0..hd {
                        attn[i * hd + d] += e / sum * values[l][p][g][d];
                    }
                }
            }
            let o = w.matvec(&n("self_attn.o_proj.weight"), &attn);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let m = w.rms_norm(&n("post_attention_layernorm.weight"), &x, eps);
            let gate = w.matvec(&n("mlp.gate_proj.weight"), &m);
            let up = w.matvec(&n("mlp.up_proj.weight"), &m);
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let d = w.matvec(&n("mlp.down_proj.weight"), &act);
            x.iter_mut().zip(&d).for_each(|(x, d)| *x += d);
        }
        out.push(w.matvec("lm_head.weight", &w.rms_norm("model.norm.weight", &x, eps)));
    }
    out
}

/// An int4 model's greedy tokens are the CPU forward pass's (f64, over the
/// checkpoint's values, which the conversion keeps exactly): at each
/// generated token the reference's logit of the GPU's choice is its
/// largest (within f32 rounding, where two logits nearly tie), fed the
/// GPU's tokens. A prompt of 5 tokens (the per-token prompt pipelines) and
/// one of 70 (the tiled product), 8 tokens each.
#[test]
fn an_int4_model_decodes_what_the_cpu_reference_computes() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = write(tmp.path());
    let weights = Weights(by_name(&tensors));
    let cfg = config();
    let engine = Engine::builder().policy(AdapterPolicy::Portable).build().unwrap();
    let options =
        LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }.weights(WeightFormat::Int4);
    let model = engine.load(tmp.path(), &options).unwrap();
    assert_eq!(model.weight_format(), WeightFormat::Int4);
    let mut rng = StdRng::seed_from_u64(7);
    for prompt_len in [5usize, 70] {
        let prompt: Vec<u32> = (0..prompt_len).map(|_| rng.random_range(0..64)).collect();
        let out = model
            .generate_with(&prompt, &GenerateOptions::default().max_new_tokens(8), |_| {
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
        let generated = out.generated_ids().to_vec();
        assert_eq!(generated.len(), 8, "prompt of {prompt_len}");
        let all = [&prompt[..], &generated[..generated.len() - 1]].concat();
        let logits = reference_logits(&weights, &cfg, &all);
        for (i, &token) in generated.iter().enumerate() {
            let want = &logits[prompt_len - 1 + i];
            let max = want.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let best = want.iter().position(|&v| v == max).unwrap();
            assert!(
                want[token as usize] >= max - 1e-4 * (1.0 + max.abs()),
                "prompt of {prompt_len}, token {i}: the GPU chose {token} (reference logit {}), the reference {best} ({max})",
                want[token as usize]
            );
        }
    }
}

/// An int4 model's sessions decode in a batch (the batched-row matvecs
/// over int4 weights) the tokens each decodes alone, in both matvec
/// layouts (split K: the f16 residual copy).
#[test]
fn int4_sessions_decode_in_a_batch_what_they_decode_alone() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path());
    for layout in [MatvecLayout::RowsPerTeam, MatvecLayout::SplitK] {
        let engine = Engine::builder().policy(AdapterPolicy::Portable).matvec_layout(layout).build().unwrap();
        let options =
            LoadOptions { cache: CachePolicy::Disabled, ..Default::default() }.weights(WeightFormat::Int4);
        let model = engine.load(tmp.path(), &options).unwrap();
        let prompts: [Vec<u32>; 2] = [vec![3, 1, 4, 1, 5], (0..20).map(|i| (i * 7 + 2) % 64).collect()];
        let n = 6;
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut s = model.session_with_capacity(64).unwrap();
                let first = s.feed(p).unwrap();
                std::iter::once(first).chain((1..n).map(|_| s.next_token().unwrap())).collect()
            })
            .collect();
        let mut batch = model.batch(&BatchOptions::default().slots(2).capacity_per_slot(64)).unwrap();
        let (mut a, mut b) = (batch.session().unwrap(), batch.session().unwrap());
        let mut got = [vec![a.feed(&prompts[0]).unwrap()], vec![b.feed(&prompts[1]).unwrap()]];
        for _ in 1..n {
            let tokens = batch.step(&mut [&mut a, &mut b]).unwrap();
            got[0].push(tokens[0]);
            got[1].push(tokens[1]);
        }
        assert_eq!(got.to_vec(), alone, "{layout:?}");
    }
}
