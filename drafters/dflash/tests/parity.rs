//! Parity with the references on random weights: a tiny random Qwen3 target and random DFlash
//! and DSpark drafters (each Markov head, with and without the confidence head), several rounds
//! with partial acceptance. The fixtures were made by `tests/fixtures/dflash/make.py` with
//! `dflash==0.1.0` and DeepSpec's own modeling code; see that script.
//!
//! Each round feeds the drafter exactly what the host would (the prompt's taps at `Open`, the
//! verified rows' taps at `Commit`, one row at `Advance` when DSpark drafted nothing) and checks
//! its draft logits (within 1e-4), ids, confidences and confidence-scheduled length.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use dflash::{Block, DFlash, DeviceChoice, LinearDType, Options, VocabChoice, WeightsSource};
use serde_json::Value;
use specula_protocol::sdk::{AdvanceArgs, CommitArgs, DraftAsk, Drafter, OpenArgs, Taps};
use specula_protocol::wire::{SamplingSpec, TargetInfo};

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash")
}

fn target() -> TargetInfo {
    TargetInfo {
        architecture: "qwen3".into(),
        vocab_size: 128,
        hidden_size: 32,
        num_layers: 6,
        num_kv_heads: 2,
        head_dim: 8,
        weights_path: fixtures().join("target").display().to_string(),
        context_len: 128,
        ..TargetInfo::default()
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    if a.elem_count() == 0 {
        return 0.0;
    }
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

struct Case {
    meta: Value,
    tensors: HashMap<String, Tensor>,
}

impl Case {
    fn load(name: &str) -> Case {
        let dir = fixtures().join(name);
        let meta = std::fs::read_to_string(dir.join("rounds.json")).unwrap();
        let tensors =
            candle_core::safetensors::load(dir.join("rounds.safetensors"), &Device::Cpu).unwrap();
        Case {
            meta: serde_json::from_str(&meta).unwrap(),
            tensors,
        }
    }

    fn taps(&self, prefix: &str) -> Vec<Vec<f32>> {
        let layers = self.meta["tap_layers"].as_array().unwrap();
        layers
            .iter()
            .map(|l| {
                let t = &self.tensors[&format!("{prefix}.tap{}", l.as_u64().unwrap())];
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect()
    }

    fn rows(&self, prefix: &str) -> u32 {
        let l = self.meta["tap_layers"][0].as_u64().unwrap();
        self.tensors[&format!("{prefix}.tap{l}")].dims()[0] as u32
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The first round of `case` on `d`: session 1 opened on the prompt with the `open` taps and
/// `sampling`, one block of up to 16 drafts.
fn first_block(d: &mut DFlash, case: &Case, sampling: &SamplingSpec) -> Block {
    let mut prompt = ids(&case.meta["prompt"]);
    prompt.push(case.meta["rounds"][0]["anchor"].as_u64().unwrap() as u32);
    let open = case.taps("open");
    let taps = Taps::from_f32(0, case.rows("open"), &open, None, &[]);
    let args = OpenArgs {
        prompt: &prompt,
        sampling,
        taps: Some(taps),
    };
    d.open(1, args);
    let ask = DraftAsk {
        session: 1,
        new_tokens: &[],
        n: 16,
        donors: None,
    };
    d.blocks(&[ask]).unwrap().pop().unwrap().expect("a block")
}

/// Runs a case at the fixture's confidence threshold, or at `threshold` (0: whole blocks).
fn run(name: &str) {
    run_at(name, None);
}

fn run_at(name: &str, threshold: Option<f32>) {
    run_on(name, threshold, DeviceChoice::Host);
}

fn run_on(name: &str, threshold: Option<f32>, device: DeviceChoice) {
    let case = Case::load(name);
    let fixture = case.meta["threshold"].as_f64().unwrap_or(0.0) as f32;
    let threshold = threshold.unwrap_or(fixture);
    let options = Options {
        confidence_threshold: threshold,
        device,
        ..Options::default()
    };
    let mut d = DFlash::new(WeightsSource::Path(fixtures().join(name)), options).unwrap();
    let target = target();
    d.accept_target(&target).unwrap();
    let caps = d.capabilities(&target);
    assert_eq!(caps.tap_layers, vec![1, 3], "{name}");
    let rounds = case.meta["rounds"].as_array().unwrap();
    let mut prompt = ids(&case.meta["prompt"]);
    prompt.push(rounds[0]["anchor"].as_u64().unwrap() as u32);
    let open_taps = case.taps("open");
    let rows = case.rows("open");
    let sampling = SamplingSpec::greedy();
    let taps = Taps::from_f32(0, rows, &open_taps, None, &[]);
    d.open(
        1,
        OpenArgs {
            prompt: &prompt,
            sampling: &sampling,
            taps: Some(taps),
        },
    );
    let mut cached = rows as usize;
    for (r, round) in rounds.iter().enumerate() {
        assert_eq!(d.context_rows(1), Some((cached, 0)), "{name} round {r}");
        let ask = DraftAsk {
            session: 1,
            new_tokens: &[],
            n: 16,
            donors: None,
        };
        let block = d.blocks(&[ask]).unwrap().pop().unwrap().expect("a block");
        let drafts = ids(&round["drafts"]);
        // The round as the fixture ran it (its ℓ decides Commit or Advance)...
        let length = round["length"]
            .as_u64()
            .map_or(drafts.len(), |l| l as usize);
        // ...and what this drafter proposes at its own threshold.
        let proposed = match threshold == fixture {
            true => length,
            false => drafts.len(),
        };
        // A confidence cut stops before the lm_head rows of the slots it drops.
        let want = case.tensors[&format!("round{r}.logits")]
            .narrow(0, 0, proposed)
            .unwrap();
        let diff = max_diff(&block.logits, &want);
        assert!(diff <= TOL, "{name} round {r}: logits differ by {diff}");
        assert_eq!(block.tokens, drafts[..proposed], "{name} round {r}: ids");
        match case.tensors.get(&format!("round{r}.confidence")) {
            Some(c) => {
                let want = c.to_vec1::<f32>().unwrap();
                let got = block.confidence.as_ref().expect("confidences");
                assert_eq!(got.len(), proposed, "{name} round {r}: ℓ");
                for (a, b) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= TOL,
                        "{name} round {r}: confidence {a} vs {b}"
                    );
                }
            }
            // No confidence head: the drafter's own calibrated confidences, one per draft.
            None => {
                let got = block.confidence.as_ref().expect("calibrated confidences");
                assert_eq!(got.len(), proposed, "{name} round {r}");
                assert!(got.iter().all(|c| (0.0..=1.0).contains(c)), "{got:?}");
            }
        }
        let committed = ids(&round["committed"]);
        let accepted = round["accepted"].as_u64().unwrap() as usize;
        let verified = case.taps(&format!("round{r}"));
        let vrows = case.rows(&format!("round{r}"));
        assert_eq!(vrows as usize, accepted + 1);
        let pos = round["pos"].as_u64().unwrap();
        let taps = Some(Taps::from_f32(pos, vrows, &verified, None, &[]));
        match length {
            // ℓ = 0: the round verified the anchor alone; the host sends Advance.
            0 => {
                let args = AdvanceArgs {
                    ids: &committed,
                    taps,
                };
                d.advance(1, args);
            }
            _ => {
                let args = CommitArgs {
                    drafted: length,
                    accepted,
                    ids: &committed,
                    taps,
                };
                d.commit(1, args);
            }
        }
        cached += accepted + 1;
    }
}

#[test]
fn dflash_matches_dflash_0_1_0() {
    run("dflash");
}

#[test]
fn dflash_with_a_learned_mask_embedding() {
    run("dflash_maskemb");
}

#[test]
fn dspark_vanilla_markov_matches_deepspec() {
    run("dspark_vanilla");
    run("dspark_vanilla_conf");
    run_at("dspark_vanilla_conf", Some(0.0));
}

#[test]
fn dspark_gated_markov_matches_deepspec() {
    // dspark_gated keeps its own embed/lm_head copies (they differ from the target's).
    run("dspark_gated");
    run("dspark_gated_conf");
    run_at("dspark_gated_conf", Some(0.0));
}

#[test]
fn dspark_rnn_markov_matches_deepspec() {
    run("dspark_rnn");
    run("dspark_rnn_conf");
    run_at("dspark_rnn_conf", Some(0.0));
}

/// The device path (`--device cuda`'s candle ops, run here on the CPU) matches the references
/// as the host path does: every case, at the fixture's threshold and without a cut.
#[test]
fn the_device_path_matches_the_references() {
    for name in [
        "dflash",
        "dflash_maskemb",
        "dspark_vanilla",
        "dspark_vanilla_conf",
        "dspark_gated",
        "dspark_gated_conf",
        "dspark_rnn",
        "dspark_rnn_conf",
    ] {
        run_on(name, None, DeviceChoice::CandleCpu);
    }
    run_on("dspark_vanilla_conf", Some(0.0), DeviceChoice::CandleCpu);
}

/// One batched forward for several sessions drafts what each session drafts alone.
#[test]
fn a_batched_draft_equals_each_session_alone() {
    for name in ["dflash", "dspark_rnn_conf"] {
        let case = Case::load(name);
        let mut d = DFlash::new(
            WeightsSource::Path(fixtures().join(name)),
            Options::default(),
        )
        .unwrap();
        d.accept_target(&target()).unwrap();
        let rounds = case.meta["rounds"].as_array().unwrap();
        let mut prompt = ids(&case.meta["prompt"]);
        prompt.push(rounds[0]["anchor"].as_u64().unwrap() as u32);
        let open = case.taps("open");
        let sampling = SamplingSpec::greedy();
        // Session 2 sees a shorter prompt (its first 6 positions), so its context differs.
        let short: Vec<Vec<f32>> = open.iter().map(|t| t[..6 * 32].to_vec()).collect();
        for (session, prompt, taps) in [(1, &prompt[..], &open), (2, &prompt[..7], &short)] {
            let rows = (prompt.len() - 1) as u32;
            let taps = Taps::from_f32(0, rows, taps, None, &[]);
            let args = OpenArgs {
                prompt,
                sampling: &sampling,
                taps: Some(taps),
            };
            d.open(session, args);
        }
        let ask = |session| DraftAsk {
            session,
            new_tokens: &[],
            n: 8,
            donors: None,
        };
        let both = d.blocks(&[ask(1), ask(2), ask(9)]).unwrap();
        assert!(
            both[2].is_none(),
            "a session that is not open drafts nothing"
        );
        for (i, session) in [1, 2].into_iter().enumerate() {
            let alone = d.blocks(&[ask(session)]).unwrap().pop().unwrap().unwrap();
            let batched = both[i].as_ref().unwrap();
            assert_eq!(batched.tokens, alone.tokens, "{name} session {session}");
            // Row blocking in the matmuls may reorder sums: equal within the parity tolerance.
            let diff = max_diff(&batched.logits, &alone.logits);
            assert!(diff <= TOL, "{name} session {session}: {diff}");
        }
        let a = both[0].as_ref().unwrap();
        let b = both[1].as_ref().unwrap();
        assert!(
            max_diff(&a.logits, &b.logits) > 1e-3,
            "{name}: the contexts differ"
        );
    }
}

/// With its projections requantized to Q8_0 the drafter is no longer exact, but stays close to
/// the reference: the first round's logits within a few percent of their range.
#[test]
fn q8_linears_stay_close_to_the_reference() {
    let name = "dflash";
    let case = Case::load(name);
    let options = Options {
        linear_dtype: LinearDType::Q8_0,
        ..Options::default()
    };
    let mut d = DFlash::new(WeightsSource::Path(fixtures().join(name)), options).unwrap();
    d.accept_target(&target()).unwrap();
    let block = first_block(&mut d, &case, &SamplingSpec::greedy());
    let want = &case.tensors["round0.logits"];
    let range = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let diff = max_diff(&block.logits, want);
    assert!(diff > 0.0, "requantized weights give other numbers");
    assert!(
        diff < 0.05 * range,
        "q8: logits differ by {diff} (range {range})"
    );
}

/// The fixture drafter `name` in a temporary folder with a draft vocabulary of `ids`.
fn with_draft_vocab(name: &str, ids: &[u32]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join(name).join(f), dir.path().join(f)).unwrap();
    }
    let list =
        serde_json::json!({"format": "specula-draft-vocab/1", "vocab_size": 128, "ids": ids});
    std::fs::write(dir.path().join("draft_vocab.json"), list.to_string()).unwrap();
    dir
}

/// With a draft vocabulary the first round's logits are the reference's columns at its ids (in
/// its order), greedy drafts are the argmax among them, and sampled `q` rows are a distribution
/// over the vocabulary that is zero outside them, the sampled id among them.
#[test]
fn a_draft_vocabulary_drafts_the_subsets_argmax_and_samples_within_it() {
    for name in ["dflash", "dspark_rnn_conf"] {
        let case = Case::load(name);
        let round = &case.meta["rounds"][0];
        let want = &case.tensors["round0.logits"];
        // Odd ids, descending, plus the reference's drafts (DSpark chains each draft into the
        // next, so its drafts must stay reachable for the chain to be the reference's).
        let mut subset: Vec<u32> = (0..128).rev().filter(|i| i % 2 == 1).collect();
        if name.starts_with("dspark") {
            for id in ids(&round["drafts"]) {
                if !subset.contains(&id) {
                    subset.push(id);
                }
            }
        }
        let dir = with_draft_vocab(name, &subset);
        for temperature in [0.0, 1.0] {
            let options = Options {
                draft_vocab: VocabChoice::Shipped,
                ..Options::default()
            };
            let source = WeightsSource::Path(dir.path().to_path_buf());
            let mut d = DFlash::new(source, options).unwrap();
            d.accept_target(&target()).unwrap();
            let sampling = SamplingSpec {
                temperature,
                seed: Some(5),
                ..SamplingSpec::greedy()
            };
            let block = first_block(&mut d, &case, &sampling);
            let index = Tensor::new(subset.as_slice(), &Device::Cpu).unwrap();
            let rows = block.logits.dims()[0];
            let columns = want
                .narrow(0, 0, rows)
                .unwrap()
                .index_select(&index, 1)
                .unwrap();
            if temperature == 0.0 {
                let diff = max_diff(&block.logits, &columns);
                assert!(diff <= TOL, "{name}: logits differ by {diff}");
                let argmax: Vec<u32> = columns.argmax(1).unwrap().to_vec1().unwrap();
                let expect: Vec<u32> = argmax.iter().map(|&i| subset[i as usize]).collect();
                assert_eq!(block.tokens, expect, "{name}: the subset's argmax");
                if name.starts_with("dspark") {
                    assert_eq!(block.tokens, ids(&round["drafts"]), "{name}: the chain");
                }
                assert!(block.q.is_none());
                continue;
            }
            let q = block.q.as_ref().expect("q rows when sampled");
            assert_eq!(q.len(), block.tokens.len());
            for (row, &id) in q.iter().zip(&block.tokens) {
                assert_eq!(row.len(), 128, "{name}: q over the whole vocabulary");
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-4, "{name}: q sums to {sum}");
                for (t, &p) in row.iter().enumerate() {
                    assert!(p == 0.0 || subset.contains(&(t as u32)), "{name}: q[{t}]");
                }
                assert!(
                    subset.contains(&id) && row[id as usize] > 0.0,
                    "{name}: {id}"
                );
            }
        }
    }
}

/// A DSpark drafter whose confidence head reads the hidden state alone cuts its block before
/// drafting (sparing the lm_head rows after the cut) and proposes exactly the prefix that the
/// uncut block has before its first slot under the threshold. Made from the vanilla fixture
/// by keeping the hidden-state columns of its confidence projection.
#[test]
fn a_cut_known_before_drafting_proposes_the_uncut_blocks_prefix() {
    let name = "dspark_vanilla_conf";
    let case = Case::load(name);
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join(name);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["confidence_head_with_markov"] = Value::Bool(false);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let key = tensors
        .keys()
        .find(|k| k.ends_with("confidence_head.proj.weight"))
        .cloned()
        .expect("a confidence projection");
    let hidden = target().hidden_size as usize;
    let w = tensors[&key]
        .narrow(1, 0, hidden)
        .unwrap()
        .contiguous()
        .unwrap();
    tensors.insert(key, w);
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();

    let block_at = |threshold: f32| {
        let options = Options {
            confidence_threshold: threshold,
            ..Options::default()
        };
        let mut d = DFlash::new(WeightsSource::Path(dir.path().to_path_buf()), options).unwrap();
        d.accept_target(&target()).unwrap();
        first_block(&mut d, &case, &SamplingSpec::greedy())
    };
    let whole = block_at(0.0);
    let conf = whole.confidence.clone().expect("confidences");
    assert!(conf.len() >= 3, "{conf:?}");
    // Thresholds that cut after the first slot, in the middle, and before the first slot.
    let mut sorted = conf.clone();
    sorted.sort_by(f32::total_cmp);
    for threshold in [sorted[sorted.len() / 2], conf[0] + 1e-3] {
        let cut = conf
            .iter()
            .position(|&c| c < threshold)
            .unwrap_or(conf.len());
        let block = block_at(threshold);
        assert_eq!(block.tokens, whole.tokens[..cut], "threshold {threshold}");
        assert_eq!(block.confidence.as_deref(), Some(&conf[..cut]));
        let want = whole.logits.narrow(0, 0, cut).unwrap();
        assert_eq!(block.logits.dims(), want.dims());
        assert!(
            max_diff(&block.logits, &want) <= TOL,
            "threshold {threshold}"
        );
    }
}

/// Without a confidence head the drafter's confidences start at the draft probability of each
/// id and follow what the target accepts within the session; a new `Open` starts afresh (a
/// request never depends on the ones before it); at a threshold above them the block is cut,
/// down to nothing (ℓ = 0: the host runs a plain step).
#[test]
fn dflash_confidences_are_calibrated_per_session_and_cut_at_the_threshold() {
    let case = Case::load("dflash");
    let sampling = SamplingSpec::greedy();
    let hidden = target().hidden_size as usize;
    let drafter = |threshold: f32| {
        let options = Options {
            confidence_threshold: threshold,
            ..Options::default()
        };
        let mut d = DFlash::new(WeightsSource::Path(fixtures().join("dflash")), options).unwrap();
        d.accept_target(&target()).unwrap();
        d
    };
    // softmax(logits)[id] of each draft: the calibration's feature.
    let raw = |b: &Block| -> Vec<f32> {
        let rows = b.logits.to_vec2::<f32>().unwrap();
        rows.iter()
            .zip(&b.tokens)
            .map(|(row, &id)| {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = row.iter().map(|z| (z - max).exp()).sum();
                (row[id as usize] - max).exp() / sum
            })
            .collect()
    };
    // `rounds` rounds of one session (opened by `first_block`): the host verifies every draft,
    // accepts `accepted` of them and commits with (synthetic, intact) taps; then one more block.
    let session = |d: &mut DFlash, rounds: usize, accepted: usize| -> Block {
        let mut block = first_block(d, &case, &sampling);
        let mut pos = ids(&case.meta["prompt"]).len();
        for _ in 0..rounds {
            let a = accepted.min(block.tokens.len());
            let mut committed = block.tokens[..a].to_vec();
            committed.push(0);
            let rows = vec![vec![0.25f32; (a + 1) * hidden]; 2];
            let args = CommitArgs {
                drafted: block.tokens.len(),
                accepted: a,
                ids: &committed,
                taps: Some(Taps::from_f32(pos as u64, (a + 1) as u32, &rows, None, &[])),
            };
            d.commit(1, args);
            pos += committed.len();
            let ask = DraftAsk {
                session: 1,
                new_tokens: &[],
                n: 16,
                donors: None,
            };
            block = d.blocks(&[ask]).unwrap().pop().unwrap().expect("a block");
        }
        d.close(1);
        block
    };
    let mut d = drafter(0.0);
    let fresh = session(&mut d, 0, 0);
    let conf = fresh.confidence.clone().expect("confidences");
    assert_eq!(conf.len(), fresh.tokens.len());
    // Before any verdict: the raw probability of each draft.
    for (j, p) in raw(&fresh).iter().enumerate() {
        assert!((conf[j] - p).abs() < 5e-4, "draft {j}: {} vs {p}", conf[j]);
    }
    // Every first draft rejected for 30 rounds: confidences fall well below the raw ones.
    let rejected = session(&mut d, 30, 0);
    let (got, p) = (rejected.confidence.clone().unwrap(), raw(&rejected));
    assert!(got[0] < p[0] / 2.0, "{} vs {}", got[0], p[0]);
    // The next request on the same drafter starts afresh: the first block's confidences again.
    assert_eq!(session(&mut d, 0, 0).confidence, Some(conf.clone()));
    // Two drafts accepted a round (12 rounds: the fixture's context is 128 positions): the
    // first two drafts' confidences rise above the raw ones.
    let accepted = session(&mut d, 12, 2);
    let (got, p) = (accepted.confidence.clone().unwrap(), raw(&accepted));
    assert!(got[0] > p[0] && got[1] > p[1], "{got:?} vs {p:?}");
    // At a threshold between the learned and the raw confidence: nothing is proposed.
    let mut cut = drafter(conf[0] * 0.75);
    assert!(
        !session(&mut cut, 0, 0).tokens.is_empty(),
        "drafts at first"
    );
    let skipped = session(&mut cut, 30, 0);
    assert!(skipped.tokens.is_empty(), "{:?}", skipped.confidence);
    assert_eq!(skipped.confidence, Some(Vec::new()));
    assert_eq!(skipped.logits.dims()[0], 0);
}
