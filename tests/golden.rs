//! Numerical golden tests: greedy decoding of real GGUF models against an independent reference.
//!
//! The fixtures in `tests/fixtures/golden/` come from `scripts/reference/forward_reference.py`: a
//! plain numpy forward (f32) over the dequantized GGUF tensors, with prompt ids from the
//! `tokenizers` package, so these tests depend neither on our tokenizer nor on candle. Regenerate:
//!
//! ```text
//! python scripts/reference/forward_reference.py --model smollm2-135m --out tests/fixtures/golden/smollm2-135m.json
//! ```
//!
//! * `f32`: dequantized weights must reproduce the reference greedy continuation token for token
//!   through the KV cache. A mismatch is tolerated only at a step where the reference's top-2 logit
//!   gap is below [`TIE_GAP`] (a near-tie that rounding may flip); the rest of that prompt is then
//!   skipped, since both continuations are legitimate from there.
//! * `native`: quantized matmuls are a different function, so exact agreement is not expected;
//!   the teacher-forced top-1 agreement must stay above [`NATIVE_MIN_AGREEMENT`].

use serde_json::Value;
use specula_models::{load_model, ForwardRequest, LoadOptions, Model, WeightDType};
use specula_tests::{model_path, workspace_root};

/// Reference top-2 gaps below this count as ties. numpy f32 and f64 forwards of SmolLM2 differ
/// by at most 4e-5 per logit (measured), so a gap can move by ~1e-4: 1e-3 leaves a 10x margin.
const TIE_GAP: f32 = 1e-3;

/// Largest allowed |our top-1 logit − reference top-1 logit| in f32 mode, while both agree.
/// It catches a wrong scale or norm that keeps the argmax. Measured: 8e-5 (SmolLM2), 6e-5 (Qwen2).
const LOGIT_TOL: f32 = 1e-3;

/// Tokens per prompt compared in native (quantized) mode.
const NATIVE_STEPS: usize = 16;

/// Minimum teacher-forced top-1 agreement of the native path with the f32 reference. Measured
/// 0.958 (SmolLM2, Q4_1) and 1.000 (Qwen2, Q5_0/Q6_K/Q8_0); a broken quantized kernel scores
/// near 0, so 0.75 catches it while leaving room for a few more near-tie flips.
const NATIVE_MIN_AGREEMENT: f64 = 0.75;

/// One prompt of a fixture.
struct Prompt {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    top2_gap: Vec<f32>,
    top1_logit: Vec<f32>,
}

/// A parsed fixture file.
struct Fixture {
    prompts: Vec<Prompt>,
}

fn array<'a>(v: &'a Value, key: &str, ctx: &str) -> &'a Vec<Value> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{ctx}: `{key}` is not an array"))
}

fn ids(v: &Value, key: &str, ctx: &str) -> Vec<u32> {
    array(v, key, ctx)
        .iter()
        .map(|x| {
            let n = x
                .as_u64()
                .unwrap_or_else(|| panic!("{ctx}: `{key}` holds a non-id {x}"));
            u32::try_from(n).unwrap_or_else(|_| panic!("{ctx}: `{key}` id {n} overflows u32"))
        })
        .collect()
}

fn floats(v: &Value, key: &str, ctx: &str) -> Vec<f32> {
    array(v, key, ctx)
        .iter()
        .map(|x| {
            x.as_f64()
                .unwrap_or_else(|| panic!("{ctx}: `{key}` holds a non-number {x}"))
                as f32
        })
        .collect()
}

/// The sha256 prefix `scripts/fetch-model` checks for `name` (the line `name) sha=...`).
fn fetch_model_sha(name: &str) -> String {
    let script = std::fs::read_to_string(workspace_root().join("scripts/fetch-model"))
        .expect("read scripts/fetch-model");
    let line = script
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{name})")))
        .unwrap_or_else(|| panic!("scripts/fetch-model has no case for {name}"));
    let sha = line
        .split("sha=")
        .nth(1)
        .expect("fetch-model case sets sha=");
    sha.split(';').next().unwrap_or(sha).trim().to_string()
}

/// Reads and checks `tests/fixtures/golden/<name>.json`.
fn fixture(name: &str) -> Fixture {
    let path = workspace_root().join(format!("tests/fixtures/golden/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(json["model"], name, "{}: wrong model", path.display());
    // The fixture must come from the very GGUF the tests load, or a mismatch means nothing.
    assert_eq!(
        json["gguf_sha256_prefix"].as_str(),
        Some(fetch_model_sha(name).as_str()),
        "{}: generated from another GGUF than scripts/fetch-model provides; regenerate it",
        path.display()
    );
    let prompts: Vec<Prompt> = array(&json, "prompts", &path.display().to_string())
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ctx = format!("{} prompt {i}", path.display());
            let prompt = Prompt {
                prompt_ids: ids(p, "prompt_ids", &ctx),
                greedy_ids: ids(p, "greedy_ids", &ctx),
                top2_gap: floats(p, "top2_gap", &ctx),
                top1_logit: floats(p, "top1_logit", &ctx),
            };
            let n = prompt.greedy_ids.len();
            assert!(n >= 32 && !prompt.prompt_ids.is_empty(), "{ctx}: too short");
            assert!(
                prompt.top2_gap.len() == n && prompt.top1_logit.len() == n,
                "{ctx}: per-step arrays differ in length"
            );
            prompt
        })
        .collect();
    assert!(
        prompts.len() >= 5,
        "{}: fewer than 5 prompts",
        path.display()
    );
    Fixture { prompts }
}

fn load(name: &str, dtype: WeightDType) -> Model {
    let path = model_path(name);
    let opts = LoadOptions {
        dtype,
        ..Default::default()
    };
    load_model(&path, &opts).unwrap_or_else(|e| panic!("load {name} as {dtype:?}: {e}"))
}

/// Index of the first maximum (lowest id on exact ties, like numpy's argmax).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits rows `[last_k, vocab]` of one forward.
fn forward_rows(
    model: &Model,
    tokens: &[u32],
    cache: &mut specula_models::KvCache,
    last_k: usize,
) -> Vec<Vec<f32>> {
    let req = ForwardRequest {
        logits: specula_models::Rows::Last(last_k),
        ..Default::default()
    };
    let out = model.forward(tokens, cache, &req).expect("forward");
    out.logits
        .to_vec2::<f32>()
        .expect("logits are [last_k, vocab] f32")
}

/// Greedy-decodes every prompt in f32 through the KV cache (prefill once, then one token at a
/// time) and asserts it follows the reference; prints the largest top-1 logit difference seen.
fn check_f32(name: &str) {
    let fx = fixture(name);
    let model = load(name, WeightDType::F32);
    let mut max_logit_diff = 0f32;
    let mut compared = 0;
    for (i, p) in fx.prompts.iter().enumerate() {
        let mut cache = model.new_cache();
        let mut row = forward_rows(&model, &p.prompt_ids, &mut cache, 1).remove(0);
        for (step, &want) in p.greedy_ids.iter().enumerate() {
            let got = argmax(&row);
            if got != want {
                let gap = p.top2_gap[step];
                assert!(
                    gap < TIE_GAP,
                    "{name} prompt {i} step {step}: got token {got} (logit {}), reference {want} \
                     (our logit {}, reference top-2 gap {gap}); reference continuation {:?}",
                    row[got as usize],
                    row[want as usize],
                    p.greedy_ids,
                );
                println!(
                    "{name} prompt {i}: near-tie at step {step} (gap {gap}), rest not compared"
                );
                break;
            }
            let diff = (row[want as usize] - p.top1_logit[step]).abs();
            assert!(
                diff <= LOGIT_TOL,
                "{name} prompt {i} step {step}: top-1 logit {} vs reference {} (|diff| {diff} > {LOGIT_TOL})",
                row[want as usize],
                p.top1_logit[step]
            );
            max_logit_diff = max_logit_diff.max(diff);
            compared += 1;
            if step + 1 < p.greedy_ids.len() {
                row = forward_rows(&model, &[got], &mut cache, 1).remove(0);
            }
        }
    }
    println!("{name} f32: {compared} tokens equal to the reference, max |top-1 logit diff| {max_logit_diff:.2e}");
}

/// Teacher-forced top-1 agreement of the native (quantized) path with the reference on the first
/// [`NATIVE_STEPS`] tokens of every prompt.
///
/// Teacher forcing (feeding the reference continuation, not our own) scores each step on its own:
/// one early flip in free-running decoding would otherwise count every later token as wrong.
fn check_native(name: &str) {
    let fx = fixture(name);
    let model = load(name, WeightDType::Native);
    let (mut agree, mut total) = (0usize, 0usize);
    for p in &fx.prompts {
        let mut tokens = p.prompt_ids.clone();
        tokens.extend_from_slice(&p.greedy_ids[..NATIVE_STEPS - 1]);
        let mut cache = model.new_cache();
        // Row j holds the prediction for greedy_ids[j].
        let rows = forward_rows(&model, &tokens, &mut cache, NATIVE_STEPS);
        for (row, &want) in rows.iter().zip(&p.greedy_ids) {
            agree += usize::from(argmax(row) == want);
            total += 1;
        }
    }
    let frac = agree as f64 / total as f64;
    println!("{name} native: {agree}/{total} = {frac:.3} teacher-forced top-1 agreement with the f32 reference");
    assert!(
        frac >= NATIVE_MIN_AGREEMENT,
        "{name} native: top-1 agreement {frac:.3} < {NATIVE_MIN_AGREEMENT}: the quantized path is broken"
    );
}

#[test]
fn golden_smollm2_f32_matches_reference() {
    check_f32("smollm2-135m");
}

#[test]
fn golden_qwen2_f32_matches_reference() {
    check_f32("qwen2.5-coder-0.5b");
}

#[test]
fn golden_smollm2_native_agrees() {
    check_native("smollm2-135m");
}

#[test]
fn golden_qwen2_native_agrees() {
    check_native("qwen2.5-coder-0.5b");
}
