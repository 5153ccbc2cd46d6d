//! The shipped SmolLM2 assistant (`drafters/weights/smollm2-135m/assistant`) against its PyTorch
//! twin: on every other bench prompt of the fixture the Rust drafter drafts the ids the twin
//! drafted (`train/results/smollm2-135m/twin-drafts.json`, made by `train/specula_train/twin_drafts.py`
//! from the same weight files, whose sha256 the fixture records and this test checks first).
//!
//! Each round pends at one position `a` of the twin's: the drafter opens a session on the prompt
//! and the target's greedy answer up to `a`, with the final-norm hidden states and the last
//! layer's K/V of positions `< a` (what the host sends it), and drafts 7 chained ids. The target
//! here is the Rust one in f32 and its K are in the GGUF's interleaved layout (the drafter
//! permutes its q heads to match); the twin's is the same GGUF dequantized in PyTorch with
//! half-split K. Logits differ only by summation order, so a draft is compared while the twin's
//! top-1/top-2 margin is at least [`MARGIN`]; each draft feeds the next, so a round's comparison
//! stops at its first narrow margin. The test fails if fewer than 70 % of the drafts are
//! compared.

use assistant::drafter::AssistantDrafter;
use dflash::WeightsSource;
use serde_json::Value;
use specula_models::testing::{real_model, repo_root};
use specula_models::{load_model, ForwardRequest, LoadOptions, Rows, TapId, WeightDType};
use specula_protocol::sdk::{Drafter, OpenArgs, Taps};
use specula_protocol::wire::{SamplingSpec, TargetInfo};

/// Logit margins under this may flip between two f32 implementations.
const MARGIN: f64 = 0.05;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

#[test]
fn shipped_smollm2_assistant_drafts_what_its_pytorch_twin_drafts() {
    let twin: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("train/results/smollm2-135m/twin-drafts.json"))
            .expect("twin-drafts.json"),
    )
    .expect("json");
    let weights = repo_root().join("drafters/weights/smollm2-135m/assistant");
    let sums = std::fs::read_to_string(weights.join("SHA256SUMS")).expect("SHA256SUMS");
    assert_eq!(
        twin["weights_sha256"]["assistant"].as_str(),
        Some(sums.as_str()),
        "twin-drafts.json was made from other assistant weights: remake it (train/README.md)"
    );
    let path = real_model("smollm2-135m");
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..Default::default()
    };
    let model = load_model(&path, &opts).expect("load SmolLM2");
    let c = model.config();
    let target = TargetInfo {
        architecture: c.model_type.clone(),
        vocab_size: c.vocab_size as u32,
        hidden_size: c.hidden_size as u32,
        num_layers: c.num_hidden_layers as u32,
        num_kv_heads: c.kv_heads() as u32,
        head_dim: c.head_dim() as u32,
        weights_path: path.display().to_string(),
        context_len: model.context_len() as u32,
        ..TargetInfo::default()
    };
    let mut d = AssistantDrafter::for_target(WeightsSource::Path(weights), &target)
        .expect("the weights fit SmolLM2");
    let last = c.num_hidden_layers - 1;
    let (mut compared, mut total, mut session) = (0, 0, 0);
    for case in twin["cases"].as_array().expect("cases").iter().step_by(2) {
        let mut seq = ids(&case["prompt_ids"]);
        seq.extend(ids(&case["target_greedy"]));
        let req = ForwardRequest {
            logits: Rows::Last(0),
            taps: vec![TapId::FinalNorm],
            tap_rows: Rows::All,
        };
        let mut cache = model.new_cache();
        let out = model
            .forward(&seq, &mut cache, &req)
            .expect("target forward");
        let hidden = out.taps[0]
            .1
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let width = c.hidden_size;
        for round in case["assistant"].as_array().expect("rounds") {
            let a = round["anchor_pos"].as_u64().expect("anchor") as usize;
            assert_eq!(seq[a], round["anchor_id"].as_u64().unwrap() as u32);
            let kv = vec![cache.rows(last, 0..a).expect("donor rows")];
            session += 1;
            d.open(
                session,
                OpenArgs {
                    prompt: &seq[..=a],
                    sampling: &SamplingSpec::greedy(),
                    taps: Some(Taps::from_f32(
                        0,
                        a as u32,
                        &[],
                        Some(&hidden[..a * width]),
                        &kv,
                    )),
                },
            );
            let want = ids(&round["drafts"]);
            let got = d.draft(session, &[], want.len()).tokens;
            assert_eq!(got.len(), want.len(), "anchor {a}: draft length");
            total += want.len();
            let margins = round["margins"].as_array().expect("margins");
            for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if margins[k].as_f64().expect("a margin") < MARGIN {
                    break; // later drafts follow this one, which may differ
                }
                assert_eq!(g, w, "anchor {a} draft {k}: Rust {g}, twin {w}");
                compared += 1;
            }
            d.close(session);
        }
    }
    eprintln!("assistant: {compared} of {total} drafts compared, all equal");
    assert!(
        total > 0 && compared * 10 >= total * 7,
        "only {compared} of {total} drafts had a clear margin"
    );
}
