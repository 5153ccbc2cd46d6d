//! `mtp`: the native MTP drafter process. The target host starts it
//! (`target-host serve --drafter mtp [--drafter-arg=--weights=DIR]`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use mtp::weights::default_root;
use mtp::{MtpDrafter, Options, WeightsSource};

/// Command line of the drafter.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Specula's native MTP drafter (started by target-host)"
)]
struct Args {
    /// A folder with the MTP module's `config.json` and safetensors; by default the target's
    /// own checkpoint, else the head shipped for the target.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Where shipped heads live (default: `SPECULA_DRAFTER_WEIGHTS`, else drafters/weights).
    #[arg(long)]
    weights_root: Option<PathBuf>,
    /// The most drafts per round (by recursion; MiMo drafts one).
    #[arg(long, default_value_t = Options::default().max_draft)]
    max_draft: usize,
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
    let options = Options {
        max_draft: args.max_draft,
    };
    match MtpDrafter::new(source, options) {
        Ok(drafter) => specula_protocol::sdk::serve(drafter),
        Err(e) => {
            eprintln!("mtp: {e}");
            ExitCode::from(2)
        }
    }
}
