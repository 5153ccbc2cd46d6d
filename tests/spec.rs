//! The law on real models: greedy output with the n-gram drafter (out of process, through the
//! `target-host` binary, and in process) equals greedy output without speculation, except at a
//! recorded near-tie of the target's top-2 logits.

use std::process::Command;

use ngram::{NgramConfig, NgramDrafter};
use specula_models::loader::{load, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::LoadOptions;
use specula_tests::{bin_path, model_path};
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation, Target};
use target_host::inprocess::InProcess;
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

/// Runs `target-host generate --json` and returns (prompt ids, generated ids).
fn cli_generate(model: &str, kind: &str, text: &str, drafter: &[&str]) -> (Vec<u32>, Vec<u32>) {
    let out = Command::new(bin_path("target-host"))
        .args(["generate", "--model", model, "--json", "--max-tokens"])
        .arg(MAX_TOKENS.to_string())
        .arg(format!("--{kind}"))
        .arg(text)
        .args(drafter)
        .output()
        .expect("run target-host");
    assert!(
        out.status.success(),
        "target-host generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap_or_else(|| panic!("{k} in {v}"))
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    (ids("prompt_ids"), ids("token_ids"))
}

fn lib_generate(
    loaded: &LoadedModel,
    prompt_ids: &[u32],
    proposer: Option<Box<dyn Proposer>>,
    logprobs: Option<usize>,
    events: &mut Vec<Option<(f32, f32)>>,
) -> Generation {
    let target = Target {
        model: &loaded.model,
        tokenizer: &loaded.tokenizer,
    };
    let speculation = match proposer {
        Some(_) => Speculation::On { num_draft_tokens: 4 },
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
        logprobs,
    };
    let mut cache = loaded.model.new_cache();
    generate(&target, &mut cache, &slot, &req, &mut |ev| {
        events.push(ev.logprob.map(|lp| (lp.top[0].1, lp.top[1].1)));
        Flow::Continue
    })
    .expect("generate")
}

/// Index of the first difference, when there is one that is not a near-tie of the plain run.
fn real_divergence(plain: &[u32], spec: &[u32], top2: &[Option<(f32, f32)>]) -> Option<usize> {
    let i = plain.iter().zip(spec).position(|(a, b)| a != b).or_else(|| {
        (plain.len() != spec.len()).then_some(plain.len().min(spec.len()))
    })?;
    let gap = top2.get(i).copied().flatten().map(|(a, b)| a - b);
    match gap {
        Some(g) if g < NEAR_TIE => {
            eprintln!("near-tie at token {i} (gap {g:e}): outputs may differ from here on");
            None
        }
        _ => Some(i),
    }
}

fn check_model(name: &str) {
    let path = model_path(name);
    let model = path.to_str().expect("utf-8 path");
    let loaded = load(&path, &LoadOptions::default()).expect("load model");
    let mut rounds_with_accepts = 0;
    for (kind, text) in PROMPTS {
        let (prompt_ids, cli_plain) = cli_generate(model, kind, text, &["--no-speculation"]);
        let (_, cli_spec) = cli_generate(model, kind, text, &["--drafter", "ngram"]);
        let mut top2 = Vec::new();
        let plain = lib_generate(&loaded, &prompt_ids, None, Some(2), &mut top2);
        assert_eq!(plain.token_ids, cli_plain, "{name}: library and CLI plain decoding differ");
        let drafter = NgramDrafter::new(NgramConfig::default(), 16);
        let inproc = lib_generate(
            &loaded,
            &prompt_ids,
            Some(Box::new(InProcess::new(drafter))),
            None,
            &mut Vec::new(),
        );
        rounds_with_accepts += usize::from(inproc.stats.accepted > 0);
        for (label, spec) in [("out-of-process", &cli_spec), ("in-process", &inproc.token_ids)] {
            assert_eq!(
                real_divergence(&plain.token_ids, spec, &top2),
                None,
                "{name} {label} ngram diverges from plain greedy on {text:?}\nplain {:?}\nspec  {:?}",
                plain.token_ids,
                spec
            );
        }
    }
    assert!(rounds_with_accepts > 0, "{name}: the n-gram drafter never got a draft accepted");
}

#[test]
fn ngram_greedy_equals_plain_smollm2() {
    check_model("smollm2-135m");
}

#[test]
fn ngram_greedy_equals_plain_qwen05b() {
    check_model("qwen2.5-coder-0.5b");
}
