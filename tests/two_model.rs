//! The two-model drafter end to end: `target-host generate` spawning the real `two-model`
//! binary over real models.

use std::path::Path;
use std::process::{Command, Output};

use specula_models::testing::TinyModel;
use specula_tests::{bin_path, model_path, tiny::write_tiny_tokenizer};

const CHAT: &str = "Write a haiku about the sea.";

fn generate(model: &Path, extra: &[&str]) -> Output {
    let out = Command::new(bin_path("target-host"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--json", "--max-tokens", "40", "--chat", CHAT])
        .args(extra)
        .output()
        .expect("run target-host");
    assert!(
        out.status.success(),
        "target-host failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("one JSON line on stdout");
    serde_json::from_str(line).expect("JSON output")
}

/// `--drafter two-model --drafter-arg=--model --drafter-arg=DRAFT` plus `more` drafter args.
fn two_model_args<'a>(draft: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--drafter", "two-model", "--drafter-arg=--model"];
    args.push("--drafter-arg");
    args.push(draft);
    args.extend_from_slice(more);
    args
}

#[test]
fn smollm_drafting_for_itself_is_accepted_and_changes_nothing() {
    let m = model_path("smollm2-135m");
    let m_str = m.to_str().expect("utf-8 model path");
    let plain = json(&generate(&m, &["--no-speculation"]));
    let spec = json(&generate(&m, &two_model_args(m_str, &[])));
    assert_eq!(spec["token_ids"], plain["token_ids"], "greedy spec == greedy plain");
    assert_eq!(spec["text"], plain["text"]);
    let stats = &spec["stats"];
    let drafted = stats["drafted"].as_u64().unwrap();
    assert!(drafted >= 20, "the drafter drafted: {stats}");
    // Same weights, same dtype: only batch-shape rounding can flip an argmax.
    let rate = stats["acceptance_rate"].as_f64().unwrap();
    assert!(rate >= 0.95, "acceptance {rate} of a model drafting for itself");
    assert!(stats["target_forwards"].as_u64().unwrap() < 20, "{stats}");
}

#[test]
fn a_draft_model_with_another_tokenizer_is_refused_and_generation_goes_on() {
    let m = model_path("smollm2-135m");
    let dir = tempfile::tempdir().unwrap();
    let tiny = TinyModel::new("llama", 7).unwrap();
    tiny.write_hf_dir(dir.path()).unwrap();
    let vocab = TinyModel::tiny_config("llama").unwrap().vocab_size;
    write_tiny_tokenizer(dir.path(), vocab).unwrap();
    let draft = dir.path().to_str().expect("utf-8 temp path");

    let plain = json(&generate(&m, &["--no-speculation"]));
    let out = generate(&m, &two_model_args(draft, &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tokenizer mismatch"),
        "the refusal names the reason: {stderr}"
    );
    let spec = json(&out);
    assert_eq!(spec["token_ids"], plain["token_ids"]);
    assert_eq!(spec["stats"]["drafted"], 0);
}

#[test]
fn sampled_generation_with_two_model_completes() {
    let m = model_path("smollm2-135m");
    let m_str = m.to_str().expect("utf-8 model path");
    let mut args = vec!["--temperature", "0.8", "--seed", "7"];
    args.extend(two_model_args(m_str, &[]));
    let out = json(&generate(&m, &args));
    assert!(!out["text"].as_str().unwrap().is_empty(), "{out}");
    let stats = &out["stats"];
    assert_eq!(stats["generated_tokens"], 40, "{stats}");
    assert!(stats["drafted"].as_u64().unwrap() > 0, "{stats}");
    // The draft model is the target: its q equals p, so rejection sampling accepts most drafts.
    assert!(stats["acceptance_rate"].as_f64().unwrap() > 0.5, "{stats}");
}
