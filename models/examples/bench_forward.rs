//! Forward-pass timing of a model: prefill tokens/s at several prompt lengths, decode tokens/s,
//! the cost of a k-token chunk relative to a single-token step (what speculative
//! verification pays per draft length) and of one decode row for each of s sequences in one
//! packed forward (what the batched engine pays per stream), on the SIMD path it names
//! (`SPECULA_ISA` forces one).
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
use specula_models::{
    load_model, Batch, ForwardRequest, LoadOptions, Model, Rows, SeqRows, WeightDType,
};

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
    /// prefill chunks); none when the flag is left out.
    #[arg(long, value_delimiter = ',')]
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
    /// Sequence counts timed as one packed forward of one decode row each, every sequence at
    /// `--context` (ratios against a one-row step of one sequence); none when the flag is left
    /// out.
    #[arg(long, value_delimiter = ',')]
    seqs: Vec<usize>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// CPU time of all this process's threads in ms (Linux `schedstat`, ns resolution), or 0
/// elsewhere. On a machine shared with other jobs it counts only our own work, which makes
/// A/B comparisons steadier than wall time (run with `RAYON_NUM_THREADS=1` so that no
/// worker spins waiting).
fn cpu_ms() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e6
}

/// Deterministic token ids spread over the vocabulary.
fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

fn main() -> anyhow::Result<()> {
    // As target-host runs (the comparison with llama-bench is of what users get).
    specula_models::alloc::keep_freed_memory();
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
        let (mut secs, mut cpu) = (Vec::new(), Vec::new());
        for _ in 0..args.prefill_runs.max(1) {
            let mut cache = model.new_cache();
            let (t, c) = (Instant::now(), cpu_ms());
            model.prefill(&prompt, &mut cache, &ForwardRequest::default())?;
            secs.push(t.elapsed().as_secs_f64());
            cpu.push((cpu_ms() - c) / 1e3);
        }
        let (s, c) = (median(secs), median(cpu));
        println!(
            "prefill {n:>5} tokens: median {s:.3}s ({:.1} tok/s; cpu {c:.3}s, {:.1} tok/cpu-s; {} runs)",
            n as f64 / s,
            n as f64 / c,
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
    let mut cpu = vec![Vec::new(); args.chunks.len()];
    for _ in 0..args.runs.max(3) * 2 {
        for ((&k, times), cpu) in args.chunks.iter().zip(&mut times).zip(&mut cpu) {
            let req = ForwardRequest {
                logits: specula_models::Rows::Last(k),
                ..Default::default()
            };
            let (t, c) = (Instant::now(), cpu_ms());
            model.forward(&tokens(k, vocab), &mut cache, &req)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            cpu.push(cpu_ms() - c);
            cache.trim(k)?;
        }
    }
    let labels = args.chunks.iter().map(|k| format!("chunk {k:>2}"));
    print_curve(labels, args.context, times, cpu);
    if !args.seqs.is_empty() {
        seqs(&model, &args, &prompt)?;
    }
    Ok(())
}

/// One decode row for each of `s` sequences (all at `--context`, distinct contexts) in one
/// packed forward, for each `s` of `--seqs`, alternated like the chunks; the ratio is against
/// `s = 1`.
fn seqs(model: &Model, args: &Args, prompt: &[u32]) -> anyhow::Result<()> {
    let vocab = model.config().vocab_size;
    let most = args.seqs.iter().copied().max().unwrap_or(1);
    let blocks = most * args.context.div_ceil(specula_models::kv_pool::BLOCK_SIZE) + most * 2;
    let mut pool = model.new_pool(blocks)?;
    let mut ids = Vec::with_capacity(most);
    for i in 0..most {
        let seq = pool.create();
        // Each sequence its own context: rotate the prompt's ids.
        let ctx: Vec<u32> = prompt
            .iter()
            .map(|&t| (t + i as u32) % vocab as u32)
            .collect();
        let batch = Batch {
            seqs: vec![SeqRows {
                seq,
                tokens: ctx,
                logits: Rows::Last(0),
                taps: Rows::Last(0),
            }],
            taps: Vec::new(),
        };
        model.forward_batch(&batch, &mut pool)?;
        ids.push(seq);
    }
    let mut times = vec![Vec::new(); args.seqs.len()];
    let mut cpu = vec![Vec::new(); args.seqs.len()];
    for rep in 0..args.runs.max(3) * 2 {
        for ((&s, times), cpu) in args.seqs.iter().zip(&mut times).zip(&mut cpu) {
            let batch = Batch {
                seqs: ids[..s]
                    .iter()
                    .enumerate()
                    .map(|(i, &seq)| SeqRows {
                        seq,
                        tokens: vec![((rep * 31 + i * 7) % vocab) as u32],
                        logits: Rows::Last(1),
                        taps: Rows::Last(0),
                    })
                    .collect(),
                taps: Vec::new(),
            };
            let (t, c) = (Instant::now(), cpu_ms());
            model.forward_batch(&batch, &mut pool)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            cpu.push(cpu_ms() - c);
            for &seq in &ids[..s] {
                pool.truncate(seq, args.context)?;
            }
        }
    }
    let labels = args.seqs.iter().map(|s| format!("seqs  {s:>2} x 1 row"));
    print_curve(labels, args.context, times, cpu);
    Ok(())
}

/// One line per point of a curve: median, minimum and CPU time, each with its ratio to the
/// first point's. The minimum is the run least disturbed by other processes: on a loaded
/// machine its ratios are the steadier ones.
fn print_curve(
    labels: impl Iterator<Item = String>,
    context: usize,
    times: Vec<Vec<f64>>,
    cpu: Vec<Vec<f64>>,
) {
    let mut base = None;
    for ((label, times), cpu) in labels.zip(times).zip(cpu) {
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        let (ms, cpu) = (median(times), median(cpu));
        let (b_med, b_min, b_cpu) = *base.get_or_insert((ms, min, cpu));
        println!(
            "{label} @ ctx {context}: median {ms:7.2} ms (ratio {:.2})  min {min:7.2} ms (ratio {:.2})  cpu {cpu:7.2} ms (ratio {:.2})",
            ms / b_med,
            min / b_min,
            cpu / b_cpu
        );
    }
}
