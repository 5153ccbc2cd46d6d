//! The drafter's `config.json`, in the references' own formats.
//!
//! - z-lab DFlash (`DFlashDraftModel`): Qwen3 block fields, `block_size`, `num_target_layers`,
//!   `dflash_config.{target_layer_ids, mask_token_id}` (each also accepted at the top level, as
//!   the reference's `_draft_value` does), optional `input_embedding_scale`, `output_multiplier`,
//!   `final_logit_softcapping`.
//! - DeepSpec DSpark (`Qwen3DSparkModel`; Specula's trainer writes `DSparkDraftModel`): the same
//!   backbone plus `markov_rank`, `markov_head_type` (`vanilla`, `gated`, `rnn`),
//!   `enable_confidence_head`, `confidence_head_with_markov`.
//!
//! `mask_token_id: null` means the file carries a learned `mask_embedding` `[hidden]` tensor
//! (Specula's extra, for targets with no spare vocabulary row). Parts of `dflash==0.1.0`'s
//! `model.py` beyond the published checkpoints (`DFlash2DraftModel`'s grouped causal conv and
//! candidate selector), causal or sliding-window draft layers and RoPE scaling are refused by
//! name.

use std::path::Path;

use serde_json::Value;

use crate::Error;

/// Which drafter a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// DFlash: the block `[anchor, MASK × (B − 1)]` proposes `B − 1` tokens (mask slots).
    DFlash,
    /// DSpark: the anchor slot predicts too, so the block proposes `B` tokens.
    DSpark,
}

/// DSpark's Markov correction of the block logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkovHead {
    /// `z_k = U_k + W2 W1[x_{k−1}]`.
    Vanilla,
    /// `z_k = U_k + W2 (σ(gate([h_k; W1[x_{k−1}]])) ⊙ W1[x_{k−1}])`.
    Gated,
    /// A GRU-like state over the block: `joint_proj([s; W1[x_{k−1}]; h_k])`.
    Rnn,
}

/// The DSpark heads on top of the backbone.
#[derive(Debug, Clone, PartialEq)]
pub struct DSparkHeads {
    /// `markov_rank` and the head, when `markov_rank > 0`.
    pub markov: Option<(usize, MarkovHead)>,
    /// Whether there is a confidence head, and whether it also reads `W1[x_{k−1}]`.
    pub confidence: Option<ConfidenceInput>,
}

/// What the confidence head reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfidenceInput {
    /// `proj(h_k)`.
    Hidden,
    /// `proj([h_k; W1[x_{k−1}]])`.
    HiddenAndMarkov,
}

/// Everything the drafter reads from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    /// DFlash or DSpark.
    pub kind: Kind,
    /// Width of the hidden state (the target's).
    pub hidden_size: usize,
    /// Draft decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// K/V heads.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary (the target's).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Whether q/k/v/o projections have biases.
    pub attention_bias: bool,
    /// Block size the drafter was trained with.
    pub block_size: usize,
    /// Layers of the target it was trained on.
    pub num_target_layers: usize,
    /// Reference tap ids, ascending: `l` = HF `hidden_states[l + 1]`, `-1` = the embedding output.
    pub target_layer_ids: Vec<i64>,
    /// The mask token, or `None` when the file carries a learned `mask_embedding`.
    pub mask_token_id: Option<u32>,
    /// Scale of the block embeddings (`input_embedding_scale`, default 1).
    pub input_embedding_scale: f64,
    /// Multiplier of the draft logits (`output_multiplier`, default 1).
    pub output_multiplier: f64,
    /// `tanh` softcap of the draft logits (`final_logit_softcapping`), when set and positive.
    pub logit_softcap: Option<f64>,
    /// DSpark's heads (`None` for DFlash).
    pub dspark: Option<DSparkHeads>,
}

/// The reference's default tap ids (`dflash/model.py` `build_target_layer_ids`).
pub fn build_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<i64> {
    let l = num_target_layers as f64;
    if num_draft_layers == 1 {
        return vec![(num_target_layers / 2) as i64];
    }
    let (start, end) = (1.0, l - 3.0);
    let span = end - start;
    (0..num_draft_layers)
        .map(|i| round_half_even(start + (i as f64 * span) / (num_draft_layers - 1) as f64) as i64)
        .collect()
}

/// Python's `round`: halves go to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    match (x - x.trunc()).abs() == 0.5 {
        true => 2.0 * (x / 2.0).round(),
        false => x.round(),
    }
}

impl DraftConfig {
    /// Reads and checks `path`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and what is missing, malformed or unsupported.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: format!("not JSON: {e}"),
        })?;
        Self::from_json(&json).map_err(|reason| Error::Config {
            path: path.to_path_buf(),
            reason,
        })
    }

    /// Parses a config already read as JSON.
    ///
    /// # Errors
    /// What is missing, malformed or unsupported.
    pub fn from_json(json: &Value) -> Result<Self, String> {
        let draft = json.get("dflash_config");
        // The reference's `_draft_value`: `dflash_config.X`, else the top-level `X`.
        let value = |name: &str| -> Option<&Value> {
            draft.and_then(|d| d.get(name)).or_else(|| json.get(name))
        };
        let usize_of = |name: &str| -> Result<usize, String> {
            value(name)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| format!("`{name}` is missing or not a non-negative integer"))
        };
        let f64_or = |name: &str, default: f64| -> Result<f64, String> {
            match value(name) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| format!("`{name}` is not a number")),
            }
        };
        refuse_optional_parts(json, &value)?;
        if value("anchor_predicts").and_then(Value::as_bool) == Some(false) {
            return Err("`anchor_predicts: false` is not a DSpark this drafter knows".into());
        }
        let architectures: Vec<&str> = json
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let dspark = architectures.iter().any(|a| a.contains("DSpark"))
            || value("markov_rank").is_some()
            || value("enable_confidence_head").is_some();
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let num_layers = usize_of("num_hidden_layers")?;
        let num_target_layers = usize_of("num_target_layers")?;
        let head_dim = match value("head_dim") {
            Some(_) => usize_of("head_dim")?,
            None => hidden_size / num_heads.max(1),
        };
        let target_layer_ids = match value("target_layer_ids") {
            None | Some(Value::Null) => build_target_layer_ids(num_target_layers, num_layers),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
                .ok_or("`target_layer_ids` is not a list of integers")?,
        };
        check_tap_ids(&target_layer_ids, num_target_layers, dspark)?;
        let mask_token_id = match value("mask_token_id") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|&id| id <= u64::from(u32::MAX))
                    .ok_or("`mask_token_id` is not a token id")? as u32,
            ),
        };
        let rope_theta = match json.get("rope_parameters") {
            Some(p) => p.get("rope_theta").and_then(Value::as_f64),
            None => None,
        };
        let rope_theta = match rope_theta {
            Some(t) => t,
            None => f64_or("rope_theta", 10_000.0)?,
        };
        let softcap = f64_or("final_logit_softcapping", 0.0)?;
        let config = DraftConfig {
            kind: match dspark {
                true => Kind::DSpark,
                false => Kind::DFlash,
            },
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads: match value("num_key_value_heads") {
                Some(_) => usize_of("num_key_value_heads")?,
                None => num_heads,
            },
            head_dim,
            intermediate_size: usize_of("intermediate_size")?,
            vocab_size: usize_of("vocab_size")?,
            rms_norm_eps: f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            attention_bias: value("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            block_size: match value("block_size") {
                Some(_) => usize_of("block_size")?,
                None => 16,
            },
            num_target_layers,
            target_layer_ids,
            mask_token_id,
            input_embedding_scale: f64_or("input_embedding_scale", 1.0)?,
            output_multiplier: f64_or("output_multiplier", 1.0)?,
            logit_softcap: (softcap > 0.0).then_some(softcap),
            dspark: match dspark {
                true => Some(dspark_heads(&value)?),
                false => None,
            },
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return Err(format!(
                "{} attention heads cannot share {} K/V heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd: RoPE needs pairs",
                self.head_dim
            ));
        }
        let min_block = match self.kind {
            Kind::DFlash => 2,
            Kind::DSpark => 1,
        };
        if self.block_size < min_block {
            return Err(format!("block_size {} proposes nothing", self.block_size));
        }
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return Err("hidden_size, num_hidden_layers and vocab_size must be positive".into());
        }
        Ok(())
    }

    /// Drafts one block proposes at block size `block`.
    pub fn drafts_per_block(&self, block: usize) -> usize {
        match self.kind {
            Kind::DFlash => block - 1,
            Kind::DSpark => block,
        }
    }
}

/// The parts of `dflash==0.1.0` `model.py` this drafter does not implement, and other switches
/// that would change the forward: refused by name, never ignored.
fn refuse_optional_parts<'a>(
    json: &'a Value,
    value: &dyn Fn(&str) -> Option<&'a Value>,
) -> Result<(), String> {
    let architectures = json.get("architectures").map(Value::to_string);
    if architectures
        .as_deref()
        .is_some_and(|a| a.contains("DFlash2"))
    {
        return Err(
            "DFlash2DraftModel (grouped dynamic causal conv + candidate selector) is \
                    not supported: only the base DFlash configuration of the published \
                    checkpoints"
                .into(),
        );
    }
    let present = |name: &str| value(name).is_some_and(|v| !v.is_null());
    for (names, what) in [
        (
            &["conv_kernel_size", "conv_group_size"][..],
            "the grouped dynamic causal conv (GroupedDynamicCausalConv)",
        ),
        (
            &["selector_rank", "selector_top_k"][..],
            "the candidate selector (CandidateSelector)",
        ),
    ] {
        if let Some(name) = names.iter().find(|n| present(n)) {
            return Err(format!(
                "`{name}` turns on {what} of dflash 0.1.0's model.py, which this drafter does \
                 not implement"
            ));
        }
    }
    if value("is_causal").and_then(Value::as_bool) == Some(true) {
        return Err("`is_causal: true` (causal draft layers) is not supported".into());
    }
    let sliding = json
        .get("layer_types")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t.as_str() != Some("full_attention")));
    if sliding {
        return Err(
            "layer_types other than full_attention (sliding-window draft layers) are \
                    not supported"
                .into(),
        );
    }
    let scaling = json
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| json.get("rope_parameters"))
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str);
    if let Some(kind) = scaling.filter(|k| *k != "default") {
        return Err(format!("RoPE scaling `{kind}` is not supported"));
    }
    Ok(())
}

fn check_tap_ids(ids: &[i64], num_target_layers: usize, dspark: bool) -> Result<(), String> {
    if ids.is_empty() {
        return Err("`target_layer_ids` is empty".into());
    }
    if ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "`target_layer_ids` {ids:?} are not strictly increasing"
        ));
    }
    let last = num_target_layers as i64 - 1;
    let lowest = if dspark { -1 } else { 0 };
    if let Some(id) = ids.iter().find(|&&id| id < lowest || id > last) {
        return Err(format!(
            "tap id {id} is outside {lowest}..={last} for a target of {num_target_layers} layers"
        ));
    }
    if dspark && ids.contains(&last) {
        // DeepSpec `assert_no_final_target_layer`: HF's last hidden state is post-norm.
        return Err(format!(
            "tap id {last} is the target's final layer, which DSpark forbids"
        ));
    }
    Ok(())
}

fn dspark_heads<'a>(value: &dyn Fn(&str) -> Option<&'a Value>) -> Result<DSparkHeads, String> {
    let rank = match value("markov_rank") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or("`markov_rank` is not a non-negative integer")? as usize,
    };
    let markov = match rank {
        0 => None,
        r => {
            let kind = value("markov_head_type")
                .and_then(Value::as_str)
                .ok_or("`markov_head_type` is required when markov_rank > 0")?;
            let head = match kind.to_ascii_lowercase().as_str() {
                "vanilla" => MarkovHead::Vanilla,
                "gated" => MarkovHead::Gated,
                "rnn" => MarkovHead::Rnn,
                other => {
                    return Err(format!(
                        "markov_head_type `{other}` is not one of vanilla, gated, rnn"
                    ))
                }
            };
            Some((r, head))
        }
    };
    let enabled = value("enable_confidence_head")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let confidence = match enabled {
        false => None,
        true => match value("confidence_head_with_markov").and_then(Value::as_bool) {
            Some(true) if markov.is_none() => {
                return Err("confidence_head_with_markov needs a Markov head".into())
            }
            Some(true) => Some(ConfidenceInput::HiddenAndMarkov),
            Some(false) => Some(ConfidenceInput::Hidden),
            None => {
                return Err(
                    "`confidence_head_with_markov` is required with the confidence head".into(),
                )
            }
        },
    };
    Ok(DSparkHeads { markov, confidence })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn base() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "intermediate_size": 64, "vocab_size": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "block_size": 4, "num_target_layers": 6,
            "layer_types": ["full_attention", "full_attention"],
            "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 127}
        })
    }

    #[test]
    fn default_tap_ids_follow_the_reference() {
        // dflash/model.py build_target_layer_ids(36, 5) = [1, 9, 17, 25, 33] (Qwen3-8B-b16).
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(build_target_layer_ids(30, 1), vec![15]);
        // round(1 + 1 * 26 / 4) = round(7.5) = 8 (Python rounds halves to even).
        assert_eq!(build_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        let mut j = base();
        j["dflash_config"]["target_layer_ids"] = Value::Null;
        let c = DraftConfig::from_json(&j).unwrap();
        assert_eq!(c.target_layer_ids, build_target_layer_ids(6, 2));
    }

    #[test]
    fn reads_dflash_and_dspark_configs() {
        let c = DraftConfig::from_json(&base()).unwrap();
        assert_eq!(
            (c.kind, c.mask_token_id, c.block_size),
            (Kind::DFlash, Some(127), 4)
        );
        assert_eq!(c.drafts_per_block(4), 3);
        let mut j = base();
        j["architectures"] = json!(["Qwen3DSparkModel"]);
        j["markov_rank"] = json!(8);
        j["markov_head_type"] = json!("rnn");
        j["enable_confidence_head"] = json!(true);
        j["confidence_head_with_markov"] = json!(false);
        j["dflash_config"]["mask_token_id"] = Value::Null;
        let c = DraftConfig::from_json(&j).unwrap();
        assert_eq!(c.kind, Kind::DSpark);
        assert_eq!(c.mask_token_id, None);
        assert_eq!(
            c.dspark,
            Some(DSparkHeads {
                markov: Some((8, MarkovHead::Rnn)),
                confidence: Some(ConfidenceInput::Hidden),
            })
        );
        assert_eq!(c.drafts_per_block(4), 4);
    }

    #[test]
    fn refuses_what_it_does_not_implement_by_name() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|j| j["architectures"] = json!(["DFlash2DraftModel"])),
                "DFlash2",
            ),
            (
                Box::new(|j| j["dflash_config"]["conv_kernel_size"] = json!(4)),
                "GroupedDynamicCausalConv",
            ),
            (
                Box::new(|j| j["selector_top_k"] = json!(8)),
                "CandidateSelector",
            ),
            (Box::new(|j| j["is_causal"] = json!(true)), "is_causal"),
            (
                Box::new(|j| j["layer_types"] = json!(["sliding_attention", "full_attention"])),
                "sliding",
            ),
            (
                Box::new(|j| j["rope_scaling"] = json!({"rope_type": "yarn"})),
                "yarn",
            ),
            (
                Box::new(|j| j["dflash_config"]["target_layer_ids"] = json!([3, 1])),
                "increasing",
            ),
            (
                Box::new(|j| j["dflash_config"]["target_layer_ids"] = json!([1, 6])),
                "tap id 6",
            ),
            (
                Box::new(|j| j["num_key_value_heads"] = json!(3)),
                "K/V heads",
            ),
            (Box::new(|j| j["block_size"] = json!(1)), "proposes nothing"),
            (
                Box::new(|j| {
                    j.as_object_mut().unwrap().remove("hidden_size");
                }),
                "hidden_size",
            ),
            (
                Box::new(|j| {
                    j["markov_rank"] = json!(8);
                    j["markov_head_type"] = json!("lstm");
                }),
                "lstm",
            ),
            (
                Box::new(|j| {
                    j["architectures"] = json!(["Qwen3DSparkModel"]);
                    j["dflash_config"]["target_layer_ids"] = json!([1, 5]);
                }),
                "final layer",
            ),
        ];
        for (edit, why) in cases {
            let mut j = base();
            edit(&mut j);
            let err = DraftConfig::from_json(&j).unwrap_err();
            assert!(err.contains(why), "{err:?} should mention {why:?}");
        }
    }
}
