//! The cost of one drafter round (a `Draft` of k ids plus the `Commit` of the verified rows'
//! taps) on the SmolLM2-135M target, for several drafter configurations A/B in one process:
//! configurations take turns in blocks of rounds, so machine drift hits them alike. Prints per
//! configuration the CPU milliseconds per round (process user + system time, all threads:
//! run with `RAYON_NUM_THREADS=1` for a single-core figure) and the median wall time of the
//! draft and of the commit.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run --release -p dflash --example bench_round -- \
//!     --k 4 --rounds 200 dflash:off dflash:shipped dflash:4096 dspark:shipped:q8_0
//! ```
//!
//! A configuration is `KIND[:VOCAB[:LINEARS[:BLOCK]]]`: KIND `dflash` or `dspark`, VOCAB a
//! `--draft-vocab` value (default `shipped`), LINEARS a `--linear-dtype` (default `stored`),
//! BLOCK a `--block-size` (default the checkpoint's). The taps are random
//! (speed does not depend on their values); each round commits `accepted = round % (k + 1)`
//! drafts, so the context grows as in a real request.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use dflash::{DFlash, LinearDType, Options, VocabChoice, WeightsSource};
use rand::{Rng, SeedableRng};
use specula_protocol::sdk::{CommitArgs, DraftAsk, Drafter, OpenArgs, Taps};
use specula_protocol::wire::{SamplingSpec, TargetInfo};

const HIDDEN: usize = 576;

struct Config {
    name: String,
    drafter: DFlash,
    taps: usize,
    /// Tap windows of 1..=k + 1 rows (index rows − 1): made once, outside the measurement.
    windows: Vec<(Vec<Vec<f32>>, Vec<f32>)>,
    cpu_ticks: u64,
    rounds: usize,
    draft_us: Vec<f64>,
    commit_us: Vec<f64>,
    pos: usize,
}

/// Process CPU time (user + system) in clock ticks (`/proc/self/stat` fields 14 and 15).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name start at field 3 (the state).
    let after: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, r)| r)
        .split_whitespace()
        .collect();
    let field = |n: usize| {
        after
            .get(n - 3)
            .and_then(|x| x.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<()> {
    let mut k = 4usize;
    let mut rounds = 200usize;
    let mut ctx = 160usize;
    let mut specs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<usize> {
            args.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| format!("{name} needs a number"))
        };
        match a.as_str() {
            "--k" => k = value("--k")?,
            "--rounds" => rounds = value("--rounds")?,
            "--ctx" => ctx = value("--ctx")?,
            _ => specs.push(a),
        }
    }
    if specs.is_empty() {
        specs = vec!["dflash:off".into(), "dflash:shipped".into()];
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gguf = root.join("models/cache/smollm2-135m.gguf");
    if !gguf.is_file() {
        bail!(
            "{} is missing: run scripts/fetch-model smollm2-135m",
            gguf.display()
        );
    }
    let target = TargetInfo {
        architecture: "llama".into(),
        vocab_size: 49152,
        hidden_size: HIDDEN as u32,
        num_layers: 30,
        num_kv_heads: 3,
        head_dim: 64,
        weights_path: gguf.display().to_string(),
        context_len: 8192,
        ..TargetInfo::default()
    };
    let mut configs = Vec::new();
    for spec in &specs {
        let mut parts = spec.split(':');
        let kind = parts.next().unwrap_or("dflash").to_string();
        let vocab: VocabChoice = parts
            .next()
            .unwrap_or("shipped")
            .parse()
            .map_err(anyhow::Error::msg)?;
        let linear_dtype: LinearDType = parts
            .next()
            .unwrap_or("stored")
            .parse()
            .map_err(anyhow::Error::msg)?;
        let block_size = match parts.next() {
            None => None,
            Some(b) => Some(b.parse::<usize>().context("BLOCK must be a number")?),
        };
        let weights = root.join("drafters/weights/smollm2-135m").join(&kind);
        let options = Options {
            draft_vocab: vocab,
            linear_dtype,
            block_size,
            ..Options::default()
        };
        let mut drafter = DFlash::new(WeightsSource::Path(weights), options)?;
        drafter.load(&target)?;
        let caps = drafter.capabilities(&target);
        let taps = caps.tap_layers.len();
        configs.push(Config {
            name: spec.clone(),
            drafter,
            taps,
            windows: Vec::new(),
            cpu_ticks: 0,
            rounds: 0,
            draft_us: Vec::new(),
            commit_us: Vec::new(),
            pos: 0,
        });
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut random_taps = |rows: usize, n: usize| -> Vec<Vec<f32>> {
        (0..n)
            .map(|_| {
                (0..rows * HIDDEN)
                    .map(|_| rng.random_range(-2.0..2.0))
                    .collect()
            })
            .collect()
    };
    let sampling = SamplingSpec::greedy();
    let prompt: Vec<u32> = (0..ctx as u32 + 1).map(|i| 100 + i % 1000).collect();
    for c in &mut configs {
        let layers = random_taps(ctx, c.taps);
        let final_hidden = random_taps(ctx, 1).pop();
        let taps = Taps::from_f32(0, ctx as u32, &layers, final_hidden.as_deref(), &[]);
        let args = OpenArgs {
            prompt: &prompt,
            sampling: &sampling,
            taps: Some(taps),
        };
        c.drafter.open(1, args);
        c.pos = ctx;
        c.windows = (1..=k + 1)
            .map(|rows| (random_taps(rows, c.taps), random_taps(rows, 1).remove(0)))
            .collect();
    }
    const BLOCK: usize = 10;
    for start in (0..rounds).step_by(BLOCK) {
        for c in &mut configs {
            let ticks = cpu_ticks();
            for r in start..(start + BLOCK).min(rounds) {
                let t = Instant::now();
                let ask = DraftAsk {
                    session: 1,
                    new_tokens: &[],
                    n: k,
                    donors: None,
                };
                let proposal = c.drafter.draft_batch(&[ask]).pop().unwrap_or_default();
                c.draft_us.push(t.elapsed().as_secs_f64() * 1e6);
                let accepted = (r % (k + 1)).min(proposal.tokens.len());
                let mut ids = proposal.tokens[..accepted].to_vec();
                ids.push(100 + r as u32);
                let rows = ids.len();
                let (layers, final_hidden) = &c.windows[rows - 1];
                let taps =
                    Taps::from_f32(c.pos as u64, rows as u32, layers, Some(final_hidden), &[]);
                let t = Instant::now();
                let args = CommitArgs {
                    drafted: proposal.tokens.len(),
                    accepted,
                    ids: &ids,
                    taps: Some(taps),
                };
                c.drafter.commit(1, args);
                c.commit_us.push(t.elapsed().as_secs_f64() * 1e6);
                c.pos += rows;
                c.rounds += 1;
            }
            c.cpu_ticks += cpu_ticks() - ticks;
        }
    }
    // Clock ticks are 10 ms on Linux (USER_HZ = 100).
    println!("k {k}, {rounds} rounds from a context of {ctx}");
    println!("| configuration | CPU ms/round | draft µs p50 | commit µs p50 |");
    println!("|---|---|---|---|");
    for c in &mut configs {
        let cpu_ms = c.cpu_ticks as f64 * 10.0 / c.rounds.max(1) as f64;
        println!(
            "| {} | {:.2} | {:.0} | {:.0} |",
            c.name,
            cpu_ms,
            median(&mut c.draft_us),
            median(&mut c.commit_us)
        );
    }
    Ok(())
}
