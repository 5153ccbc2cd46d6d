//! Where the MTP module comes from, in order: an explicit `--weights PATH`; the target's own
//! checkpoint (an HF directory whose safetensors hold an MTP module, as DeepSeek-V3, GLM,
//! Qwen3-Next and MiMo ship it, or a GGUF file with llama.cpp's NextN layer,
//! `blk.{L}.nextn.*`); else the heads Specula ships under `drafters/weights/<target>/mtp/`,
//! matched by the `specula_target` keys of their `config.json` (architecture, tokenizer
//! fingerprint, hidden size, layer count).

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;
use specula_models::config::ModelConfig;
use specula_models::loader::read_gguf;
use specula_models::weights::{WeightDType, Weights};
use specula_protocol::wire::TargetInfo;

use crate::config::{config_path, find_layout};
use crate::Error;

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightsSource {
    /// A folder with `config.json` and safetensors, or a GGUF file with a NextN layer.
    Path(PathBuf),
    /// The target's own checkpoint when it has an MTP module, else the shipped heads under
    /// `root`.
    Auto {
        /// `drafters/weights` (or `SPECULA_DRAFTER_WEIGHTS`).
        root: PathBuf,
    },
}

pub use specula_protocol::sdk::shipped::default_root;
use specula_protocol::sdk::shipped::{describe, find};

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
                if has_mtp(own) {
                    return Ok(own.to_path_buf());
                }
                find(root, "mtp", target).ok_or_else(|| Error::NoWeights {
                    target: describe(target),
                    root: root.clone(),
                })
            }
        }
    }
}

/// Whether `path` names a GGUF file (by its extension, as the target loader decides).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Opens the checkpoint at `dir`: a GGUF file (its tensors as stored: quantized matrices stay
/// quantized), else the folder's safetensors (`model.safetensors`, or every `*.safetensors`
/// shard), dense f32 on the CPU.
///
/// # Errors
/// [`Error::Weights`] when there are none or they cannot be read.
pub fn open(dir: &Path) -> Result<Weights, Error> {
    let bad = |reason: String| Error::Weights {
        path: dir.to_path_buf(),
        reason,
    };
    if is_gguf(dir) {
        let (content, file) = read_gguf(dir).map_err(|e| bad(e.to_string()))?;
        return Ok(Weights::gguf(
            content,
            file,
            dir,
            WeightDType::Native,
            &Device::Cpu,
        ));
    }
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

/// Whether the checkpoint at `dir` (a folder or a GGUF file) holds an MTP module.
fn has_mtp(dir: &Path) -> bool {
    let layers = match is_gguf(dir) {
        true => read_gguf(dir)
            .ok()
            .and_then(|(content, _)| ModelConfig::from_gguf(&content, dir).ok())
            .map(|c| c.num_hidden_layers),
        false if dir.is_dir() => std::fs::read_to_string(config_path(dir))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|j| j.get("num_hidden_layers").and_then(Value::as_u64))
            .map(|l| l as usize),
        false => None,
    };
    match (layers, open(dir)) {
        (Some(layers), Ok(w)) => find_layout(&w, layers).is_some(),
        _ => false,
    }
}
