//! Random weights of a real architecture (`--load-format random`), created directly on the
//! device, as vLLM's `--load-format dummy` does: speed can be measured on a machine that the
//! checkpoint cannot reach (the GPU machine receives at most 64 MiB per run).
//!
//! Projections and embeddings are `N(0, 0.02)` (HF's `initializer_range`), norms are ones,
//! q/k/v biases `N(0, 0.02)`. The output is meaningless but every kernel runs on the shapes of
//! the real model. With no checkpoint there is no tokenizer either: [`synthetic_tokenizer`]
//! gives a word-level one whose token `i` is the text `t{i}`, so callers work on ids.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};

use crate::arch::{self, Checkpoint};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::layers::{Embedding, Linear};
use crate::loader::{LoadOptions, LoadedModel, WeightSource};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use crate::weights::{Bias, WeightDType};

/// Standard deviation of random weights (HF `initializer_range`).
const STD: f32 = 0.02;

/// Names accepted by [`preset`], for help texts and errors.
pub const PRESETS: &str = "qwen2.5-1.5b, qwen3-8b";

/// The config of a named model shape, mirroring its published `config.json`.
///
/// # Errors
/// [`Error::InvalidRequest`] for an unknown name, listing [`PRESETS`].
pub fn preset(name: &str) -> Result<ModelConfig> {
    let base = ModelConfig {
        model_type: String::new(),
        vocab_size: 151_936,
        hidden_size: 0,
        intermediate_size: 0,
        num_hidden_layers: 0,
        num_attention_heads: 0,
        num_key_value_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 32_768,
        tie_word_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_id: Vec::new(),
        gemma: Default::default(),
    };
    match name {
        // Qwen/Qwen2.5-1.5B config.json
        "qwen2.5-1.5b" => Ok(ModelConfig {
            model_type: "qwen2".into(),
            hidden_size: 1536,
            intermediate_size: 8960,
            num_hidden_layers: 28,
            num_attention_heads: 12,
            num_key_value_heads: Some(2),
            tie_word_embeddings: true,
            attention_bias: true,
            ..base
        }),
        // Qwen/Qwen3-8B config.json
        "qwen3-8b" => Ok(ModelConfig {
            model_type: "qwen3".into(),
            hidden_size: 4096,
            intermediate_size: 12_288,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            head_dim: Some(128),
            max_position_embeddings: 40_960,
            qk_norm: true,
            ..base
        }),
        other => Err(Error::InvalidRequest {
            op: "random weights",
            reason: format!("unknown preset '{other}' (presets: {PRESETS}; or a config.json path)"),
        }),
    }
}

/// A preset name, or the path of an HF `config.json` (or of the directory holding one).
///
/// # Errors
/// As [`preset`] for a name, as [`ModelConfig::from_hf_json`] for a path.
pub fn config(spec: &str) -> Result<ModelConfig> {
    let path = Path::new(spec);
    match (path.is_dir(), path.exists()) {
        (true, _) => ModelConfig::from_hf_json(&path.join("config.json")),
        (false, true) => ModelConfig::from_hf_json(path),
        (false, false) => preset(spec),
    }
}

/// The dtype random weights get: `native` means bf16 on a GPU (what servers run) and f32 on
/// the CPU (whose tests compare against f32 references).
pub fn dtype(want: WeightDType, device: &Device) -> DType {
    match want {
        WeightDType::Native if device.is_cpu() => DType::F32,
        WeightDType::Native | WeightDType::Bf16 => DType::BF16,
        WeightDType::F16 => DType::F16,
        WeightDType::F32 => DType::F32,
    }
}

/// A [`WeightSource`] that draws every tensor at random on `device`.
pub struct RandomWeights {
    device: Device,
    dtype: DType,
}

impl RandomWeights {
    /// Random weights in `dtype` on `device`.
    pub fn new(device: &Device, dtype: DType) -> Self {
        Self {
            device: device.clone(),
            dtype,
        }
    }

    fn normal(&self, shape: (usize, usize)) -> Result<Tensor> {
        // f32 draws then a cast: candle's device RNGs do not all draw half precision directly.
        Ok(Tensor::randn(0f32, STD, shape, &self.device)?.to_dtype(self.dtype)?)
    }
}

impl WeightSource for RandomWeights {
    fn device(&self) -> &Device {
        &self.device
    }

    fn vector(&mut self, _hf: &str, len: usize) -> Result<Tensor> {
        Ok(Tensor::ones(len, DType::F32, &self.device)?)
    }

    fn linear(&mut self, _prefix: &str, dims: (usize, usize), bias: Bias) -> Result<Linear> {
        let bias = match bias {
            Bias::Required => Some(Tensor::randn(0f32, STD, dims.0, &self.device)?),
            Bias::IfPresent | Bias::No => None,
        };
        Linear::dense(self.normal(dims)?, bias)
    }

    fn embedding_and_head(
        &mut self,
        dims: (usize, usize),
        tied: bool,
    ) -> Result<(Embedding, Linear)> {
        let table = self.normal(dims)?;
        let head = match tied {
            true => table.clone(),
            false => self.normal(dims)?,
        };
        Ok((Embedding::Dense(table), Linear::dense(head, None)?))
    }
}

/// Builds a model of `config`'s shape with random weights on `opts.device`, with a
/// [`synthetic_tokenizer`] and no chat template. `name` labels it (its `weights_path`).
///
/// # Errors
/// [`Error::UnsupportedArchitecture`] for a `model_type` Specula does not run,
/// [`Error::Tokenizer`] if the synthetic tokenizer cannot be written, and allocation
/// failures on the device.
pub fn load(name: &str, config: ModelConfig, opts: &LoadOptions) -> Result<LoadedModel> {
    let arch_name = arch::canonical(&config.model_type)?;
    let dtype = dtype(opts.dtype, &opts.device);
    tracing::info!(name, arch = arch_name, ?dtype, "building random weights");
    let mut weights = RandomWeights::new(&opts.device, dtype);
    // HF layout: random weights have no converter permutation to undo.
    let net = arch::load(&config, &mut weights, Checkpoint::Hf)?;
    let tokenizer = synthetic_tokenizer(config.vocab_size)?;
    let label = PathBuf::from(format!("random:{name}"));
    let model = Model::from_parts(net, config, &label, opts.prefill_chunk, &opts.device)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template: None,
    })
}

/// The `tokenizer.json` of a word-level tokenizer whose token `i` is the text `t{i}`
/// (whitespace-separated, no special tokens, unknown words map to `t0`).
pub fn word_level_tokenizer_json(vocab: usize) -> serde_json::Value {
    let vocab_map: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| (format!("t{i}"), serde_json::Value::from(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "t0"},
    })
}

/// A word-level tokenizer of `vocab` tokens `t0 t1 ...` (whitespace-separated text), with no
/// special tokens: nothing ends generation early.
///
/// # Errors
/// [`Error::Io`] if its `tokenizer.json` cannot be written to the temp directory,
/// [`Error::Tokenizer`] if it cannot be read back.
pub fn synthetic_tokenizer(vocab: usize) -> Result<Tokenizer> {
    let json = word_level_tokenizer_json(vocab);
    // Tokenizer reads HF folders only: write one, private to this call.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "specula-synthetic-tokenizer-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    ));
    let io = |source| Error::Io {
        path: dir.clone(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).map_err(io)?;
    let tokenizer = Tokenizer::from_hf_dir(&dir);
    // Best effort: the folder is no longer needed once read.
    let _ = std::fs::remove_dir_all(&dir);
    tokenizer
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ForwardRequest, KvCache};

    fn tiny(model_type: &str) -> ModelConfig {
        ModelConfig {
            model_type: model_type.into(),
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            max_position_embeddings: 128,
            tie_word_embeddings: true,
            attention_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_id: Vec::new(),
            gemma: Default::default(),
        }
    }

    #[test]
    fn presets_mirror_the_published_configs() {
        let q = preset("qwen2.5-1.5b").unwrap();
        assert_eq!(
            (q.hidden_size, q.num_hidden_layers, q.kv_heads()),
            (1536, 28, 2)
        );
        assert_eq!(q.head_dim(), 128);
        let q = preset("qwen3-8b").unwrap();
        assert_eq!(
            (q.hidden_size, q.num_hidden_layers, q.kv_heads()),
            (4096, 36, 8)
        );
        assert!(q.qk_norm && !q.tie_word_embeddings);
        let err = config("qwen9-1t").unwrap_err().to_string();
        assert!(err.contains("qwen2.5-1.5b"), "{err}");
    }

    /// A random model runs, and a verify window gives the logits of one-token steps.
    #[test]
    fn random_model_decodes_and_verifies_consistently() {
        for arch in ["qwen2", "qwen3"] {
            let opts = LoadOptions::default();
            let loaded = load("tiny", tiny(arch), &opts).unwrap();
            let model = &loaded.model;
            let ids = [3u32, 9, 27, 1, 60];
            let mut cache: KvCache = model.new_cache();
            let req = ForwardRequest {
                logits: crate::Rows::Last(3),
                ..ForwardRequest::default()
            };
            let window: Vec<Vec<f32>> = model
                .forward(&ids, &mut cache, &req)
                .unwrap()
                .logits
                .to_vec2()
                .unwrap();
            cache.truncate(0).unwrap();
            let mut steps = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                let out = model
                    .forward(&[*id], &mut cache, &ForwardRequest::default())
                    .unwrap();
                if i >= 2 {
                    steps.push(out.logits.to_vec2::<f32>().unwrap().remove(0));
                }
            }
            assert_eq!(window.len(), 3);
            for (a, b) in window.iter().zip(&steps) {
                let diff = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 1e-4, "{arch}: window vs steps differ by {diff}");
            }
            // Random logits are not degenerate: the rows differ.
            assert_ne!(window[0], window[1]);
        }
    }

    #[test]
    fn synthetic_tokenizer_round_trips_ids() {
        let tok = synthetic_tokenizer(100).unwrap();
        assert_eq!(tok.vocab_size(), 100);
        let ids = tok
            .encode("t5 t99 t0", crate::tokenizer::Special::Plain)
            .unwrap();
        assert_eq!(ids, vec![5, 99, 0]);
        assert!(tok.eos_ids().is_empty());
    }
}
