//! The model shape the CUDA step runs, from a preset or an HF `config.json`, checked against
//! what the kernels need, and the bytes one step must read (the bandwidth limit's denominator).
//!
//! Plain data with no dependency on the candle runtime, so this crate builds in seconds and the
//! engine maps its own config onto it.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Most query rows one step takes (a verify window of up to 16 tokens).
pub const MAX_ROWS: usize = 16;
/// Keys per split of the attention's first pass (`ATTN_CHUNK` in `kernels/step.cu`).
pub const ATTN_CHUNK: usize = 32;
/// Widest head the attention kernel holds in shared memory (`HD_MAX`).
pub const HEAD_DIM_MAX: usize = 128;
/// Longest KV cache: the attention merge keeps 16 rows' weights of every split in the shared
/// memory of one 32-key split (32 × 129 floats), so at most 258 splits.
pub const MAX_CTX: usize = 258 * ATTN_CHUNK;

/// Names accepted by [`Shape::preset`].
pub const PRESETS: &str = "qwen2.5-1.5b, qwen3-8b";

/// A llama-family decoder (llama, mistral, qwen2, qwen3) as the kernels see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub tied_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

/// The fields of an HF `config.json` the step reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_theta() -> f64 {
    10_000.0
}

impl Shape {
    /// A named shape (random-weight benchmarks), as models/src/random.rs's presets: the
    /// published `config.json` of Qwen/Qwen2.5-1.5B and Qwen/Qwen3-8B.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown name, listing [`PRESETS`].
    pub fn preset(name: &str) -> Result<Self> {
        let base = Self {
            vocab: 151_936,
            hidden: 0,
            intermediate: 0,
            layers: 0,
            heads: 0,
            kv_heads: 0,
            head_dim: 128,
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
        };
        let shape = match name {
            "qwen2.5-1.5b" => Self {
                hidden: 1536,
                intermediate: 8960,
                layers: 28,
                heads: 12,
                kv_heads: 2,
                tied_embeddings: true,
                qkv_bias: true,
                ..base
            },
            "qwen3-8b" => Self {
                hidden: 4096,
                intermediate: 12_288,
                layers: 36,
                heads: 32,
                kv_heads: 8,
                qk_norm: true,
                ..base
            },
            other => {
                return Err(Error::Invalid(format!(
                    "unknown preset '{other}' (presets: {PRESETS}; or a config.json path)"
                )))
            }
        };
        shape.check()?;
        Ok(shape)
    }

    /// A preset name, or the path of an HF `config.json`.
    ///
    /// # Errors
    /// As [`Shape::preset`] and [`Shape::from_hf_json`].
    pub fn from_spec(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.exists() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Invalid(format!("reading {spec}: {e}")))?;
            Self::from_hf_json(&text)
        } else {
            Self::preset(spec)
        }
    }

    /// The shape of an HF `config.json`'s text, or why the kernels cannot run it.
    ///
    /// # Errors
    /// [`Error::Invalid`] for bad JSON; [`Error::Unsupported`] for another architecture or a
    /// dimension the kernels cannot tile.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let c: HfConfig =
            serde_json::from_str(text).map_err(|e| Error::Invalid(format!("config.json: {e}")))?;
        let arch = c.model_type.as_str();
        if !matches!(arch, "llama" | "mistral" | "qwen2" | "qwen3") {
            return Err(Error::Unsupported(format!(
                "architecture '{arch}' (the CUDA step runs llama, mistral, qwen2, qwen3)"
            )));
        }
        if c.num_attention_heads == 0 {
            return Err(Error::Unsupported("a model with no attention heads".into()));
        }
        let shape = Self {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads),
            rms_eps: c.rms_norm_eps as f32,
            rope_theta: c.rope_theta,
            tied_embeddings: c.tie_word_embeddings,
            qkv_bias: c.attention_bias || arch == "qwen2",
            qk_norm: arch == "qwen3",
        };
        shape.check()?;
        Ok(shape)
    }

    /// Whether the kernels can run this shape.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the dimension they cannot tile.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Unsupported(what));
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.vocab == 0 {
            return bad("a model with no layers, heads or vocabulary".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads over {} kv heads",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(64) || self.head_dim > HEAD_DIM_MAX {
            return bad(format!("head_dim {} (64 or 128)", self.head_dim));
        }
        // The projections' kernel tiles 8 outputs by 32 inputs.
        for (name, n, k) in [
            ("qkv", self.qkv_width(), self.hidden),
            ("o_proj", self.hidden, self.heads * self.head_dim),
            ("gate_up", 2 * self.intermediate, self.hidden),
            ("down", self.hidden, self.intermediate),
            ("lm_head", self.vocab, self.hidden),
        ] {
            if !n.is_multiple_of(8) || !k.is_multiple_of(32) {
                return bad(format!(
                    "{name} of {n}x{k} (needs outputs % 8, inputs % 32)"
                ));
            }
        }
        Ok(())
    }

    /// Width of the fused q|k|v projection's output.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Elements of one layer's projections: qkv, o, gate|up, down.
    pub fn layer_weights(&self) -> usize {
        self.qkv_width() * self.hidden
            + self.hidden * self.heads * self.head_dim
            + 3 * self.intermediate * self.hidden
    }

    /// Bytes of bf16 weights one step streams: every projection and the lm_head (the
    /// embedding's few gathered rows and the norms are left out).
    pub fn step_weight_bytes(&self) -> u64 {
        2 * (self.layers * self.layer_weights() + self.vocab * self.hidden) as u64
    }

    /// Bytes of the bf16 KV cache a step reads at `context` positions.
    pub fn kv_bytes(&self, context: usize) -> u64 {
        (2 * 2 * self.layers * self.kv_heads * self.head_dim * context) as u64
    }

    /// Parameters of the model (embedding and lm_head counted once each; norms and biases left
    /// out), for reports.
    pub fn parameters(&self) -> u64 {
        let lm_head = if self.tied_embeddings {
            0
        } else {
            self.vocab * self.hidden
        };
        (self.layers * self.layer_weights() + self.vocab * self.hidden + lm_head) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_sizes() {
        let q15 = Shape::preset("qwen2.5-1.5b").unwrap();
        assert_eq!(
            (q15.hidden, q15.heads, q15.kv_heads, q15.head_dim),
            (1536, 12, 2, 128)
        );
        assert!(q15.qkv_bias && q15.tied_embeddings && !q15.qk_norm);
        // 1.54B parameters (norms and biases aside).
        assert_eq!(q15.parameters() / 10_000_000, 154);
        let q8 = Shape::preset("qwen3-8b").unwrap();
        assert!(q8.qk_norm && !q8.qkv_bias && !q8.tied_embeddings);
        // 8.19B parameters; one step streams 15.1 GB of weights and 75 MB of KV at 512.
        assert_eq!(q8.parameters() / 10_000_000, 819);
        assert_eq!(q8.step_weight_bytes() / 100_000_000, 151);
        assert_eq!(q8.kv_bytes(512), 2 * 2 * 36 * 8 * 128 * 512);
        assert!(Shape::preset("qwen9")
            .unwrap_err()
            .to_string()
            .contains("qwen2.5-1.5b"));
    }

    const SMOLLM2: &str = r#"{"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": true}"#;

    #[test]
    fn hf_configs_map_onto_the_shape() {
        let s = Shape::from_hf_json(SMOLLM2).unwrap();
        assert_eq!((s.head_dim, s.kv_heads, s.vocab), (64, 3, 49152));
        assert!(s.tied_embeddings && !s.qkv_bias && !s.qk_norm);
        assert_eq!((s.rms_eps, s.rope_theta), (1e-5, 100_000.0));
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused() {
        let with = |from: &str, to: &str| {
            Shape::from_hf_json(&SMOLLM2.replace(from, to))
                .unwrap_err()
                .to_string()
        };
        assert!(
            with("\"intermediate_size\": 1536", "\"intermediate_size\": 1538").contains("gate_up")
        );
        assert!(with("\"hidden_size\": 576", "\"hidden_size\": 2304").contains("head_dim 256"));
        assert!(
            with("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 2")
                .contains("9 heads over 2")
        );
        assert!(with("\"llama\"", "\"gemma3\"").contains("gemma3"));
        assert!(with("\"vocab_size\": 49152,", "").contains("vocab_size"));
        assert!(Shape::from_hf_json("{")
            .unwrap_err()
            .to_string()
            .contains("config.json"));
    }
}
