//! The law with the Gemma 4 assistant drafting: for a random-weight Gemma 4 target
//! (`tests/fixtures/gemma4-tiny/full`: sliding and global layers, KV sharing, window 4) and the
//! random assistant made for it (`tests/fixtures/gemma4-assistant-tiny/plain`), greedy output
//! equals plain decoding whatever k, in process and through the drafter process, and at T = 1
//! rejection sampling keeps the target's distribution.

use std::path::{Path, PathBuf};

use assistant::drafter::AssistantDrafter;
use dflash::WeightsSource;
use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_tests::tiny::write_tiny_tokenizer;
use specula_tests::{bin_path, cli_generate_json, json_ids};
use target_host::drafter::InProcess;
use target_host::drafter_args::target_info;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation};
use target_host::proposer::ProposerSlot;

use specula_tests::stats::{chi_square, critical};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn assistant_dir() -> PathBuf {
    fixtures().join("gemma4-assistant-tiny/plain")
}

/// The tiny Gemma 4 target in a temporary HF folder with a word-level tokenizer.
fn target() -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().expect("temp dir");
    let src = fixtures().join("gemma4-tiny/full");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy the fixture");
    }
    write_tiny_tokenizer(dir.path(), 128).expect("tokenizer");
    let loaded = load(dir.path(), &LoadOptions::default()).expect("load the tiny gemma4");
    (dir, loaded)
}

fn drafter(loaded: &LoadedModel) -> Box<InProcess<AssistantDrafter>> {
    let info = target_info(&loaded.model, &loaded.tokenizer);
    let d = AssistantDrafter::for_target(WeightsSource::Path(assistant_dir()), &info)
        .expect("the assistant fits the tiny gemma4");
    Box::new(InProcess::new(d))
}

fn run(
    loaded: &LoadedModel,
    with: bool,
    prompt: &[u32],
    n: usize,
    sampling: SamplingParams,
    k: usize,
) -> Generation {
    let slot = ProposerSlot::new(with.then(|| drafter(loaded) as Box<_>));
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt.to_vec(),
        max_tokens: n,
        sampling,
        stop: vec![],
        speculation: match with {
            false => Speculation::Off,
            true => Speculation::On {
                num_draft_tokens: k,
            },
        },
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

#[test]
fn assistant_greedy_equals_plain_on_tiny_gemma4() {
    let (_dir, loaded) = target();
    // Long enough that the sliding donor (window 4) drops rows, short of the 64 positions.
    for prompt in [&[5u32, 17, 33, 8, 90, 41][..], &[7, 3]] {
        let plain = run(&loaded, false, prompt, 40, SamplingParams::default(), 0);
        assert!(plain.token_ids.len() > 8, "generated {:?}", plain.token_ids);
        for k in [1, 3, 8] {
            let spec = run(&loaded, true, prompt, 40, SamplingParams::default(), k);
            assert_eq!(spec.token_ids, plain.token_ids, "k={k} prompt {prompt:?}");
            assert!(spec.stats.drafted > 0, "k={k}: the assistant never drafted");
        }
    }
}

/// At T = 1 the committed tokens keep the target's distribution with the assistant sampling its
/// drafts (with its `q` rows).
#[test]
fn assistant_sampling_keeps_the_target_distribution() {
    let (_dir, loaded) = target();
    let vocab = loaded.model.config().vocab_size;
    let prompt = [11, 12, 13, 14, 15, 16];
    let (positions, runs) = (3, 2000u64);
    let histogram = |with: bool| {
        let mut h = vec![vec![0usize; vocab]; positions];
        let mut stats = (0, 0);
        for seed in 0..runs {
            let sampling = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let out = run(&loaded, with, &prompt, positions, sampling, 4);
            for (i, &t) in out.token_ids.iter().enumerate() {
                h[i][t as usize] += 1;
            }
            stats.0 += out.stats.drafted;
            stats.1 += out.stats.accepted;
        }
        (h, stats)
    };
    let (plain, _) = histogram(false);
    let (spec, (drafted, accepted)) = histogram(true);
    assert!(
        drafted > 0 && accepted > 0,
        "drafted {drafted}, accepted {accepted}"
    );
    for i in 0..positions {
        let (stat, df) = chi_square(&plain[i], &spec[i]);
        assert!(
            stat < critical(df),
            "position {i}: chi2 {stat:.1} >= {:.1} (df {df})",
            critical(df)
        );
    }
}

/// `target-host generate --json` on the tiny gemma4; returns (ids, drafted).
fn cli(model: &Path, extra: &[&str]) -> (Vec<u32>, u64) {
    let model = model.to_str().expect("utf-8 path");
    let v = cli_generate_json(model, "prompt", "t5 t17 t33 t8 t90", 30, extra);
    let drafted = v["stats"]["drafted"].as_u64().unwrap_or(0);
    (json_ids(&v, "token_ids"), drafted)
}

/// The drafter process, K/V rows over shared memory: greedy output unchanged, drafts made.
#[test]
fn assistant_process_greedy_equals_plain_on_tiny_gemma4() {
    let (dir, _loaded) = target();
    let (plain, _) = cli(dir.path(), &["--no-speculation"]);
    let drafter = bin_path("assistant");
    let weights = format!("--drafter-arg=--weights={}", assistant_dir().display());
    let (spec, drafted) = cli(
        dir.path(),
        &[
            "--drafter",
            drafter.to_str().expect("utf-8"),
            &weights,
            "--num-draft-tokens",
            "4",
            "--fixed-draft",
        ],
    );
    assert_eq!(spec, plain, "the assistant changed the greedy output");
    assert!(drafted > 0, "the assistant process never drafted");
}
