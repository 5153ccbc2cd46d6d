//! Parity with the reference forward: `tests/fixtures/mtp/make.py` ports vLLM's
//! `deepseek_mtp.py`, `qwen3_next_mtp.py`, `mimo_mtp.py` and the `EagleProposer.propose`
//! recursion to PyTorch and records, on tiny random weights, several rounds of verified windows
//! with partial acceptance and the drafts and logits that follow each. Replayed here through
//! the drafter's own session code: ids equal, logits within 1e-4 (f32).

use std::path::{Path, PathBuf};

use candle_core::Device;
use mtp::config::{config_path, MtpConfig};
use mtp::model::argmax_rows;
use mtp::state::{Core, Session};
use mtp::{weights, Layout, LinearDType, Mtp, Recycle};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mtp")
}

fn load(case: &str) -> (Core, MtpConfig) {
    load_with(case, |_| {})
}

/// Loads `case` with its config changed by `edit`.
fn load_with(case: &str, edit: impl FnOnce(&mut MtpConfig)) -> (Core, MtpConfig) {
    load_as(case, edit, LinearDType::Stored)
}

/// Loads `case` with its config changed by `edit` and its projections kept as `dtype`.
fn load_as(case: &str, edit: impl FnOnce(&mut MtpConfig), dtype: LinearDType) -> (Core, MtpConfig) {
    let dir = fixtures().join(case);
    let mut w = weights::open(&dir).expect("fixture weights");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(config_path(&dir)).unwrap()).unwrap();
    let block = json["specula_fixture"]["block"].as_str().unwrap();
    let mut config = MtpConfig::load(&config_path(&dir), &w, block).expect("config");
    edit(&mut config);
    let (embedding, lm_head) = w
        .embedding_and_head((config.vocab_size, config.hidden_size), false)
        .expect("the target's embedding and lm_head");
    let mtp = Mtp::load(config.clone(), &mut w, 512, dtype).expect("module");
    (
        Core::new(mtp, embedding, lm_head, None).expect("core"),
        config,
    )
}

/// Replays `rounds_k{k}.json` of `case`; panics on a mismatch.
fn replay(case: &str, k: usize) {
    let (core, _) = load(case);
    if let Err(e) = replay_with(&core, case, k) {
        panic!("{e}");
    }
}

/// Replays `rounds_k{k}.json` of `case` through `core`; the first mismatch, if any.
/// Greedy drafts of `session` with the logits each was picked from.
struct Drafts {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn greedy(session: &mut Session, core: &Core, k: usize) -> Drafts {
    let mut logits = Vec::new();
    let mut pick = |l: &candle_core::Tensor| {
        logits.push(l.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        Ok(Some(argmax_rows(l)?[0]))
    };
    let tokens = session.draft(core, k, 512, &mut pick).unwrap();
    Drafts { tokens, logits }
}

fn replay_with(core: &Core, case: &str, k: usize) -> Result<(), String> {
    let path = fixtures().join(case).join(format!("rounds_k{k}.json"));
    let data: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let hidden = data["hidden_size"].as_u64().unwrap() as usize;
    let mut session = Session::new();
    for (r, round) in data["rounds"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = round["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            round["pos"].as_u64().unwrap() as usize,
            session.pos(),
            "round {r}"
        );
        let h: Vec<f32> = round["hidden"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let h = candle_core::Tensor::from_vec(h, (ids.len(), hidden), &Device::Cpu).unwrap();
        session.extend(core, Some(&h), &ids).unwrap();
        let drafts = greedy(&mut session, core, k);
        let want: Vec<u32> = round["drafts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let want_logits = round["logits"].as_array().unwrap();
        assert_eq!(drafts.logits.len(), want_logits.len());
        for (j, (got, want)) in drafts.logits.iter().zip(want_logits).enumerate() {
            for (a, b) in got.iter().zip(want.as_array().unwrap()) {
                let d = (a - b.as_f64().unwrap() as f32).abs();
                if d >= 1e-4 {
                    return Err(format!(
                        "{case} k={k} round {r} draft {j}: logit off by {d}"
                    ));
                }
            }
        }
        if drafts.tokens != want {
            return Err(format!(
                "{case} k={k} round {r}: drafts {:?}, want {want:?}",
                drafts.tokens
            ));
        }
    }
    Ok(())
}

#[test]
fn deepseek_layout_matches_vllm_k1_and_k3() {
    let (core, c) = load("deepseek_llama");
    assert_eq!(c.layout, Layout::DeepSeek);
    assert_eq!(c.recycle, Recycle::PreNorm);
    assert!(c.mask_position_zero && core.mtp.has_own_head());
    replay("deepseek_llama", 1);
    replay("deepseek_llama", 3);
}

#[test]
fn deepseek_layout_with_a_qwen3_block_and_the_targets_head_matches_vllm() {
    let (core, _) = load("deepseek_qwen3");
    assert!(
        !core.mtp.has_own_head(),
        "falls back to the target's lm_head"
    );
    replay("deepseek_qwen3", 3);
}

#[test]
fn qwen3_next_layout_matches_vllm_k1_and_k3() {
    let (_, c) = load("qwen3_next");
    assert_eq!(c.layout, Layout::QwenNext);
    assert!(c.zero_centred && !c.mask_position_zero);
    assert_eq!(c.recycle, Recycle::PostNorm);
    replay("qwen3_next", 1);
    replay("qwen3_next", 3);
}

#[test]
fn mimo_layout_matches_vllm_and_drafts_one() {
    let (core, c) = load("mimo");
    assert_eq!(c.layout, Layout::MiMo);
    assert_eq!(c.max_depth, Some(1));
    replay("mimo", 1);
    // Asked for three, MiMo drafts one (its reference asserts spec_step_idx == 0).
    let mut s = Session::new();
    let h = candle_core::Tensor::ones((2, c.hidden_size), candle_core::DType::F32, &Device::Cpu)
        .unwrap();
    s.extend(&core, Some(&h), &[3, 4]).unwrap();
    assert_eq!(greedy(&mut s, &core, 3).tokens.len(), 1);
}

/// The fixtures tell the conventions apart: flipping DeepSeek's recycle rule, its position-0
/// mask or Qwen3-Next's zero-centred norms breaks parity.
#[test]
fn parity_fails_for_the_wrong_convention() {
    let flip = |case: &str, k, edit: fn(&mut MtpConfig)| {
        let (core, _) = load_with(case, edit);
        replay_with(&core, case, k).expect_err("a wrong convention must not match")
    };
    flip("deepseek_llama", 3, |c| c.recycle = Recycle::PostNorm);
    flip("deepseek_llama", 1, |c| c.mask_position_zero = false);
    flip("mimo", 1, |c| c.mask_position_zero = false);
    flip("qwen3_next", 1, |c| c.zero_centred = false);
}

/// A window longer than a chunk (a prompt) gives what the same rows give window by window.
#[test]
fn a_long_window_equals_the_same_rows_in_small_windows() {
    let (core, c) = load("deepseek_qwen3");
    let n = mtp::state::CHUNK * 2 + 37;
    let h: Vec<f32> = (0..n * c.hidden_size)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let h = candle_core::Tensor::from_vec(h, (n, c.hidden_size), &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| (i * 31 % c.vocab_size) as u32).collect();
    let mut whole = Session::new();
    whole.extend(&core, Some(&h), &ids).unwrap();
    let a = greedy(&mut whole, &core, 3);
    let mut pieces = Session::new();
    for start in (0..n).step_by(9) {
        let len = 9.min(n - start);
        let rows = h.narrow(0, start, len).unwrap();
        pieces
            .extend(&core, Some(&rows), &ids[start..start + len])
            .unwrap();
    }
    let b = greedy(&mut pieces, &core, 3);
    assert_eq!(whole.rows(), (n, 0));
    assert_eq!(a.tokens, b.tokens);
    for (x, y) in a.logits.iter().flatten().zip(b.logits.iter().flatten()) {
        assert!((x - y).abs() < 1e-4, "{x} vs {y}");
    }
}

/// `--linear-dtype q8_0` requantizes the module's projections (its own head included): the
/// logits move off the f32 reference, by no more than Q8_0's rounding allows.
#[test]
fn q8_linears_stay_near_the_reference() {
    for case in ["deepseek_llama", "deepseek_qwen3"] {
        let (f32_core, c) = load(case);
        let (q8_core, _) = load_as(case, |_| {}, LinearDType::Q8_0);
        let n = 40;
        let h: Vec<f32> = (0..n * c.hidden_size)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let h = candle_core::Tensor::from_vec(h, (n, c.hidden_size), &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..n).map(|i| (i * 31 % c.vocab_size) as u32).collect();
        let run = |core: &Core| {
            let mut s = Session::new();
            s.extend(core, Some(&h), &ids).unwrap();
            greedy(&mut s, core, 3)
        };
        let (a, b) = (run(&f32_core), run(&q8_core));
        let (mut worst, mut scale) = (0.0f32, 0.0f32);
        for (x, y) in a.logits.iter().flatten().zip(b.logits.iter().flatten()) {
            worst = worst.max((x - y).abs());
            scale = scale.max(x.abs());
        }
        assert!(worst > 0.0, "{case}: q8_0 changed nothing: not requantized");
        assert!(
            worst < 0.05 * scale,
            "{case}: q8_0 logits off by {worst} (scale {scale})"
        );
    }
}
