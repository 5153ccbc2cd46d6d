//! The error type of the model runtime.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A model file exists but is not a valid GGUF / safetensors / config file.
    #[error("invalid model file {path}: {reason}")]
    InvalidModel {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The architecture named by the model is not implemented.
    #[error("unsupported architecture '{got}' (supported: {supported})")]
    UnsupportedArchitecture {
        /// What the model says it is.
        got: String,
        /// Comma-separated list of what is supported.
        supported: String,
    },
    /// A tensor's quantization type is not supported.
    #[error("unsupported tensor type {dtype} for {tensor}")]
    UnsupportedQuant {
        /// Tensor name.
        tensor: String,
        /// Its GGML type.
        dtype: String,
    },
    /// A required tensor or metadata key is missing.
    #[error("missing {what} in {path}")]
    Missing {
        /// The key or tensor name.
        what: String,
        /// The file.
        path: PathBuf,
    },
    /// The prompt plus generation does not fit the model's context.
    #[error("context overflow: {got} tokens, the model's context is {max}")]
    ContextOverflow {
        /// Tokens requested.
        got: usize,
        /// The context length.
        max: usize,
    },
    /// The KV pool has too few blocks left for the request (free, growable and evictable).
    #[error("KV pool full: {needed} blocks needed, {available} available")]
    KvPoolFull {
        /// Blocks the operation needed.
        needed: usize,
        /// Blocks the pool could still provide.
        available: usize,
    },
    /// A caller passed arguments that cannot work (e.g. logit rows past the chunk,
    /// truncating a KV cache past its length).
    #[error("invalid request to {op}: {reason}")]
    InvalidRequest {
        /// The operation called.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Tokenizer construction, encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Invalid sampling parameters.
    #[error("invalid sampling parameter {name}: {reason}")]
    Sampling {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A candle tensor operation failed.
    #[error("tensor op {op}: {source}")]
    Candle {
        /// What we were doing.
        op: &'static str,
        /// The cause.
        #[source]
        source: candle_core::Error,
    },
}

impl From<candle_core::Error> for Error {
    fn from(source: candle_core::Error) -> Self {
        Error::Candle {
            op: "forward",
            source,
        }
    }
}
