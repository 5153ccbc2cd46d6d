//! End-to-end: `specula-bench run` on a tiny suite with the real SmolLM2 model (fetched by
//! `scripts/fetch-model` when absent): plain vs the n-gram drafter in process, one pass, plus a
//! configuration that cannot start and must be reported, not dropped.

use std::process::Command;

use serde_json::Value;

#[test]
fn tiny_suite_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let workload = dir.path().join("w.jsonl");
    std::fs::write(
        &workload,
        r#"{"tag": "code-edit", "messages": [{"role": "user", "content": "Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"}], "max_tokens": 12}"#,
    )
    .unwrap();
    let suite = dir.path().join("suite.json");
    std::fs::write(
        &suite,
        r#"{"name": "tiny", "workload": "w.jsonl", "warmup": 0, "repeats": 1, "groups": [
            {"name": "Smol", "model": "smollm2-135m", "configs": [
                {"name": "plain", "engine": "specula"},
                {"name": "ngram k4", "engine": "specula", "drafter": "ngram", "placement": "in-process", "k": 4},
                {"name": "broken", "engine": "specula", "drafter": "two-model", "k": 2, "draft_model": "/nonexistent/draft.gguf"}
            ]}]}"#,
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = Command::new(env!("CARGO_BIN_EXE_specula-bench"))
        .args(["run", "--suite"])
        .arg(&suite)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("SKIPPED Smol / broken"), "{stderr}");

    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("results.json")).unwrap())
            .unwrap();
    let configs = results["groups"][0]["configs"].as_array().unwrap();
    let plain = &configs[0];
    let ngram = &configs[1];
    assert_eq!(plain["records"].as_array().unwrap().len(), 1);
    let all = &ngram["summary"]["all"];
    // The law: the drafter changed speed only.
    assert_eq!(all["same_output"], serde_json::json!([1, 1]), "{all}");
    assert_eq!(
        plain["records"][0]["sample"]["token_ids"],
        ngram["records"][0]["sample"]["token_ids"]
    );
    assert!(all["acceptance"].as_f64().unwrap() > 0.0, "{all}");
    assert!(all["forwards_per_token"].as_f64().unwrap() < 1.0, "{all}");
    assert!(plain["done"]["peak_rss_kb"].as_u64().unwrap() > 10_000);
    assert!(configs[2]["skipped"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/draft.gguf"));

    let md = std::fs::read_to_string(out_dir.join("results.md")).unwrap();
    assert!(md.contains("| ngram k4 |"), "{md}");
    assert!(md.contains("**SKIPPED** broken"), "{md}");
    let svg = std::fs::read_to_string(out_dir.join("speedup.svg")).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("specula ngram (in-process)"),
        "{svg}"
    );
}

/// The peer worker leaves OpenMP's wait policy alone for llama.cpp: loading `run_peer.py` must
/// not set `OMP_WAIT_POLICY` for the whole process (PASSIVE, meant for torch, made ggml's
/// OpenMP threads sleep between ops: llama.cpp decoded SmolLM2 3.4x slower in `bench/run`).
/// Only the transformers runner sets it, before torch loads.
#[test]
fn the_peer_worker_sets_omp_wait_policy_only_for_torch() {
    let peers = concat!(env!("CARGO_MANIFEST_DIR"), "/peers");
    let probe = "import os, sys, inspect; sys.path.insert(0, sys.argv[1]); import run_peer; \
                 print(os.environ.get('OMP_WAIT_POLICY')); \
                 print('OMP_WAIT_POLICY' in inspect.getsource(run_peer.Transformers.__init__))";
    let out = Command::new("python3")
        .args(["-c", probe, peers])
        .env_remove("OMP_WAIT_POLICY")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["None", "True"],
        "{stdout}"
    );
}
