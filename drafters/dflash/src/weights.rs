//! Finding the drafter's weights: an explicit `--weights DIR`, or the weights Specula ships for
//! the target under `drafters/weights/<target>/<kind>/`, matched by the `specula_target` keys of
//! their `config.json` (architecture, tokenizer fingerprint, hidden size, layer count) against
//! the host's `TargetInfo`.

use std::path::PathBuf;

use specula_protocol::wire::TargetInfo;

use crate::Error;

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightsSource {
    /// A folder with `config.json` and `model.safetensors`.
    Path(PathBuf),
    /// The folder of shipped weights, searched for `kind` (`dflash`, `dspark`) of the target.
    Shipped {
        /// `drafters/weights` (or `SPECULA_DRAFTER_WEIGHTS`).
        root: PathBuf,
        /// The sub-folder name.
        kind: String,
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
            WeightsSource::Shipped { root, kind } => {
                find(root, kind, target).ok_or_else(|| Error::NoWeights {
                    kind: kind.clone(),
                    target: describe(target),
                    root: root.clone(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn target(fp: &str) -> TargetInfo {
        TargetInfo {
            architecture: "llama".into(),
            hidden_size: 576,
            num_layers: 30,
            tokenizer_fingerprint: fp.into(),
            ..TargetInfo::default()
        }
    }

    #[test]
    fn finds_the_weights_shipped_for_the_target_or_refuses_clearly() {
        let root = tempfile::tempdir().unwrap();
        for (name, fp) in [("a", "aaaa"), ("smollm2-135m", "ffff")] {
            let dir = root.path().join(name).join("dspark");
            std::fs::create_dir_all(&dir).unwrap();
            let config = json!({"specula_target": {"architecture": "llama",
                "tokenizer_fingerprint": fp, "hidden_size": 576, "num_layers": 30}});
            std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        }
        let shipped = |kind: &str| WeightsSource::Shipped {
            root: root.path().to_path_buf(),
            kind: kind.into(),
        };
        let got = shipped("dspark").resolve(&target("ffff")).unwrap();
        assert!(got.ends_with("smollm2-135m/dspark"), "{got:?}");
        let err = shipped("dflash").resolve(&target("ffff")).unwrap_err();
        assert!(err.to_string().contains("no dflash weights"), "{err}");
        let err = shipped("dspark")
            .resolve(&target("0123456789abcdef"))
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("tokenizer 0123456789ab") && text.contains("--weights"),
            "{text}"
        );
    }
}
