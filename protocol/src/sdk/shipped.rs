//! Weights that Specula ships for a target: `drafters/weights/<target>/<kind>/`, each folder's
//! `config.json` naming its target by `specula_target` keys (architecture, tokenizer
//! fingerprint, hidden size, layer count), matched against the host's [`TargetInfo`]. One
//! lookup for every learned drafter (dflash, dspark, mtp, assistant).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::wire::TargetInfo;

/// The default root of shipped weights: `SPECULA_DRAFTER_WEIGHTS`, else the repository's
/// `drafters/weights`.
pub fn default_root() -> PathBuf {
    match std::env::var_os("SPECULA_DRAFTER_WEIGHTS") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../drafters/weights"),
    }
}

/// The folder `root/*/kind` whose config names `target` (the first by name when several do).
pub fn find(root: &Path, kind: &str, target: &TargetInfo) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join(kind))
        .filter(|dir| matches(&dir.join("config.json"), target))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// The target in a line, for errors: architecture, hidden size, layers, fingerprint prefix.
pub fn describe(t: &TargetInfo) -> String {
    let fp: String = t.tokenizer_fingerprint.chars().take(12).collect();
    format!(
        "{} (hidden {}, {} layers, tokenizer {fp}…)",
        t.architecture, t.hidden_size, t.num_layers
    )
}

/// Whether the config file's `specula_target` names `target`; false when it is unreadable.
pub fn matches(config: &Path, target: &TargetInfo) -> bool {
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
