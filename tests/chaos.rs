//! Misbehaving drafters against the real model: whatever the drafter does (random or
//! out-of-vocabulary ids, too many ids, NaN probabilities, sleeping past the deadline, exiting
//! mid-request, speaking an old protocol, refusing the target), the request completes with
//! exactly the plain greedy output.

use specula_tests::{cli_generate, model_path};

const PROMPT: &str = "List the days of the week, then the months of the year.";

#[test]
fn misbehaving_drafters_never_change_the_output() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let (_, plain) = cli_generate(model, "chat", PROMPT, 40, &["--no-speculation"]);
    assert!(!plain.is_empty());
    for mode in [
        "random-ids",
        "oov-ids",
        "too-many",
        "nan-q",
        "sleep-past-deadline",
        "exit-mid-request",
        "wrong-major",
        "refuse-target",
    ] {
        let mode_arg = format!("--drafter-arg={mode}");
        let mut extra = vec![
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            &mode_arg,
        ];
        // Short deadline: the sleeping drafter must cost one empty round, not the test's time.
        extra.extend(["--draft-deadline-ms", "50"]);
        if mode == "exit-mid-request" {
            extra.extend(["--drafter-arg=--after", "--drafter-arg=2"]);
        }
        let (_, spec) = cli_generate(model, "chat", PROMPT, 40, &extra);
        assert_eq!(spec, plain, "drafter mode {mode} changed the output");
    }
}

/// A drafter that asks for hidden taps and K/V rows of the real model gets them on every round
/// (none torn), and the output is unchanged.
#[test]
fn taps_reach_a_drafter_from_the_real_model() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("taps.log");
    let out_arg = format!("--drafter-arg={}", out.display());
    let (_, plain) = cli_generate(
        model,
        "prompt",
        "One, two, three, four,",
        24,
        &["--no-speculation"],
    );
    let (_, spec) = cli_generate(
        model,
        "prompt",
        "One, two, three, four,",
        24,
        &[
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            "--drafter-arg=taps-check",
            "--drafter-arg=--out",
            &out_arg,
        ],
    );
    assert_eq!(spec, plain);
    let log = std::fs::read_to_string(&out).expect("the drafter wrote its log");
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with("open ")),
        "no open in {log}"
    );
    assert!(
        lines.iter().filter(|l| l.starts_with("commit ")).count() >= 1,
        "no commit in {log}"
    );
    assert!(!log.contains("torn"), "torn taps: {log}");
}

/// A drafter path that names no runnable program is the user's error: a clear message and a
/// non-zero exit. A drafter that runs but speaks another protocol major is logged, naming
/// both versions, and generation goes on without speculation.
#[test]
fn bad_drafter_paths_and_old_protocols() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let dir = tempfile::tempdir().expect("temp dir");
    let not_exec = dir.path().join("drafter.txt");
    std::fs::write(&not_exec, "not a program").expect("write");
    let missing = dir.path().join("no-such-drafter");
    for (drafter, expected) in [
        (missing.to_str().expect("utf-8"), "not found"),
        (not_exec.to_str().expect("utf-8"), "not an executable"),
    ] {
        let out = generate_hi(model, &["--max-tokens", "2", "--drafter", drafter]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{drafter}: should fail");
        assert!(
            stderr.contains(expected),
            "{drafter}: stderr lacks {expected:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = generate_hi(
        model,
        &[
            "--max-tokens",
            "4",
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            "--drafter-arg=wrong-major",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("2.0") && stderr.contains(&specula_protocol::PROTOCOL_VERSION.to_string()),
        "versions not named: {stderr}"
    );
}

/// Runs `target-host generate --model MODEL --prompt Hi EXTRA...`.
fn generate_hi(model: &str, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(specula_tests::bin_path("target-host"))
        .args(["generate", "--model", model, "--prompt", "Hi"])
        .args(extra)
        .output()
        .expect("run target-host")
}
