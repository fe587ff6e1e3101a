//! What a session is made with: [`SessionOptions`].

use crate::kv_cache::KvFormat;

/// How [`Model::session_with`](crate::Model::session_with) makes a
/// session: its KV-cache capacity and format.
///
/// ```no_run
/// # fn f(model: &qwen3_wgpu::Model) -> qwen3_wgpu::Result<()> {
/// use qwen3_wgpu::{KvFormat, SessionOptions};
/// let options = SessionOptions::default().capacity(8192).kv_cache(KvFormat::Int8);
/// let session = model.session_with(&options)?;
/// assert_eq!(session.kv_format(), KvFormat::Int8);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SessionOptions {
    /// KV-cache capacity in positions; `None`: [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY)
    /// (at most the model's `max_position_embeddings`).
    pub capacity: Option<usize>,
    /// How the KV cache stores its rows (default [`KvFormat::F16`]).
    pub kv_cache: KvFormat,
}

impl SessionOptions {
    /// Sets [`Self::capacity`].
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// Sets [`Self::kv_cache`].
    pub fn kv_cache(mut self, format: KvFormat) -> Self {
        self.kv_cache = format;
        self
    }
}
