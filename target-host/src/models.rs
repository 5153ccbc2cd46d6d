//! Finding and loading the target model named on the command line: a checkpoint (GGUF file,
//! HF directory, or a name `scripts/fetch-model` knows) or random weights of a real shape
//! (`--load-format random --config qwen3-8b`, for benchmarks where checkpoints cannot travel),
//! on the CPU or a GPU (`--device cuda`, in builds with the `cuda` feature).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::{Args, ValueEnum};
use specula_models::loader::{load, LoadedModel};
use specula_models::{random, LoadOptions, WeightDType};

/// The model fetched and served when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Command-line options that choose and load the target model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, an HF model directory, or a name known to `scripts/fetch-model`
    /// (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m). Default:
    /// smollm2-135m.
    #[arg(long)]
    pub model: Option<String>,
    /// Weight precision: native (as stored; GGUF stays quantized), f32, f16 or bf16.
    #[arg(long, default_value = "native")]
    pub dtype: String,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Where the model runs: cpu, cuda or cuda:N (cuda needs a build with the `cuda` feature,
    /// see scripts/build-cuda).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// How to read the weights: auto (a .gguf file or an HF directory, by --model), or random
    /// weights of the shape --config names (text in and out is then `t0 t1 ...` ids).
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// With --load-format random: a preset (qwen2.5-1.5b, qwen3-8b) or an HF config.json path.
    #[arg(long)]
    pub config: Option<String>,
}

/// Where the weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    /// A GGUF file or an HF safetensors directory, chosen by `--model`.
    Auto,
    /// `--model` must be a GGUF file.
    Gguf,
    /// `--model` must be an HF directory with safetensors.
    Safetensors,
    /// Random weights of the `--config` shape, built on the device.
    Random,
}

/// Parses `cpu`, `cuda` or `cuda:N`.
///
/// # Errors
/// An unknown device name, or `cuda` in a build without the `cuda` feature.
pub fn parse_device(spec: &str) -> Result<Device> {
    let ordinal = match spec.to_ascii_lowercase().as_str() {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => bail!("--device {spec}: expected cpu, cuda or cuda:N"),
        },
    };
    if !candle_core::utils::cuda_is_available() {
        bail!("--device {spec}: this build has no CUDA support (build it with scripts/build-cuda)");
    }
    Device::new_cuda(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))
}

/// Resolves [`ModelArgs::model`] to a path and loads it.
///
/// # Errors
/// Unknown names, missing files, failed fetches and everything [`load`] rejects, each with the
/// path or name involved.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let dtype: WeightDType = args.dtype.parse()?;
    let opts = LoadOptions {
        dtype,
        device: parse_device(&args.device)?,
        prefill_chunk: args.prefill_chunk.max(1),
    };
    if args.load_format == LoadFormat::Random {
        if args.model.is_some() {
            bail!("--load-format random builds the model from --config: drop --model");
        }
        let spec = args
            .config
            .as_deref()
            .context("--load-format random needs --config (a preset: qwen2.5-1.5b, qwen3-8b; or a config.json)")?;
        let config = random::config(spec).with_context(|| format!("--config {spec}"))?;
        return random::load(spec, config, &opts)
            .with_context(|| format!("building random weights for {spec}"));
    }
    if args.config.is_some() {
        bail!("--config is only used with --load-format random");
    }
    let path = resolve_model(args.model.as_deref().unwrap_or(DEFAULT_MODEL))?;
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    match args.load_format {
        LoadFormat::Gguf if !is_gguf => {
            bail!("--load-format gguf: {} is not a .gguf file", path.display())
        }
        LoadFormat::Safetensors if !path.is_dir() => {
            bail!(
                "--load-format safetensors: {} is not an HF model directory",
                path.display()
            )
        }
        _ => {}
    }
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
