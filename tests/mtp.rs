//! The law with the native MTP drafter: greedy output equals `--no-speculation` on SmolLM2-135M
//! with the head trained for it (`drafters/weights/smollm2-135m/mtp`, found by the drafter from
//! the target's identity) and on tiny random targets of every layout (the module in the target's
//! own checkpoint); sampled output keeps the target's distribution (chi-square).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::testing::TinyModel;
use specula_models::WeightDType;
use specula_tests::proposers::{check_confidence_cut, Recording};
use specula_tests::stats::{chi_square, critical};
use specula_tests::tiny::write_tiny_tokenizer;
use specula_tests::{bin_path, cli_generate_json, json_ids, model_path};
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec};
use target_host::drafter_args::target_info;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation};
use target_host::proposer::{Proposer, ProposerSlot};

const MAX_TOKENS: usize = 40;

/// A chat prompt of each workload kind, and a plain completion.
const PROMPTS: &[(&str, &str)] = &[
    (
        "chat",
        "Write a Python function that returns the factorial of n.",
    ),
    ("chat", "What are three good habits for writing clear code?"),
    (
        "prompt",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ),
];

/// `target-host generate --json` on `model` with `extra`; returns (generated ids, accepted).
fn cli_run(model: &std::path::Path, kind: &str, text: &str, extra: &[&str]) -> (Vec<u32>, u64) {
    let model = model.to_str().expect("utf-8 path");
    let v = cli_generate_json(model, kind, text, MAX_TOKENS, extra);
    let accepted = v["stats"]["accepted"].as_u64().unwrap_or(0);
    (json_ids(&v, "token_ids"), accepted)
}

#[test]
fn mtp_greedy_equals_plain_smollm2() {
    let model = model_path("smollm2-135m");
    let drafter = bin_path("mtp");
    let drafter = drafter.to_str().expect("utf-8 path");
    let mut accepted = 0;
    for k in ["1", "3"] {
        for (kind, text) in PROMPTS {
            let (plain, _) = cli_run(&model, kind, text, &["--no-speculation"]);
            let args = [
                "--drafter",
                drafter,
                &format!("--drafter-arg=--max-draft={k}"),
                "--num-draft-tokens",
                k,
                "--fixed-draft",
                // Patient deadlines: at k = 1 one miss on a loaded machine stops drafting
                // until a probe comes back.
                "--draft-deadline-steps",
                "1000",
                "--draft-deadline-ms",
                "10000",
            ];
            let (spec, acc) = cli_run(&model, kind, text, &args);
            assert_eq!(
                spec, plain,
                "mtp k={k} changed the greedy output of {text:?}"
            );
            accepted += acc;
        }
    }
    assert!(accepted > 0, "mtp: no draft was ever accepted");
}

// ------------------------------------------------------------------ tiny random targets

/// A tiny random target (`llama`, `qwen2`, `qwen3` or `mimo`) whose own checkpoint carries a
/// random MTP module in `layout` (`deepseek`, `qwen3_next`, `mimo`), as the published models
/// ship it: the drafter finds it there. Keep the `TempDir` alive while the model is used.
fn tiny_target_with_mtp(arch: &str, layout: &str, seed: u64) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = if arch == "mimo" { "qwen2" } else { arch };
    let tiny = TinyModel::new(base, seed).expect("tiny model");
    tiny.write_hf_dir(dir.path()).expect("write tiny model");
    let c = TinyModel::tiny_config(base).expect("tiny config");
    write_tiny_tokenizer(dir.path(), c.vocab_size).expect("tokenizer");
    if arch == "mimo" {
        let path = dir.path().join("config.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["model_type"] = "mimo".into();
        json["num_nextn_predict_layers"] = 1.into();
        std::fs::write(&path, json.to_string()).unwrap();
    }
    let (h, hd, inter) = (c.hidden_size, c.head_dim(), c.intermediate_size);
    let (q, kv) = (c.num_attention_heads * hd, c.kv_heads() * hd);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x004d_5450);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut put = |name: String, dims: &[usize], centre: f32| {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| centre + (rng.random::<f32>() - 0.5) * 0.3)
            .collect();
        tensors.insert(name, Tensor::from_vec(data, dims, &Device::Cpu).unwrap());
    };
    let norm = if layout == "qwen3_next" { 0.0 } else { 1.0 };
    let b = match layout {
        "deepseek" => {
            let p = format!("model.layers.{}.", c.num_hidden_layers);
            for n in ["enorm", "hnorm", "shared_head.norm"] {
                put(format!("{p}{n}.weight"), &[h], norm);
            }
            put(format!("{p}eh_proj.weight"), &[h, 2 * h], 0.0);
            p
        }
        "qwen3_next" => {
            for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
                put(format!("mtp.{n}.weight"), &[h], norm);
            }
            put("mtp.fc.weight".into(), &[h, 2 * h], 0.0);
            "mtp.layers.0.".to_string()
        }
        _ => {
            let p = "model.mtp_layers.0.".to_string();
            for n in ["token_layernorm", "hidden_layernorm", "final_layernorm"] {
                put(format!("{p}{n}.weight"), &[h], norm);
            }
            put(format!("{p}input_proj.weight"), &[h, 2 * h], 0.0);
            p
        }
    };
    for n in ["input_layernorm", "post_attention_layernorm"] {
        put(format!("{b}{n}.weight"), &[h], norm);
    }
    for (n, rows) in [("q", q), ("k", kv), ("v", kv)] {
        put(format!("{b}self_attn.{n}_proj.weight"), &[rows, h], 0.0);
        if matches!(arch, "qwen2" | "mimo") {
            put(format!("{b}self_attn.{n}_proj.bias"), &[rows], 0.0);
        }
    }
    put(format!("{b}self_attn.o_proj.weight"), &[h, q], 0.0);
    if arch == "qwen3" {
        put(format!("{b}self_attn.q_norm.weight"), &[hd], norm);
        put(format!("{b}self_attn.k_norm.weight"), &[hd], norm);
    }
    put(format!("{b}mlp.gate_proj.weight"), &[inter, h], 0.0);
    put(format!("{b}mlp.up_proj.weight"), &[inter, h], 0.0);
    put(format!("{b}mlp.down_proj.weight"), &[h, inter], 0.0);
    candle_core::safetensors::save(&tensors, dir.path().join("mtp.safetensors")).unwrap();
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..LoadOptions::default()
    };
    let loaded = load(dir.path(), &opts).expect("load the tiny target");
    (dir, loaded)
}

/// The drafter on `loaded`, waited for (a tiny target's step is microseconds: the default
/// deadline of a few target steps would drop every draft). It proposes every draft asked for
/// (its own `--min-confidence` is off by default), each with its probability as confidence.
fn mtp_slot(loaded: &LoadedModel, k: usize) -> ProposerSlot {
    ProposerSlot::new(Some(mtp_client(loaded, k)))
}

/// The MTP drafter process, started for `loaded` with `--max-draft=k`.
fn mtp_client(loaded: &LoadedModel, k: usize) -> Box<dyn Proposer> {
    let spec = DrafterSpec::new(bin_path("mtp")).with_args([format!("--max-draft={k}")]);
    let config = ClientConfig {
        draft_deadline: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    let target = target_info(&loaded.model, &loaded.tokenizer);
    let client = DrafterClient::start(spec, target, config).expect("the MTP drafter starts");
    Box::new(client)
}

fn waiting_engine() -> EngineConfig {
    EngineConfig {
        draft_deadline_steps: 1e9,
        draft_deadline_cap: Duration::from_secs(10),
        ..EngineConfig::default()
    }
}

fn run(loaded: &LoadedModel, slot: &ProposerSlot, req: &GenerationRequest) -> Generation {
    generate(
        &loaded.model,
        &loaded.tokenizer,
        slot,
        &waiting_engine(),
        req,
        &mut |_| Flow::Continue,
    )
    .expect("generate")
}

fn request(
    session: u64,
    prompt: &[u32],
    max: usize,
    sampling: SamplingParams,
    k: usize,
) -> GenerationRequest {
    GenerationRequest {
        session,
        prompt_ids: prompt.to_vec(),
        max_tokens: max,
        sampling,
        stop: vec![],
        speculation: match k {
            0 => Speculation::Off,
            k => Speculation::On {
                num_draft_tokens: k,
            },
        },
        logprobs: None,
        grammar: None,
    }
}

/// Greedy output through the MTP drafter equals plain decoding on a tiny target per layout and
/// block (the module read from the target's own checkpoint), at k = 1 and 3.
#[test]
fn mtp_greedy_equals_plain_on_tiny_targets_of_every_layout() {
    let prompt = [5, 17, 33, 8, 40, 41];
    for (arch, layout) in [
        ("llama", "deepseek"),
        ("qwen3", "deepseek"),
        ("qwen3", "qwen3_next"),
        ("qwen2", "qwen3_next"),
        ("mimo", "mimo"),
    ] {
        let (_dir, loaded) = tiny_target_with_mtp(arch, layout, 7);
        let none = ProposerSlot::new(None);
        let plain = run(
            &loaded,
            &none,
            &request(1, &prompt, 24, SamplingParams::default(), 0),
        );
        assert!(plain.token_ids.len() > 4, "{arch}: generated too little");
        for k in [1, 3] {
            let slot = mtp_slot(&loaded, k);
            let spec = run(
                &loaded,
                &slot,
                &request(2, &prompt, 24, SamplingParams::default(), k),
            );
            assert_eq!(spec.token_ids, plain.token_ids, "{arch}/{layout} k={k}");
            assert!(
                spec.stats.drafted > 0,
                "{arch}/{layout} k={k}: the drafter never drafted"
            );
        }
    }
}

/// At temperature 1 the tokens committed with the MTP drafter's sampled drafts (its own `q`)
/// have the target's distribution: the chi-square test of `tests/generate.rs`, per position.
#[test]
fn mtp_sampled_output_keeps_the_target_distribution() {
    let (_dir, loaded) = tiny_target_with_mtp("llama", "deepseek", 21);
    let vocab = loaded.model.config().vocab_size;
    let prompt = [11, 12, 13];
    let (positions, runs) = (3, 2000u64);
    let none = ProposerSlot::new(None);
    let slot = mtp_slot(&loaded, 3);
    let (mut drafted, mut accepted) = (0, 0);
    let mut histogram = |slot: &ProposerSlot, k: usize| {
        let mut h = vec![vec![0usize; vocab]; positions];
        for seed in 0..runs {
            let sampling = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let out = run(
                &loaded,
                slot,
                &request(seed + 1, &prompt, positions, sampling, k),
            );
            drafted += out.stats.drafted;
            accepted += out.stats.accepted;
            for (i, &t) in out.token_ids.iter().enumerate() {
                h[i][t as usize] += 1;
            }
        }
        h
    };
    let plain = histogram(&none, 0);
    let spec = histogram(&slot, 3);
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

/// The host alone cuts by confidence, and only under the controller. A random-weight head is
/// rarely sure of its drafts: each carries its own probability (mostly near 1 / vocabulary).
/// Under the controller the host verifies a draft's leading tokens only while their reach (the
/// product of their confidences) stays at or above its floor, which is never under
/// `CONFIDENCE_FLOOR` (0.1) and otherwise depends on the measured verify cost: so the rule is
/// checked per round against that lowest floor, and every token the host did not verify is
/// counted as cut. Under a fixed k the same drafter's drafts are all verified. The output is
/// plain's either way.
#[test]
fn the_host_cuts_the_mtp_drafters_unsure_drafts_under_the_controller_only() {
    let (_dir, loaded) = tiny_target_with_mtp("llama", "deepseek", 7);
    let prompt = [5, 17, 33, 8, 40, 41];
    let none = ProposerSlot::new(None);
    let plain = run(
        &loaded,
        &none,
        &request(1, &prompt, 24, SamplingParams::default(), 0),
    );
    let slot = mtp_slot(&loaded, 3);
    let fixed = run(
        &loaded,
        &slot,
        &request(2, &prompt, 24, SamplingParams::default(), 3),
    );
    assert_eq!(fixed.token_ids, plain.token_ids, "fixed k");
    assert!(
        fixed.stats.drafted >= 2 * fixed.stats.rounds && fixed.stats.rounds > 0,
        "a fixed k verifies the drafts as sent (3 a round, fewer only at the end): {:?}",
        fixed.stats
    );
    assert_eq!(fixed.stats.confidence_cut, 0, "a fixed k is never cut");

    // Several prompts, so that the rounds the controller asks for include unsure drafts
    // whatever it decides on a loaded machine (one prompt's run may draft only once or twice).
    let rounds = Arc::new(Mutex::new(Vec::new()));
    let recording = Recording::new(mtp_client(&loaded, 3), 0, &rounds);
    let recorded = ProposerSlot::new(Some(Box::new(recording)));
    let (mut cut, mut forwards, mut plain_forwards) = (0, 0, 0);
    for (i, prompt) in [&prompt[..], &[9, 3, 27, 61], &[44, 2, 2, 19, 7], &[12, 50]]
        .into_iter()
        .enumerate()
    {
        let session = 10 + 2 * i as u64;
        let alone = run(
            &loaded,
            &none,
            &request(session, prompt, 24, SamplingParams::default(), 0),
        );
        let mut req = request(session + 1, prompt, 24, SamplingParams::default(), 0);
        req.speculation = Speculation::Adaptive {
            max_draft_tokens: 3,
        };
        let controlled = run(&loaded, &recorded, &req);
        assert_eq!(
            controlled.token_ids, alone.token_ids,
            "controller, {prompt:?}"
        );
        cut += controlled.stats.confidence_cut;
        forwards += controlled.stats.target_forwards;
        plain_forwards += alone.stats.target_forwards;
    }
    let rounds = rounds.lock().expect("lock").clone();
    assert!(!rounds.is_empty(), "the controller never asked the drafter");
    let unsure = check_confidence_cut(&rounds, cut);
    assert!(
        unsure > 0 && cut >= unsure,
        "a random head sends unsure drafts, and the host cuts them: {rounds:?}"
    );
    assert!(
        forwards <= plain_forwards,
        "every forward still commits a token: {forwards} vs plain {plain_forwards}"
    );
}
