//! The hyper-parameters of a llama-family model, read from an HF `config.json` or from the
//! `{arch}.*` metadata keys of a GGUF file (see llama.cpp's `gguf-py/gguf/constants.py` for the
//! key names).

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Mirror of the fields of an HF `config.json` that the llama family needs.
///
/// Optional HF fields get the defaults `transformers` uses; `head_dim` defaults to
/// `hidden_size / num_attention_heads`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `model_type` of HF (`llama`, `mistral`, `qwen2`, `qwen3`), or GGUF `general.architecture`.
    pub model_type: String,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of one head; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Epsilon of the RMS norms.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Context length the model was trained for.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Whether `lm_head` reuses the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have biases (qwen2 always does).
    #[serde(default)]
    pub attention_bias: bool,
    /// Whether q and k get a per-head RMS norm before rope (qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Beginning-of-sequence token id, if any.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id(s); HF allows a list.
    #[serde(default, deserialize_with = "de_eos")]
    pub eos_token_id: Vec<u32>,
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    2048
}

/// HF writes `eos_token_id` as a number, a list or null.
fn de_eos<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Eos {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<Eos>::deserialize(d)? {
        None => Vec::new(),
        Some(Eos::One(id)) => vec![id],
        Some(Eos::Many(ids)) => ids,
    })
}

impl ModelConfig {
    /// Number of key/value heads, resolving the HF default.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head, resolving the HF default.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Reads an HF `config.json`.
    ///
    /// qwen2 configs do not spell out `attention_bias` and qwen3 configs do not spell out
    /// q/k norms: both are implied by `model_type` and set here.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read, [`Error::InvalidModel`] if it is not valid
    /// JSON or misses a required field or has inconsistent sizes.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |reason: String| Error::InvalidModel {
            path: path.to_path_buf(),
            reason: format!("config.json: {reason}"),
        };
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let mut cfg = ModelConfig::deserialize(&raw).map_err(|e| invalid(e.to_string()))?;
        // transformers 5 moved `rope_theta` into `rope_parameters` (older files: `rope_scaling`
        // beside a top-level `rope_theta`). Only plain rope is implemented: refuse the scaled
        // kinds instead of decoding with wrong positions.
        for key in ["rope_parameters", "rope_scaling"] {
            let Some(rope) = raw.get(key).filter(|v| !v.is_null()) else {
                continue;
            };
            if raw.get("rope_theta").is_none() {
                if let Some(theta) = rope.get("rope_theta").and_then(|v| v.as_f64()) {
                    cfg.rope_theta = theta;
                }
            }
            let kind = rope.get("rope_type").or_else(|| rope.get("type"));
            match kind.and_then(|v| v.as_str()) {
                None | Some("default") => {}
                Some(other) => {
                    return Err(invalid(format!(
                        "{key}.rope_type `{other}` is not supported (only default rope)"
                    )))
                }
            }
        }
        match cfg.model_type.as_str() {
            "qwen2" => cfg.attention_bias = true,
            "qwen3" => cfg.qk_norm = true,
            _ => {}
        }
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Builds the config from GGUF metadata (`general.architecture`, `{arch}.block_count`,
    /// `{arch}.embedding_length`, ...).
    ///
    /// # Errors
    /// [`Error::Missing`] naming the first missing key, [`Error::InvalidModel`] for a key of
    /// the wrong type or inconsistent sizes.
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let md = GgufMeta { content, path };
        let arch = md.string("general.architecture")?;
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = md.usize(&key("embedding_length"))?;
        let num_attention_heads = md.usize(&key("attention.head_count"))?;
        let num_key_value_heads = md.opt_usize(&key("attention.head_count_kv"))?;
        let head_dim = md.opt_usize(&key("attention.key_length"))?;
        let vocab_size = match md.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => match content.metadata.get("tokenizer.ggml.tokens") {
                Some(v) => v.to_vec().map(Vec::len).map_err(|e| md.invalid(e))?,
                None => md.tensor_rows("token_embd.weight")?,
            },
        };
        let has = |t: &str| content.tensor_infos.contains_key(t);
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: md.usize(&key("feed_forward_length"))?,
            num_hidden_layers: md.usize(&key("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: md
                .opt_f64(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or_else(default_rms_norm_eps),
            rope_theta: md
                .opt_f64(&key("rope.freq_base"))?
                .unwrap_or_else(default_rope_theta),
            max_position_embeddings: md
                .opt_usize(&key("context_length"))?
                .unwrap_or_else(default_max_position_embeddings),
            tie_word_embeddings: !has("output.weight"),
            attention_bias: has("blk.0.attn_q.bias"),
            qk_norm: has("blk.0.attn_q_norm.weight"),
            bos_token_id: md
                .opt_usize("tokenizer.ggml.bos_token_id")?
                .map(|v| v as u32),
            eos_token_id: md
                .opt_usize("tokenizer.ggml.eos_token_id")?
                .map(|v| vec![v as u32])
                .unwrap_or_default(),
            model_type: arch,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Rejects sizes that would make the model's shapes meaningless.
    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidModel {
                path: path.to_path_buf(),
                reason,
            })
        };
        let kv = self.kv_heads();
        if self.vocab_size == 0
            || self.hidden_size == 0
            || self.num_hidden_layers == 0
            || self.num_attention_heads == 0
            || kv == 0
            || self.intermediate_size == 0
            || self.max_position_embeddings == 0
        {
            return bad(format!("a size in the config is zero: {self:?}"));
        }
        if !self.num_attention_heads.is_multiple_of(kv) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {kv}",
                self.num_attention_heads
            ));
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return bad(format!("head_dim {} must be even and > 0", self.head_dim()));
        }
        Ok(())
    }
}

/// Typed access to GGUF metadata with errors naming the key and file.
struct GgufMeta<'a> {
    content: &'a gguf_file::Content,
    path: &'a Path,
}

impl GgufMeta<'_> {
    fn invalid(&self, e: impl std::fmt::Display) -> Error {
        Error::InvalidModel {
            path: self.path.to_path_buf(),
            reason: format!("GGUF metadata: {e}"),
        }
    }

    fn get(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| Error::Missing {
                what: format!("GGUF metadata key {key}"),
                path: self.path.to_path_buf(),
            })
    }

    fn string(&self, key: &str) -> Result<String> {
        self.get(key)?
            .to_string()
            .cloned()
            .map_err(|e| self.invalid(format!("{key}: {e}")))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        // Writers differ in the integer width they use for counts.
        let n = match v {
            gguf_file::Value::U8(x) => *x as u64,
            gguf_file::Value::U16(x) => *x as u64,
            gguf_file::Value::U32(x) => *x as u64,
            gguf_file::Value::U64(x) => *x,
            gguf_file::Value::I8(x) if *x >= 0 => *x as u64,
            gguf_file::Value::I16(x) if *x >= 0 => *x as u64,
            gguf_file::Value::I32(x) if *x >= 0 => *x as u64,
            gguf_file::Value::I64(x) if *x >= 0 => *x as u64,
            other => {
                return Err(self.invalid(format!(
                    "{key}: expected a non-negative integer, got {other:?}"
                )))
            }
        };
        usize::try_from(n).map_err(|e| self.invalid(format!("{key}: {e}")))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.content.metadata.contains_key(key) {
            true => self.usize(key).map(Some),
            false => Ok(None),
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.content.metadata.get(key) else {
            return Ok(None);
        };
        match v {
            gguf_file::Value::F32(x) => Ok(Some(*x as f64)),
            gguf_file::Value::F64(x) => Ok(Some(*x)),
            other => Err(self.invalid(format!("{key}: expected a float, got {other:?}"))),
        }
    }

    fn tensor_rows(&self, name: &str) -> Result<usize> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::Missing {
                what: format!("tensor {name}"),
                path: self.path.to_path_buf(),
            })?;
        info.shape
            .dims2()
            .map(|(rows, _)| rows)
            .map_err(|e| self.invalid(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_json_defaults_and_eos_list() {
        let dir = std::env::temp_dir().join(format!("specula-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        std::fs::write(
            &path,
            r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,
               "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
               "eos_token_id":[3,4]}"#,
        )
        .unwrap();
        let cfg = ModelConfig::from_hf_json(&path).unwrap();
        assert_eq!(cfg.head_dim(), 4);
        assert_eq!(cfg.kv_heads(), 1);
        assert!(cfg.attention_bias, "qwen2 implies q/k/v biases");
        assert_eq!(cfg.eos_token_id, vec![3, 4]);
        assert_eq!(cfg.rope_theta, 10_000.0);

        std::fs::write(&path, r#"{"model_type":"llama","vocab_size":10}"#).unwrap();
        let err = ModelConfig::from_hf_json(&path).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");

        std::fs::write(
            &path,
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
               "num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2}"#,
        )
        .unwrap();
        let err = ModelConfig::from_hf_json(&path).unwrap_err().to_string();
        assert!(err.contains("not a multiple"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_json_rope_parameters() {
        let dir = std::env::temp_dir().join(format!("specula-rope-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        let with = |rope: &str| {
            let body = format!(
                r#"{{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                   "num_hidden_layers":1,"num_attention_heads":2,{rope}}}"#
            );
            std::fs::write(&path, body).unwrap();
            ModelConfig::from_hf_json(&path)
        };
        // transformers 5 layout.
        let cfg = with(r#""rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"}"#);
        assert_eq!(cfg.unwrap().rope_theta, 1_000_000.0);
        // transformers 4 layout: a top-level theta and a null scaling.
        let cfg = with(r#""rope_theta":500000.0,"rope_scaling":null"#);
        assert_eq!(cfg.unwrap().rope_theta, 500_000.0);
        // Scaled rope would decode with wrong positions: refused, naming the kind.
        let err =
            with(r#""rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("llama3"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
