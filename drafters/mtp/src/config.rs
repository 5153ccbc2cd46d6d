//! What an MTP checkpoint is: its layout (found from the tensor names), the shapes of its block
//! (from `config.json`, which for a native MTP is the target's own), the block architecture
//! (the target's), and the conventions each reference follows. Everything this drafter cannot
//! run is refused here, by name.
//!
//! | layout | tensors (prefix `P`) | fusion | out norm | head |
//! |---|---|---|---|---|
//! | DeepSeek-V3 / GLM | `model.layers.{L}.` (`L` = target layers) `enorm, hnorm, eh_proj, shared_head.norm` | `eh_proj([enorm(e); hnorm(h)])` | `shared_head.norm` | `shared_head.head`, else the target's lm_head |
//! | Qwen3-Next / Qwen3.5 | `mtp.` `pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm`; block `mtp.layers.0.` | `fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)])` | `mtp.norm` | the target's lm_head |
//! | MiMo | `model.mtp_layers.{i}.` `token_layernorm, hidden_layernorm, input_proj, final_layernorm` | `input_proj([hidden_layernorm(h); token_layernorm(e)])` (h first) | `final_layernorm` | the target's lm_head |
//!
//! Qwen3-Next's RMSNorms are zero-centred (`Qwen3NextRMSNorm`: `x̂ · (1 + w)`), all of them,
//! the block's included. The published DeepSeek/GLM blocks are MLA + MoE and Qwen3-Next's is
//! gated attention + MoE: those are refused; the layouts run here with a dense block of the
//! target's architecture (llama, qwen2, qwen3; MiMo's is qwen2).

use std::path::{Path, PathBuf};

use serde_json::Value;
use specula_models::arch::llama::Switches;
use specula_models::config::ModelConfig;
use specula_models::layers::RopeStyle;
use specula_models::loader::read_gguf;
use specula_models::weights::Weights;

use crate::Error;

/// Why a gated-attention block is refused (also found from the q_proj shape at load).
pub const GATED: &str =
    "the MTP block uses gated attention (q_proj emits the query and a sigmoid gate, \
     Qwen3-Next / Qwen3.5), which is not implemented";

/// Which published MTP layout a checkpoint follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// DeepSeek-V3 / GLM-4.5 (`deepseek_mtp.py`, `glm4_moe_mtp.py`).
    DeepSeek,
    /// Qwen3-Next / Qwen3.5 (`qwen3_next_mtp.py`).
    QwenNext,
    /// Xiaomi MiMo (`mimo_mtp.py`).
    MiMo,
}

/// Which hidden a deeper draft step feeds back as its `h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recycle {
    /// The block's output before the out norm (vLLM `deepseek_mtp.py` @ 03356f8c returns
    /// `residual + hidden_states`, and `eagle.py` feeds the returned hidden back).
    PreNorm,
    /// After the out norm (Qwen3-Next's forward returns `mtp.norm(x)`; MiMo's
    /// `final_layernorm(x)`; Specula's trained heads, `recycle_hidden_for_depth_2`).
    PostNorm,
}

/// The dense decoder block's switches, from the target's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockKind {
    /// The architecture named (`llama`, `qwen2`, `qwen3`, `mimo`).
    pub name: &'static str,
    /// q/k/v projections have biases (qwen2, MiMo).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorms (qwen3).
    pub qk_norm: bool,
}

impl BlockKind {
    /// The block of a target of architecture `arch`.
    ///
    /// # Errors
    /// [`Error::Target`] for an architecture without a dense block here.
    pub fn of_target(arch: &str) -> Result<Self, Error> {
        let kind = |name, qkv_bias, qk_norm| BlockKind {
            name,
            qkv_bias,
            qk_norm,
        };
        match arch {
            "llama" | "mistral" => Ok(kind("llama", false, false)),
            "qwen2" => Ok(kind("qwen2", true, false)),
            "mimo" => Ok(kind("mimo", true, false)),
            "qwen3" => Ok(kind("qwen3", false, true)),
            other => Err(Error::Target(format!(
                "an MTP block for a {other} target is not implemented (llama, qwen2, qwen3, mimo)"
            ))),
        }
    }
}

/// Tensor names of one MTP module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// Norm of the token embedding (`enorm`, `pre_fc_norm_embedding`, `token_layernorm`).
    pub token_norm: String,
    /// Norm of the target hidden (`hnorm`, `pre_fc_norm_hidden`, `hidden_layernorm`).
    pub hidden_norm: String,
    /// The `2H → H` fusion (`eh_proj`, `fc`, `input_proj`).
    pub proj: String,
    /// Prefix of the decoder block's tensors (`…input_layernorm`, `…self_attn.q_proj`, ...).
    pub block: String,
    /// The norm before the head (`shared_head.norm`, `norm`, `final_layernorm`).
    pub out_norm: String,
    /// DeepSeek's own head (`shared_head.head`), used when the checkpoint has it.
    pub head: Option<String>,
}

/// A loaded `config.json` plus what the tensors say.
#[derive(Debug, Clone, PartialEq)]
pub struct MtpConfig {
    /// The layout.
    pub layout: Layout,
    /// Tensor names.
    pub names: Names,
    /// The dense block's switches.
    pub block: BlockKind,
    /// Hidden width.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// K/V heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// The MLP's width.
    pub intermediate_size: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorms are zero-centred (`x̂ · (1 + w)`).
    pub zero_centred: bool,
    /// The embedding input is zeroed at position 0 (vLLM's DeepSeek and MiMo modules: "masking
    /// inputs at position 0, as not needed by MTP"; not Qwen3-Next, not Specula's trained heads,
    /// whose training never did it).
    pub mask_position_zero: bool,
    /// Feedback rule of deeper drafts.
    pub recycle: Recycle,
    /// The most drafts a round may chain (MiMo: 1, as its reference asserts).
    pub max_depth: Option<usize>,
    /// How q/k are laid out for RoPE: half-split in HF checkpoints; in GGUF files as the
    /// target's architecture stores them (llama's rows are permuted to interleaved pairs).
    pub rope: RopeStyle,
}

fn get<'a>(json: &'a Value, key: &str) -> Option<&'a Value> {
    json.get(key)
        .or_else(|| json.get("text_config").and_then(|t| t.get(key)))
}

fn size(json: &Value, key: &str) -> Option<usize> {
    get(json, key).and_then(Value::as_u64).map(|v| v as usize)
}

impl MtpConfig {
    /// Reads `config` (the checkpoint's `config.json`) and finds the MTP module in `weights`;
    /// `target_arch` names the block architecture.
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed or unsupported config, [`Error::Weights`] when no MTP
    /// module is found or its block is MoE, MLA or gated attention, [`Error::Target`] for a
    /// target architecture without a dense block here.
    pub fn load(config: &Path, weights: &Weights, target_arch: &str) -> Result<Self, Error> {
        let text = std::fs::read_to_string(config).map_err(|source| Error::Io {
            path: config.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: config.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::from_json(&json, config, weights, target_arch)
    }

    /// The config of the checkpoint at `path`: a folder's `config.json`
    /// ([`MtpConfig::load`]), or a GGUF file's metadata ([`MtpConfig::from_gguf`]).
    ///
    /// # Errors
    /// As [`MtpConfig::load`].
    pub fn for_checkpoint(
        path: &Path,
        weights: &Weights,
        target_arch: &str,
    ) -> Result<Self, Error> {
        match crate::weights::is_gguf(path) {
            true => Self::from_gguf(path, weights, target_arch),
            false => Self::load(&config_path(path), weights, target_arch),
        }
    }

    /// The config of a GGUF target carrying llama.cpp's NextN layer (`blk.{L}.nextn.*`, `L` =
    /// its decoder layers, `{arch}.nextn_predict_layers`): the block's shapes are the target's
    /// (`{arch}.*` metadata), with the conventions of the DeepSeek/GLM layout the NextN names
    /// come from; q/k rows as the architecture's GGUF files store them.
    ///
    /// # Errors
    /// As [`MtpConfig::load`]; [`Error::Config`] for unreadable metadata.
    pub fn from_gguf(path: &Path, weights: &Weights, target_arch: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::Config {
            path: path.to_path_buf(),
            reason,
        };
        let (content, _) = read_gguf(path).map_err(|e| bad(e.to_string()))?;
        let c = ModelConfig::from_gguf(&content, path).map_err(|e| bad(e.to_string()))?;
        let arch = &c.model_type;
        let nextn = match content
            .metadata
            .get(&format!("{arch}.nextn_predict_layers"))
        {
            Some(v) => v.to_u32().map_err(|e| bad(e.to_string()))? as usize,
            None => 0,
        };
        let json = serde_json::json!({
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.kv_heads(),
            "head_dim": c.head_dim(),
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "num_hidden_layers": c.num_hidden_layers,
            "num_nextn_predict_layers": nextn,
        });
        let mut config = Self::from_json(&json, path, weights, target_arch)?;
        config.rope = Switches::of(arch).map_or(RopeStyle::HalfSplit, |s| s.gguf_rope);
        Ok(config)
    }

    /// As [`MtpConfig::load`], from parsed JSON (`path` only names it in errors).
    ///
    /// # Errors
    /// As [`MtpConfig::load`].
    pub fn from_json(
        json: &Value,
        path: &Path,
        weights: &Weights,
        target_arch: &str,
    ) -> Result<Self, Error> {
        let bad = |reason: String| Error::Config {
            path: path.to_path_buf(),
            reason,
        };
        let need = |key: &str| size(json, key).ok_or_else(|| bad(format!("{key} is missing")));
        let hidden_size = need("hidden_size")?;
        let num_heads = need("num_attention_heads")?;
        let num_kv_heads = size(json, "num_key_value_heads").unwrap_or(num_heads);
        let head_dim = size(json, "head_dim").unwrap_or(hidden_size / num_heads.max(1));
        let layers = need("num_hidden_layers")?;
        if let Some(s) = get(json, "rope_scaling").filter(|v| !v.is_null()) {
            return Err(bad(format!("rope_scaling {s} is not implemented")));
        }
        if let Some(act) = get(json, "hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(format!("hidden_act {act} is not implemented (silu)")));
            }
        }
        let architectures: Vec<&str> = get(json, "architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let specula_trained = architectures.contains(&"SpeculaLlamaMTP");
        let (layout, names, count) =
            find_layout(weights, layers).ok_or_else(|| Error::Weights {
                path: weights.path().to_path_buf(),
                reason: format!(
                    "no MTP module: none of model.layers.{layers}.eh_proj (DeepSeek/GLM), mtp.fc \
                 (Qwen3-Next/Qwen3.5), model.mtp_layers.0.input_proj (MiMo)"
                ),
            })?;
        let declared = size(json, "num_nextn_predict_layers").unwrap_or(count);
        if layout != Layout::MiMo && (count > 1 || declared > 1) {
            return Err(bad(format!(
                "{} MTP layers: only one is implemented (each further layer would need its \
                 own cache policy; the published checkpoints have one)",
                count.max(declared)
            )));
        }
        refuse_blocks(weights, &names.block)?;
        if get(json, "attn_output_gate").and_then(Value::as_bool) == Some(true) {
            return Err(bad(GATED.to_string()));
        }
        let block = BlockKind::of_target(target_arch)?;
        let recycle = match layout {
            Layout::DeepSeek => {
                let post = json
                    .pointer("/mtp/recycle_hidden_for_depth_2")
                    .and_then(Value::as_str)
                    .is_some_and(|s| s.contains("norm output"));
                match post {
                    true => Recycle::PostNorm,
                    false => Recycle::PreNorm,
                }
            }
            Layout::QwenNext | Layout::MiMo => Recycle::PostNorm,
        };
        Ok(MtpConfig {
            layout,
            names,
            block,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: need("intermediate_size")?,
            vocab_size: need("vocab_size")?,
            rms_norm_eps: get(json, "rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta: get(json, "rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
            zero_centred: layout == Layout::QwenNext,
            mask_position_zero: matches!(layout, Layout::DeepSeek | Layout::MiMo)
                && !specula_trained,
            recycle,
            max_depth: (layout == Layout::MiMo).then_some(1),
            rope: RopeStyle::HalfSplit,
        })
    }
}

/// The layout whose fusion tensor the checkpoint has, its names and its MTP layer count.
pub(crate) fn find_layout(w: &Weights, layers: usize) -> Option<(Layout, Names, usize)> {
    let count = |f: &dyn Fn(usize) -> String| (0..).take_while(|&i| w.contains(&f(i))).count();
    let p = format!("model.layers.{layers}.");
    if w.contains(&format!("{p}eh_proj.weight")) {
        let head = format!("{p}shared_head.head");
        let n = count(&|i| format!("model.layers.{}.eh_proj.weight", layers + i));
        let names = Names {
            token_norm: format!("{p}enorm"),
            hidden_norm: format!("{p}hnorm"),
            proj: format!("{p}eh_proj"),
            block: p.clone(),
            out_norm: format!("{p}shared_head.norm"),
            head: w.contains(&format!("{head}.weight")).then_some(head),
        };
        return Some((Layout::DeepSeek, names, n));
    }
    if w.contains("mtp.fc.weight") {
        let n = count(&|i| format!("mtp.layers.{i}.input_layernorm.weight"));
        let names = Names {
            token_norm: "mtp.pre_fc_norm_embedding".into(),
            hidden_norm: "mtp.pre_fc_norm_hidden".into(),
            proj: "mtp.fc".into(),
            block: "mtp.layers.0.".into(),
            out_norm: "mtp.norm".into(),
            head: None,
        };
        return Some((Layout::QwenNext, names, n));
    }
    let p = "model.mtp_layers.0.";
    if w.contains(&format!("{p}input_proj.weight")) {
        let n = count(&|i| format!("model.mtp_layers.{i}.input_proj.weight"));
        let names = Names {
            token_norm: format!("{p}token_layernorm"),
            hidden_norm: format!("{p}hidden_layernorm"),
            proj: format!("{p}input_proj"),
            block: p.to_string(),
            out_norm: format!("{p}final_layernorm"),
            head: None,
        };
        return Some((Layout::MiMo, names, n));
    }
    None
}

/// Refuses the blocks this drafter has no implementation of, naming what is missing.
fn refuse_blocks(w: &Weights, p: &str) -> Result<(), Error> {
    let has = |name: &str| w.contains(&format!("{p}{name}"));
    let refuse = |what: &str| {
        Err(Error::Weights {
            path: w.path().to_path_buf(),
            reason: format!("the MTP block ({p}*) uses {what}, which is not implemented"),
        })
    };
    if has("self_attn.kv_a_proj_with_mqa.weight")
        || has("self_attn.q_a_proj.weight")
        || has("self_attn.kv_b_proj.weight")
    {
        return refuse("multi-head latent attention (MLA: q_a_proj / kv_a_proj_with_mqa)");
    }
    if has("mlp.gate.weight")
        || has("mlp.experts.0.gate_proj.weight")
        || has("mlp.shared_expert.gate_proj.weight")
        || has("mlp.shared_experts.gate_proj.weight")
    {
        return refuse("a mixture-of-experts MLP (mlp.gate, mlp.experts.*)");
    }
    if has("linear_attn.in_proj_qkvz.weight") {
        return refuse("linear attention (Gated DeltaNet)");
    }
    Ok(())
}

/// Where `config.json` lives for weights at `dir`.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}
