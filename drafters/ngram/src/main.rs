//! The n-gram drafter as a process: `ngram [--min-ngram N] [--max-ngram N] [--max-draft N]`,
//! started by the target host (see `specula_protocol::sdk`).

use std::process::ExitCode;

use clap::Parser;
use ngram::{NgramConfig, NgramDrafter};

/// Prompt-lookup drafter for Specula.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Shortest context suffix that may match.
    #[arg(long, default_value_t = NgramConfig::default().min_n)]
    min_ngram: usize,
    /// Longest context suffix, tried first.
    #[arg(long, default_value_t = NgramConfig::default().max_n)]
    max_ngram: usize,
    /// The most drafts proposed per round.
    #[arg(long, default_value_t = 16)]
    max_draft: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = NgramConfig {
        min_n: args.min_ngram,
        max_n: args.max_ngram,
    };
    if let Err(e) = config.validate() {
        eprintln!("ngram: {e}");
        return ExitCode::from(2);
    }
    specula_protocol::sdk::serve(NgramDrafter::new(config, args.max_draft))
}
