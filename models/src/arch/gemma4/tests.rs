//! Gemma 4 against transformers on tiny random-weight models (`tests/fixtures/gemma4-tiny/*`,
//! written by `scripts/reference/gemma4_tiny.py`): KV sharing, k_eq_v, per-layer embeddings,
//! proportional RoPE, a sliding window of 4 keys and a softcap in `full`, none of them in `plain`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::loader::{load_model, LoadOptions};
use crate::{ForwardRequest, Model, Rows, WeightDType};

const TOL: f32 = 1e-4;

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gemma4-tiny")
        .join(name)
}

fn load(name: &str) -> (Model, Vec<u32>, Vec<Vec<f32>>) {
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..LoadOptions::default()
    };
    let model = load_model(&dir(name), &opts).unwrap();
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("logits.json")).unwrap())
            .unwrap();
    let ids = serde_json::from_value(fx["ids"].clone()).unwrap();
    let logits = serde_json::from_value(fx["logits"].clone()).unwrap();
    (model, ids, logits)
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// Every position's logits, once in one forward and once as a prefill of 5 then single-token
/// steps (the shared and sliding layers then read K/V written by earlier calls, across the
/// window).
fn check(name: &str) {
    let (model, ids, want) = load(name);
    assert!(ids.len() > 2 * 4, "the ids run past the sliding window");
    let all = ForwardRequest {
        logits: Rows::All,
        ..ForwardRequest::default()
    };
    let mut cache = model.new_cache();
    let got = model
        .forward(&ids, &mut cache, &all)
        .unwrap()
        .logits
        .to_vec2::<f32>()
        .unwrap();
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = max_diff(g, w);
        assert!(d < TOL, "{name}: position {pos} differs by {d}");
    }
    let mut cache = model.new_cache();
    let mut rows = model
        .forward(&ids[..5], &mut cache, &all)
        .unwrap()
        .logits
        .to_vec2::<f32>()
        .unwrap();
    for &id in &ids[5..] {
        let out = model
            .forward(&[id], &mut cache, &ForwardRequest::default())
            .unwrap();
        rows.extend(out.logits.to_vec2::<f32>().unwrap());
    }
    // Dense f32 matmuls of 1 and 14 rows may round differently (candle's gemm), so the steps
    // are held to the reference's tolerance rather than to the one-shot bits.
    for (pos, (g, w)) in rows.iter().zip(&want).enumerate() {
        let d = max_diff(g, w);
        assert!(
            d < TOL,
            "{name}: step-by-step position {pos} differs by {d}"
        );
    }
}

#[test]
fn full_features_match_transformers() {
    check("full");
}

#[test]
fn plain_matches_transformers() {
    check("plain");
}

#[test]
fn shared_layers_store_no_kv() {
    let (model, _, _) = load("full");
    // 6 layers, the last 2 reuse layers 3 and 2: 4 slots, the global one 1 head of 32.
    let slots = model.kv_layout().slots;
    assert_eq!(slots.len(), 4);
    assert_eq!((slots[2].kv_heads, slots[2].head_dim), (1, 32));
    assert_eq!((slots[3].kv_heads, slots[3].head_dim), (2, 16));
}

#[test]
fn moe_and_gguf_are_refused() {
    let cfg_path = dir("plain").join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["enable_moe_block"] = Value::Bool(true);
    let tmp = std::env::temp_dir().join(format!("specula-gemma4-moe-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let err = crate::config::ModelConfig::from_hf_json(&tmp.join("config.json")).unwrap_err();
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(err.to_string().contains("mixture of experts"), "{err}");
}
