//! The compute floor of a burst's time to first token, and how close the engine's scheduler
//! gets to it (issue #13's "TTFT p99 at 8 streams ≤ 2× alone").
//!
//! N short chat prompts (the ones `scripts/load-test --sweep` sends) are admitted to one
//! [`Core`] together, with no HTTP in the way, and three times are taken (medians of `--reps`):
//!
//! | row | what |
//! |---|---|
//! | `floor` | one step with all N prompts admitted and a budget that holds all their rows: one forward over every prompt row (no scheduler can give the last stream its first token sooner without sharing rows) |
//! | `dedup floor` | one forward over the rows left when the prompts' common prefix runs once (a single prompt of that many rows): the floor with perfect prefix sharing |
//! | `engine` | the engine as configured (`--max-batch-tokens`), without and with in-flight prefix dedup (a prompt waits for the blocks an earlier one is computing and adopts them): the time until the last of the N has its first token, and the steps it took |
//!
//! each against the same measurement for one prompt alone. The prefix cache is off, so every
//! repetition starts cold (dedup shares blocks only while their writer holds them).
//!
//! ```sh
//! cargo run --release -p target-host --example burst -- --model models/cache/smollm2-135m.gguf --streams 8
//! ```

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use specula_models::chat::{ChatMessage, RenderOptions};
use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use target_host::engine::{Core, Counters, EngineConfig, Sink};
use target_host::generation::{
    Flow, Generation, GenerationError, GenerationRequest, Speculation, TokenEvent,
};
use target_host::proposer::ProposerSlot;

/// The prompts of `scripts/load-test --sweep`, in its order.
const PROMPTS: [&str; 4] = [
    "Write a short story about a robot who learns to paint, in three sentences.",
    "Explain in a few sentences why the sky is blue, for a ten year old.",
    "List five tips for writing clean Python code, one line each.",
    "Describe the water cycle in four short steps.",
];

/// Records when the first token came.
struct First(Arc<Mutex<Option<Instant>>>);

impl Sink for First {
    fn token(&mut self, _: TokenEvent<'_>) -> Flow {
        self.0
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(Instant::now);
        Flow::Continue
    }
    fn done(&mut self, _: Result<Generation, GenerationError>) {}
    fn is_closed(&self) -> bool {
        false
    }
}

struct Args {
    model: String,
    streams: usize,
    reps: usize,
    batch_tokens: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        model: "models/cache/smollm2-135m.gguf".into(),
        streams: 8,
        reps: 5,
        batch_tokens: EngineConfig::default().max_batch_tokens,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => a.model = value,
            "--streams" => a.streams = value.parse()?,
            "--reps" => a.reps = value.parse()?,
            "--max-batch-tokens" => a.batch_tokens = value.parse()?,
            _ => anyhow::bail!(
                "unknown flag {flag} (--model, --streams, --reps, --max-batch-tokens)"
            ),
        }
    }
    anyhow::ensure!(
        a.streams > 0 && a.reps > 0,
        "--streams and --reps must be positive"
    );
    Ok(a)
}

fn prompts(loaded: &LoadedModel, n: usize) -> Result<Vec<Vec<u32>>> {
    let template = loaded
        .chat_template
        .as_ref()
        .context("the model has no chat template")?;
    (0..n)
        .map(|i| {
            let msgs = [ChatMessage::new("user", PROMPTS[i % PROMPTS.len()])];
            Ok(template
                .render_prompt(&msgs, &RenderOptions::default())?
                .encode(&loaded.tokenizer)?)
        })
        .collect()
}

/// Rows left when every prompt's longest common prefix with an earlier prompt runs once.
fn unique_rows(prompts: &[Vec<u32>]) -> usize {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let shared = prompts[..i]
                .iter()
                .map(|q| p.iter().zip(q).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0);
            // The last prompt id always runs: its row samples the first token.
            p.len() - shared.min(p.len() - 1)
        })
        .sum()
}

/// Admits `prompts` together and steps until each has its first token: (ms, steps, rows run).
fn burst(
    loaded: &LoadedModel,
    prompts: &[Vec<u32>],
    batch_tokens: usize,
    prefix_dedup: bool,
) -> Result<(f64, usize, u64)> {
    let config = EngineConfig {
        max_running: prompts.len(),
        max_batch_tokens: batch_tokens.max(prompts.len()),
        prefix_cache_mib: 0,
        prefix_dedup,
        profile: false,
        ..EngineConfig::default()
    };
    let slot = ProposerSlot::new(None);
    let counters = Arc::new(Counters::default());
    let mut core = Core::with_counters(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        config,
        counters.clone(),
    )?;
    let firsts: Vec<_> = prompts.iter().map(|_| Arc::new(Mutex::new(None))).collect();
    for (i, p) in prompts.iter().enumerate() {
        let req = GenerationRequest {
            session: i as u64 + 1,
            prompt_ids: p.clone(),
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop: vec![],
            speculation: Speculation::Off,
            logprobs: None,
            grammar: None,
        };
        core.admit(req, Box::new(First(firsts[i].clone())))?;
    }
    let started = Instant::now();
    let mut steps = 0;
    while firsts
        .iter()
        .any(|f| f.lock().expect("not poisoned").is_none())
    {
        core.step()?;
        steps += 1;
        anyhow::ensure!(steps < 10_000, "the burst never finished");
    }
    let last = firsts
        .iter()
        .filter_map(|f| *f.lock().expect("not poisoned"))
        .max()
        .context("no first token")?;
    let rows = counters.snapshot().batch_rows;
    Ok((
        last.duration_since(started).as_secs_f64() * 1e3,
        steps,
        rows,
    ))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Median over `reps` of [`burst`], steps and rows of the last.
fn timed(
    loaded: &LoadedModel,
    prompts: &[Vec<u32>],
    batch: usize,
    prefix_dedup: bool,
    reps: usize,
) -> Result<(f64, usize, u64)> {
    let mut times = Vec::new();
    let (mut steps, mut rows) = (0, 0);
    for _ in 0..reps {
        let (ms, s, r) = burst(loaded, prompts, batch, prefix_dedup)?;
        times.push(ms);
        (steps, rows) = (s, r);
    }
    Ok((median(times), steps, rows))
}

fn main() -> Result<()> {
    let a = args()?;
    let loaded = load(std::path::Path::new(&a.model), &LoadOptions::default())?;
    let all = prompts(&loaded, a.streams)?;
    let one = &all[..1];
    let rows: usize = all.iter().map(Vec::len).sum();
    let unique = unique_rows(&all);
    // Warm-up: first allocations and page faults.
    burst(&loaded, &all, rows, false)?;
    let (alone, _, _) = timed(&loaded, one, rows, false, a.reps)?;
    let (floor, _, _) = timed(&loaded, &all, rows, false, a.reps)?;
    let synthetic: Vec<u32> = all.iter().flatten().copied().take(unique).collect();
    let (dedup, _, _) = timed(&loaded, &[synthetic], rows, false, a.reps)?;
    let (plain, plain_steps, plain_rows) = timed(&loaded, &all, a.batch_tokens, false, a.reps)?;
    let (engine, steps, engine_rows) = timed(&loaded, &all, a.batch_tokens, true, a.reps)?;
    println!(
        "# burst: {}, {} prompts of {} rows in all ({} after their common prefixes; one alone: {} rows), medians of {}",
        loaded.model.weights_path().display(),
        a.streams,
        rows,
        unique,
        one[0].len(),
        a.reps
    );
    println!("| what | last first token ms | × one prompt alone | steps | rows run |");
    println!("|---|---|---|---|---|");
    println!(
        "| one prompt alone | {alone:.1} | 1.00 | 1 | {} |",
        one[0].len()
    );
    println!(
        "| floor: one forward over all {rows} rows | {floor:.1} | {:.2} | 1 | {rows} |",
        floor / alone
    );
    println!(
        "| dedup floor: one forward over {unique} rows | {dedup:.1} | {:.2} | 1 | {unique} |",
        dedup / alone
    );
    println!(
        "| engine, --max-batch-tokens {} --no-prefix-dedup | {plain:.1} | {:.2} | {plain_steps} | {plain_rows} |",
        a.batch_tokens,
        plain / alone
    );
    println!(
        "| engine, --max-batch-tokens {} (in-flight prefix dedup) | {engine:.1} | {:.2} | {steps} | {engine_rows} |",
        a.batch_tokens,
        engine / alone
    );
    Ok(())
}
