//! The one error type of the crate. Every variant has a stable, documented
//! [`Error::code`] that callers (and the `decode` example's JSON) can match on.

use std::path::PathBuf;

/// One field of config.json (or one tensor shape) that differs from what was
/// expected: the profile's value or the shape config.json implies.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    /// Field name (`hidden_size`) or tensor name (`model.layers.0.mlp.up_proj.weight`).
    pub field: String,
    /// What was expected, as text (`1024`, `[3072, 1024]`).
    pub expected: String,
    /// What the checkpoint holds, as text.
    pub found: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: expected {}, found {}", self.field, self.expected, self.found)
    }
}

fn list(m: &[Mismatch]) -> String {
    m.iter().map(|m| m.to_string()).collect::<Vec<_>>().join("; ")
}

/// Everything that can go wrong, each with a stable [`code`](Error::code).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The checkpoint directory or one of its required files does not exist.
    #[error("checkpoint not found: {path}: {reason}")]
    CheckpointNotFound {
        /// The file or directory concerned.
        path: PathBuf,
        /// What went wrong, in words.
        reason: String,
    },

    /// A checkpoint file exists but cannot be parsed (malformed JSON or
    /// safetensors, a missing tensor, a shard index pointing nowhere).
    #[error("invalid checkpoint {path}: {reason}")]
    CheckpointInvalid {
        /// The file or directory concerned.
        path: PathBuf,
        /// What went wrong, in words.
        reason: String,
    },

    /// The checkpoint is not a shape this engine (or the requested profile)
    /// accepts. Lists every mismatched field or tensor, not just the first.
    #[error("unsupported checkpoint architecture ({profile}): {}", list(.mismatches))]
    UnsupportedArchitecture {
        /// The profile checked against (`qwen3` or `qwen3-0.6b`).
        profile: String,
        /// Every mismatched field or tensor.
        mismatches: Vec<Mismatch>,
    },

    /// A tensor is stored in a dtype the converter does not read.
    #[error("unsupported dtype {dtype} for tensor {tensor} (expected BF16, F16 or F32)")]
    UnsupportedDtype {
        /// The tensor's name.
        tensor: String,
        /// Its stored dtype.
        dtype: String,
    },

    /// Under the default `MetalOnly` policy the adapter found is not Metal.
    #[error("the GPU adapter \"{adapter}\" uses the {backend} backend; this engine runs on Metal by default (opt in to other backends with AdapterPolicy::Portable, --backend portable or QWEN3_WGPU_BACKEND=portable)")]
    NonMetalAdapter {
        /// The adapter's backend.
        backend: String,
        /// The adapter's name.
        adapter: String,
    },

    /// No GPU adapter (of the allowed backends) exists.
    #[error("no GPU adapter found: {reason}")]
    NoGpuAdapter {
        /// What went wrong, in words.
        reason: String,
    },

    /// The device could not be created, was lost, or reported an error.
    #[error("GPU device failed: {reason}")]
    GpuDeviceFailed {
        /// What went wrong, in words.
        reason: String,
    },

    /// A kernel failed to compile or to build a pipeline.
    #[error("shader {kernel} failed to compile: {reason}")]
    ShaderCompileFailed {
        /// The kernel's name.
        kernel: String,
        /// What went wrong, in words.
        reason: String,
    },

    /// A token id is not below the vocabulary size.
    #[error("token id {id} at position {position} is out of range (vocab_size {vocab_size})")]
    InvalidTokenId {
        /// The token id.
        id: u32,
        /// Its position in the input.
        position: usize,
        /// The model's vocabulary size.
        vocab_size: usize,
    },

    /// Decoding needs at least one prompt token.
    #[error("the prompt is empty: decoding needs at least one token")]
    EmptyPrompt,

    /// A decode step was asked for before any token was fed: there is no
    /// pending prediction to continue from (call `Session::feed` first).
    #[error("no pending token: feed the session a prompt before asking for the next token")]
    NoPendingToken,

    /// The prompt plus the new tokens do not fit the session's KV cache.
    #[error("context overflow: {needed} positions needed, capacity is {capacity}")]
    ContextOverflow {
        /// Positions needed.
        needed: usize,
        /// The session's KV-cache capacity, positions.
        capacity: usize,
    },

    /// Reading or writing the converted-weights cache failed.
    #[error("cache i/o failed at {path}: {reason}")]
    CacheIo {
        /// The file or directory concerned.
        path: PathBuf,
        /// What went wrong, in words.
        reason: String,
    },

    /// An argument or configuration value is not one the engine accepts
    /// (an unknown `QWEN3_WGPU_*` value, a malformed command-line flag).
    /// Names the argument and what is allowed.
    #[error("invalid argument {name}: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: String,
        /// What went wrong, in words.
        reason: String,
    },

    /// The engine's own bookkeeping broke an invariant (a bug in this
    /// crate, not in the input or the device): please report it with the
    /// reason.
    #[error("internal error (a bug in qwen3-wgpu, please report it): {reason}")]
    Internal {
        /// What went wrong, in words.
        reason: String,
    },

    /// An allocation the engine needs is larger than the memory available
    /// (host memory for conversion, say). Names the bytes needed and available.
    #[error("out of memory: {what} needs {needed} bytes, {available} available")]
    OutOfMemory {
        /// What the allocation is for.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available (0 when unknown).
        available: u64,
    },

    /// A session file cannot be read or written: a missing file, a missing
    /// or unwritable directory, a full disk. A failed save leaves no file.
    #[error("session file i/o failed at {path}: {reason}")]
    SessionIo {
        /// The file concerned.
        path: PathBuf,
        /// What went wrong, in words.
        reason: String,
    },

    /// A file given to restore a session is not a complete, intact session
    /// file of this format version (wrong magic or version, truncated or
    /// extended, a checksum mismatch, token ids outside the vocabulary).
    #[error("invalid session file {path}: {reason}")]
    SessionFileInvalid {
        /// The file concerned.
        path: PathBuf,
        /// What went wrong, in words.
        reason: String,
    },

    /// An intact session file saved from another model (its weights
    /// fingerprint differs from the loaded model's).
    #[error("session file {path} belongs to another model: saved from weights {found}, this model's are {expected}")]
    SessionModelMismatch {
        /// The file concerned.
        path: PathBuf,
        /// The loaded model's fingerprint.
        expected: String,
        /// The fingerprint the file records.
        found: String,
    },

    /// The caller cancelled the operation (a load progress callback
    /// returned `ControlFlow::Break`). Nothing it would have written is
    /// left behind.
    #[error("cancelled by the caller")]
    Cancelled,
}

impl Error {
    /// The stable machine-readable code of this error.
    ///
    /// ```
    /// use qwen3_wgpu::Error;
    /// assert_eq!(Error::EmptyPrompt.code(), "empty_prompt");
    /// ```
    pub fn code(&self) -> &'static str {
        match self {
            Error::CheckpointNotFound { .. } => "checkpoint_not_found",
            Error::CheckpointInvalid { .. } => "checkpoint_invalid",
            Error::UnsupportedArchitecture { .. } => "unsupported_checkpoint_architecture",
            Error::UnsupportedDtype { .. } => "unsupported_dtype",
            Error::NonMetalAdapter { .. } => "non_metal_adapter",
            Error::NoGpuAdapter { .. } => "no_gpu_adapter",
            Error::GpuDeviceFailed { .. } => "gpu_device_failed",
            Error::ShaderCompileFailed { .. } => "shader_compile_failed",
            Error::InvalidTokenId { .. } => "invalid_token_id",
            Error::EmptyPrompt => "empty_prompt",
            Error::NoPendingToken => "no_pending_token",
            Error::ContextOverflow { .. } => "context_overflow",
            Error::CacheIo { .. } => "cache_io",
            Error::InvalidArgument { .. } => "invalid_argument",
            Error::Internal { .. } => "internal",
            Error::OutOfMemory { .. } => "out_of_memory",
            Error::SessionIo { .. } => "session_io",
            Error::SessionFileInvalid { .. } => "session_file_invalid",
            Error::SessionModelMismatch { .. } => "session_model_mismatch",
            Error::Cancelled => "cancelled",
        }
    }

    /// Every code, in declaration order (for documentation and tests).
    pub const ALL_CODES: [&'static str; 20] = [
        "checkpoint_not_found",
        "checkpoint_invalid",
        "unsupported_checkpoint_architecture",
        "unsupported_dtype",
        "non_metal_adapter",
        "no_gpu_adapter",
        "gpu_device_failed",
        "shader_compile_failed",
        "invalid_token_id",
        "empty_prompt",
        "no_pending_token",
        "context_overflow",
        "cache_io",
        "invalid_argument",
        "internal",
        "out_of_memory",
        "session_io",
        "session_file_invalid",
        "session_model_mismatch",
        "cancelled",
    ];

    pub(crate) fn cache_io(path: impl Into<PathBuf>, e: impl std::fmt::Display) -> Self {
        Error::CacheIo { path: path.into(), reason: e.to_string() }
    }

    pub(crate) fn invalid_argument(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { name: name.into(), reason: reason.into() }
    }

    pub(crate) fn internal(reason: impl Into<String>) -> Self {
        Error::Internal { reason: reason.into() }
    }

    pub(crate) fn invalid(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::CheckpointInvalid { path: path.into(), reason: reason.into() }
    }
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
