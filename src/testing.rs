//! Random Qwen3 checkpoints of any shape, written in the Hugging Face
//! layout (config.json + BF16 model.safetensors) for tests and benchmarks.
//! Tensors are generated while the file is written, so even the exact
//! 0.6B shape (~1.2 GB) never sits in memory whole.

use std::borrow::Cow;
use std::path::Path;

use safetensors::{Dtype, View};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A BF16 tensor whose bytes are generated on request: uniform noise with
/// standard deviation `std`, around 1 for norm weights.
struct RandomBf16 {
    shape: Vec<usize>,
    seed: u64,
    std: f32,
    around_one: bool,
}

impl View for RandomBf16 {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let n: usize = self.shape.iter().product();
        let mut out = Vec::with_capacity(2 * n);
        let mut s = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let offset = if self.around_one { 1.0 } else { 0.0 };
        for _ in 0..n {
            // xorshift64*
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            let v = (r * 2.0 - 1.0) * self.std * 1.732 + offset;
            out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        2 * self.shape.iter().product::<usize>()
    }
}

/// Writes `config.json` and `model.safetensors` for a random model of
/// shape `cfg` into `dir` (which must exist).
pub fn write_random_checkpoint(dir: &Path, cfg: &ModelConfig, seed: u64) -> Result<()> {
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16",
        "eos_token_id": cfg.eos_token_ids, "hidden_act": "silu"
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).map_err(|e| Error::cache_io(&path, e))?;

    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let mut n = seed << 16;
    let mut t = |shape: &[usize], std: f32, around_one: bool| {
        n += 1;
        RandomBf16 { shape: shape.to_vec(), seed: n, std, around_one }
    };
    let w = 1.0 / (h as f32).sqrt();
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), t(&[cfg.vocab_size, h], 0.05, false))];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        tensors.push((format!("{p}.input_layernorm.weight"), t(&[h], 0.1, true)));
        tensors.push((format!("{p}.self_attn.q_proj.weight"), t(&[cfg.q_dim(), h], w, false)));
        tensors.push((format!("{p}.self_attn.k_proj.weight"), t(&[cfg.kv_dim(), h], w, false)));
        tensors.push((format!("{p}.self_attn.v_proj.weight"), t(&[cfg.kv_dim(), h], w, false)));
        tensors.push((format!("{p}.self_attn.o_proj.weight"), t(&[h, cfg.q_dim()], w, false)));
        tensors.push((format!("{p}.self_attn.q_norm.weight"), t(&[hd], 0.1, true)));
        tensors.push((format!("{p}.self_attn.k_norm.weight"), t(&[hd], 0.1, true)));
        tensors.push((format!("{p}.post_attention_layernorm.weight"), t(&[h], 0.1, true)));
        tensors.push((format!("{p}.mlp.gate_proj.weight"), t(&[inter, h], w, false)));
        tensors.push((format!("{p}.mlp.up_proj.weight"), t(&[inter, h], w, false)));
        tensors
            .push((format!("{p}.mlp.down_proj.weight"), t(&[h, inter], 1.0 / (inter as f32).sqrt(), false)));
    }
    tensors.push(("model.norm.weight".to_string(), t(&[h], 0.1, true)));
    if !cfg.tie_word_embeddings {
        tensors.push(("lm_head.weight".to_string(), t(&[cfg.vocab_size, h], 0.05, false)));
    }
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).map_err(|e| Error::cache_io(&path, e))
}
