//! Speculation benchmark: plain decoding vs the n-gram drafter out of process (a real drafter
//! process over IPC) vs the same n-gram logic in process, on an echo-heavy prompt, in one run.
//!
//! ```text
//! cargo build --release -p target-host -p ngram --examples --bins
//! target/release/examples/bench_spec --model smollm2-135m --dtype native --reps 5
//! ```
//!
//! Configurations alternate (A B C A B C ...) so machine drift cancels; medians are reported,
//! with ratios against plain decoding from the same run.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use ngram::{NgramConfig, NgramDrafter};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use target_host::drafter::InProcess;
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec};
use target_host::drafter_args::target_info;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation, Target};
use target_host::models::{load_model, ModelArgs};
use target_host::proposer::{Proposer, ProposerSlot, Shared};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Repetitions of each configuration.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Tokens per generation.
    #[arg(long, default_value_t = 160)]
    max_tokens: usize,
    /// Drafts per round.
    #[arg(long, default_value_t = 8)]
    k: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

const PROMPT: &str = "Rewrite this Python code so that the function is called `mean_of` instead of \
`average`. Change nothing else and print the whole code.\n\n```python\nimport math\n\n\
def average(values):\n    \"\"\"Return the arithmetic mean of a list of numbers.\"\"\"\n    if not values:\n        \
raise ValueError(\"values must not be empty\")\n    total = 0.0\n    for v in values:\n        total += v\n    \
return total / len(values)\n\n\ndef spread(values):\n    m = average(values)\n    return math.sqrt(sum((v - m) ** 2 \
for v in values) / len(values))\n\n\nif __name__ == \"__main__\":\n    data = [3, 1, 4, 1, 5, 9, 2, 6]\n    \
print(average(data), spread(data))\n```\n";

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let loaded = load_model(&args.model)?;
    let template = loaded
        .chat_template
        .as_ref()
        .context("model has no chat template")?;
    let text = template.render(&[ChatMessage::new("user", PROMPT)], GenerationPrompt::Add)?;
    let prompt_ids = loaded.tokenizer.encode(&text, Special::Parse)?;
    let exe_dir = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(PathBuf::from)
        .context("binary folder")?;
    let client = DrafterClient::start(
        DrafterSpec::new(exe_dir.join("ngram")),
        target_info(&loaded.model, &loaded.tokenizer),
        ClientConfig {
            draft_deadline: Duration::from_millis(500),
            ..ClientConfig::default()
        },
    )?;
    let (shared, client) = Shared::new(client);
    let slots = [
        ("plain", ProposerSlot::new(None)),
        (
            "ngram out-of-process",
            ProposerSlot::new(Some(Box::new(shared))),
        ),
        (
            "ngram in-process",
            ProposerSlot::new(Some(Box::new(InProcess::new(NgramDrafter::new(
                NgramConfig::default(),
                16,
            ))) as Box<dyn Proposer>)),
        ),
    ];
    let target = Target {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
    };
    let mut cache = loaded.model.new_cache();
    let run = |slot: &ProposerSlot, cache: &mut _, spec: bool| -> Result<Generation> {
        let req = GenerationRequest {
            session: 1,
            prompt_ids: prompt_ids.clone(),
            max_tokens: args.max_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            speculation: if spec {
                Speculation::On {
                    num_draft_tokens: args.k,
                }
            } else {
                Speculation::Off
            },
            logprobs: None,
        };
        generate(&target, cache, slot, &req, &mut |_| Flow::Continue)
    };
    // Warm-up: page the weights in and start the drafter's caches.
    for (i, (_, slot)) in slots.iter().enumerate() {
        run(slot, &mut cache, i > 0)?;
    }
    let mut results: Vec<Vec<Generation>> = vec![Vec::new(); slots.len()];
    for rep in 0..args.reps {
        for (i, (name, slot)) in slots.iter().enumerate() {
            let g = run(slot, &mut cache, i > 0)?;
            eprintln!("rep {rep} {name}: {:.1} tok/s", g.stats.decode_tokens_per_s);
            results[i].push(g);
        }
    }
    let plain_ids = &results[0][0].token_ids;
    let mut plain_tps = results[0]
        .iter()
        .map(|g| g.stats.decode_tokens_per_s)
        .collect::<Vec<_>>();
    let plain_med = median(&mut plain_tps);
    println!(
        "model {} dtype {}, prompt {} tokens, {} generated, k = {}, {} reps (medians)",
        args.model.model.as_deref().unwrap_or("smollm2-135m"),
        args.model.dtype,
        prompt_ids.len(),
        plain_ids.len(),
        args.k,
        args.reps
    );
    println!(
        "| config | tok/s | min–max | ratio vs plain | acceptance | accepted/round | same output |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for (i, (name, _)) in slots.iter().enumerate() {
        let gens = &results[i];
        let mut tps: Vec<f64> = gens.iter().map(|g| g.stats.decode_tokens_per_s).collect();
        let (lo, hi) = (
            tps.iter().copied().fold(f64::MAX, f64::min),
            tps.iter().copied().fold(0.0, f64::max),
        );
        let med = median(&mut tps);
        let s = &gens[0].stats;
        let same = gens.iter().all(|g| &g.token_ids == plain_ids);
        println!(
            "| {name} | {med:.1} | {lo:.1}–{hi:.1} | {:.2}x | {:.1}% | {:.2} | {same} |",
            med / plain_med,
            100.0 * s.acceptance_rate,
            s.mean_accepted_per_round
        );
        json.push(serde_json::json!({
            "config": name, "tokens_per_s": med, "min": lo, "max": hi,
            "ratio": med / plain_med, "acceptance_rate": s.acceptance_rate,
            "mean_accepted_per_round": s.mean_accepted_per_round, "same_output": same,
        }));
    }
    let stats = client
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .stats();
    let p = |q| {
        stats
            .rtt_percentile(q)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    println!(
        "IPC round trip (draft → drafted), {} requests: p50 {:.0} µs, p99 {:.0} µs; deadline misses {}",
        stats.requests,
        p(0.5),
        p(0.99),
        stats.deadline_misses
    );
    if let Some(out) = &args.out {
        let rtt =
            serde_json::json!({"p50_us": p(0.5), "p99_us": p(0.99), "requests": stats.requests});
        std::fs::write(
            out,
            serde_json::to_string_pretty(&serde_json::json!({"configs": json, "rtt": rtt}))?,
        )?;
    }
    Ok(())
}
