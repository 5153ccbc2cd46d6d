//! Xiaomi MiMo as a target: Qwen2 decoder blocks (q/k/v biases, half-split RoPE) plus
//! `model.mtp_layers.{i}` multi-token-prediction modules (HF `MiMoForCausalLM`; vLLM
//! `mimo.py` runs the Qwen2 model and leaves the MTP layers to `mimo_mtp.py`). The target's
//! forward is the Qwen2 one; the MTP layers are read by the `mtp` drafter, not here.

use crate::arch::llama::{Llama, Switches};
use crate::arch::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::RopeStyle;
use crate::loader::WeightSource;

/// MiMo's switches: Qwen2's, under its own name.
pub const SWITCHES: Switches = Switches {
    name: "mimo",
    gguf_rope: RopeStyle::HalfSplit,
    qkv_bias: true,
    qk_norm: false,
};

/// Builds a MiMo target from `weights` (its `mtp_layers` stay unread).
///
/// # Errors
/// As [`Llama::load`].
pub fn load(cfg: &ModelConfig, weights: &mut dyn WeightSource, from: Checkpoint) -> Result<Llama> {
    Llama::load(cfg, SWITCHES, weights, from)
}

#[cfg(test)]
mod tests {
    use crate::config::ModelConfig;
    use crate::testing::TinyModel;

    /// A MiMo checkpoint (a Qwen2 one with `model_type: mimo` and MTP layers beside it) loads
    /// as MiMo and computes exactly what the Qwen2 network of the same weights computes.
    #[test]
    fn mimo_runs_the_qwen2_network_of_its_weights() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = TinyModel::new("qwen2", 5).unwrap();
        tiny.write_hf_dir(dir.path()).unwrap();
        let qwen2 = crate::load_model(dir.path(), &Default::default()).unwrap();
        let path = dir.path().join("config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["model_type"] = "mimo".into();
        json["num_nextn_predict_layers"] = 1.into();
        std::fs::write(&path, json.to_string()).unwrap();
        let cfg = ModelConfig::from_hf_json(&path).unwrap();
        assert!(cfg.attention_bias, "MiMo blocks are Qwen2's: q/k/v biases");
        let mimo = crate::load_model(dir.path(), &Default::default()).unwrap();
        assert_eq!(mimo.arch().name(), "mimo");
        let ids = [3u32, 9, 27, 4];
        let logits = |m: &crate::Model| {
            let req = crate::ForwardRequest {
                logits: crate::Rows::Last(ids.len()),
                ..Default::default()
            };
            let out = m.forward(&ids, &mut m.new_cache(), &req).unwrap().logits;
            out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(logits(&qwen2), logits(&mimo));
    }
}
