//! The law with the DFlash / DSpark drafter on SmolLM2-135M and the drafters trained for it
//! (`drafters/weights/smollm2-135m/`, found by the drafter from the target's identity): greedy
//! output equals `--no-speculation` on every prompt, and the drafts are accepted at all.

use std::process::Command;

use specula_tests::{bin_path, model_path};

const MAX_TOKENS: usize = 40;

/// A chat prompt of each workload kind, and a plain completion.
const PROMPTS: &[(&str, &str)] = &[
    (
        "chat",
        "Write a Python function that returns the factorial of n.",
    ),
    (
        "chat",
        "Summarize in one sentence: The city council met on Tuesday to discuss the new bike \
         lanes. The council approved the bike lanes on Main Street and asked for a study of Oak \
         Street.",
    ),
    ("chat", "What are three good habits for writing clear code?"),
    (
        "prompt",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ),
];

/// `target-host generate --json` with `extra`; returns (generated ids, accepted drafts).
fn generate(kind: &str, text: &str, extra: &[&str]) -> (Vec<u32>, u64) {
    let model = model_path("smollm2-135m");
    let out = Command::new(bin_path("target-host"))
        .args([
            "generate",
            "--json",
            "--max-tokens",
            &MAX_TOKENS.to_string(),
        ])
        .arg("--model")
        .arg(&model)
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

fn check(kind_arg: &str) {
    let drafter = bin_path("dflash");
    let drafter = drafter.to_str().expect("utf-8 path");
    let mut accepted = 0;
    for (kind, text) in PROMPTS {
        let (plain, _) = generate(kind, text, &["--no-speculation"]);
        let args = [
            "--drafter",
            drafter,
            &format!("--drafter-arg=--kind={kind_arg}"),
            "--num-draft-tokens",
            "7",
        ];
        let (spec, acc) = generate(kind, text, &args);
        assert_eq!(
            spec, plain,
            "{kind_arg} changed the greedy output of {text:?}"
        );
        accepted += acc;
    }
    assert!(accepted > 0, "{kind_arg}: no draft was ever accepted");
}

#[test]
fn dflash_greedy_equals_plain_smollm2() {
    check("dflash");
}

#[test]
fn dspark_greedy_equals_plain_smollm2() {
    check("dspark");
}
