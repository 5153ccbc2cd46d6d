//! `mtp`: the native MTP drafter process. The target host starts it
//! (`target-host serve --drafter mtp [--drafter-arg=--weights=DIR]`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use mtp::weights::default_root;
use mtp::{LinearDType, MtpDrafter, Options, WeightsSource};
use specula_models::drafter_support::draft_vocab::VocabChoice;

/// Command line of the drafter.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Specula's native MTP drafter (started by target-host)"
)]
struct Args {
    /// A folder with the MTP module's `config.json` and safetensors (or a GGUF file with a
    /// NextN layer); by default the target's own checkpoint, else the head shipped for it.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Where shipped heads live (default: `SPECULA_DRAFTER_WEIGHTS`, else drafters/weights).
    #[arg(long)]
    weights_root: Option<PathBuf>,
    /// The most drafts per round (by recursion; MiMo drafts one).
    #[arg(long, default_value_t = Options::default().max_draft)]
    max_draft: usize,
    /// The module's own projections: `stored` (as the checkpoint has them: the references'
    /// numerics) or `q8_0` (requantized at load: fewer bytes per step; drafts may differ,
    /// output never does).
    #[arg(long, default_value = "q8_0")]
    linear_dtype: String,
    /// The ids drafts are picked from: `shipped` (the `draft_vocab.json` beside the weights,
    /// else the whole vocabulary), `off` (the whole vocabulary) or N (the list's first N).
    #[arg(long, default_value = "shipped")]
    draft_vocab: VocabChoice,
    /// Propose drafts only while the product of their probabilities stays at or above this
    /// (0..=1; 0, the default, proposes whatever is asked: the host cuts on the confidences
    /// every draft carries).
    #[arg(long, default_value_t = Options::default().min_confidence)]
    min_confidence: f32,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let source = match args.weights {
        Some(dir) => WeightsSource::Path(dir),
        None => WeightsSource::Auto {
            root: args.weights_root.unwrap_or_else(default_root),
        },
    };
    let linear_dtype = match args.linear_dtype.as_str() {
        "stored" | "f32" => LinearDType::Stored,
        "q8_0" => LinearDType::Q8_0,
        other => {
            eprintln!("mtp: --linear-dtype must be stored or q8_0, got {other:?}");
            return ExitCode::from(2);
        }
    };
    let options = Options {
        max_draft: args.max_draft,
        linear_dtype,
        draft_vocab: args.draft_vocab,
        min_confidence: args.min_confidence,
    };
    match MtpDrafter::new(source, options) {
        Ok(drafter) => specula_protocol::sdk::serve(drafter),
        Err(e) => {
            eprintln!("mtp: {e}");
            ExitCode::from(2)
        }
    }
}
