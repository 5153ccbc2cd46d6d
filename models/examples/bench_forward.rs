//! Forward-pass timing of a model: prefill tokens/s at several prompt lengths, decode tokens/s,
//! and the cost of a k-token chunk relative to a single-token step (what speculative
//! verification pays per draft length), on the SIMD path it names (`SPECULA_ISA` forces one).
//!
//! ```text
//! cargo run --release -p specula-models --example bench_forward -- \
//!     --model models/cache/smollm2-135m.gguf --dtype native --prefill 128,512,2048
//! SPECULA_ISA=avx2 target/release/examples/bench_forward --model ...   # another path
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use specula_models::layers::simd::Isa;
use specula_models::{load_model, ForwardRequest, LoadOptions, Model, WeightDType};

#[derive(Parser)]
struct Args {
    /// A .gguf file or HF directory.
    #[arg(long)]
    model: PathBuf,
    /// native | f32 | f16 | bf16
    #[arg(long, default_value = "native")]
    dtype: String,
    /// Context length before timing decode and chunks.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Prompt lengths whose prefill is timed (median of `--prefill-runs`, in the model's
    /// prefill chunks); empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "")]
    prefill: Vec<usize>,
    /// Runs per prefill length.
    #[arg(long, default_value_t = 3)]
    prefill_runs: usize,
    /// Tokens generated per decode run.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Runs per measurement (median reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Chunk sizes timed after decoding (the first is the base of the ratios).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    chunks: Vec<usize>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Deterministic token ids spread over the vocabulary.
fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dtype: WeightDType = args.dtype.parse()?;
    let opts = LoadOptions {
        dtype,
        ..Default::default()
    };
    let t = Instant::now();
    let model: Model = load_model(&args.model, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    println!(
        "loaded {} ({dtype:?}) in {:.2}s",
        args.model.display(),
        t.elapsed().as_secs_f64()
    );
    println!(
        "simd path: {} (of {}; threads {})",
        Isa::selected()?,
        Isa::available()
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(", "),
        rayon::current_num_threads()
    );
    let vocab = model.config().vocab_size;
    for &n in &args.prefill {
        let prompt = tokens(n, vocab);
        let mut secs = Vec::new();
        for _ in 0..args.prefill_runs.max(1) {
            let mut cache = model.new_cache();
            let t = Instant::now();
            model.prefill(&prompt, &mut cache, &ForwardRequest::default())?;
            secs.push(t.elapsed().as_secs_f64());
        }
        let s = median(secs);
        println!(
            "prefill {n:>5} tokens: median {s:.3}s ({:.1} tok/s, {} runs)",
            n as f64 / s,
            args.prefill_runs.max(1)
        );
    }
    let prompt = tokens(args.context, vocab);
    let mut cache = model.new_cache();
    let t = Instant::now();
    model.prefill(&prompt, &mut cache, &ForwardRequest::default())?;
    let prefill_s = t.elapsed().as_secs_f64();
    println!(
        "prefill {} tokens: {:.3}s ({:.1} tok/s)",
        args.context,
        prefill_s,
        args.context as f64 / prefill_s
    );

    if args.decode > 0 {
        let mut rates = Vec::new();
        for _ in 0..args.runs {
            let t = Instant::now();
            for tok in tokens(args.decode, vocab) {
                model.forward(&[tok], &mut cache, &ForwardRequest::default())?;
            }
            rates.push(args.decode as f64 / t.elapsed().as_secs_f64());
            cache.truncate(args.context)?;
        }
        println!(
            "decode: {:.1} tok/s (median of {} runs of {})",
            median(rates),
            args.runs,
            args.decode
        );
    }

    // Sizes alternate within each repetition (1 2 4 8 16 1 2 ...) so that load drift on a
    // shared machine hits every size alike; the ratios are the point.
    let mut times = vec![Vec::new(); args.chunks.len()];
    for _ in 0..args.runs.max(3) * 2 {
        for (&k, times) in args.chunks.iter().zip(&mut times) {
            let req = ForwardRequest {
                logits: specula_models::Rows::Last(k),
                ..Default::default()
            };
            let t = Instant::now();
            model.forward(&tokens(k, vocab), &mut cache, &req)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            cache.trim(k)?;
        }
    }
    // The minimum is the run least disturbed by other processes: on a loaded machine its
    // ratios are the steadier ones.
    let mut base = None;
    for (&k, times) in args.chunks.iter().zip(times) {
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        let ms = median(times);
        let (b_med, b_min) = *base.get_or_insert((ms, min));
        println!(
            "chunk {k:>2} @ ctx {}: median {ms:7.2} ms (ratio {:.2})  min {min:7.2} ms (ratio {:.2})",
            args.context,
            ms / b_med,
            min / b_min
        );
    }
    Ok(())
}
