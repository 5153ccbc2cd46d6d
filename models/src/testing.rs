//! Test utility: tiny llama / qwen2 / qwen3 models with seeded random f32 weights, written out
//! as an HF directory (`config.json` + `model.safetensors`) or a GGUF file so that tests of
//! this and other crates exercise the real load paths.
//!
//! Only weights and config are written — no tokenizer — so tests load them with
//! [`crate::load_model`] (not [`crate::loader`]'s tokenizer-bearing entry point) and feed token
//! ids directly.
//!
//! ```no_run
//! # fn main() -> specula_models::Result<()> {
//! use specula_models::testing::TinyModel;
//! let tiny = TinyModel::new("qwen2", 7)?;
//! let dir = std::env::temp_dir().join("tiny-qwen2");
//! tiny.write_hf_dir(&dir)?;
//! let model = specula_models::load_model(&dir, &Default::default())?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::arch;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::weights::gguf_name;

/// A tiny model held in memory: its config and its tensors under HF names.
#[derive(Clone, Debug)]
pub struct TinyModel {
    /// The config written to `config.json` / GGUF metadata.
    pub config: ModelConfig,
    /// `(HF name, f32 tensor)`, weights `[out, in]` in the HF (half-split rope) layout.
    pub tensors: Vec<(String, Tensor)>,
}

impl TinyModel {
    /// The tiny config of `model_type` (`llama`, `qwen2`, `qwen3`): 2 layers, hidden 64,
    /// 4 query heads over 2 KV heads of width 16, vocab 96, context 64.
    ///
    /// # Errors
    /// [`Error::UnsupportedArchitecture`] for another `model_type`.
    pub fn tiny_config(model_type: &str) -> Result<ModelConfig> {
        let spec = switches(model_type)?;
        Ok(ModelConfig {
            model_type: model_type.to_string(),
            vocab_size: 96,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: Some(16),
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 64,
            tie_word_embeddings: model_type != "llama",
            attention_bias: spec.qkv_bias,
            qk_norm: spec.qk_norm,
            bos_token_id: Some(1),
            eos_token_id: vec![2],
            gemma: Default::default(),
        })
    }

    /// A tiny model of `model_type` with weights drawn from `seed`.
    ///
    /// # Errors
    /// As [`TinyModel::tiny_config`].
    pub fn new(model_type: &str, seed: u64) -> Result<Self> {
        Self::with_config(Self::tiny_config(model_type)?, seed)
    }

    /// Random weights for `config` (any size; keep it small).
    ///
    /// # Errors
    /// If a tensor cannot be built.
    pub fn with_config(config: ModelConfig, seed: u64) -> Result<Self> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (h, hd, i) = (
            config.hidden_size,
            config.head_dim(),
            config.intermediate_size,
        );
        let (q, kv) = (config.num_attention_heads * hd, config.kv_heads() * hd);
        let mut tensors = Vec::new();
        // Scale 1/sqrt(in) keeps activations O(1) so logits are not all saturated.
        let mut mat = |name: String, out: usize, inp: usize| -> Result<()> {
            let s = 1.0 / (inp as f32).sqrt();
            let data: Vec<f32> = (0..out * inp)
                .map(|_| rng.random_range(-s..s) * 1.7)
                .collect();
            tensors.push((name, Tensor::from_vec(data, (out, inp), &Device::Cpu)?));
            Ok(())
        };
        mat("model.embed_tokens.weight".into(), config.vocab_size, h)?;
        let mut vectors: Vec<(String, usize, f32)> = Vec::new();
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            mat(format!("{p}.self_attn.q_proj.weight"), q, h)?;
            mat(format!("{p}.self_attn.k_proj.weight"), kv, h)?;
            mat(format!("{p}.self_attn.v_proj.weight"), kv, h)?;
            mat(format!("{p}.self_attn.o_proj.weight"), h, q)?;
            mat(format!("{p}.mlp.gate_proj.weight"), i, h)?;
            mat(format!("{p}.mlp.up_proj.weight"), i, h)?;
            mat(format!("{p}.mlp.down_proj.weight"), h, i)?;
            vectors.push((format!("{p}.input_layernorm.weight"), h, 1.0));
            vectors.push((format!("{p}.post_attention_layernorm.weight"), h, 1.0));
            if config.attention_bias {
                for (n, d) in [("q", q), ("k", kv), ("v", kv)] {
                    vectors.push((format!("{p}.self_attn.{n}_proj.bias"), d, 0.0));
                }
            }
            if config.qk_norm {
                vectors.push((format!("{p}.self_attn.q_norm.weight"), hd, 1.0));
                vectors.push((format!("{p}.self_attn.k_norm.weight"), hd, 1.0));
            }
        }
        vectors.push(("model.norm.weight".into(), h, 1.0));
        if !config.tie_word_embeddings {
            mat("lm_head.weight".into(), config.vocab_size, h)?;
        }
        for (name, d, center) in vectors {
            let data: Vec<f32> = (0..d)
                .map(|_| center + rng.random_range(-0.3..0.3))
                .collect();
            tensors.push((name, Tensor::from_vec(data, d, &Device::Cpu)?));
        }
        Ok(Self { config, tensors })
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if needed).
    ///
    /// # Errors
    /// [`Error::Io`] if the directory or files cannot be written.
    pub fn write_hf_dir(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let cfg = serde_json::to_string_pretty(&self.config).map_err(|e| Error::InvalidModel {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, cfg).map_err(|source| Error::Io {
            path: cfg_path,
            source,
        })?;
        let map: HashMap<String, Tensor> = self.tensors.iter().cloned().collect();
        candle_core::safetensors::save(&map, dir.join("model.safetensors")).map_err(|e| {
            Error::Candle {
                op: "write safetensors",
                source: e,
            }
        })
    }

    /// Writes a GGUF file as llama.cpp's converter would: llama q/k rows permuted to the
    /// interleaved rope layout, matrices stored as `dtype` (e.g. `F32`, `Q8_0`), vectors f32.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be written, [`Error::Candle`] if a tensor cannot be
    /// quantized to `dtype` (row length not a multiple of its block).
    pub fn write_gguf(&self, path: &Path, dtype: GgmlDType) -> Result<()> {
        self.write_gguf_with_nextn(path, dtype, 0)
    }

    /// As [`TinyModel::write_gguf`], for a model whose tensors include `nextn` MTP layers after
    /// its decoder layers (DeepSeek names, `model.layers.{L}.eh_proj`, …): llama.cpp counts them
    /// in `block_count` and records `{arch}.nextn_predict_layers`.
    ///
    /// # Errors
    /// As [`TinyModel::write_gguf`].
    pub fn write_gguf_with_nextn(&self, path: &Path, dtype: GgmlDType, nextn: usize) -> Result<()> {
        let cfg = &self.config;
        let spec = switches(&cfg.model_type)?;
        let mut qtensors = Vec::new();
        for (hf, t) in &self.tensors {
            let name = gguf_name(hf).expect("invariant: TinyModel only makes mappable names");
            let t = match (spec.gguf_rope, hf.rsplit('.').nth(1)) {
                (crate::layers::RopeStyle::Interleaved, Some("q_proj")) => {
                    permute_rows(t, cfg.num_attention_heads)?
                }
                (crate::layers::RopeStyle::Interleaved, Some("k_proj")) => {
                    permute_rows(t, cfg.kv_heads())?
                }
                _ => t.clone(),
            };
            let q = match t.rank() {
                1 => QTensor::quantize(&t, GgmlDType::F32)?,
                _ => QTensor::quantize(&t, dtype)?,
            };
            qtensors.push((name, q));
        }
        let arch = spec.name;
        let u32v = |v: usize| Value::U32(v as u32);
        let mut md: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (
                format!("{arch}.block_count"),
                u32v(cfg.num_hidden_layers + nextn),
            ),
            (format!("{arch}.embedding_length"), u32v(cfg.hidden_size)),
            (
                format!("{arch}.feed_forward_length"),
                u32v(cfg.intermediate_size),
            ),
            (
                format!("{arch}.attention.head_count"),
                u32v(cfg.num_attention_heads),
            ),
            (
                format!("{arch}.attention.head_count_kv"),
                u32v(cfg.kv_heads()),
            ),
            (format!("{arch}.attention.key_length"), u32v(cfg.head_dim())),
            (
                format!("{arch}.context_length"),
                u32v(cfg.max_position_embeddings),
            ),
            (
                format!("{arch}.rope.freq_base"),
                Value::F32(cfg.rope_theta as f32),
            ),
            (
                format!("{arch}.attention.layer_norm_rms_epsilon"),
                Value::F32(cfg.rms_norm_eps as f32),
            ),
            (format!("{arch}.vocab_size"), u32v(cfg.vocab_size)),
        ];
        if nextn > 0 {
            md.push((format!("{arch}.nextn_predict_layers"), u32v(nextn)));
        }
        let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut file = std::fs::File::create(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        gguf_file::write(&mut file, &md_refs, &t_refs).map_err(|e| Error::Candle {
            op: "write gguf",
            source: e,
        })
    }
}

/// llama.cpp `LlamaModel.permute`: rows of each head go from the half-split to the interleaved
/// rope layout. PyTorch: `w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:]).swapaxes(1, 2)`.
fn permute_rows(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    Ok(w.reshape((n_head, 2, rows / n_head / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// The llama-family switches of `name`, the families [`TinyModel`] builds.
fn switches(name: &str) -> Result<arch::llama::Switches> {
    arch::llama::Switches::of(name).ok_or_else(|| Error::UnsupportedArchitecture {
        got: name.to_string(),
        supported: "llama, mistral, qwen2, qwen3 (tiny models)".to_string(),
    })
}

/// The repository root (the parent of this crate), for tests that read committed fixtures.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Path of a real GGUF model, fetched by `scripts/fetch-model` when absent. Panics rather
/// than skipping: a test without its model must not pass as green.
pub fn real_model(name: &str) -> PathBuf {
    // Two tests asking for the same model at once would race on the download.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let out = std::process::Command::new(repo_root().join("scripts/fetch-model"))
        .arg(name)
        .output()
        .expect("run scripts/fetch-model");
    assert!(
        out.status.success(),
        "scripts/fetch-model {name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}
