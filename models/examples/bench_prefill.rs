//! Prefill throughput at given prompt lengths (median of several runs, a fresh cache each),
//! for A/B runs of two builds on one machine: it uses only the API both sides of an attention
//! change share.
//!
//! ```text
//! cargo run --release -p specula-models --example bench_prefill -- \
//!     --model models/cache/smollm2-135m.gguf --lengths 128,512,2048
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use specula_models::{load_model, ForwardRequest, LoadOptions, WeightDType};

#[derive(Parser)]
struct Args {
    /// A .gguf file or HF directory.
    #[arg(long)]
    model: PathBuf,
    /// native | f32 | f16 | bf16
    #[arg(long, default_value = "native")]
    dtype: String,
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    lengths: Vec<usize>,
    /// Runs per length (median reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Label printed on every line (e.g. the branch).
    #[arg(long, default_value = "")]
    label: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let opts = LoadOptions {
        dtype: args.dtype.parse::<WeightDType>()?,
        ..Default::default()
    };
    let model = load_model(&args.model, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let vocab = model.config().vocab_size;
    for &n in &args.lengths {
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let mut secs = Vec::with_capacity(args.runs);
        for _ in 0..args.runs {
            let mut cache = model.new_cache();
            let t = Instant::now();
            model.prefill(&prompt, &mut cache, &ForwardRequest::default())?;
            secs.push(t.elapsed().as_secs_f64());
        }
        secs.sort_by(f64::total_cmp);
        let med = secs[secs.len() / 2];
        println!(
            "{} prefill {n:>5} tokens: {med:.3}s median of {} ({:.1} tok/s)",
            args.label,
            args.runs,
            n as f64 / med
        );
    }
    Ok(())
}
