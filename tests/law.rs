//! The law over real models, through the `target-host generate` CLI: greedy output is one token
//! stream whatever the draft length, the prefill chunk, the prompt and the drafter.
//!
//! Seeded property cases: prompts of random length, `--num-draft-tokens` in 1..=64,
//! `--prefill-chunk` in 1..=1024 (log-uniform, so small chunks are common), drafters `ngram`,
//! `echo-drafter` and `chaos-drafter --mode random-ids`, on SmolLM2-135M (Q4_1) and
//! Qwen2.5-Coder-0.5B (Q4_K_M), native and f32 weights. Each case must equal the plain run
//! (`--no-speculation`, default chunk) of its prompt bit for bit. `SPECULA_LAW_SEED` picks
//! another seed; a failure prints the case to rerun.

use rand::{Rng, SeedableRng};
use specula_tests::{cli_generate, model_path};

/// Words prompts are made of (plain English and code, so ngram and echo find repeats).
const WORDS: &[&str] = &[
    "the",
    "sea",
    "is",
    "calm",
    "and",
    "blue",
    "fn",
    "main()",
    "{",
    "}",
    "let",
    "x",
    "=",
    "1;",
    "for",
    "i",
    "in",
    "0..10",
    "print(i)",
    "return",
    "a",
    "list",
    "of",
    "days:",
    "Monday,",
    "Tuesday,",
    "Wednesday,",
    "def",
    "f(x):",
    "if",
    "x",
    ">",
    "0:",
    "else:",
    "#",
    "note",
    "\n",
];

#[derive(Debug)]
struct Case {
    k: usize,
    chunk: usize,
    drafter: &'static str,
}

fn seed() -> u64 {
    std::env::var("SPECULA_LAW_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(18)
}

fn prompt(rng: &mut rand::rngs::StdRng, words: usize) -> String {
    (0..words)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// `prompts` random prompts of `max_words` words at most, each checked against `variants`
/// random cases, in every dtype.
fn law(model: &str, prompts: usize, variants: usize, max_words: usize, max_tokens: usize) {
    let path = model_path(model);
    let model = path.to_str().expect("utf-8 path");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    for p in 0..prompts {
        let words = rng.random_range(1..=max_words);
        let text = prompt(&mut rng, words);
        for dtype in ["native", "f32"] {
            let (_, plain) = cli_generate(
                model,
                "prompt",
                &text,
                max_tokens,
                &["--no-speculation", "--dtype", dtype],
            );
            assert!(!plain.is_empty(), "{model} {dtype}: generated nothing");
            for _ in 0..variants {
                let case = Case {
                    k: rng.random_range(1..=64),
                    // 2^(0..10): 1..=1024, small chunks as likely as large ones.
                    chunk: (2f64.powf(rng.random_range(0.0..10.0)) as usize).clamp(1, 1024),
                    drafter: ["ngram", "echo-drafter", "chaos-drafter"][rng.random_range(0..3)],
                };
                let (k, chunk) = (case.k.to_string(), case.chunk.to_string());
                let mut extra = vec![
                    "--dtype",
                    dtype,
                    "--drafter",
                    case.drafter,
                    "--num-draft-tokens",
                    &k,
                    "--prefill-chunk",
                    &chunk,
                ];
                if case.drafter == "chaos-drafter" {
                    extra.extend(["--drafter-arg=--mode", "--drafter-arg=random-ids"]);
                }
                let (_, spec) = cli_generate(model, "prompt", &text, max_tokens, &extra);
                assert_eq!(
                    spec,
                    plain,
                    "{model} {dtype}, prompt {p} of {words} words (seed {}), {case:?}: differs from plain",
                    seed()
                );
            }
        }
    }
}

#[test]
fn greedy_output_is_one_stream_on_smollm2() {
    law("smollm2-135m", 2, 3, 300, 24);
}

#[test]
fn greedy_output_is_one_stream_on_qwen_coder_0_5b() {
    law("qwen2.5-coder-0.5b", 1, 2, 200, 16);
}
