//! The law on real models: greedy output with the n-gram drafter (out of process, through the
//! `target-host` binary, and in process) equals greedy output without speculation, except at a
//! recorded near-tie of the target's top-2 logits.

use ngram::{NgramConfig, NgramDrafter};
use specula_models::loader::{load, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::{ForwardRequest, LoadOptions, WeightDType};
use specula_tests::{cli_generate, model_path};
use target_host::drafter::InProcess;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation};
use target_host::proposer::{Proposer, ProposerSlot};

/// Logit gap below which two candidates are a tie that float summation order may flip.
const NEAR_TIE: f32 = 1e-3;
const MAX_TOKENS: usize = 48;

/// Prompts of every kind the issue names: code edits, summaries, chat, stories.
const PROMPTS: &[(&str, &str)] = &[
    (
        "chat",
        "Rewrite this function so that it uses a for loop instead of while, and change nothing else:\n\
         def total(xs):\n    i = 0\n    s = 0\n    while i < len(xs):\n        s += xs[i]\n        i += 1\n    return s\n",
    ),
    (
        "chat",
        "Summarize in one sentence: The city council met on Tuesday to discuss the new bike lanes. \
         The council approved the bike lanes on Main Street and asked for a study of Oak Street.",
    ),
    ("chat", "What are three good habits for writing clear code?"),
    ("prompt", "Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    (
        "prompt",
        "fn main() {\n    let names = vec![\"ada\", \"grace\", \"linus\"];\n    for name in &names {\n        println!(\"hello {}\", name);\n    }\n    for name in &names {\n",
    ),
];

fn lib_generate(
    loaded: &LoadedModel,
    prompt_ids: &[u32],
    proposer: Option<Box<dyn Proposer>>,
) -> Generation {
    let speculation = match proposer {
        Some(_) => Speculation::On {
            num_draft_tokens: 4,
        },
        None => Speculation::Off,
    };
    let slot = ProposerSlot::new(proposer);
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt_ids.to_vec(),
        max_tokens: MAX_TOKENS,
        sampling: SamplingParams::default(),
        stop: vec![],
        speculation,
        logprobs: None,
        grammar: None,
    };
    generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &EngineConfig::default(),
        &req,
        &mut |_| Flow::Continue,
    )
    .expect("generate")
}

/// Gap between the target's two best logits after `context` (prompt + generated prefix).
fn top2_gap(loaded: &LoadedModel, context: &[u32]) -> f32 {
    let mut cache = loaded.model.new_cache();
    let out = loaded
        .model
        .prefill(context, &mut cache, &ForwardRequest::default())
        .expect("forward");
    let mut row: Vec<f32> = out
        .logits
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("logits");
    row.sort_by(|a, b| b.total_cmp(a));
    row[0] - row[1]
}

/// Index of the first difference that is not a near-tie of the target's top-2 logits there.
fn real_divergence(
    loaded: &LoadedModel,
    prompt: &[u32],
    plain: &[u32],
    spec: &[u32],
) -> Option<usize> {
    let i = plain
        .iter()
        .zip(spec)
        .position(|(a, b)| a != b)
        .or_else(|| (plain.len() != spec.len()).then_some(plain.len().min(spec.len())))?;
    let context: Vec<u32> = prompt.iter().chain(&plain[..i]).copied().collect();
    let gap = top2_gap(loaded, &context);
    if gap < NEAR_TIE {
        eprintln!("near-tie at token {i} (top-2 gap {gap:e}): outputs may differ from here on");
        None
    } else {
        Some(i)
    }
}

fn check_model(name: &str) {
    let path = model_path(name);
    let model = path.to_str().expect("utf-8 path");
    let loaded = load(&path, &LoadOptions::default()).expect("load model");
    let mut rounds_with_accepts = 0;
    for (kind, text) in PROMPTS {
        let (prompt_ids, cli_plain) =
            cli_generate(model, kind, text, MAX_TOKENS, &["--no-speculation"]);
        let (_, cli_spec) = cli_generate(model, kind, text, MAX_TOKENS, &["--drafter", "ngram"]);
        let plain = lib_generate(&loaded, &prompt_ids, None);
        assert_eq!(
            plain.token_ids, cli_plain,
            "{name}: library and CLI plain decoding differ"
        );
        let drafter = NgramDrafter::new(NgramConfig::default(), 16);
        let inproc = lib_generate(
            &loaded,
            &prompt_ids,
            Some(Box::new(InProcess::new(drafter))),
        );
        rounds_with_accepts += usize::from(inproc.stats.accepted > 0);
        for (label, spec) in [
            ("out-of-process", &cli_spec),
            ("in-process", &inproc.token_ids),
        ] {
            assert_eq!(
                real_divergence(&loaded, &prompt_ids, &plain.token_ids, spec),
                None,
                "{name} {label} ngram diverges from plain greedy on {text:?}\nplain {:?}\nspec  {:?}",
                plain.token_ids,
                spec
            );
        }
    }
    assert!(
        rounds_with_accepts > 0,
        "{name}: the n-gram drafter never got a draft accepted"
    );
}

#[test]
fn ngram_greedy_equals_plain_smollm2() {
    check_model("smollm2-135m");
}

#[test]
fn ngram_greedy_equals_plain_qwen05b() {
    check_model("qwen2.5-coder-0.5b");
}

/// The verify window: logits of a chunk forward equal those of one-token steps on the real
/// model (bit for bit when quantized), also after a rollback of the cache.
#[test]
fn verify_window_matches_stepwise_decoding() {
    for model in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
        for dtype in [WeightDType::F32, WeightDType::Native] {
            verify_window_matches_stepwise(model, dtype);
        }
    }
}

fn verify_window_matches_stepwise(name: &str, dtype: WeightDType) {
    let path = model_path(name);
    let opts = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    let loaded = load(&path, &opts).expect("load model");
    let model = &loaded.model;
    let prompt = loaded
        .tokenizer
        .encode(
            "def total(xs):\n    s = 0\n    for x in xs:\n",
            specula_models::tokenizer::Special::Parse,
        )
        .expect("encode");
    let window = [262u32, 479, 3725, 198, 198, 1348];
    let rows = |cache: &mut specula_models::KvCache, chunk: &[u32], k: usize| -> Vec<Vec<f32>> {
        let req = ForwardRequest {
            logits: specula_models::Rows::Last(k),
            ..ForwardRequest::default()
        };
        model
            .forward(chunk, cache, &req)
            .expect("forward")
            .logits
            .to_vec2()
            .expect("rows")
    };
    let mut stepwise = model.new_cache();
    model
        .prefill(&prompt, &mut stepwise, &ForwardRequest::default())
        .expect("prefill");
    let base = stepwise.len();
    let steps: Vec<Vec<f32>> = window
        .iter()
        .map(|&t| rows(&mut stepwise, &[t], 1).remove(0))
        .collect();

    let mut chunked = model.new_cache();
    model
        .prefill(&prompt, &mut chunked, &ForwardRequest::default())
        .expect("prefill");
    // A rejected window first, rolled back: it must leave no trace.
    rows(&mut chunked, &[9, 9, 9, 9], 4);
    chunked.truncate(base).expect("truncate");
    let chunk = rows(&mut chunked, &window, window.len());
    for (i, (a, b)) in steps.iter().zip(&chunk).enumerate() {
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-2,
            "{dtype:?} row {i}: chunk and step logits differ by {diff}"
        );
        assert_eq!(
            specula_models::sampling::argmax(a),
            specula_models::sampling::argmax(b),
            "{name} row {i}: argmax differs"
        );
    }
}
