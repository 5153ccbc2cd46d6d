//! `assistant`: the Gemma 4 assistant drafter process, borrowing the target's K/V. The target
//! host starts it (`target-host serve --drafter assistant [--drafter-arg=--weights=DIR]`).

use std::path::PathBuf;
use std::process::ExitCode;

use assistant::drafter::AssistantDrafter;
use clap::Parser;
use dflash::weights::default_root;
use dflash::WeightsSource;

/// Command line of the drafter.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Specula's Gemma 4 assistant drafter (started by target-host)"
)]
struct Args {
    /// A folder with the assistant's `config.json` and `model.safetensors`; by default the
    /// weights shipped for the target (`drafters/weights/<target>/assistant`) are looked up.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Where shipped weights live (default: `SPECULA_DRAFTER_WEIGHTS`, else drafters/weights).
    #[arg(long)]
    weights_root: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let source = match args.weights {
        Some(dir) => WeightsSource::Path(dir),
        None => WeightsSource::Shipped {
            root: args.weights_root.unwrap_or_else(default_root),
            kind: "assistant".into(),
        },
    };
    specula_protocol::sdk::serve(AssistantDrafter::new(source))
}
