//! Specula's model runtime on candle: loading (GGUF and HF safetensors), the llama-family
//! architectures, the packed forward over a paged KV pool (rows of many sequences in one
//! forward, rolled back by length), hidden-state taps,
//! tokenizers rebuilt from GGUF metadata, chat templates and sampling.
//!
//! The one entry point most callers need is [`load`]: it returns a [`LoadedModel`] with the
//! [`Model`], its [`Tokenizer`] and its [`ChatTemplate`].

pub mod alloc;
pub mod arch;
pub mod batch;
pub mod chat;
pub mod config;
pub mod drafter_support;
pub mod error;
pub mod int8;
pub mod kv_cache;
pub mod kv_pool;
pub mod layers;
pub mod loader;
pub mod model;
pub mod par;
pub mod random;
pub mod sampling;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use batch::{Batch, BatchOutput, Rows, SeqRows};
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use kv_pool::{KvPool, SeqId};
pub use loader::{load, load_model, LoadOptions, LoadedModel};
pub use model::{ForwardOutput, ForwardRequest, Model, TapId};
pub use weights::WeightDType;
