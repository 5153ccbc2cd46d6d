//! Helpers shared by the end-to-end tests: locating the workspace, fetching real models, finding
//! the built binaries, tiny models, in-process proposers a test controls, and the chi-square test.

pub mod proposers;
pub mod stats;
pub mod tiny;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Root of the workspace (the folder holding the top-level `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("invariant: tests/ lives inside the workspace")
        .to_path_buf()
}

/// Path of a real GGUF model, fetched by `scripts/fetch-model NAME` when it is not there yet
/// (one fetch at a time; panics when the fetch fails, so a test without its model never passes).
pub use specula_models::testing::real_model as model_path;

/// Path of a binary built by this workspace (`target-host`, `ngram`, ...), in the same profile
/// as the running test.
pub fn bin_path(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps; binaries one folder up.
    let exe = std::env::current_exe().expect("current test executable");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("invariant: test binary lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace` before the tests",
        path.display()
    );
    path
}

/// Runs `target-host generate --json --model MODEL --max-tokens N --KIND TEXT EXTRA...` (KIND:
/// `prompt` or `chat`) and returns its JSON (`prompt_ids`, `token_ids`, `stats`).
///
/// # Panics
/// When the command fails or prints no JSON.
pub fn cli_generate_json(
    model: &str,
    kind: &str,
    text: &str,
    max_tokens: usize,
    extra: &[&str],
) -> serde_json::Value {
    let out = Command::new(bin_path("target-host"))
        .args(["generate", "--model", model, "--json", "--max-tokens"])
        .arg(max_tokens.to_string())
        .arg(format!("--{kind}"))
        .arg(text)
        .args(extra)
        .output()
        .expect("run target-host");
    assert!(
        out.status.success(),
        "target-host generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json output")
}

/// The ids under `key` (`prompt_ids`, `token_ids`) of [`cli_generate_json`]'s output.
///
/// # Panics
/// When `key` is not a list of ids.
pub fn json_ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// [`cli_generate_json`], returning (prompt ids, generated ids).
///
/// # Panics
/// When the command fails or prints no JSON.
pub fn cli_generate(
    model: &str,
    kind: &str,
    text: &str,
    max_tokens: usize,
    extra: &[&str],
) -> (Vec<u32>, Vec<u32>) {
    let v = cli_generate_json(model, kind, text, max_tokens, extra);
    (json_ids(&v, "prompt_ids"), json_ids(&v, "token_ids"))
}
