//! `dflash`: the DFlash / DSpark drafter process. The target host starts it
//! (`target-host serve --drafter dflash [--drafter-arg=--kind=dspark]`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dflash::weights::default_root;
use dflash::{DFlash, DeviceChoice, LinearDType, Options, VocabChoice, WeightsSource};

/// Command line of the drafter.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Specula's DFlash / DSpark drafter (started by target-host)"
)]
struct Args {
    /// A folder with the drafter's `config.json` and `model.safetensors`; by default the
    /// weights shipped for the target are looked up.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Which shipped weights to look up: `dflash` or `dspark`.
    #[arg(long, default_value = "dflash")]
    kind: String,
    /// Where shipped weights live (default: `SPECULA_DRAFTER_WEIGHTS`, else drafters/weights).
    #[arg(long)]
    weights_root: Option<PathBuf>,
    /// Run a shorter block than the checkpoint's.
    #[arg(long)]
    block_size: Option<usize>,
    /// Cut each block at the first draft whose confidence is below this (0: never): DSpark's
    /// confidence head, or the calibrated confidences of a drafter without one. A first draft
    /// below it proposes nothing (the host runs a plain step).
    #[arg(long, default_value_t = 0.0)]
    confidence_threshold: f32,
    /// The drafter's own projections: `q8_0` (default: requantized at load, through the
    /// runtime's packed int8 kernels; a quarter of the f32 bytes per step, drafts may differ
    /// from the reference's, output never does), `stored` (the checkpoint's dtype, bf16 for the
    /// shipped drafters: the references' numerics) or `f32`.
    #[arg(long, default_value = "q8_0")]
    linear_dtype: LinearDType,
    /// Draft over a subset of the vocabulary: `shipped` (the weights' `draft_vocab.json`, all
    /// its ids, when there is one), N (its first N ids, the most frequent) or `off` (the whole
    /// vocabulary). Output never changes; drafts are cheaper and may be accepted less often.
    #[arg(long, default_value = "shipped")]
    draft_vocab: VocabChoice,
    /// Where the forward runs: `cpu` (the host path), `cuda` or `cuda:N` (the whole forward on
    /// that GPU, weights in f32, context K/V on it; a build with the `cuda` feature, see
    /// scripts/build-cuda) or `candle-cpu` (the GPU path's ops on the CPU, for checks).
    #[arg(long, default_value = "cpu")]
    device: DeviceChoice,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !matches!(args.kind.as_str(), "dflash" | "dspark") {
        eprintln!("--kind must be dflash or dspark, got {:?}", args.kind);
        return ExitCode::from(2);
    }
    if !(0.0..=1.0).contains(&args.confidence_threshold) {
        eprintln!(
            "--confidence-threshold must be in 0..=1, got {}",
            args.confidence_threshold
        );
        return ExitCode::from(2);
    }
    let source = match args.weights {
        Some(dir) => WeightsSource::Path(dir),
        None => WeightsSource::Shipped {
            root: args.weights_root.unwrap_or_else(default_root),
            kind: args.kind,
        },
    };
    let options = Options {
        block_size: args.block_size,
        confidence_threshold: args.confidence_threshold,
        linear_dtype: args.linear_dtype,
        draft_vocab: args.draft_vocab,
        device: args.device,
    };
    match DFlash::new(source, options) {
        Ok(drafter) => specula_protocol::sdk::serve(drafter),
        Err(e) => {
            eprintln!("dflash: {e}");
            ExitCode::from(2)
        }
    }
}
