//! Finding and loading the target model named on the command line.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;
use specula_models::loader::{load, LoadedModel};
use specula_models::{LoadOptions, WeightDType};

/// The model fetched and served when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Command-line options that choose and load the target model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, an HF model directory, or a name known to `scripts/fetch-model`
    /// (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b). Default: smollm2-135m.
    #[arg(long)]
    pub model: Option<String>,
    /// Weight precision: native (as stored; GGUF stays quantized), f32, f16 or bf16.
    #[arg(long, default_value = "native")]
    pub dtype: String,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
}

/// Resolves [`ModelArgs::model`] to a path and loads it.
///
/// # Errors
/// Unknown names, missing files, failed fetches and everything [`load`] rejects, each with the
/// path or name involved.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let path = resolve_model(args.model.as_deref().unwrap_or(DEFAULT_MODEL))?;
    let dtype: WeightDType = args.dtype.parse()?;
    let opts = LoadOptions {
        dtype,
        prefill_chunk: args.prefill_chunk.max(1),
        ..LoadOptions::default()
    };
    tracing::info!("loading {} ({})", path.display(), args.dtype);
    load(&path, &opts).with_context(|| format!("loading model {}", path.display()))
}

/// A path that exists is used as it is; a known name is fetched into the model cache.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if spec.contains('/') || spec.ends_with(".gguf") {
        bail!("model file {spec} does not exist");
    }
    let script = workspace_root().join("scripts/fetch-model");
    if !script.exists() {
        bail!(
            "model {spec} does not exist, and there is no {} to fetch it",
            script.display()
        );
    }
    let out = Command::new(&script)
        .arg(spec)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("could not fetch model '{spec}' (see the messages above)");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The workspace this binary was built from: the fetch script and model cache live there.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}
