//! Gemma-3-270M against transformers (`tests/fixtures/gemma3-270m.json`, written by
//! `scripts/reference/gemma3_forward.py` from the dequantized GGUF in f32).

use std::path::Path;

use candle_core::Tensor;
use serde_json::Value;

use crate::loader::{load_model, LoadOptions};
use crate::{ForwardRequest, Model, WeightDType};

/// A divergence from the reference is only acceptable at a near-tie of its top two logits.
const NEAR_TIE: f64 = 1e-3;
/// f32 against f32 with other summation orders, on logits of magnitude ~30.
const LOGIT_TOL: f32 = 2e-3;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma3-270m.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn model(dtype: WeightDType) -> Model {
    let path = crate::tokenizer::tests::real_model("gemma3-270m");
    let opts = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    load_model(&path, &opts).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Teacher-forced greedy run over the reference continuation: per step our argmax and logits.
fn run(model: &Model, prompt: &[u32], reference: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let req = ForwardRequest::default();
    let first = model.prefill(prompt, &mut cache, &req).unwrap().logits;
    let mut rows = vec![first.squeeze(0).unwrap().to_vec1::<f32>().unwrap()];
    for &tok in &reference[..reference.len() - 1] {
        let out = model.forward(&[tok], &mut cache, &req).unwrap().logits;
        rows.push(out.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
    }
    rows
}

#[test]
fn greedy_f32_equals_transformers() {
    let fx = fixture();
    let model = model(WeightDType::F32);
    let fixed = ids(&fx["fixed_ids"]);
    let (mut steps, mut near_ties) = (0, 0);
    for p in fx["prompts"].as_array().unwrap() {
        let (prompt, reference) = (ids(&p["prompt_ids"]), ids(&p["greedy"]));
        assert!(reference.len() >= 32);
        let rows = run(&model, &prompt, &reference);
        for (step, row) in rows.iter().enumerate() {
            steps += 1;
            if argmax(row) != reference[step] {
                let gap = p["top2_gap"][step].as_f64().unwrap();
                assert!(
                    gap < NEAR_TIE,
                    "prompt {:?} step {step}: not a near-tie ({gap})",
                    p["prompt"]
                );
                near_ties += 1;
            }
        }
        for lr in p["logits"].as_array().unwrap() {
            let row = &rows[lr["step"].as_u64().unwrap() as usize];
            let top = ids(&lr["top_ids"]);
            let want = top.iter().zip(lr["top_logits"].as_array().unwrap());
            let fixed_want = fixed.iter().zip(lr["fixed_logits"].as_array().unwrap());
            for (id, v) in want.chain(fixed_want) {
                let (id, v) = (*id as usize, v.as_f64().unwrap() as f32);
                assert!(
                    (row[id] - v).abs() < LOGIT_TOL,
                    "logit {id}: {} vs {v}",
                    row[id]
                );
            }
        }
    }
    eprintln!("gemma3 f32: {steps} greedy steps, {near_ties} near-tie divergences");
    assert!(steps >= 6 * 32);
}

/// The quantized weights as stored (Q4_K_M and friends) are not the reference's numbers: report
/// how often their greedy token agrees, and require most of them to.
#[test]
fn native_quantized_agreement() {
    let fx = fixture();
    let model = model(WeightDType::Native);
    let (mut steps, mut agree) = (0, 0);
    for p in fx["prompts"].as_array().unwrap() {
        let (prompt, reference) = (ids(&p["prompt_ids"]), ids(&p["greedy"]));
        for (step, row) in run(&model, &prompt, &reference).iter().enumerate() {
            steps += 1;
            agree += usize::from(argmax(row) == reference[step]);
        }
    }
    eprintln!(
        "gemma3 native: {agree}/{steps} teacher-forced greedy steps agree with f32 transformers"
    );
    assert!(agree * 10 >= steps * 7, "{agree}/{steps}");
}

#[test]
fn logits_of_chunked_and_one_shot_prefill_are_identical() {
    let fx = fixture();
    let model = model(WeightDType::F32);
    let long = ids(&fx["prompts"][5]["prompt_ids"]);
    assert!(
        long.len() > 512,
        "the long prompt crosses the sliding window"
    );
    let req = ForwardRequest {
        logits: crate::Rows::Last(3),
        ..ForwardRequest::default()
    };
    let mut a = model.new_cache();
    let one: Tensor = model.forward(&long, &mut a, &req).unwrap().logits;
    let mut b = model.new_cache();
    let chunked = model
        .forward_chunked(&long, &mut b, &req, 100)
        .unwrap()
        .logits;
    let diff = (one - chunked).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
}

/// The HF safetensors path ((1 + w) norms stored as w), a window of 3 keys, a scale that is not
/// head_dim's and a final softcap, against transformers (`tests/fixtures/gemma3-tiny`, written
/// by `scripts/reference/gemma3_tiny.py`).
#[test]
fn tiny_hf_checkpoint_matches_transformers() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma3-tiny");
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..LoadOptions::default()
    };
    let model = load_model(&dir, &opts).unwrap();
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap()).unwrap();
    let (ids, want): (Vec<u32>, Vec<Vec<f32>>) = (
        serde_json::from_value(fx["ids"].clone()).unwrap(),
        serde_json::from_value(fx["logits"].clone()).unwrap(),
    );
    let req = ForwardRequest {
        logits: crate::Rows::All,
        ..ForwardRequest::default()
    };
    let mut cache = model.new_cache();
    let got = model
        .forward(&ids, &mut cache, &req)
        .unwrap()
        .logits
        .to_vec2::<f32>()
        .unwrap();
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d < 1e-4, "position {pos} differs by {d}");
    }
}
