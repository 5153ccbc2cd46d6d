//! Where the MTP module comes from, in order: an explicit `--weights DIR`; the target's own
//! checkpoint (an HF directory whose safetensors hold an MTP module, as DeepSeek-V3, GLM,
//! Qwen3-Next and MiMo ship it); else the heads Specula ships under
//! `drafters/weights/<target>/mtp/`, matched by the `specula_target` keys of their
//! `config.json` (architecture, tokenizer fingerprint, hidden size, layer count).

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;
use specula_models::weights::{WeightDType, Weights};
use specula_protocol::wire::TargetInfo;

use crate::config::{config_path, find_layout};
use crate::Error;

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightsSource {
    /// A folder with `config.json` and safetensors.
    Path(PathBuf),
    /// The target's own checkpoint when it has an MTP module, else the shipped heads under
    /// `root`.
    Auto {
        /// `drafters/weights` (or `SPECULA_DRAFTER_WEIGHTS`).
        root: PathBuf,
    },
}

/// The default root of shipped weights: `SPECULA_DRAFTER_WEIGHTS`, else this crate's sibling
/// `drafters/weights`.
pub fn default_root() -> PathBuf {
    match std::env::var_os("SPECULA_DRAFTER_WEIGHTS") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights"),
    }
}

impl WeightsSource {
    /// The folder to load for `target`.
    ///
    /// # Errors
    /// [`Error::NoWeights`] naming the target and where it looked.
    pub fn resolve(&self, target: &TargetInfo) -> Result<PathBuf, Error> {
        match self {
            WeightsSource::Path(dir) => Ok(dir.clone()),
            WeightsSource::Auto { root } => {
                let own = Path::new(&target.weights_path);
                if own.is_dir() && has_mtp(own) {
                    return Ok(own.to_path_buf());
                }
                let mut found: Vec<PathBuf> = std::fs::read_dir(root)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|d| d.path().join("mtp"))
                    .filter(|dir| matches(&config_path(dir), target))
                    .collect();
                found.sort();
                found.into_iter().next().ok_or_else(|| Error::NoWeights {
                    target: describe(target),
                    root: root.clone(),
                })
            }
        }
    }
}

/// Opens the safetensors of `dir` (`model.safetensors`, or every `*.safetensors` shard), dense
/// f32 on the CPU.
///
/// # Errors
/// [`Error::Weights`] when there are none or they are not safetensors.
pub fn open(dir: &Path) -> Result<Weights, Error> {
    let bad = |reason: String| Error::Weights {
        path: dir.to_path_buf(),
        reason,
    };
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(bad("no .safetensors file".into()));
    }
    Weights::safetensors(dir, &shards, WeightDType::F32, &Device::Cpu)
        .map_err(|e| bad(e.to_string()))
}

/// Whether the checkpoint at `dir` holds an MTP module.
fn has_mtp(dir: &Path) -> bool {
    let layers = std::fs::read_to_string(config_path(dir))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|j| j.get("num_hidden_layers").and_then(Value::as_u64));
    match (layers, open(dir)) {
        (Some(layers), Ok(w)) => find_layout(&w, layers as usize).is_some(),
        _ => false,
    }
}

fn describe(t: &TargetInfo) -> String {
    let fp: String = t.tokenizer_fingerprint.chars().take(12).collect();
    format!(
        "{} (hidden {}, {} layers, tokenizer {fp}…)",
        t.architecture, t.hidden_size, t.num_layers
    )
}

/// Whether the config's `specula_target` names `target`.
fn matches(config: &Path, target: &TargetInfo) -> bool {
    let Some(json) = std::fs::read_to_string(config)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
    else {
        return false;
    };
    let Some(key) = json.get("specula_target") else {
        return false;
    };
    let u = |k: &str| key.get(k).and_then(Value::as_u64);
    key.get("architecture").and_then(Value::as_str) == Some(target.architecture.as_str())
        && key.get("tokenizer_fingerprint").and_then(Value::as_str)
            == Some(target.tokenizer_fingerprint.as_str())
        && u("hidden_size") == Some(u64::from(target.hidden_size))
        && u("num_layers") == Some(u64::from(target.num_layers))
}
