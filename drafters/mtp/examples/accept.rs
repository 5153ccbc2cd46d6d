//! First- and second-token acceptance of an MTP head on a real target, per workload, measured
//! the way train's `evaluate.py` measures its twin: the target continues each prompt greedily,
//! and at every position t of the answer the drafter (fed as the host feeds it: `Open` on the
//! prompt, then one `Commit` per token with that row's final-norm hidden) drafts two ids; the
//! first is accepted when it is token t+2, the second (counted only after an accepted first) when
//! it is t+3. This is exactly the drafts a greedy verify loop would see at k = 1 after every
//! round, and at k = 2 after a round that ended at t, without the loop's timing.
//!
//! ```text
//! cargo run -p mtp --example accept -- --dtype native --new 128
//! cargo run -p mtp --example accept -- --dtype f32 --json out.json
//! ```
//! Head: `--weights DIR` (default: the shipped SmolLM2 head). Prompts: the bench prompts of `tests/fixtures/mtp/twin-chain.json` (ids as `serve` encodes
//! them through the chat template; the same prompts as `bench/workloads/default.jsonl`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mtp::feed::{target_info, HostFeed};
use mtp::{LinearDType, MtpDrafter, Options, WeightsSource};
use serde_json::{json, Value};
use specula_models::drafter_support::draft_vocab::VocabChoice;
use specula_models::loader::{load, LoadOptions};
use specula_models::{ForwardRequest, Rows, TapId, WeightDType};
use specula_protocol::sdk::Drafter;

struct Args {
    model: PathBuf,
    dtype: WeightDType,
    new: usize,
    prompts: PathBuf,
    weights: PathBuf,
    json: Option<PathBuf>,
    linear_dtype: LinearDType,
    draft_vocab: VocabChoice,
}

fn args() -> Result<Args> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut a = Args {
        model: root.join("models/cache/smollm2-135m.gguf"),
        dtype: WeightDType::Native,
        new: 128,
        prompts: root.join("tests/fixtures/mtp/twin-chain.json"),
        weights: root.join("drafters/weights/smollm2-135m/mtp"),
        json: None,
        linear_dtype: LinearDType::Stored,
        draft_vocab: VocabChoice::Full,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = val()?.into(),
            "--dtype" => {
                a.dtype = match val()?.as_str() {
                    "native" => WeightDType::Native,
                    "f32" => WeightDType::F32,
                    other => bail!("--dtype {other}: native or f32"),
                }
            }
            "--new" => a.new = val()?.parse().context("--new")?,
            "--prompts" => a.prompts = val()?.into(),
            "--weights" => a.weights = val()?.into(),
            "--json" => a.json = Some(val()?.into()),
            "--draft-vocab" => a.draft_vocab = val()?.parse().map_err(anyhow::Error::msg)?,
            "--linear-dtype" => {
                a.linear_dtype = match val()?.as_str() {
                    "stored" => LinearDType::Stored,
                    "q8_0" => LinearDType::Q8_0,
                    other => bail!("--linear-dtype {other}: stored or q8_0"),
                }
            }
            other => bail!(
                "unknown argument {other} (--model, --dtype, --new, --prompts, --weights, --json, --linear-dtype, --draft-vocab)"
            ),
        }
    }
    Ok(a)
}

/// first ok, first n, second ok, second n, draft seconds.
#[derive(Default, Clone, Copy)]
struct Tally([f64; 5]);

fn main() -> Result<()> {
    let a = args()?;
    let opts = LoadOptions {
        dtype: a.dtype,
        ..Default::default()
    };
    let loaded = load(&a.model, &opts).with_context(|| format!("load {}", a.model.display()))?;
    let (model, eos) = (&loaded.model, loaded.tokenizer.eos_ids().to_vec());
    let c = model.config();
    let target = target_info(c, &a.model, model.context_len());
    let source = WeightsSource::Path(a.weights.clone());
    let mut d = MtpDrafter::new(
        source,
        Options {
            max_draft: 2,
            linear_dtype: a.linear_dtype,
            draft_vocab: a.draft_vocab,
            // Every position drafts: the confidences are binned below instead.
            min_confidence: 0.0,
        },
    )?;
    d.accept_target(&target).map_err(anyhow::Error::msg)?;
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&a.prompts)?)?;
    let hidden = c.hidden_size;
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    // First drafts by confidence decile: [drafted, accepted].
    let mut bins = [[0.0f64; 2]; 10];
    let cases = fixture["cases"].as_array().context("cases")?;
    for (session, case) in (1..).zip(cases) {
        let tag = case["tag"].as_str().context("tag")?.to_string();
        let prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .context("prompt_ids")?
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect();
        // The target's greedy answer and the final-norm hidden of every row.
        let req = ForwardRequest {
            logits: Rows::Last(1),
            taps: vec![TapId::FinalNorm],
            tap_rows: Rows::All,
        };
        let mut cache = model.new_cache();
        let (mut seq, mut h) = (prompt.clone(), Vec::<f32>::new());
        let mut input = prompt.clone();
        while seq.len() < prompt.len() + a.new {
            let out = model.forward(&input, &mut cache, &req)?;
            h.extend(out.taps[0].1.flatten_all()?.to_vec1::<f32>()?);
            let next = out.logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?;
            seq.push(next);
            if eos.contains(&next) {
                break;
            }
            input = vec![next];
        }
        // h holds rows 0..seq.len()-1 (the last id is pending).
        let feed = HostFeed {
            seq: &seq,
            hiddens: &h,
            hidden,
        };
        let pending = prompt.len();
        feed.open(&mut d, session, pending);
        let mut t_case = Tally::default();
        // The last window row is at t; its drafts are tokens t+2 and t+3.
        for t in pending - 1..seq.len().saturating_sub(2) {
            if t >= pending {
                feed.commit(&mut d, session, t, 1);
            }
            let start = Instant::now();
            let proposal = d.draft(session, &[], 2);
            t_case.0[4] += start.elapsed().as_secs_f64();
            let got = proposal.tokens;
            let hit = got.first() == Some(&seq[t + 2]);
            if let Some(&c) = proposal.confidence.as_ref().and_then(|c| c.first()) {
                let bin = &mut bins[((c * 10.0) as usize).min(9)];
                bin[0] += 1.0;
                bin[1] += f64::from(u8::from(hit));
            }
            t_case.0[0] += f64::from(u8::from(hit));
            t_case.0[1] += 1.0;
            if hit && t + 3 < seq.len() {
                t_case.0[2] += f64::from(u8::from(got.get(1) == Some(&seq[t + 3])));
                t_case.0[3] += 1.0;
            }
        }
        d.close(session);
        for key in [tag.clone(), "all".into()] {
            let s = tally.entry(key).or_default();
            for (x, y) in s.0.iter_mut().zip(t_case.0) {
                *x += y;
            }
        }
        eprintln!(
            "{tag}: {} answer tokens, first {:.3}",
            seq.len() - prompt.len(),
            t_case.0[0] / t_case.0[1].max(1.0)
        );
    }
    let dtype = format!("{:?}", a.dtype).to_lowercase();
    println!(
        "target {} ({dtype}), up to {} new tokens",
        a.model.display(),
        a.new
    );
    println!("workload        positions  1st    2nd|1st  tau(k2, excl bonus)  ms/draft(k2)");
    let mut doc = serde_json::Map::new();
    for (tag, Tally(s)) in &tally {
        let first = s[0] / s[1].max(1.0);
        let second = s[2] / s[3].max(1.0);
        let tau = (s[0] + s[2]) / s[1].max(1.0);
        let ms = 1e3 * s[4] / s[1].max(1.0);
        println!(
            "{tag:<15} {:>9}  {first:.3}  {second:.3}    {tau:.3}                {ms:.2}",
            s[1]
        );
        doc.insert(
            tag.clone(),
            json!({"positions": s[1], "first_token_acceptance": first,
                   "second_token_acceptance_given_first": second, "tau_excl_bonus_k2": tau,
                   "draft_ms_k2": ms}),
        );
    }
    // What a `--min-confidence` T would keep of the first drafts (k = 1 rounds).
    println!("first-draft confidence  drafts  accepted");
    for (i, [n, hit]) in bins.iter().enumerate() {
        println!(
            "{:.1}..{:.1}                {n:>6}  {:.3}",
            i as f64 / 10.0,
            (i + 1) as f64 / 10.0,
            hit / n.max(1.0)
        );
    }
    let total: f64 = bins.iter().map(|b| b[0]).sum();
    println!("min-confidence  drafted  accepted of drafted  accepted per position");
    for t in 1..=6 {
        let kept = &bins[t..];
        let (n, hit): (f64, f64) = kept
            .iter()
            .fold((0.0, 0.0), |a, b| (a.0 + b[0], a.1 + b[1]));
        println!(
            "{:.1}             {:.3}    {:.3}                {:.3}",
            t as f64 / 10.0,
            n / total.max(1.0),
            hit / n.max(1.0),
            hit / total.max(1.0)
        );
    }
    if let Some(path) = &a.json {
        let out = json!({"target": a.model.display().to_string(), "dtype": dtype,
                         "new_tokens": a.new, "workloads": doc});
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}
