//! Prints the greedy next token of every position of a token sequence and optionally dumps
//! all logits (`[n, vocab]` little-endian f32) — for checking a model against a reference
//! implementation.
//!
//! ```text
//! cargo run --release -p specula-models --example logits -- \
//!     --model models/cache/smollm2-135m.gguf --tokens 1,504,3153 --out /tmp/logits.f32
//! ```

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use specula_models::{load_model, ForwardRequest, LoadOptions, WeightDType};

#[derive(Parser)]
struct Args {
    /// A .gguf file or HF directory.
    #[arg(long)]
    model: PathBuf,
    /// native | f32 | f16 | bf16
    #[arg(long, default_value = "native")]
    dtype: String,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Where to write the raw logits.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let opts = LoadOptions {
        dtype: args.dtype.parse::<WeightDType>()?,
        ..Default::default()
    };
    let model = load_model(&args.model, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let mut cache = model.new_cache();
    let req = ForwardRequest {
        logits: specula_models::Rows::Last(args.tokens.len()),
        ..Default::default()
    };
    let logits = model.forward(&args.tokens, &mut cache, &req)?.logits;
    let argmax: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    println!("argmax per position: {argmax:?}");
    if let Some(out) = args.out {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let mut f = std::fs::File::create(&out).with_context(|| format!("{}", out.display()))?;
        for v in rows.iter().flatten() {
            f.write_all(&v.to_le_bytes())?;
        }
        println!(
            "wrote {} x {} logits to {}",
            rows.len(),
            model.config().vocab_size,
            out.display()
        );
    }
    Ok(())
}
