//! The two-model drafter end to end: `target-host generate` spawning the real `two-model`
//! binary over real models.

use std::path::Path;
use std::process::{Command, Output};

use specula_models::testing::TinyModel;
use specula_tests::{bin_path, model_path, tiny::write_tiny_tokenizer};

const CHAT: &str = "Write a haiku about the sea.";

fn run(model: &Path, extra: &[&str]) -> Output {
    Command::new(bin_path("target-host"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--json", "--max-tokens", "40", "--chat", CHAT])
        // The shared test machine is slow, and the draft model is as large as the target
        // (SmolLM2 drafting for itself): the default deadline of 4 target steps would rightly
        // cut it off. These tests measure acceptance and losslessness, not the deadline policy
        // (tests/chaos.rs does): wait for every draft, so each round verifies one.
        .args([
            "--draft-deadline-ms",
            "60000",
            "--draft-deadline-steps",
            "1000",
        ])
        .args(extra)
        .output()
        .expect("run target-host")
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    let out = run(model, extra);
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

/// SmolLM2 drafting for itself, both sides in f32, with `host` options added: returns the
/// speculative result after checking that its ids and text equal plain greedy decoding.
///
/// f32 on both sides: the verify forward runs several rows where plain decoding runs one, and
/// only dense f32 keeps those argmaxes equal (see the report on quantized batch shapes).
fn self_drafting_equals_plain(host: &[&str]) -> serde_json::Value {
    let m = model_path("smollm2-135m");
    let m_str = m.to_str().expect("utf-8 model path");
    let plain = json(&generate(&m, &["--dtype", "f32", "--no-speculation"]));
    let mut args = vec!["--dtype", "f32"];
    args.extend_from_slice(host);
    args.extend(two_model_args(
        m_str,
        &["--drafter-arg=--dtype", "--drafter-arg=f32"],
    ));
    let spec = json(&generate(&m, &args));
    assert_eq!(
        spec["token_ids"], plain["token_ids"],
        "greedy spec ({host:?}) == greedy plain"
    );
    assert_eq!(spec["text"], plain["text"]);
    spec
}

#[test]
fn smollm_drafting_for_itself_is_accepted_and_changes_nothing() {
    // A fixed k: what is measured is acceptance, not the controller's choice of k.
    let spec = self_drafting_equals_plain(&["--fixed-draft"]);
    let stats = &spec["stats"];
    let drafted = stats["drafted"].as_u64().unwrap();
    assert!(drafted >= 20, "the drafter drafted: {stats}");
    // Same weights, same dtype: only batch-shape rounding can flip an argmax.
    let rate = stats["acceptance_rate"].as_f64().unwrap();
    assert!(
        rate >= 0.95,
        "acceptance {rate} of a model drafting for itself"
    );
    assert!(stats["target_forwards"].as_u64().unwrap() < 20, "{stats}");
}

/// A tiny HF model with a word-level tokenizer (vocab 96): nothing like SmolLM2's.
fn foreign_draft_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    TinyModel::new("llama", 7)
        .unwrap()
        .write_hf_dir(dir.path())
        .unwrap();
    let vocab = TinyModel::tiny_config("llama").unwrap().vocab_size;
    write_tiny_tokenizer(dir.path(), vocab).unwrap();
    dir
}

#[test]
fn a_draft_model_with_another_tokenizer_is_refused_with_the_reason() {
    let m = model_path("smollm2-135m");
    let dir = foreign_draft_model();
    let draft = dir.path().to_str().expect("utf-8 temp path");
    let out = run(&m, &two_model_args(draft, &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tokenizer mismatch")
            && stderr.contains("vocab 96")
            && stderr.contains("vocab 49152"),
        "the refusal names the reason and both vocabularies: {stderr}"
    );
}

#[test]
fn generation_goes_on_without_a_refused_drafter() {
    let m = model_path("smollm2-135m");
    let dir = foreign_draft_model();
    let draft = dir.path().to_str().expect("utf-8 temp path");
    let plain = json(&generate(&m, &["--no-speculation"]));
    let spec = json(&generate(&m, &two_model_args(draft, &[])));
    assert_eq!(spec["token_ids"], plain["token_ids"]);
    assert_eq!(spec["stats"]["drafted"], 0);
}

#[test]
fn sampled_generation_with_two_model_completes() {
    let m = model_path("smollm2-135m");
    let m_str = m.to_str().expect("utf-8 model path");
    // A fixed k (`run` waits for every draft): the counts below do not hang on the
    // controller's choices.
    let mut args = vec![
        "--temperature",
        "0.8",
        "--seed",
        "7",
        "--fixed-draft",
        "--num-draft-tokens",
        "4",
    ];
    args.extend(two_model_args(m_str, &[]));
    let out = json(&generate(&m, &args));
    assert!(!out["text"].as_str().unwrap().is_empty(), "{out}");
    let stats = &out["stats"];
    // Sampling may end at EOS before the 40-token limit.
    let generated = stats["generated_tokens"].as_u64().unwrap();
    assert!((1..=40).contains(&generated), "{stats}");
    assert!(stats["drafted"].as_u64().unwrap() > 0, "{stats}");
    // The draft model is the target: its q equals p, so rejection sampling accepts most drafts.
    assert!(stats["acceptance_rate"].as_f64().unwrap() > 0.5, "{stats}");
}

#[test]
fn adaptive_draft_length_changes_nothing() {
    let spec = self_drafting_equals_plain(&["--adaptive-draft", "--num-draft-tokens", "6"]);
    let stats = &spec["stats"];
    let drafted = stats["drafted"].as_u64().unwrap();
    let rounds = stats["rounds"].as_u64().unwrap();
    assert!(drafted > 0 && rounds > 0, "the drafter drafted: {stats}");
    assert!(drafted <= 6 * rounds, "k stays within the maximum: {stats}");
}
