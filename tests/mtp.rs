//! The law with the native MTP drafter: greedy output equals `--no-speculation` on SmolLM2-135M
//! with the head trained for it (`drafters/weights/smollm2-135m/mtp`, found by the drafter from
//! the target's identity), and its drafts are accepted at all.

use std::process::Command;

use specula_tests::{bin_path, model_path};

const MAX_TOKENS: usize = 40;

/// A chat prompt of each workload kind, and a plain completion.
const PROMPTS: &[(&str, &str)] = &[
    (
        "chat",
        "Write a Python function that returns the factorial of n.",
    ),
    ("chat", "What are three good habits for writing clear code?"),
    (
        "prompt",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ),
];

/// `target-host generate --json` on `model` with `extra`; returns (generated ids, accepted).
fn generate(model: &std::path::Path, kind: &str, text: &str, extra: &[&str]) -> (Vec<u32>, u64) {
    let out = Command::new(bin_path("target-host"))
        .args([
            "generate",
            "--json",
            "--max-tokens",
            &MAX_TOKENS.to_string(),
        ])
        .arg("--model")
        .arg(model)
        .arg(format!("--{kind}"))
        .arg(text)
        .args(extra)
        .output()
        .expect("run target-host");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "target-host failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output");
    let ids = v["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}; stderr {stderr}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    (ids, v["stats"]["accepted"].as_u64().unwrap_or(0))
}

#[test]
fn mtp_greedy_equals_plain_smollm2() {
    let model = model_path("smollm2-135m");
    let drafter = bin_path("mtp");
    let drafter = drafter.to_str().expect("utf-8 path");
    let mut accepted = 0;
    for k in ["1", "3"] {
        for (kind, text) in PROMPTS {
            let (plain, _) = generate(&model, kind, text, &["--no-speculation"]);
            let args = [
                "--drafter",
                drafter,
                &format!("--drafter-arg=--max-draft={k}"),
                "--num-draft-tokens",
                k,
                "--fixed-draft",
            ];
            let (spec, acc) = generate(&model, kind, text, &args);
            assert_eq!(
                spec, plain,
                "mtp k={k} changed the greedy output of {text:?}"
            );
            accepted += acc;
        }
    }
    assert!(accepted > 0, "mtp: no draft was ever accepted");
}
