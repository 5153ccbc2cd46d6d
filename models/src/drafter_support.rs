//! The target's weights as a library call, for drafters that reuse them (DFlash, DSpark, MTP,
//! the Gemma assistant): open `TargetInfo.weights_path` and get the target's token embedding, its
//! final norm and its lm_head as ready layers, plus its tokenizer.
//!
//! Only those tensors are read, in the target's own storage: GGUF blocks stay quantized
//! (`WeightDType::Native`), safetensors are memory-mapped and loaded in their dtype, and a tied
//! lm_head shares the embedding's storage. Nothing here dequantizes a `[vocab, hidden]` matrix,
//! so a drafter never holds a second dense copy of a 50k–150k-row table.
//!
//! [`draft_vocab`]: the draft vocabulary those drafters' heads can be restricted to; [`attend`]: attention
//! over a drafter's own small K/V cache.
//!
//! ```no_run
//! # fn main() -> specula_models::Result<()> {
//! use specula_models::drafter_support::TargetParts;
//! let parts = TargetParts::open("models/cache/smollm2-135m.gguf".as_ref(), &candle_core::Device::Cpu)?;
//! let x = parts.embedding.forward(&[1, 2, 3])?;           // [3, hidden] f32
//! let logits = parts.lm_head.forward(&parts.final_norm.forward(&x)?)?; // [3, vocab]
//! let tokenizer = parts.tokenizer()?;
//! # Ok(()) }
//! ```

pub mod attend;
pub mod draft_vocab;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layers::{Embedding, Linear, RmsNorm};
use crate::loader::{read_gguf, safetensors_shards};
use crate::tokenizer::Tokenizer;
use crate::weights::{WeightDType, Weights};

/// The target's embedding, final norm and lm_head, opened from its weights.
#[derive(Clone, Debug)]
pub struct TargetParts {
    /// The target's config (from `config.json` or the GGUF metadata).
    pub config: ModelConfig,
    /// `model.embed_tokens` `[vocab, hidden]`, in the target's storage.
    pub embedding: Embedding,
    /// `model.norm`: what the target applies before its lm_head.
    pub final_norm: RmsNorm,
    /// `lm_head` `[vocab, hidden]` (sharing the embedding's storage when tied).
    pub lm_head: Linear,
    path: PathBuf,
}

impl TargetParts {
    /// Opens the target's weights at `path` (a `.gguf` file or an HF directory) and loads only
    /// the embedding, final norm and lm_head onto `device`.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::InvalidModel`], [`Error::Missing`] for bad or incomplete files.
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let (config, mut weights) = match is_gguf(path) {
            true => {
                let (content, file) = read_gguf(path)?;
                let config = ModelConfig::from_gguf(&content, path)?;
                let weights = Weights::gguf(content, file, path, WeightDType::Native, device);
                (config, weights)
            }
            false => {
                let config = ModelConfig::from_hf_json(&path.join("config.json"))?;
                let shards = safetensors_shards(path)?;
                let weights = Weights::safetensors(path, &shards, WeightDType::Native, device)?;
                (config, weights)
            }
        };
        let dims = (config.vocab_size, config.hidden_size);
        let (embedding, lm_head) = weights.embedding_and_head(dims, config.tie_word_embeddings)?;
        let norm = weights.vector("model.norm.weight")?;
        if norm.dims1()? != config.hidden_size {
            return Err(Error::InvalidModel {
                path: path.to_path_buf(),
                reason: format!(
                    "model.norm.weight has {} elements, hidden size is {}",
                    norm.dims1()?,
                    config.hidden_size
                ),
            });
        }
        Ok(TargetParts {
            final_norm: RmsNorm::new(norm, config.rms_norm_eps)?,
            config,
            embedding,
            lm_head,
            path: path.to_path_buf(),
        })
    }

    /// Where the weights came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The target's tokenizer (GGUF metadata or `tokenizer.json` beside the weights).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] / [`Error::Io`] when it cannot be rebuilt.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match is_gguf(&self.path) {
            true => Tokenizer::from_gguf_file(&self.path),
            false => Tokenizer::from_hf_dir(&self.path),
        }
    }

    /// A digest of the embedding's values rounded to bf16, or `None` when it is quantized (a
    /// quantized table is never the same tensor as a float copy). A drafter that ships a copy of
    /// the embedding compares [`value_digest`] of its copy with this and maps the target's
    /// table instead when they are equal.
    ///
    /// # Errors
    /// If the table cannot be read.
    pub fn embedding_digest(&self) -> Result<Option<String>> {
        match &self.embedding {
            Embedding::Quantized(_) => Ok(None),
            Embedding::Dense(t) => value_digest(t).map(Some),
        }
    }

    /// As [`TargetParts::embedding_digest`], for the lm_head.
    ///
    /// # Errors
    /// If the weight cannot be read.
    pub fn lm_head_digest(&self) -> Result<Option<String>> {
        match self.lm_head.weight() {
            crate::layers::linear::Weight::Dense(t) => value_digest(t).map(Some),
            _ => Ok(None),
        }
    }
}

/// SHA-256 over a float tensor's shape and values rounded to bf16, in row chunks (no full f32
/// copy of a large matrix): equal for the same tensor stored as f32, f16 or bf16.
///
/// # Errors
/// If the tensor is not a float tensor of rank ≥ 1.
pub fn value_digest(t: &Tensor) -> Result<String> {
    let mut h = Sha256::new();
    h.update(b"specula-values-bf16-v1");
    for d in t.dims() {
        h.update((*d as u64).to_le_bytes());
    }
    let rows = t.dims().first().copied().unwrap_or(1);
    let t = t.reshape((rows, ()))?;
    const CHUNK: usize = 1024;
    for start in (0..rows).step_by(CHUNK) {
        let n = CHUNK.min(rows - start);
        let chunk = t
            .narrow(0, start, n)?
            .to_dtype(DType::BF16)?
            .flatten_all()?;
        for x in chunk.to_vec1::<half::bf16>()? {
            h.update(x.to_bits().to_le_bytes());
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;
    use crate::testing::TinyModel;
    use crate::ForwardRequest;

    /// The parts reproduce the target's own logits: lm_head(final_norm(last layer output)).
    fn check_against_the_model(path: &Path, tol: f32) {
        let model = crate::load_model(path, &Default::default()).unwrap();
        let parts = TargetParts::open(path, &Device::Cpu).unwrap();
        assert_eq!(parts.config.vocab_size, 96);
        let ids = [3u32, 17, 42, 5];
        let mut cache = model.new_cache();
        let req = ForwardRequest {
            logits: crate::batch::Rows::All,
            taps: vec![crate::TapId::Layer(1), crate::TapId::FinalNorm],
            tap_rows: crate::batch::Rows::All,
        };
        let out = model.forward(&ids, &mut cache, &req).unwrap();
        let last_layer = &out.taps[0].1;
        let ours = parts
            .lm_head
            .forward(&parts.final_norm.forward(last_layer).unwrap())
            .unwrap();
        let diff = (ours - &out.logits)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff <= tol, "logits differ by {diff}");
        // The embedding row is the one the target looks up.
        let e = parts.embedding.forward(&[17]).unwrap();
        assert_eq!(e.dims(), &[1, 64]);
    }

    #[test]
    fn hf_parts_give_the_targets_logits_and_digests() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = TinyModel::new("qwen3", 11).unwrap();
        tiny.write_hf_dir(dir.path()).unwrap();
        check_against_the_model(dir.path(), 1e-4);
        let parts = TargetParts::open(dir.path(), &Device::Cpu).unwrap();
        let embed = &tiny
            .tensors
            .iter()
            .find(|(n, _)| n == "model.embed_tokens.weight")
            .unwrap()
            .1;
        let digest = parts.embedding_digest().unwrap().unwrap();
        // The same values in bf16 storage hash the same; another tensor does not.
        let as_bf16 = embed.to_dtype(DType::BF16).unwrap();
        assert_eq!(value_digest(&as_bf16).unwrap(), digest);
        let other = (embed + 1.0).unwrap();
        assert_ne!(value_digest(&other).unwrap(), digest);
        // Tied: the lm_head is the embedding.
        assert_eq!(parts.lm_head_digest().unwrap().unwrap(), digest);
    }

    #[test]
    fn gguf_parts_stay_quantized() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        TinyModel::new("qwen3", 12)
            .unwrap()
            .write_gguf(&path, GgmlDType::Q8_0)
            .unwrap();
        check_against_the_model(&path, 1e-4);
        let parts = TargetParts::open(&path, &Device::Cpu).unwrap();
        assert!(matches!(parts.embedding, Embedding::Quantized(_)));
        assert_eq!(parts.embedding_digest().unwrap(), None);
    }

    #[test]
    fn missing_weights_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = TargetParts::open(dir.path(), &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("config.json"), "{err}");
        let err = TargetParts::open(&dir.path().join("no.gguf"), &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("no.gguf"), "{err}");
    }
}
