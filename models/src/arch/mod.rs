//! The architectures Specula runs: one [`Architecture`] trait over the shared
//! [`crate::layers`], one file per family, registered in one place ([`load`]'s `match`).
//!
//! The trait is the per-architecture part of a forward; [`crate::Model`] drives it (embed, the
//! decoder layers, the final norm, then `lm_head` over the rows that want logits) and owns what
//! is common to all: the packed batch, the KV pool, taps and row selection. A family adds its
//! own embedding scale, norms, sliding windows, shared K/V slots or logit softcap inside its
//! file without touching the driver.
//!
//! - [`llama`]: llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k norms), as switches.
//! - [`gemma3`]: Gemma 3 text (sliding/global layers, sandwich norms, `(1 + w)` norms).
//! - [`gemma4`]: Gemma 4 text (KV sharing, per-layer embeddings, proportional RoPE).
//! - [`mimo`]: Xiaomi MiMo (Qwen2 blocks; its MTP layers are the `mtp` drafter's).

pub mod gemma3;
pub mod gemma4;
pub mod llama;
pub mod mimo;

use std::fmt::Debug;
use std::sync::Arc;

use candle_core::Tensor;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_pool::{KvLayout, KvPool};
use crate::layers::attention::AttnBatch;
use crate::layers::Embedding;
use crate::loader::WeightSource;

/// One architecture's network. Rows are packed: `[T, hidden]` holds the rows of every sequence
/// of the batch, and nothing a layer does to one row may depend on another row (the
/// batch-invariance law; the shared layers guarantee it).
pub trait Architecture: Send + Sync + Debug {
    /// Canonical name (`llama`, `qwen2`, `qwen3`, ...).
    fn name(&self) -> &'static str;

    /// Number of decoder layers (taps are `Layer(0..num_layers)`).
    fn num_layers(&self) -> usize;

    /// Hidden width.
    fn hidden_size(&self) -> usize;

    /// What one KV block stores: a slot per layer that owns K/V.
    fn kv_layout(&self) -> KvLayout;

    /// The token embedding table (drafters that share it, e.g. MTP and DFlash, read it here).
    fn embedding(&self) -> &Embedding;

    /// The input of layer 0 for `ids`: `[ids.len(), hidden]` f32 (embedding lookup and any
    /// architecture-specific scaling).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id outside the vocabulary.
    fn embed(&self, ids: &[u32]) -> Result<Tensor>;

    /// Decoder layer `l` over the packed rows `xs`, attending through `pool`.
    ///
    /// # Errors
    /// On a tensor failure.
    fn layer(&self, l: usize, xs: &Tensor, batch: &AttnBatch, pool: &mut KvPool) -> Result<Tensor>;

    /// The final norm (its output is the [`crate::TapId::FinalNorm`] tap).
    ///
    /// # Errors
    /// On a tensor failure.
    fn final_norm(&self, xs: &Tensor) -> Result<Tensor>;

    /// Final-norm hidden states `[rows, hidden]` → logits `[rows, vocab]` f32 (any softcap
    /// included).
    ///
    /// # Errors
    /// On a shape mismatch.
    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor>;
}

/// Where a checkpoint's q/k rows come from (llama.cpp's converter permutes llama's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpoint {
    /// A GGUF file.
    Gguf,
    /// HF safetensors (or random weights in the HF layout).
    Hf,
}

/// Names accepted by [`load`], for error messages.
pub const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, mimo, gemma3, gemma3_text, gemma4_text";

/// Whether [`load`] knows the architecture named by GGUF `general.architecture` or HF
/// `model_type`, and its canonical name.
///
/// # Errors
/// [`Error::UnsupportedArchitecture`] naming what is supported.
pub fn canonical(name: &str) -> Result<&'static str> {
    match name {
        "gemma3" | "gemma3_text" => Ok("gemma3"),
        "gemma4" | "gemma4_text" => Ok("gemma4"),
        "mimo" => Ok("mimo"),
        _ => match llama::Switches::of(name) {
            Some(s) => Ok(s.name),
            None => Err(unsupported(name)),
        },
    }
}

/// Builds the network of `cfg.model_type` from `weights`.
///
/// # Errors
/// [`Error::UnsupportedArchitecture`] naming what is supported, and the weight source's errors
/// for absent or misshapen tensors.
pub fn load(
    cfg: &ModelConfig,
    weights: &mut dyn WeightSource,
    from: Checkpoint,
) -> Result<Arc<dyn Architecture>> {
    let name = cfg.model_type.as_str();
    match name {
        "llama" | "mistral" | "qwen2" | "qwen3" => {
            let switches = llama::Switches::of(name).expect("invariant: a llama-family name");
            Ok(Arc::new(llama::Llama::load(cfg, switches, weights, from)?))
        }
        "gemma3" | "gemma3_text" => Ok(Arc::new(gemma3::Gemma3::load(cfg, weights, from)?)),
        "gemma4" | "gemma4_text" => Ok(Arc::new(gemma4::Gemma4::load(cfg, weights, from)?)),
        "mimo" => Ok(Arc::new(mimo::load(cfg, weights, from)?)),
        other => Err(unsupported(other)),
    }
}

fn unsupported(name: &str) -> Error {
    Error::UnsupportedArchitecture {
        got: name.to_string(),
        supported: SUPPORTED.to_string(),
    }
}
