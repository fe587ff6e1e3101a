//! `config.json` of a Hugging Face Qwen3 checkpoint, and the shape profiles
//! the engine accepts.

/// The model hyper-parameters the engine uses, read from `config.json`
/// (and `generation_config.json` for the end-of-text ids).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
    /// Ids that end generation (config.json's and generation_config.json's
    /// `eos_token_id`, which may be a number or a list).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Rows of the fused q/k/v projection: `(heads + 2 * kv_heads) * head_dim`.
    pub fn qkv_rows(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }
    /// Width of the attention output (`heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    /// Width of one position's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}
