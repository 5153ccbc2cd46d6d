//! `assistant`: the Gemma 4 assistant drafter process, borrowing the target's K/V. The target
//! host starts it (`target-host serve --drafter assistant [--drafter-arg=--weights=DIR]`).

use std::path::PathBuf;
use std::process::ExitCode;

use assistant::drafter::AssistantDrafter;
use clap::Parser;
use dflash::weights::default_root;
use dflash::WeightsSource;
use specula_protocol::version::Version;

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
    /// Ask for the target's K/V as rows copied into every message's taps instead of reading the
    /// host's KV pool in place (the copy path, for comparisons).
    #[arg(long)]
    no_kv_views: bool,
    /// Speak at most this protocol version, `MAJOR.MINOR` (an older drafter, for compatibility
    /// checks): below 1.2 the host sends K/V rows in the taps.
    #[arg(long, value_parser = parse_version)]
    protocol: Option<Version>,
}

fn parse_version(s: &str) -> Result<Version, String> {
    let bad = || format!("`{s}` is not a protocol version MAJOR.MINOR (e.g. 1.1)");
    let (major, minor) = s.split_once('.').ok_or_else(bad)?;
    Ok(Version {
        major: major.parse().map_err(|_| bad())?,
        minor: minor.parse().map_err(|_| bad())?,
    })
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
    let mut drafter = AssistantDrafter::new(source);
    if args.no_kv_views {
        drafter = drafter.with_copies();
    }
    if let Some(version) = args.protocol {
        drafter = match drafter.speaking(version) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("assistant: {e}");
                return ExitCode::from(1);
            }
        };
    }
    specula_protocol::sdk::serve(drafter)
}
