//! The law with the Gemma 4 assistant drafting: for a random-weight Gemma 4 target
//! (`tests/fixtures/gemma4-tiny/full`: sliding and global layers, KV sharing, window 4) and the
//! random assistant made for it (`tests/fixtures/gemma4-assistant-tiny/plain`), greedy output
//! equals plain decoding whatever k, in process and through the drafter process, and at T = 1
//! rejection sampling keeps the target's distribution.
//!
//! K/V donor views: the drafter reads the donor layers in place from the host's KV pool (its
//! memfd region) and drafts exactly what it drafts from copied rows, on the tiny gemma4 and on
//! SmolLM2 (a random assistant written here); a torn epoch costs a round, never output; a
//! respawned drafter maps the region again; a protocol 1.1 drafter gets copies. The copied K/V
//! bytes are counted on both paths (0 with views).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use assistant::drafter::AssistantDrafter;
use dflash::WeightsSource;
use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_tests::tiny::write_tiny_tokenizer;
use specula_tests::{bin_path, cli_generate_json, json_ids};
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec, DrafterState, InProcess};
use target_host::drafter_args::target_info;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, Generation, GenerationRequest, Speculation};
use target_host::proposer::{
    Draft, DraftBatch, Proposer, ProposerSlot, SessionId, Shared, TapRows, Transfer, Verdict, Wants,
};

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
    fitted(loaded, &assistant_dir(), true)
}

/// The assistant at `dir` fitted to `loaded`, reading donor views (`views`) or copied rows.
fn fitted(loaded: &LoadedModel, dir: &Path, views: bool) -> Box<InProcess<AssistantDrafter>> {
    let info = target_info(&loaded.model, &loaded.tokenizer);
    let d = AssistantDrafter::for_target(WeightsSource::Path(dir.to_path_buf()), &info)
        .expect("the assistant fits the target");
    Box::new(match views {
        true => InProcess::new(d),
        false => InProcess::with_copies(d),
    })
}

fn run(
    loaded: &LoadedModel,
    with: bool,
    prompt: &[u32],
    n: usize,
    sampling: SamplingParams,
    k: usize,
) -> Generation {
    run_with(
        loaded,
        with.then(|| drafter(loaded) as Box<dyn Proposer>),
        prompt,
        n,
        sampling,
        k,
    )
}

fn run_with(
    loaded: &LoadedModel,
    proposer: Option<Box<dyn Proposer>>,
    prompt: &[u32],
    n: usize,
    sampling: SamplingParams,
    k: usize,
) -> Generation {
    let with = proposer.is_some();
    let slot = ProposerSlot::new(proposer);
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

/// `target-host generate --json` on the tiny gemma4; returns (ids, stats, transfer).
fn cli(model: &Path, extra: &[&str]) -> (Vec<u32>, serde_json::Value, serde_json::Value) {
    let model = model.to_str().expect("utf-8 path");
    let v = cli_generate_json(model, "prompt", "t5 t17 t33 t8 t90", 30, extra);
    (
        json_ids(&v, "token_ids"),
        v["stats"].clone(),
        v["transfer"].clone(),
    )
}

/// The drafter process reading the donor K/V in place from the host's pool (no K/V byte
/// copied), asking for copies instead, and speaking protocol 1.1 (copies whatever it asks):
/// greedy output unchanged, the same drafts accepted on every path.
#[test]
fn assistant_process_greedy_equals_plain_with_views_copies_and_protocol_1_1() {
    let (dir, _loaded) = target();
    let (plain, _, _) = cli(dir.path(), &["--no-speculation"]);
    let drafter = bin_path("assistant");
    let weights = format!("--drafter-arg=--weights={}", assistant_dir().display());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--drafter",
            drafter.to_str().expect("utf-8"),
            &weights,
            "--num-draft-tokens",
            "4",
            "--fixed-draft",
            // No deadline missed under load: every round drafts, on every path alike.
            "--draft-deadline-steps",
            "100000",
            "--draft-deadline-ms",
            "20000",
        ];
        args.extend_from_slice(extra);
        cli(dir.path(), &args)
    };
    let (views, vs, vt) = run(&[]);
    assert_eq!(views, plain, "the assistant changed the greedy output");
    assert!(
        vs["drafted"].as_u64().unwrap_or(0) > 0,
        "never drafted: {vs}"
    );
    assert_eq!(vt["kv_copied_bytes"], 0, "views copied K/V: {vt}");
    assert_eq!(vt["donor_maps"], 1, "{vt}");
    assert!(vt["donor_table_bytes"].as_u64().unwrap_or(0) > 0, "{vt}");
    for extra in [
        "--drafter-arg=--no-kv-views",
        "--drafter-arg=--protocol=1.1",
    ] {
        let (ids, stats, t) = run(&[extra]);
        assert_eq!(ids, plain, "{extra} changed the greedy output");
        assert!(
            t["kv_copied_bytes"].as_u64().unwrap_or(0) > 0,
            "{extra}: {t}"
        );
        assert_eq!(t["donor_maps"], 0, "{extra}: {t}");
        for key in ["drafted", "accepted"] {
            assert_eq!(
                stats[key], vs[key],
                "{extra}: {key} differs from the view path"
            );
        }
    }
}

/// The drafter process SIGKILLed mid-request: the respawned process is handed the donor region
/// again and drafts from it; the output is plain decoding's.
#[test]
fn a_respawned_assistant_maps_the_donor_region_again() {
    let (_dir, loaded) = target();
    let prompt = [5u32, 17, 33, 8, 90, 41];
    let plain = run(&loaded, false, &prompt, 40, SamplingParams::default(), 0);
    let spec = DrafterSpec::new(bin_path("assistant"))
        .with_args([format!("--weights={}", assistant_dir().display())]);
    let info = target_info(&loaded.model, &loaded.tokenizer);
    let patient = std::time::Duration::from_secs(20);
    let config = ClientConfig {
        draft_deadline: patient,
        ..ClientConfig::default()
    };
    let client = DrafterClient::start(spec, info, config).expect("start");
    let (shared, handle) = Shared::new(client);
    let slot = ProposerSlot::new(Some(Box::new(shared)));
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt.to_vec(),
        max_tokens: 40,
        sampling: SamplingParams::default(),
        stop: vec![],
        speculation: Speculation::On {
            num_draft_tokens: 3,
        },
        logprobs: None,
        grammar: None,
    };
    let killed = Arc::new(Mutex::new(None));
    let mut tokens = 0;
    // No deadline missed under load: the rounds after the respawn draft.
    let engine = EngineConfig {
        draft_deadline_steps: 1e5,
        draft_deadline_cap: patient,
        ..EngineConfig::default()
    };
    let gen = generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &engine,
        &req,
        &mut |_| {
            tokens += 1;
            if tokens == 8 {
                let mut c = handle.lock().expect("client");
                let pid = c.pid().expect("a running drafter");
                let drafted = c.stats().drafted;
                let status = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status()
                    .expect("kill");
                assert!(status.success());
                *killed.lock().expect("killed") = Some(drafted);
                // Let the host notice (a ping that goes unanswered) and respawn before the next
                // round, so the rest of the request runs on the new process.
                assert!(!c.barrier(), "a killed drafter answered");
                let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while c.poll() != DrafterState::Ready {
                    assert!(std::time::Instant::now() < until, "no respawn");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
            Flow::Continue
        },
    )
    .expect("generate");
    assert_eq!(
        gen.token_ids, plain.token_ids,
        "the kill changed the output"
    );
    let before = killed.lock().expect("killed").expect("killed the drafter");
    let c = handle.lock().expect("client");
    let (stats, t) = (c.stats(), c.transfer());
    assert_eq!(stats.restarts, 1, "{stats:?}");
    assert_eq!(
        t.donor_maps, 2,
        "the new process was not handed the region: {t:?}"
    );
    assert_eq!(t.kv_copied_bytes, 0, "{t:?}");
    assert!(
        stats.drafted > before,
        "no drafts after the respawn: {stats:?}"
    );
}

/// What a proposer was told and answered, in order.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Drafted(Vec<u32>),
    Committed(usize),
    Advanced,
    /// The commit whose donor table was torn.
    Torn,
}

/// Forwards to `inner`, logging every draft; announces the donor table of the `tear_at`-th
/// commit with its first block under another epoch, as a reader sees a block the host reused.
struct Recording {
    inner: Box<dyn Proposer>,
    log: Vec<Event>,
    tear_at: Option<usize>,
    commits: usize,
}

impl Proposer for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn wants(&self) -> Wants {
        self.inner.wants()
    }
    fn open(&mut self, s: SessionId, ctx: &[u32], p: &SamplingParams, taps: Option<&TapRows>) {
        self.inner.open(s, ctx, p, taps);
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let drafts = self.inner.draft(batch);
        let tokens = drafts.iter().map(|d| Event::Drafted(d.tokens.clone()));
        self.log.extend(tokens);
        drafts
    }
    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.commits += 1;
        let torn = match (self.tear_at == Some(self.commits), verdict.taps) {
            (true, Some(taps)) if taps.donor.is_some() => {
                let mut taps = taps.clone();
                taps.donor.as_mut().expect("checked").table[0].epoch += 2;
                Some(taps)
            }
            _ => None,
        };
        match &torn {
            Some(taps) => {
                self.log.push(Event::Torn);
                let v = Verdict {
                    taps: Some(taps),
                    ..verdict.clone()
                };
                self.inner.commit(session, &v);
            }
            None => {
                self.log.push(Event::Committed(verdict.accepted));
                self.inner.commit(session, verdict);
            }
        }
    }
    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        self.log.push(Event::Advanced);
        self.inner.advance(session, ids, taps);
    }
    fn close(&mut self, session: SessionId) {
        self.inner.close(session);
    }
    fn incarnation(&self) -> u64 {
        self.inner.incarnation()
    }
    fn transfer(&self) -> Transfer {
        self.inner.transfer()
    }
}

/// Runs `proposer` recorded (tearing the `tear_at`-th commit's table); returns the generation,
/// the log and what reached the drafter.
fn recorded(
    loaded: &LoadedModel,
    proposer: Box<dyn Proposer>,
    tear_at: Option<usize>,
    prompt: &[u32],
    sampling: SamplingParams,
) -> (Generation, Vec<Event>, Transfer) {
    let (shared, handle) = Shared::new(Recording {
        inner: proposer,
        log: Vec::new(),
        tear_at,
        commits: 0,
    });
    let gen = run_with(loaded, Some(Box::new(shared)), prompt, 40, sampling, 3);
    let rec = handle.lock().expect("recording");
    (gen, rec.log.clone(), rec.transfer())
}

fn drafts(log: &[Event]) -> usize {
    log.iter()
        .filter(|e| matches!(e, Event::Drafted(t) if !t.is_empty()))
        .count()
}

/// The view path and the copy path draft the same tokens, round by round (greedy and sampled),
/// and only the copy path copies K/V; the output is plain decoding's.
#[test]
fn donor_views_draft_exactly_what_copied_rows_draft_on_tiny_gemma4() {
    let (_dir, loaded) = target();
    let prompt = [5u32, 17, 33, 8, 90, 41];
    let plain = run(&loaded, false, &prompt, 40, SamplingParams::default(), 0);
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: Some(7),
        ..SamplingParams::default()
    };
    for sampling in [SamplingParams::default(), sampled] {
        let dir = assistant_dir();
        let (views, vlog, vt) = recorded(
            &loaded,
            fitted(&loaded, &dir, true),
            None,
            &prompt,
            sampling.clone(),
        );
        let (copies, clog, ct) = recorded(
            &loaded,
            fitted(&loaded, &dir, false),
            None,
            &prompt,
            sampling.clone(),
        );
        assert_eq!(vlog, clog, "views and copies drafted differently");
        assert!(drafts(&vlog) > 3, "{vlog:?}");
        assert_eq!(views.token_ids, copies.token_ids);
        if sampling.temperature == 0.0 {
            assert_eq!(views.token_ids, plain.token_ids, "views changed the output");
        }
        assert_eq!(vt.kv_copied_bytes, 0, "{vt:?}");
        assert!(vt.donor_maps >= 1 && vt.donor_table_bytes > 0, "{vt:?}");
        assert!(ct.kv_copied_bytes > 0 && ct.donor_maps == 0, "{ct:?}");
    }
}

/// A table whose epoch no longer matches its block (the host reused it): the drafter drafts
/// nothing that round, drafts again once a good table comes, and the output is unchanged.
#[test]
fn a_torn_donor_epoch_skips_the_round_and_keeps_the_output() {
    let (_dir, loaded) = target();
    let prompt = [5u32, 17, 33, 8, 90, 41];
    let plain = run(&loaded, false, &prompt, 40, SamplingParams::default(), 0);
    let views = fitted(&loaded, &assistant_dir(), true);
    let (gen, log, _) = recorded(&loaded, views, Some(2), &prompt, SamplingParams::default());
    assert_eq!(
        gen.token_ids, plain.token_ids,
        "a torn view changed the output"
    );
    let torn = log
        .iter()
        .position(|e| *e == Event::Torn)
        .expect("torn once");
    let next = log[torn..]
        .iter()
        .find_map(|e| match e {
            Event::Drafted(t) => Some(t),
            _ => None,
        })
        .expect("a draft after the tear");
    assert!(next.is_empty(), "drafted from a torn view: {log:?}");
    assert!(drafts(&log[torn..]) > 0, "never drafted again: {log:?}");
}

/// A random assistant for SmolLM2 (ASSISTANT-FORMAT.md: one layer, H = 576, 9 q heads over the
/// last layer's 3 K/V heads, the target's lm_head), written into `dir`.
fn write_smollm2_assistant(dir: &Path) {
    use candle_core::{DType, Device, Tensor};
    let config = serde_json::json!({
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": 576,
        "use_ordered_embeddings": false,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 576, "num_hidden_layers": 1,
            "num_kv_shared_layers": 1, "layer_types": ["full_attention"],
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "global_head_dim": 64, "intermediate_size": 256,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
            },
            "max_position_embeddings": 8192, "vocab_size": 49152, "sliding_window": 512,
            "attention_k_eq_v": false, "enable_moe_block": false, "tie_word_embeddings": true
        }
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let dev = Device::Cpu;
    let randn =
        |shape: &[usize], std: f64| Tensor::randn(0f32, std as f32, shape, &dev).expect("randn");
    let ones = |n: usize| Tensor::ones(n, DType::F32, &dev).expect("ones");
    let mut t = std::collections::HashMap::new();
    t.insert(
        "pre_projection.weight".to_string(),
        randn(&[576, 1152], 0.03),
    );
    t.insert(
        "post_projection.weight".to_string(),
        randn(&[576, 576], 0.04),
    );
    let l = "model.layers.0";
    for norm in [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ] {
        t.insert(format!("{l}.{norm}.weight"), ones(576));
    }
    t.insert(
        format!("{l}.self_attn.q_proj.weight"),
        randn(&[576, 576], 0.04),
    );
    t.insert(format!("{l}.self_attn.q_norm.weight"), ones(64));
    t.insert(
        format!("{l}.self_attn.o_proj.weight"),
        randn(&[576, 576], 0.04),
    );
    t.insert(
        format!("{l}.mlp.gate_proj.weight"),
        randn(&[256, 576], 0.04),
    );
    t.insert(format!("{l}.mlp.up_proj.weight"), randn(&[256, 576], 0.04));
    t.insert(
        format!("{l}.mlp.down_proj.weight"),
        randn(&[576, 256], 0.06),
    );
    t.insert(format!("{l}.layer_scalar"), ones(1));
    t.insert("model.norm.weight".to_string(), ones(576));
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).expect("safetensors");
}

/// SmolLM2 with the donor views on: greedy output is plain decoding's, the view path drafts what
/// the copy path drafts, and no K/V byte is copied per round (the copy path: 1536 B a position).
#[test]
fn smollm2_with_donor_views_equals_plain_and_the_copy_path() {
    let path = specula_tests::model_path("smollm2-135m");
    let loaded = load(&path, &LoadOptions::default()).expect("load SmolLM2");
    let dir = tempfile::tempdir().expect("temp dir");
    write_smollm2_assistant(dir.path());
    let prompt = loaded
        .tokenizer
        .encode(
            "The capital of France is Paris, and the capital of Italy is",
            specula_models::tokenizer::Special::Plain,
        )
        .expect("encode");
    let plain = run(&loaded, false, &prompt, 40, SamplingParams::default(), 0);
    let greedy = SamplingParams::default;
    let (views, vlog, vt) = recorded(
        &loaded,
        fitted(&loaded, dir.path(), true),
        None,
        &prompt,
        greedy(),
    );
    let (copies, clog, ct) = recorded(
        &loaded,
        fitted(&loaded, dir.path(), false),
        None,
        &prompt,
        greedy(),
    );
    assert_eq!(views.token_ids, plain.token_ids, "views changed the output");
    assert_eq!(
        copies.token_ids, plain.token_ids,
        "copies changed the output"
    );
    assert_eq!(vlog, clog, "views and copies drafted differently");
    assert!(drafts(&vlog) > 3, "{vlog:?}");
    assert_eq!(vt.kv_copied_bytes, 0, "{vt:?}");
    // One donor layer (the last): 3 K/V heads × 64 × (K + V) × 4 bytes a position.
    assert_eq!(ct.kv_copied_bytes % 1536, 0, "{ct:?}");
    assert!(
        ct.kv_copied_bytes >= 1536 * (prompt.len() as u64 - 1),
        "{ct:?}"
    );
}
