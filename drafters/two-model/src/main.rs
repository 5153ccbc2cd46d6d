//! The two-model drafter as a process, started by the target host (see
//! `specula_protocol::sdk`):
//!
//! ```text
//! two-model --model PATH [--dtype native|f32|f16|bf16] [--prefill-chunk N]
//!           [--max-draft N] [--checkpoints N]
//! ```
//!
//! `PATH` is a `.gguf` file or an HF safetensors directory whose tokenizer must be the target's
//! (the handshake refuses any other). Use `--dtype f32` to match an f32 target bit for bit.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use specula_models::loader::{load, LoadOptions};
use specula_models::WeightDType;
use two_model::{TwoModelConfig, TwoModelDrafter};

/// A small language model drafting for a large one (same tokenizer).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The draft model: a `.gguf` file or an HF safetensors directory.
    #[arg(long)]
    model: PathBuf,
    /// Weight precision: native (GGUF stays quantized), f32, f16 or bf16.
    #[arg(long, default_value = "native")]
    dtype: String,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// The most drafts proposed per round.
    #[arg(long, default_value_t = TwoModelConfig::default().max_draft_len)]
    max_draft: u32,
    /// Closed sessions' caches kept for reuse by a later session sharing their prefix.
    #[arg(long, default_value_t = TwoModelConfig::default().checkpoints)]
    checkpoints: usize,
}

fn load_drafter(args: &Args) -> Result<TwoModelDrafter> {
    let dtype: WeightDType = args.dtype.parse().context("--dtype")?;
    anyhow::ensure!(args.prefill_chunk > 0, "--prefill-chunk must be at least 1");
    anyhow::ensure!(args.max_draft > 0, "--max-draft must be at least 1");
    let opts = LoadOptions {
        dtype,
        prefill_chunk: args.prefill_chunk,
        ..LoadOptions::default()
    };
    let loaded = load(&args.model, &opts)
        .with_context(|| format!("loading the draft model {}", args.model.display()))?;
    let config = TwoModelConfig {
        max_draft_len: args.max_draft,
        checkpoints: args.checkpoints,
    };
    Ok(TwoModelDrafter::new(
        loaded.model,
        &loaded.tokenizer,
        config,
    ))
}

fn main() -> ExitCode {
    specula_models::alloc::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let args = Args::parse();
    match load_drafter(&args) {
        Ok(drafter) => specula_protocol::sdk::serve(drafter),
        Err(e) => {
            eprintln!("two-model: {e:#}");
            ExitCode::from(2)
        }
    }
}
