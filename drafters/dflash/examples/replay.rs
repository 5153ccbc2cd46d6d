//! Live vs teacher-forced drafting on SmolLM2-135M, in one process: the live path (the host's
//! protocol: `Open` with the prompt's taps, then per round `Draft` n, a greedy verify forward of
//! `[pending, drafts]` on the target's KV cache, `Commit` with the taps of the `accepted + 1`
//! verified rows) against the same drafter opened afresh at every live anchor with the taps of a
//! single forward over the final sequence (what `train/`'s evaluation and the twin test do).
//!
//! ```text
//! cargo run -p dflash --example replay -- [--kind dflash|dspark] [--k 7] [--tokens 64] [--f32] \
//!     [--cases train/results/smollm2-135m/bench-answers.json]
//! ```
//!
//! Prints, per twin-fixture bench prompt, live τ, the teacher-forced τ at the same anchors and
//! the rounds whose drafts differ between the two. With `--cases` (train/'s 10 bench prompts and
//! the target's greedy answers the simulation walks, made on the GPU: `bench-answers.json`) it
//! first prints the simulation itself (`train/specula_train/evaluate.py`'s rounds) over the
//! first `--tokens` answer tokens and over the whole answer (up to 320 tokens), then the live
//! run of `--tokens` on this CPU target.
//!
//! What it showed (session 8): the live path drafts exactly what a fresh `Open` at the same
//! anchor drafts (0 rounds differ), and the simulation reproduces train/'s bench τ (DFlash 1.60
//! over whole answers) but gives 1.09 over the first 64 tokens, the live τ of `bench/run`. The
//! "live vs simulated gap" was the window: SmolLM2's long greedy answers fall into repetition
//! (creative: τ 4.5 over 320 tokens, 1.8 over the first 64), which the 48-64-token bench never
//! reaches.

use std::path::PathBuf;

use anyhow::{Context, Result};
use dflash::{DFlash, LinearDType, Options, VocabChoice, WeightsSource};
use serde_json::Value;
use specula_models::{load_model, ForwardRequest, LoadOptions, Rows, TapId, WeightDType};
use specula_protocol::sdk::{CommitArgs, DraftAsk, Drafter, OpenArgs, Taps};
use specula_protocol::wire::{SamplingSpec, TargetInfo};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn rows_of(out: &specula_models::ForwardOutput) -> Result<Vec<Vec<Vec<f32>>>> {
    out.taps
        .iter()
        .map(|(_, t)| Ok(t.to_vec2::<f32>()?))
        .collect()
}

fn draft(d: &mut DFlash, session: u64, n: usize) -> Vec<u32> {
    let ask = DraftAsk {
        session,
        new_tokens: &[],
        n,
        donors: None,
    };
    d.draft_batch(&[ask]).pop().unwrap_or_default().tokens
}

/// Opens a fresh session on `seq[..=a]` with the taps of one forward over the whole sequence
/// (`taps`: layers × rows × width), drafts `k` tokens from anchor `a`, and closes it: what the
/// twin test and train/'s simulation do at each anchor.
fn fresh_drafts(
    d: &mut DFlash,
    session: &mut u64,
    seq: &[u32],
    taps: &[Vec<Vec<f32>>],
    a: usize,
    k: usize,
) -> Vec<u32> {
    let flat: Vec<Vec<f32>> = taps.iter().map(|l| l[..a].concat()).collect();
    *session += 1;
    d.open(
        *session,
        OpenArgs {
            prompt: &seq[..=a],
            sampling: &SamplingSpec::greedy(),
            taps: Some(Taps::from_f32(0, a as u32, &flat, None, &[])),
        },
    );
    let drafts = draft(d, *session, k);
    d.close(*session);
    drafts
}

fn main() -> Result<()> {
    let (mut kind, mut k, mut tokens, mut f32) = ("dflash".to_string(), 7usize, 64usize, false);
    let mut cases_file: Option<PathBuf> = None;
    let mut sim_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--kind" => kind = args.next().context("--kind")?,
            "--k" => k = args.next().context("--k")?.parse()?,
            "--tokens" => tokens = args.next().context("--tokens")?.parse()?,
            "--f32" => f32 = true,
            // The simulation only (with --cases): no live run.
            "--sim-only" => sim_only = true,
            "--cases" => cases_file = Some(args.next().context("--cases")?.into()),
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gguf = root.join("models/cache/smollm2-135m.gguf");
    let opts = LoadOptions {
        dtype: if f32 {
            WeightDType::F32
        } else {
            WeightDType::Native
        },
        ..Default::default()
    };
    let model = load_model(&gguf, &opts)?;
    let c = model.config();
    let target = TargetInfo {
        architecture: c.model_type.clone(),
        vocab_size: c.vocab_size as u32,
        hidden_size: c.hidden_size as u32,
        num_layers: c.num_hidden_layers as u32,
        num_kv_heads: c.kv_heads() as u32,
        head_dim: c.head_dim() as u32,
        weights_path: gguf.display().to_string(),
        context_len: model.context_len() as u32,
        ..TargetInfo::default()
    };
    let weights = root.join("drafters/weights/smollm2-135m").join(&kind);
    let options = Options {
        block_size: None,
        confidence_threshold: 0.0,
        linear_dtype: LinearDType::Stored,
        draft_vocab: VocabChoice::Full,
        device: dflash::DeviceChoice::Host,
    };
    let mut d = DFlash::new(WeightsSource::Path(weights), options)?;
    d.accept_target(&target).map_err(anyhow::Error::msg)?;
    let layers = d.capabilities(&target).tap_layers;
    let taps_req = |logits: Rows| ForwardRequest {
        logits,
        taps: layers.iter().map(|&l| TapId::Layer(l as usize)).collect(),
        tap_rows: Rows::All,
    };
    let cases: Vec<Value> = match &cases_file {
        // [{tag, prompt_ids, answer}]: the simulation's own answers (train/'s bench split).
        Some(f) => serde_json::from_str(&std::fs::read_to_string(f)?)?,
        None => {
            let twin: Value = serde_json::from_str(&std::fs::read_to_string(
                root.join("train/results/smollm2-135m/twin-drafts.json"),
            )?)?;
            twin["cases"].as_array().context("cases")?.clone()
        }
    };
    let mut session = 0u64;
    for case in &cases {
        let prompt = ids(&case["prompt_ids"]);
        if !case["answer"].is_null() {
            // The simulation: anchors walk the given answer from its first token.
            let mut seq = prompt.clone();
            seq.extend(ids(&case["answer"]));
            let out = model.prefill(&seq, &mut model.new_cache(), &taps_req(Rows::Last(0)))?;
            let t = rows_of(&out)?;
            for limit in [tokens, usize::MAX] {
                let end = seq.len().min(prompt.len().saturating_add(limit));
                let (mut a, mut acc, mut n, mut per) =
                    (prompt.len(), 0usize, 0usize, vec![0usize; k]);
                while a + 1 < end {
                    let tf = fresh_drafts(&mut d, &mut session, &seq, &t, a, k);
                    let ok = tf
                        .iter()
                        .zip(&seq[a + 1..end])
                        .take_while(|(x, y)| x == y)
                        .count();
                    for p in per.iter_mut().take(ok) {
                        *p += 1;
                    }
                    acc += ok;
                    n += 1;
                    a += ok + 1;
                }
                println!(
                    "{} sim {} over {} answer tokens: {n} rounds, tau {:.2}, accepted at 1..k {per:?}",
                    case["tag"].as_str().unwrap_or("?"),
                    if limit == usize::MAX { "whole" } else { "window" },
                    end - prompt.len(),
                    acc as f64 / n.max(1) as f64
                );
            }
            if sim_only {
                continue;
            }
        }
        // Live: prefill all but the pending id, Open, then rounds.
        let mut cache = model.new_cache();
        let p = prompt.len();
        let out = model.prefill(&prompt[..p - 1], &mut cache, &taps_req(Rows::Last(0)))?;
        let t = rows_of(&out)?;
        let flat: Vec<Vec<f32>> = t.iter().map(|l| l.concat()).collect();
        session += 1;
        let live = session;
        d.open(
            live,
            OpenArgs {
                prompt: &prompt,
                sampling: &SamplingSpec::greedy(),
                taps: Some(Taps::from_f32(0, (p - 1) as u32, &flat, None, &[])),
            },
        );
        let mut seq = prompt.clone();
        let mut rounds = Vec::new(); // (anchor pos, drafts, accepted)
        while seq.len() - p < tokens {
            let base = seq.len() - 1;
            let drafts = draft(&mut d, live, k);
            let mut rows = vec![seq[base]];
            rows.extend(&drafts);
            let out = model.forward(&rows, &mut cache, &taps_req(Rows::All))?;
            let argmax: Vec<u32> = out
                .logits
                .argmax(candle_core::D::Minus1)?
                .to_vec1::<u32>()?;
            let accepted = drafts
                .iter()
                .zip(&argmax)
                .take_while(|(a, b)| a == b)
                .count();
            cache.truncate(base + 1 + accepted)?;
            let mut committed = drafts[..accepted].to_vec();
            committed.push(argmax[accepted]);
            let t = rows_of(&out)?;
            let head: Vec<Vec<f32>> = t.iter().map(|l| l[..accepted + 1].concat()).collect();
            d.commit(
                live,
                CommitArgs {
                    drafted: drafts.len(),
                    accepted,
                    ids: &committed,
                    taps: Some(Taps::from_f32(
                        base as u64,
                        (accepted + 1) as u32,
                        &head,
                        None,
                        &[],
                    )),
                },
            );
            rounds.push((base, drafts, accepted));
            seq.extend(committed);
        }
        d.close(live);
        // Teacher-forced at the same anchors, taps of one forward over the whole sequence.
        let out = model.prefill(&seq, &mut model.new_cache(), &taps_req(Rows::Last(0)))?;
        let t = rows_of(&out)?;
        let (mut live_acc, mut tf_acc, mut differ) = (0usize, 0usize, 0usize);
        for (a, live_drafts, accepted) in &rounds {
            let a = *a;
            let tf = fresh_drafts(&mut d, &mut session, &seq, &t, a, k);
            let tf_ok = tf
                .iter()
                .zip(&seq[a + 1..])
                .take_while(|(x, y)| x == y)
                .count();
            live_acc += accepted;
            tf_acc += tf_ok;
            if &tf != live_drafts {
                differ += 1;
                println!(
                    "  pos {a}: live {live_drafts:?} (acc {accepted}) vs fresh {tf:?} (acc {tf_ok}); truth {:?}",
                    &seq[a + 1..(a + 1 + k).min(seq.len())]
                );
            }
        }
        let n = rounds.len() as f64;
        println!(
            "{} ({} prompt ids): {} rounds, live tau {:.2}, fresh tau {:.2}, {} rounds differ",
            case["tag"].as_str().unwrap_or("?"),
            p,
            rounds.len(),
            live_acc as f64 / n,
            tf_acc as f64 / n,
            differ
        );
    }
    Ok(())
}
