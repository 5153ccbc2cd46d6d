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
    /// The Gemma-only hyper-parameters (absent for other families).
    #[serde(flatten)]
    pub gemma: GemmaConfig,
}

/// The `config.json` fields of Gemma 3 that other families lack, as HF names them.
///
/// Every field is optional: a GGUF stores few of them, and [`ModelConfig::gemma3`] fills the
/// gaps with the per-model defaults llama.cpp and transformers use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GemmaConfig {
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5` (not `head_dim^-0.5`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Keys a sliding-window layer sees (the current one and `sliding_window - 1` before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Per layer: `sliding_attention` or `full_attention`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<LayerType>>,
    /// Older configs: every `sliding_window_pattern`-th layer is global, the others slide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
    /// RoPE base of the sliding layers (`rope_theta` is the global layers').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    /// `logits = cap * tanh(logits / cap)` after `lm_head`, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<f64>,
    /// The same on attention scores (Gemma 2); not supported, refused when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<f64>,
    /// The MLP activation (`gelu_pytorch_tanh` for Gemma).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// Gemma 4: the last `num_kv_shared_layers` layers reuse the K/V of the last earlier layer
    /// of their type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_kv_shared_layers: Option<usize>,
    /// Gemma 4: per-layer overrides (`head_dim`, `num_key_value_heads` of global layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_layer_config: Option<std::collections::BTreeMap<String, LayerOverride>>,
    /// Gemma 4 (older configs): head width of the global layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_head_dim: Option<usize>,
    /// Gemma 4 (older configs): K/V heads of the global layers when `attention_k_eq_v`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_global_key_value_heads: Option<usize>,
    /// Gemma 4: global layers use K (before its norm) as V, with no `v_proj`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_k_eq_v: Option<bool>,
    /// Gemma 4: width of the per-layer embeddings (0 or absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size_per_layer_input: Option<usize>,
    /// Gemma 4: rows of the per-layer embedding table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size_per_layer_input: Option<usize>,
    /// Gemma 4: KV-shared layers have an MLP twice as wide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_double_wide_mlp: Option<bool>,
    /// Gemma 4 26B-A4B: mixture-of-experts blocks; not supported, refused when true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_moe_block: Option<bool>,
    /// Gemma 4: `partial_rotary_factor` of the global layers' proportional RoPE (from
    /// `rope_parameters.full_attention`; 1 when absent).
    #[serde(skip)]
    pub rope_global_partial_factor: Option<f64>,
}

/// One entry of Gemma 4's `per_layer_config`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerOverride {
    /// Head width of the layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// K/V heads of the layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
}

/// Where a Gemma 4 layer's K/V comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSource {
    /// The layer computes and stores its own.
    Own,
    /// The layer reuses the K/V of the given earlier layer.
    SharedFrom(usize),
    /// The layer reads the target's K/V (Gemma 4 assistant): its last layer of the same type
    /// that owns K/V.
    Target,
}

/// One Gemma 4 layer's shape, every default resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma4Layer {
    /// Sliding or global.
    pub kind: LayerType,
    /// Head width.
    pub head_dim: usize,
    /// K/V heads.
    pub kv_heads: usize,
    /// Own or shared K/V.
    pub kv: KvSource,
    /// V is K before its norm (no `v_proj`).
    pub k_eq_v: bool,
    /// MLP width.
    pub intermediate_size: usize,
}

impl Gemma4Params {
    /// The KV pool slot that an assistant layer of `kind` reads from this (target) model: the
    /// slot of the last layer of that type owning K/V (transformers' "store" layers). Slots are
    /// numbered over the owning layers in order, as [`crate::arch::gemma4::Gemma4`] lays them
    /// out.
    pub fn donor_slot(&self, kind: LayerType) -> Option<usize> {
        let owners: Vec<&Gemma4Layer> = self
            .layers
            .iter()
            .filter(|l| l.kv == KvSource::Own)
            .collect();
        owners.iter().rposition(|l| l.kind == kind)
    }
}

/// Gemma 4's hyper-parameters with every default resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Params {
    /// Every layer.
    pub layers: Vec<Gemma4Layer>,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// RoPE base of the sliding layers.
    pub rope_local_base: f64,
    /// RoPE base of the global layers.
    pub rope_global_base: f64,
    /// Fraction of the global layers' rotary pairs that rotate (proportional RoPE).
    pub rope_global_partial_factor: f64,
    /// Width of the per-layer embeddings (0: none).
    pub per_layer_input: usize,
    /// Rows of the per-layer embedding table.
    pub per_layer_vocab: usize,
    /// Final logit softcap.
    pub final_logit_softcapping: Option<f64>,
}

/// The attention kind of one Gemma layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Attends to the last `sliding_window` positions, with the local RoPE base.
    SlidingAttention,
    /// Attends to every position, with the global RoPE base.
    FullAttention,
}

/// Gemma 3's hyper-parameters with every default resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Params {
    /// Score scale `query_pre_attn_scalar^-0.5`.
    pub attn_scale: f32,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Kind of every layer.
    pub layer_types: Vec<LayerType>,
    /// RoPE base of the sliding layers.
    pub rope_local_base: f64,
    /// RoPE base of the global layers.
    pub rope_global_base: f64,
    /// Final logit softcap.
    pub final_logit_softcapping: Option<f64>,
}

/// What Gemma 3 GGUFs leave out, in one place: the values of llama.cpp (`llama-model.cpp`,
/// `LLM_ARCH_GEMMA3`) and of transformers' `Gemma3TextConfig`, which agree.
pub mod gemma3_defaults {
    /// Every 6th layer is global, the 5 before it slide.
    pub const SLIDING_WINDOW_PATTERN: usize = 6;
    /// RoPE base of the sliding layers.
    pub const ROPE_LOCAL_BASE: f64 = 10_000.0;
    /// `query_pre_attn_scalar` = `head_dim` for every Gemma 3 but the 27B (llama.cpp:
    /// `n_embd / n_head` there); the 27B is told apart by its width.
    pub const QUERY_PRE_ATTN_SCALAR_27B_HIDDEN: usize = 5376;
    /// Sliding window when neither the file nor the config names one.
    pub const SLIDING_WINDOW: usize = 4096;
    /// Gemma 3 has no final logit softcap.
    pub const FINAL_LOGIT_SOFTCAPPING: Option<f64> = None;
}

impl ModelConfig {
    /// Gemma 3's parameters, the gaps filled from [`gemma3_defaults`].
    ///
    /// # Errors
    /// What is wrong, for an attention softcap (not implemented), a `layer_types` of the wrong
    /// length, a zero window or pattern, or an activation other than GELU-tanh.
    pub fn gemma3(&self) -> std::result::Result<Gemma3Params, String> {
        use gemma3_defaults as d;
        let g = &self.gemma;
        if let Some(cap) = g.attn_logit_softcapping {
            return Err(format!(
                "attn_logit_softcapping = {cap} is not supported (Gemma 2 attention softcap)"
            ));
        }
        match g.hidden_activation.as_deref() {
            None | Some("gelu_pytorch_tanh") | Some("gelu_tanh") => {}
            Some(other) => return Err(format!("hidden_activation `{other}` is not supported")),
        }
        let n = self.num_hidden_layers;
        let layer_types = match (&g.layer_types, g.sliding_window_pattern) {
            (Some(types), _) if types.len() != n => {
                return Err(format!(
                    "layer_types has {} entries for {n} layers",
                    types.len()
                ))
            }
            (Some(types), _) => types.clone(),
            (None, Some(0)) => return Err("sliding_window_pattern is 0".into()),
            (None, pattern) => {
                let pattern = pattern.unwrap_or(d::SLIDING_WINDOW_PATTERN);
                (0..n)
                    .map(|l| match (l + 1) % pattern {
                        0 => LayerType::FullAttention,
                        _ => LayerType::SlidingAttention,
                    })
                    .collect()
            }
        };
        let sliding_window = g.sliding_window.unwrap_or(d::SLIDING_WINDOW);
        if sliding_window == 0 {
            return Err("sliding_window is 0".into());
        }
        let scalar = g.query_pre_attn_scalar.unwrap_or_else(|| {
            match self.hidden_size == d::QUERY_PRE_ATTN_SCALAR_27B_HIDDEN {
                true => (self.hidden_size / self.num_attention_heads) as f64,
                false => self.head_dim() as f64,
            }
        });
        if scalar <= 0.0 {
            return Err(format!("query_pre_attn_scalar {scalar} must be positive"));
        }
        Ok(Gemma3Params {
            attn_scale: scalar.powf(-0.5) as f32,
            sliding_window,
            layer_types,
            rope_local_base: g.rope_local_base_freq.unwrap_or(d::ROPE_LOCAL_BASE),
            rope_global_base: self.rope_theta,
            final_logit_softcapping: g.final_logit_softcapping.or(d::FINAL_LOGIT_SOFTCAPPING),
        })
    }

    /// Whether this is a Gemma 4 text model (HF `gemma4_text`, GGUF `gemma4`).
    pub fn is_gemma4(&self) -> bool {
        matches!(self.model_type.as_str(), "gemma4" | "gemma4_text")
    }

    /// Gemma 4's parameters (HF `Gemma4TextConfig`, including its `kv_sharing_modes`).
    ///
    /// # Errors
    /// What is wrong, for mixture-of-experts blocks or a softcap (not implemented), layer
    /// types that do not match the layer count, or KV sharing without a donor of some type.
    pub fn gemma4(&self) -> std::result::Result<Gemma4Params, String> {
        self.gemma4_layers(false)
    }

    /// Gemma 4 assistant (`Gemma4AssistantConfig.text_config`): every layer reads the target's
    /// K/V ([`KvSource::Target`]).
    ///
    /// # Errors
    /// As [`ModelConfig::gemma4`], and when not every layer is KV-shared.
    pub fn gemma4_assistant(&self) -> std::result::Result<Gemma4Params, String> {
        match self.gemma.num_kv_shared_layers == Some(self.num_hidden_layers) {
            true => self.gemma4_layers(true),
            false => Err("an assistant's num_kv_shared_layers must equal num_hidden_layers".into()),
        }
    }

    fn gemma4_layers(&self, assistant: bool) -> std::result::Result<Gemma4Params, String> {
        let g = &self.gemma;
        if g.enable_moe_block == Some(true) {
            return Err("enable_moe_block (Gemma 4 mixture of experts) is not supported".into());
        }
        if let Some(cap) = g.attn_logit_softcapping {
            return Err(format!("attn_logit_softcapping = {cap} is not supported"));
        }
        match g.hidden_activation.as_deref() {
            None | Some("gelu_pytorch_tanh") | Some("gelu_tanh") => {}
            Some(other) => return Err(format!("hidden_activation `{other}` is not supported")),
        }
        let n = self.num_hidden_layers;
        let kinds = match &g.layer_types {
            Some(types) if types.len() != n => {
                return Err(format!(
                    "layer_types has {} entries for {n} layers",
                    types.len()
                ))
            }
            Some(types) => types.clone(),
            // Gemma4TextConfig: every 6th layer global, and the last one always.
            None => (0..n)
                .map(|l| match (l + 1) % 6 == 0 || l + 1 == n {
                    true => LayerType::FullAttention,
                    false => LayerType::SlidingAttention,
                })
                .collect(),
        };
        let shared = g.num_kv_shared_layers.unwrap_or(0);
        if shared > n {
            return Err(format!(
                "num_kv_shared_layers {shared} exceeds the {n} layers"
            ));
        }
        if shared == n && !assistant {
            return Err("every layer shares K/V: an assistant, not a target model".into());
        }
        let first_shared = n - shared;
        let k_eq_v = g.attention_k_eq_v.unwrap_or(false);
        let mut layers = Vec::with_capacity(n);
        for (l, &kind) in kinds.iter().enumerate() {
            let over = g
                .per_layer_config
                .as_ref()
                .and_then(|m| m.get(&l.to_string()))
                .cloned()
                .unwrap_or_default();
            let global = kind == LayerType::FullAttention;
            let head_dim = over
                .head_dim
                .or(if global { g.global_head_dim } else { None })
                .unwrap_or_else(|| self.head_dim());
            let kv_heads = over
                .num_key_value_heads
                .or(if global && k_eq_v {
                    g.num_global_key_value_heads
                } else {
                    None
                })
                .unwrap_or_else(|| self.kv_heads());
            let kv = match l < first_shared {
                true => KvSource::Own,
                false if assistant => KvSource::Target,
                false => match (0..first_shared).rev().find(|&d| kinds[d] == kind) {
                    Some(donor) => KvSource::SharedFrom(donor),
                    None => {
                        return Err(format!(
                            "layer {l} shares K/V but no earlier layer is of its type"
                        ))
                    }
                },
            };
            let double = g.use_double_wide_mlp == Some(true) && l >= first_shared;
            if !self.num_attention_heads.is_multiple_of(kv_heads.max(1)) || kv_heads == 0 {
                return Err(format!(
                    "layer {l}: {kv_heads} K/V heads for {} query heads",
                    self.num_attention_heads
                ));
            }
            if head_dim == 0 || !head_dim.is_multiple_of(2) {
                return Err(format!(
                    "layer {l}: head_dim {head_dim} must be even and > 0"
                ));
            }
            layers.push(Gemma4Layer {
                kind,
                head_dim,
                kv_heads,
                kv,
                k_eq_v: k_eq_v && global,
                intermediate_size: self.intermediate_size * if double { 2 } else { 1 },
            });
        }
        for layer in &layers {
            if let KvSource::SharedFrom(d) = layer.kv {
                let donor = &layers[d];
                if (donor.head_dim, donor.kv_heads) != (layer.head_dim, layer.kv_heads) {
                    return Err(format!(
                        "a shared layer's K/V shape differs from its donor {d}'s"
                    ));
                }
            }
        }
        let sliding_window = g.sliding_window.unwrap_or(512);
        if sliding_window == 0 {
            return Err("sliding_window is 0".into());
        }
        let per_layer_input = g.hidden_size_per_layer_input.unwrap_or(0);
        Ok(Gemma4Params {
            layers,
            sliding_window,
            rope_local_base: g.rope_local_base_freq.unwrap_or(10_000.0),
            rope_global_base: self.rope_theta,
            rope_global_partial_factor: g.rope_global_partial_factor.unwrap_or(1.0),
            per_layer_input,
            per_layer_vocab: g.vocab_size_per_layer_input.unwrap_or(self.vocab_size),
            final_logit_softcapping: g.final_logit_softcapping,
        })
    }
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
    /// Whether this is a Gemma 3 text model (GGUF `gemma3`, HF `gemma3_text`).
    pub fn is_gemma3(&self) -> bool {
        matches!(self.model_type.as_str(), "gemma3" | "gemma3_text")
    }

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
        Self::from_hf_value(&raw, path)
    }

    /// As [`ModelConfig::from_hf_json`] for a parsed `config.json` (or a nested one, such as
    /// a Gemma 4 assistant's `text_config`); `path` names the file in errors.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] as [`ModelConfig::from_hf_json`].
    pub fn from_hf_value(raw: &serde_json::Value, path: &Path) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidModel {
            path: path.to_path_buf(),
            reason: format!("config.json: {reason}"),
        };
        let mut cfg = ModelConfig::deserialize(raw).map_err(|e| invalid(e.to_string()))?;
        // transformers 5 moved `rope_theta` into `rope_parameters` (older files: `rope_scaling`
        // beside a top-level `rope_theta`). Only plain rope is implemented: refuse the scaled
        // kinds instead of decoding with wrong positions.
        // Gemma (transformers 5) keys rope_parameters by layer type.
        if let Some(per_type) = raw
            .get("rope_parameters")
            .filter(|v| v.get("full_attention").is_some())
        {
            for (layer, rope) in per_type.as_object().into_iter().flatten() {
                match rope.get("rope_type").and_then(|v| v.as_str()) {
                    None | Some("default") => {}
                    // Gemma 4's global layers: only a fraction of the pairs rotate.
                    Some("proportional")
                        if layer == "full_attention"
                            && rope.get("factor").and_then(|v| v.as_f64()).unwrap_or(1.0)
                                == 1.0 =>
                    {
                        cfg.gemma.rope_global_partial_factor = Some(
                            rope.get("partial_rotary_factor")
                                .and_then(|v| v.as_f64())
                                .unwrap_or(1.0),
                        );
                    }
                    Some(other) => {
                        return Err(invalid(format!(
                            "rope_parameters.{layer}.rope_type `{other}` is not supported \
                             (only default rope)"
                        )))
                    }
                }
                let theta = rope.get("rope_theta").and_then(|v| v.as_f64());
                match (layer.as_str(), theta) {
                    ("full_attention", Some(t)) => cfg.rope_theta = t,
                    ("sliding_attention", Some(t)) => cfg.gemma.rope_local_base_freq = Some(t),
                    _ => {}
                }
            }
        }
        for key in ["rope_parameters", "rope_scaling"] {
            let Some(rope) = raw
                .get(key)
                .filter(|v| !v.is_null() && v.get("full_attention").is_none())
            else {
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
            // MiMo's blocks are Qwen2's (its `mtp_layers` are the `mtp` drafter's).
            "qwen2" | "mimo" => cfg.attention_bias = true,
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
        // llama.cpp counts MTP (NextN) layers in `block_count` (`blk.N.nextn.*`, after the
        // N decoder layers); the target runs only the decoder layers.
        let blocks = md.usize(&key("block_count"))?;
        let nextn = md.opt_usize(&key("nextn_predict_layers"))?.unwrap_or(0);
        if nextn >= blocks {
            return Err(md.invalid(format!("{nextn} MTP layers but only {blocks} blocks")));
        }
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: md.usize(&key("feed_forward_length"))?,
            num_hidden_layers: blocks - nextn,
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
            gemma: GemmaConfig {
                sliding_window: md.opt_usize(&key("attention.sliding_window"))?,
                final_logit_softcapping: md.opt_f64(&key("final_logit_softcapping"))?,
                attn_logit_softcapping: md.opt_f64(&key("attn_logit_softcapping"))?,
                ..GemmaConfig::default()
            },
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
        if self.is_gemma3() {
            if let Err(reason) = self.gemma3() {
                return bad(reason);
            }
        }
        if self.is_gemma4() {
            // An assistant's text config shares every layer's K/V with its target.
            let resolved = match self.gemma.num_kv_shared_layers == Some(self.num_hidden_layers) {
                true => self.gemma4_assistant(),
                false => self.gemma4(),
            };
            if let Err(reason) = resolved {
                return bad(reason);
            }
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

    #[test]
    fn gemma3_gguf_fills_the_missing_hyper_parameters() {
        let path = crate::tokenizer::tests::real_model("gemma3-270m");
        let content = crate::tokenizer::read_gguf_metadata(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&content, &path).unwrap();
        assert!(cfg.is_gemma3() && cfg.tie_word_embeddings);
        let p = cfg.gemma3().unwrap();
        // The values transformers' Gemma3TextConfig uses for this file (tests/fixtures/gemma3-270m.json).
        assert_eq!(p.attn_scale, 256f64.powf(-0.5) as f32);
        assert_eq!(p.sliding_window, 512);
        assert_eq!(
            (p.rope_local_base, p.rope_global_base),
            (10_000.0, 1_000_000.0)
        );
        let global: Vec<usize> = (0..18)
            .filter(|&l| p.layer_types[l] == LayerType::FullAttention)
            .collect();
        assert_eq!(global, [5, 11, 17]);
        assert_eq!(p.final_logit_softcapping, None);
    }

    #[test]
    fn gemma_bad_hyper_parameters_are_refused() {
        let base = |extra: &str| {
            format!(
                r#"{{"model_type":"gemma3_text","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                   "num_hidden_layers":2,"num_attention_heads":2,"head_dim":4{extra}}}"#
            )
        };
        let dir = std::env::temp_dir().join(format!("specula-gemma-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        let read = |body: String| {
            std::fs::write(&path, body).unwrap();
            ModelConfig::from_hf_json(&path)
        };
        let ok = read(base(
            r#","sliding_window_pattern":2,"query_pre_attn_scalar":16"#,
        ))
        .unwrap();
        let p = ok.gemma3().unwrap();
        assert_eq!(
            p.layer_types,
            [LayerType::SlidingAttention, LayerType::FullAttention]
        );
        assert_eq!(p.attn_scale, 0.25);
        for (extra, needle) in [
            (
                r#","attn_logit_softcapping":50.0"#,
                "attn_logit_softcapping",
            ),
            (r#","layer_types":["full_attention"]"#, "layer_types has 1"),
            (r#","hidden_activation":"relu""#, "relu"),
            (r#","sliding_window":0"#, "sliding_window is 0"),
        ] {
            let err = read(base(extra)).unwrap_err().to_string();
            assert!(err.contains(needle), "{extra}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gemma4_fixture_configs_resolve_sharing_and_shapes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4-tiny");
        let full = ModelConfig::from_hf_json(&dir.join("full/config.json")).unwrap();
        let p = full.gemma4().unwrap();
        // transformers' kv_sharing_modes: [None, None, store, store, reuse, reuse].
        let kv: Vec<KvSource> = p.layers.iter().map(|l| l.kv).collect();
        use KvSource::*;
        assert_eq!(kv, [Own, Own, Own, Own, SharedFrom(3), SharedFrom(2)]);
        let global = &p.layers[2];
        assert_eq!(
            (global.head_dim, global.kv_heads, global.k_eq_v),
            (32, 1, true)
        );
        assert_eq!(
            (
                p.layers[1].head_dim,
                p.layers[1].kv_heads,
                p.layers[1].k_eq_v
            ),
            (16, 2, false)
        );
        assert_eq!(p.layers[4].intermediate_size, 2 * full.intermediate_size);
        assert_eq!(p.rope_global_partial_factor, 0.25);
        assert_eq!(
            (p.per_layer_input, p.final_logit_softcapping),
            (8, Some(5.0))
        );
        let plain = ModelConfig::from_hf_json(&dir.join("plain/config.json")).unwrap();
        let p = plain.gemma4().unwrap();
        assert!(p.layers.iter().all(|l| l.kv == Own && !l.k_eq_v));
        assert_eq!(p.per_layer_input, 0);
    }
}
