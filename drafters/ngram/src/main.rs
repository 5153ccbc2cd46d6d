//! The n-gram drafter as a process:
//! `ngram [--min-ngram N] [--max-ngram N] [--max-draft N] [--choice recent|frequent]`,
//! started by the target host (see `specula_protocol::sdk`).

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use ngram::{Choice, NgramConfig, NgramDrafter};

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
    /// Which earlier occurrence of the matched suffix to copy from.
    #[arg(long, value_enum, default_value_t = ChoiceArg::Recent)]
    choice: ChoiceArg,
}

/// `--choice` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ChoiceArg {
    /// The latest occurrence.
    Recent,
    /// The latest occurrence followed by the most frequent next token.
    Frequent,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = NgramConfig {
        min_n: args.min_ngram,
        max_n: args.max_ngram,
        choice: match args.choice {
            ChoiceArg::Recent => Choice::Recent,
            ChoiceArg::Frequent => Choice::Frequent,
        },
    };
    if let Err(e) = config.validate() {
        eprintln!("ngram: {e}");
        return ExitCode::from(2);
    }
    specula_protocol::sdk::serve(NgramDrafter::new(config, args.max_draft))
}
