//! The law through the scheduler: the greedy output of every request in a batch equals its solo
//! plain (`--no-speculation`) output, whatever else runs beside it, however its prompt is
//! chunked, and whatever the drafter does — on tiny random models with in-process drafters and
//! on the real SmolLM2 with the ngram, two-model and chaos drafter processes. Plus admission:
//! a bounded queue (429 with a retry delay), and a cancelled request freeing its K/V at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use specula_models::WeightDType;
use specula_tests::proposers::{BadProposer, ScriptProposer};
use specula_tests::tiny::tiny_loaded;
use specula_tests::{bin_path, model_path};
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec};
use target_host::drafter_args::target_info;
use target_host::engine::{Core, Counters, Engine, EngineConfig, Event, Refusal, Sink};
use target_host::generation::{
    generate, Flow, Generation, GenerationError, GenerationRequest, Speculation, TokenEvent,
};
use target_host::proposer::{
    Draft, DraftBatch, Health, Proposer, ProposerSlot, TapRows, Verdict, Wants,
};

type Results = Arc<Mutex<Vec<Option<Result<Generation, GenerationError>>>>>;

/// Keeps a sequence's result in slot `i`.
struct Keep {
    results: Results,
    i: usize,
}

impl Sink for Keep {
    fn token(&mut self, _: TokenEvent<'_>) -> Flow {
        Flow::Continue
    }
    fn done(&mut self, result: Result<Generation, GenerationError>) {
        self.results.lock().unwrap()[self.i] = Some(result);
    }
    fn is_closed(&self) -> bool {
        false
    }
}

fn request(
    session: u64,
    prompt: &[u32],
    max_tokens: usize,
    speculation: Speculation,
) -> GenerationRequest {
    GenerationRequest {
        session,
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        speculation,
        logprobs: None,
        grammar: None,
    }
}

/// Runs every request of `reqs` at once through one core.
fn batch(
    loaded: &LoadedModel,
    proposer: Option<Box<dyn Proposer>>,
    config: EngineConfig,
    reqs: &[GenerationRequest],
) -> Vec<Generation> {
    batch_on(loaded, &ProposerSlot::new(proposer), config, reqs)
}

/// [`batch`] drafting through `slot`.
fn batch_on(
    loaded: &LoadedModel,
    slot: &ProposerSlot,
    config: EngineConfig,
    reqs: &[GenerationRequest],
) -> Vec<Generation> {
    run_all(&mut counted_core(loaded, slot, config).0, reqs)
}

/// A core over `loaded` drafting through `slot`, publishing into the counters returned.
fn counted_core<'a>(
    loaded: &'a LoadedModel,
    slot: &'a ProposerSlot,
    config: EngineConfig,
) -> (Core<'a>, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let core = Core::with_counters(
        &loaded.model,
        &loaded.tokenizer,
        slot,
        config,
        counters.clone(),
    )
    .expect("core");
    (core, counters)
}

/// Admits every request of `reqs` to `core` at once and steps until all are done.
fn run_all(core: &mut Core<'_>, reqs: &[GenerationRequest]) -> Vec<Generation> {
    let results: Results = Arc::new(Mutex::new(vec![None; reqs.len()]));
    for (i, req) in reqs.iter().enumerate() {
        let sink = Keep {
            results: results.clone(),
            i,
        };
        core.admit(req.clone(), Box::new(sink)).expect("admitted");
    }
    let mut steps = 0;
    while core.has_work() {
        core.step().expect("step");
        steps += 1;
        assert!(steps < 100_000, "the batch does not finish");
    }
    let results = results.lock().unwrap();
    results
        .iter()
        .map(|r| r.clone().expect("reported").expect("generated"))
        .collect()
}

/// Runs `req` alone on `core`.
fn run_one(core: &mut Core<'_>, req: GenerationRequest) -> Generation {
    run_all(core, &[req]).remove(0)
}

fn solo_plain(loaded: &LoadedModel, req: &GenerationRequest) -> Vec<u32> {
    let req = GenerationRequest {
        speculation: Speculation::Off,
        ..req.clone()
    };
    let slot = ProposerSlot::new(None);
    generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &EngineConfig::default(),
        &req,
        &mut |_| Flow::Continue,
    )
    .expect("solo generate")
    .token_ids
}

/// A request that can never run is the client's error, typed so the server answers 400: an
/// empty prompt, one filling the whole context, invalid sampling parameters.
#[test]
fn a_request_that_cannot_run_is_an_invalid_request_not_a_failure() {
    let (_dir, loaded) = tiny_loaded("llama", 3);
    let context = loaded.model.context_len();
    let slot = ProposerSlot::new(None);
    let (mut core, _) = counted_core(&loaded, &slot, tight());
    let mut bad_sampling = request(3, &[4, 5], 4, Speculation::Off);
    bad_sampling.sampling.top_p = 1.5;
    let reqs = [
        request(1, &[], 4, Speculation::Off),
        request(2, &vec![7; context], 4, Speculation::Off),
        bad_sampling,
    ];
    let results: Results = Arc::new(Mutex::new(vec![None; reqs.len()]));
    for (i, req) in reqs.iter().enumerate() {
        let sink = Keep {
            results: results.clone(),
            i,
        };
        core.admit(req.clone(), Box::new(sink))
            .expect("reported, not refused");
    }
    assert!(!core.has_work(), "nothing was queued");
    for (i, r) in results.lock().unwrap().iter().enumerate() {
        match r {
            Some(Err(GenerationError::Invalid(why))) => assert!(!why.is_empty()),
            other => panic!("request {i}: {other:?}"),
        }
    }
}

/// A small step budget and few running slots: prompts are chunked, requests wait, join and
/// leave mid-batch.
fn tight() -> EngineConfig {
    EngineConfig {
        max_running: 3,
        max_batch_tokens: 7,
        profile: false,
        ..EngineConfig::default()
    }
}

#[test]
fn batched_greedy_equals_solo_plain_on_tiny_models() {
    for arch in ["llama", "qwen2"] {
        let (_dir, loaded) = tiny_loaded(arch, 5);
        let vocab = loaded.model.config().vocab_size;
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|i| {
                (0..(1 + 7 * i))
                    .map(|j| 3 + (i * 13 + j * 5) % 60)
                    .collect()
            })
            .collect();
        let specs = [
            Speculation::Off,
            Speculation::On {
                num_draft_tokens: 3,
            },
            Speculation::Adaptive {
                max_draft_tokens: 5,
            },
        ];
        let reqs: Vec<GenerationRequest> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| request(i as u64 + 1, p, 6 + 5 * i, specs[i % 3]))
            .collect();
        let solo: Vec<Vec<u32>> = reqs.iter().map(|r| solo_plain(&loaded, r)).collect();
        for config in [
            tight(),
            EngineConfig {
                profile: false,
                ..EngineConfig::default()
            },
        ] {
            let bad = Box::new(BadProposer::new(vocab, false, 3));
            let got = batch(&loaded, Some(bad), config.clone(), &reqs);
            for (i, g) in got.iter().enumerate() {
                assert_eq!(
                    g.token_ids, solo[i],
                    "{arch} request {i} with a bad drafter, {config:?}"
                );
            }
            let got = batch(&loaded, None, config.clone(), &reqs);
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g.token_ids, solo[i], "{arch} request {i} without a drafter");
            }
        }
    }
}

#[test]
fn a_fixed_k_drafts_every_round_beside_a_controlled_sequence() {
    let (_dir, loaded) = tiny_loaded("llama", 7);
    let vocab = loaded.model.config().vocab_size;
    let prompt = [5, 6, 7, 8];
    let fixed = request(
        1,
        &prompt,
        30,
        Speculation::On {
            num_draft_tokens: 4,
        },
    );
    let adaptive = request(
        2,
        &prompt,
        30,
        Speculation::Adaptive {
            max_draft_tokens: 4,
        },
    );
    let config = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    let bad = Box::new(BadProposer::new(vocab, false, 1));
    let got = batch(&loaded, Some(bad), config, &[fixed, adaptive]);
    let f = &got[0].stats;
    assert_eq!(
        got[0].token_ids, got[1].token_ids,
        "same prompt, same output"
    );
    // Fixed k: every round drafts 4, but the last ones (max_tokens caps the tail).
    assert!(f.drafted >= 4 * (f.target_forwards - 4), "{f:?}");
    assert_eq!(f.accepted, 0, "the bad drafter is never right");
}

/// The host is the one owner of the confidence cut. Under the controller, drafts whose
/// confidences say they are not worth a verify row get none (here every one: 0.05 is under
/// the lowest floor); a fixed k verifies every draft sent, whatever its confidence. The output
/// is the solo plain output either way (the drafts are right: only the cut differs).
#[test]
fn the_host_cuts_unconfident_drafts_under_the_controller_and_never_under_a_fixed_k() {
    let (_dir, loaded) = tiny_loaded("llama", 7);
    let prompt = [5, 6, 7, 8];
    let solo = solo_plain(&loaded, &request(1, &prompt, 24, Speculation::Off));
    let config = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    let run = |speculation| {
        let script = ScriptProposer::new(&prompt, &solo).with_confidence(0.05);
        let sent = script.sent();
        let req = request(1, &prompt, 24, speculation);
        let got = batch(&loaded, Some(Box::new(script)), config.clone(), &[req]);
        (got[0].clone(), sent.load(Ordering::Relaxed))
    };
    let plain = batch(
        &loaded,
        None,
        config.clone(),
        &[request(1, &prompt, 24, Speculation::Off)],
    );
    let plain_forwards = plain[0].stats.target_forwards;
    assert!(
        plain_forwards > 10,
        "a long enough run: {:?}",
        plain[0].stats
    );
    let (controlled, sent) = run(Speculation::Adaptive {
        max_draft_tokens: 4,
    });
    assert_eq!(controlled.token_ids, solo);
    assert!(sent > 0, "the drafter was asked");
    assert_eq!(
        controlled.stats.drafted, 0,
        "every unconfident draft was cut"
    );
    assert_eq!(controlled.stats.confidence_cut, sent);
    assert_eq!(
        controlled.stats.target_forwards, plain_forwards,
        "one token per forward: no verify rows for drafts"
    );
    let (fixed, sent) = run(Speculation::On {
        num_draft_tokens: 4,
    });
    assert_eq!(fixed.token_ids, solo);
    assert_eq!(
        fixed.stats.drafted, sent,
        "a fixed k verifies every draft sent"
    );
    assert_eq!(fixed.stats.confidence_cut, 0);
    assert_eq!(
        fixed.stats.accepted, sent,
        "and the oracle's drafts are all accepted"
    );
    assert!(
        fixed.stats.target_forwards * 3 < plain_forwards,
        "{:?}",
        fixed.stats
    );
}

/// Prompts arriving together that start with a block no cache holds yet: the first computes
/// it once, the others wait for it and adopt it (in-flight prefix sharing; a repeated prompt
/// forks all of it), so the burst's forwards run the shared rows once — and every output is
/// still its solo plain output, whole prompts in one step or chunked through a tight budget,
/// with drafting beside.
#[test]
fn a_bursts_shared_prefix_is_computed_once_and_changes_nothing() {
    let (_dir, loaded) = tiny_loaded("qwen2", 3);
    let vocab = loaded.model.config().vocab_size;
    let common: Vec<u32> = (0..32u32).map(|i| 3 + (i * 11) % 50).collect();
    let mut prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| {
            let tail = (0..5).map(|j| 4 + (i * 7 + j * 3) % 40);
            common.iter().copied().chain(tail).collect()
        })
        .collect();
    // A repeat of the first (a retry, or `n` > 1): it forks all but its last id.
    prompts.push(prompts[0].clone());
    let reqs = |max_tokens: usize| -> Vec<GenerationRequest> {
        let specs = [
            Speculation::Off,
            Speculation::On {
                num_draft_tokens: 2,
            },
            Speculation::Adaptive {
                max_draft_tokens: 3,
            },
        ];
        (0..4)
            .map(|i| request(i as u64 + 1, &prompts[i], max_tokens, specs[i % 3]))
            .collect()
    };
    let untimed = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    // One token each: the forwards run prompt rows only.
    let burst = |prefix_dedup: bool| {
        let slot = ProposerSlot::new(None);
        let config = EngineConfig {
            prefix_dedup,
            ..untimed.clone()
        };
        let (mut core, counters) = counted_core(&loaded, &slot, config);
        run_all(&mut core, &reqs(1));
        counters.snapshot()
    };
    let each = burst(false);
    assert_eq!((each.batch_rows, each.steps), (4 * 37, 1), "{each:?}");
    assert_eq!(each.shared_waits, 0);
    let shared = burst(true);
    assert_eq!(
        shared.batch_rows,
        37 + 2 * 5 + 1,
        "the common block ran once, the repeat's prompt too: {shared:?}"
    );
    assert_eq!(shared.prefix_hit_tokens, 2 * 32, "two adopted the block");
    assert_eq!((shared.shared_waits, shared.steps), (3, 2));
    let reqs = reqs(12);
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| solo_plain(&loaded, r)).collect();
    // Three run at once in the tight budget: the repeat starts after the first is done, from
    // the cache.
    for (config, waits) in [(untimed, 3), (tight(), 2)] {
        let slot = ProposerSlot::new(Some(Box::new(BadProposer::new(vocab, false, 5))));
        let (mut core, counters) = counted_core(&loaded, &slot, config.clone());
        let got = run_all(&mut core, &reqs);
        assert_eq!(counters.snapshot().shared_waits, waits, "{config:?}");
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.token_ids, solo[i], "request {i}, {config:?}");
        }
    }
}

/// A proposer whose drafts wait until the test opens the gate: holds the engine inside a step.
struct Gate {
    entered: Arc<AtomicBool>,
    open: Arc<AtomicBool>,
}

impl Proposer for Gate {
    fn name(&self) -> &str {
        "gate"
    }
    fn wants(&self) -> Wants {
        Wants::default()
    }
    fn open(&mut self, _: u64, _: &[u32], _: &SamplingParams, _: Option<&TapRows>) {}
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        self.entered.store(true, Ordering::SeqCst);
        while !self.open.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        vec![Draft::default(); batch.asks.len()]
    }
    fn commit(&mut self, _: u64, _: &Verdict<'_>) {}
    fn advance(&mut self, _: u64, _: &[u32], _: Option<&TapRows>) {}
    fn close(&mut self, _: u64) {}
}

/// Panics in its first draft call, then drafts nothing.
struct PanicsOnce(Arc<AtomicBool>);

impl Proposer for PanicsOnce {
    fn name(&self) -> &str {
        "panics-once"
    }
    fn wants(&self) -> Wants {
        Wants::default()
    }
    fn open(&mut self, _: u64, _: &[u32], _: &SamplingParams, _: Option<&TapRows>) {}
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        if !self.0.swap(true, Ordering::SeqCst) {
            panic!("a proposer bug");
        }
        vec![Draft::default(); batch.asks.len()]
    }
    fn commit(&mut self, _: u64, _: &Verdict<'_>) {}
    fn advance(&mut self, _: u64, _: &[u32], _: Option<&TapRows>) {}
    fn close(&mut self, _: u64) {}
}

/// Waits for a request's last event: its result.
fn outcome(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Option<Result<Generation, GenerationError>> {
    while let Some(ev) = rx.blocking_recv() {
        if let Event::Done(result) = ev {
            return Some(result);
        }
    }
    None
}

/// A drafter that panics costs speed, never a request: the panic is caught at the call, the
/// drafter is dropped (`Health::Failed`), and the request in that step finishes with its solo
/// plain output, as does the next one.
#[test]
fn a_drafter_that_panics_is_dropped_at_the_call_and_its_requests_are_served() {
    let (_dir, loaded) = tiny_loaded("llama", 2);
    let (_dir2, reference) = tiny_loaded("llama", 2);
    let config = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    let panicked = Arc::new(AtomicBool::new(false));
    let proposer = PanicsOnce(panicked.clone());
    let engine = Engine::start(loaded, Some(Box::new(proposer)), config).expect("engine");
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    for prompt in [[5, 6, 7], [9, 3, 27]] {
        let req = request(0, &prompt, 12, spec);
        let rx = engine.submit(req.clone()).expect("queued");
        let got = outcome(rx).expect("a result").expect("served");
        assert_eq!(got.token_ids, solo_plain(&reference, &req), "{prompt:?}");
    }
    assert!(
        panicked.load(Ordering::SeqCst),
        "the drafter never panicked"
    );
    assert_eq!(engine.drafter_health(), Some(Health::Failed));
    assert!(engine.is_alive());
}

/// Counts a proposer's sessions; its drafts wait until the test opens the gate.
struct CountingGate {
    gate: Gate,
    opened: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
}

impl Proposer for CountingGate {
    fn name(&self) -> &str {
        "counting-gate"
    }
    fn wants(&self) -> Wants {
        Wants::default()
    }
    fn open(&mut self, _: u64, _: &[u32], _: &SamplingParams, _: Option<&TapRows>) {
        self.opened.fetch_add(1, Ordering::SeqCst);
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        self.gate.draft(batch)
    }
    fn commit(&mut self, _: u64, _: &Verdict<'_>) {}
    fn advance(&mut self, _: u64, _: &[u32], _: Option<&TapRows>) {}
    fn close(&mut self, _: u64) {
        self.closed.fetch_add(1, Ordering::SeqCst);
    }
}

/// A panic in the engine itself fails the requests it was serving, each with an error event
/// (none hangs, the queue count stays true), and closes their drafter sessions; a fresh core
/// serves what was still queued with the same output as alone.
#[test]
fn a_panic_in_the_engine_fails_its_requests_and_a_fresh_core_serves_the_queue() {
    let (_dir, loaded) = tiny_loaded("llama", 2);
    let (_dir2, reference) = tiny_loaded("llama", 2);
    let config = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    let (entered, open) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (opened, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let proposer = CountingGate {
        gate: Gate {
            entered: entered.clone(),
            open: open.clone(),
        },
        opened: opened.clone(),
        closed: closed.clone(),
    };
    let engine = Engine::start(loaded, Some(Box::new(proposer)), config).expect("engine");
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    let running = engine
        .submit(request(0, &[5, 6, 7], 12, spec))
        .expect("queued");
    let until = Instant::now() + Duration::from_secs(30);
    while !entered.load(Ordering::SeqCst) {
        assert!(Instant::now() < until, "the first request never drafted");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Queued behind the panic: the fresh core takes it.
    engine.inject_panic();
    let req = request(0, &[9, 3, 27], 12, spec);
    let queued = engine.submit(req.clone()).expect("queued");
    open.store(true, Ordering::SeqCst);
    match outcome(running) {
        Some(Err(GenerationError::Failed(e))) => assert!(e.contains("engine failed"), "{e}"),
        other => panic!("the request in the panicked core: {other:?}"),
    }
    let got = outcome(queued)
        .expect("a result")
        .expect("served by the fresh core");
    assert_eq!(got.token_ids, solo_plain(&reference, &req));
    assert!(engine.is_alive());
    let until = Instant::now() + Duration::from_secs(10);
    while engine.queue_depth() != 0 || engine.counters().running != 0 {
        assert!(Instant::now() < until, "the queue count leaked");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(opened.load(Ordering::SeqCst) >= 2);
    assert_eq!(
        closed.load(Ordering::SeqCst),
        opened.load(Ordering::SeqCst),
        "every drafter session opened was closed, the dead core's too"
    );
}

/// The server's engine: a full queue refuses with a retry delay; a request that can never fit
/// the pool is refused outright; dropping a receiver frees its K/V before the next step.
#[test]
fn admission_is_bounded_and_cancellation_frees_the_pool() {
    let (_dir, loaded) = tiny_loaded("llama", 2);
    let config = EngineConfig {
        max_running: 1,
        max_waiting: 2,
        max_batch_tokens: 16,
        kv_pool_tokens: 60,
        profile: false,
        ..EngineConfig::default()
    };
    let (entered, open) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let gate = Gate {
        entered: entered.clone(),
        open: open.clone(),
    };
    let engine = Engine::start(loaded, Some(Box::new(gate)), config).expect("engine");
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    let long = request(0, &[5, 6, 7], 40, spec);
    // 10 + 300 positions, capped at the context (64): more than the pool of 60.
    match engine.submit(request(0, &[5; 10], 300, spec)) {
        Err(r) => assert!(matches!(r.refusal, Refusal::TooLarge { .. }), "{r}"),
        Ok(_) => panic!("a request larger than the pool was queued"),
    }
    let first = engine.submit(long.clone()).expect("runs");
    let until = Instant::now() + Duration::from_secs(30);
    while !entered.load(Ordering::SeqCst) {
        assert!(Instant::now() < until, "the first request never drafted");
        std::thread::sleep(Duration::from_millis(1));
    }
    let queued: Vec<_> = (0..2)
        .map(|_| engine.submit(long.clone()).expect("waits"))
        .collect();
    let refused = engine.submit(long.clone()).expect_err("the queue is full");
    assert!(matches!(refused.refusal, Refusal::Busy { .. }), "{refused}");
    assert!(refused
        .retry_after
        .is_some_and(|d| d >= Duration::from_secs(1)));
    assert_eq!(engine.counters().refused, 1);
    assert_eq!(
        engine.counters().pool_reserved,
        43,
        "the running request's worst case"
    );
    // Cancel everything: the pool empties, nothing is left running.
    drop(first);
    drop(queued);
    open.store(true, Ordering::SeqCst);
    loop {
        let c = engine.counters();
        if c.running == 0 && c.waiting == 0 && c.pool_reserved == 0 && engine.queue_depth() == 0 {
            assert_eq!(c.pool_used, 0);
            break;
        }
        assert!(Instant::now() < until, "not freed: {c:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // And the engine still serves.
    let mut rx = engine
        .submit(request(0, &[5, 6], 4, Speculation::Off))
        .expect("accepted again");
    let mut done = None;
    while let Some(ev) = rx.blocking_recv() {
        if let Event::Done(r) = ev {
            done = Some(r);
        }
    }
    let g = done.expect("done").expect("ok");
    assert!(!g.token_ids.is_empty() && g.token_ids.len() <= 4);
}

/// Many requests with distinct prompts (a server's life): the pool keeps at most
/// `--prefix-cache-mib` of blocks nobody holds, so its arena (its host memory) stops growing
/// at the running peak plus that budget instead of filling the whole pool; the most recent
/// prompts still hit.
#[test]
fn distinct_prompts_do_not_grow_the_pool_past_its_prefix_cache_budget() {
    let (_dir, loaded) = tiny_loaded("llama", 2);
    let block_bytes = loaded.model.new_pool(1).expect("pool").block_bytes();
    let budget_blocks = (1 << 20) / block_bytes;
    let rounds = budget_blocks + 16;
    for mib in [0, 1] {
        let config = EngineConfig {
            max_running: 2,
            max_batch_tokens: 64,
            // Room for far more than the budget: only the budget may stop the growth.
            kv_pool_tokens: 64 * 4 * budget_blocks,
            prefix_cache_mib: mib,
            profile: false,
            ..EngineConfig::default()
        };
        let slot = ProposerSlot::new(None);
        let (mut core, counters) = counted_core(&loaded, &slot, config);
        let results: Results = Arc::new(Mutex::new(vec![None; 2]));
        // Distinct first blocks: n's digits in base 50 lead.
        let prompt = |n: usize| -> Vec<u32> {
            let digits = [n % 50, n / 50 % 50, n / 2500 % 50];
            (0..40)
                .map(|i| (digits.get(i).copied().unwrap_or(i % 50) + 1) as u32)
                .collect()
        };
        let mut peak = 0;
        for round in 0..rounds {
            for i in 0..2 {
                let sink = Keep {
                    results: results.clone(),
                    i,
                };
                // `Core` takes the session as given: one per request.
                let n = 2 * round + i;
                let req = request(n as u64 + 1, &prompt(n), 4, Speculation::Off);
                core.admit(req, Box::new(sink)).expect("admitted");
            }
            while core.has_work() {
                core.step().expect("step");
            }
            let c = counters.snapshot();
            assert!(c.pool_cached <= mib * budget_blocks * 32, "{c:?}");
            peak = peak.max(c.pool_arena);
        }
        // Two running sequences hold at most 2 blocks each; the arena doubles as it grows.
        let bound = 2 * (4 + mib * budget_blocks) * 32;
        assert!(
            peak <= bound,
            "budget {mib} MiB: the arena reached {peak} positions (bound {bound})"
        );
        // Distinct prompts made more cached blocks than the budget keeps: the bound was exercised.
        assert!(2 * rounds > mib * budget_blocks);
        let before = counters.snapshot().prefix_hit_tokens;
        let last = prompt(2 * rounds - 1);
        run_one(&mut core, request(u64::MAX, &last, 4, Speculation::Off));
        let hit = counters.snapshot().prefix_hit_tokens - before;
        assert_eq!(
            hit,
            32 * mib as u64,
            "budget {mib} MiB: the last prompt's block"
        );
    }
}

/// 32 streams that each ask for the whole context, against a pool of 4 contexts: never more
/// than 4 run, the pool is never over-reserved nor over-filled, 16 wait in the bounded queue and
/// all of them finish (each as its solo plain run), the other 16 are refused as busy.
#[test]
fn streams_at_the_whole_context_stay_within_the_pool() {
    let (_dir, loaded) = tiny_loaded("llama", 2);
    let ctx = loaded.model.context_len();
    let config = EngineConfig {
        max_running: 8,
        max_waiting: 16,
        max_batch_tokens: 64,
        kv_pool_tokens: 4 * ctx,
        profile: false,
        ..EngineConfig::default()
    };
    let reqs: Vec<GenerationRequest> = (0..32u32)
        .map(|i| {
            request(
                u64::from(i),
                &[5 + i % 7, 6 + i % 5, 7],
                ctx,
                Speculation::Off,
            )
        })
        .collect();
    let results: Results = Arc::new(Mutex::new(vec![None; reqs.len()]));
    let slot = ProposerSlot::new(None);
    let (mut core, counters) = counted_core(&loaded, &slot, config);
    let mut accepted = Vec::new();
    for (i, req) in reqs.iter().enumerate() {
        let sink = Keep {
            results: results.clone(),
            i,
        };
        match core.admit(req.clone(), Box::new(sink)) {
            Ok(()) => accepted.push(i),
            Err(Refusal::Busy { .. }) => {}
            Err(e) => panic!("refused for another reason: {e}"),
        }
    }
    assert_eq!(accepted.len(), 16, "the queue's bound");
    let (mut peak_running, mut steps) = (0, 0);
    while core.has_work() {
        core.step().expect("step");
        let c = counters.snapshot();
        assert!(c.pool_reserved <= c.pool_capacity, "over-reserved: {c:?}");
        assert!(c.pool_used <= c.pool_capacity, "over-filled: {c:?}");
        assert!(c.running <= 4, "more running than the pool holds: {c:?}");
        peak_running = peak_running.max(c.running);
        steps += 1;
        assert!(steps < 100_000, "the streams do not finish");
    }
    drop(core);
    assert_eq!(peak_running, 4, "the pool is used");
    let results = results.lock().unwrap();
    for &i in &accepted {
        let g = results[i].clone().expect("reported").expect("generated");
        assert_eq!(g.token_ids, solo_plain(&loaded, &reqs[i]), "stream {i}");
    }
    let refused = results
        .iter()
        .filter(|r| matches!(r, Some(Err(GenerationError::Refused(Refusal::Busy { .. })))))
        .count();
    assert_eq!(refused, 16);
}

fn smollm_f32() -> LoadedModel {
    let path = model_path("smollm2-135m");
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..LoadOptions::default()
    };
    load(&path, &opts).expect("load SmolLM2")
}

const CHATS: [&str; 4] = [
    "List the days of the week, then the months of the year.",
    "Write a python function that reverses a list.",
    "What is the capital of France? Answer in one sentence.",
    "Count from one to twenty in words.",
];

fn drafter(loaded: &LoadedModel, bin: &str, args: &[&str]) -> Box<dyn Proposer> {
    let spec = DrafterSpec::new(bin_path(bin)).with_args(args.iter().copied());
    let config = ClientConfig {
        draft_deadline: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    let target = target_info(&loaded.model, &loaded.tokenizer);
    Box::new(DrafterClient::start(spec, target, config).expect("drafter starts"))
}

#[test]
fn batched_greedy_equals_solo_plain_on_smollm2_with_real_drafters() {
    let loaded = smollm_f32();
    let template = loaded.chat_template.as_ref().expect("chat template");
    let reqs: Vec<GenerationRequest> = CHATS
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let msg = [specula_models::chat::ChatMessage::new("user", *text)];
            let rendered = template
                .render(&msg, specula_models::chat::GenerationPrompt::Add)
                .expect("render");
            let ids = loaded
                .tokenizer
                .encode(&rendered, Special::Parse)
                .expect("encode");
            let spec = match i % 2 {
                0 => Speculation::On {
                    num_draft_tokens: 4,
                },
                _ => Speculation::Adaptive {
                    max_draft_tokens: 4,
                },
            };
            request(i as u64 + 1, &ids, 24, spec)
        })
        .collect();
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| solo_plain(&loaded, r)).collect();
    let path = model_path("smollm2-135m");
    let path = path.to_str().expect("utf-8 path");
    let config = EngineConfig {
        max_running: 3,
        max_batch_tokens: 24,
        profile: false,
        // Debug builds draft slowly: the law holds at any deadline, this one lets drafts land.
        draft_deadline_steps: 1000.0,
        draft_deadline_cap: Duration::from_secs(5),
        ..EngineConfig::default()
    };
    let drafters: [(&str, Vec<&str>); 3] = [
        ("ngram", vec![]),
        ("chaos-drafter", vec!["--mode", "random-ids"]),
        ("two-model", vec!["--model", path, "--dtype", "f32"]),
    ];
    for (bin, args) in drafters {
        let got = batch(
            &loaded,
            Some(drafter(&loaded, bin, &args)),
            config.clone(),
            &reqs,
        );
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g.token_ids, solo[i],
                "{bin}: request {i} changed in the batch"
            );
        }
        if bin == "two-model" {
            let drafted: usize = got.iter().map(|g| g.stats.drafted).sum();
            let accepted: usize = got.iter().map(|g| g.stats.accepted).sum();
            assert!(
                accepted * 2 > drafted,
                "self-drafting is mostly accepted: {accepted}/{drafted}"
            );
        }
    }
}

/// A second chat turn (the first turn's prompt and answer, then more) adopts the cached blocks
/// of the first and skips their prefill — and still equals its solo plain output.
#[test]
fn a_second_turn_reuses_the_first_turns_blocks_and_changes_nothing() {
    let (_dir, loaded) = tiny_loaded("llama", 11);
    let turn1: Vec<u32> = (0..40u32).map(|i| 3 + (i * 7) % 50).collect();
    let slot = ProposerSlot::new(None);
    let config = EngineConfig {
        profile: false,
        ..EngineConfig::default()
    };
    let (mut core, counters) = counted_core(&loaded, &slot, config);
    let first = run_one(&mut core, request(1, &turn1, 8, Speculation::Off));
    assert_eq!(counters.snapshot().prefix_hit_tokens, 0);
    let mut turn2 = turn1.clone();
    turn2.extend(&first.token_ids);
    turn2.extend([9, 10, 11]);
    let req2 = request(2, &turn2, 8, Speculation::Off);
    let second = run_one(&mut core, req2.clone());
    let hits = counters.snapshot().prefix_hit_tokens;
    assert!(hits >= 32, "the first turn's full block was reused: {hits}");
    assert_eq!(second.token_ids, solo_plain(&loaded, &req2));
}

/// Every committed position's taps reach the drafter at most once, in order, through a batch:
/// the rows of `open`, then `commit`s (drafted rounds) and `advance`s (rounds without drafts,
/// held back until the session's next draft), add up to the positions before the pending one
/// but for those after the session's last draft, which it never needs.
#[test]
fn every_committed_position_reaches_a_tap_drafter_exactly_once() {
    let loaded = smollm_f32();
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("taps.log");
    let log_arg = log.to_str().expect("utf-8 path");
    let prompts: [&[u32]; 3] = [
        &[1, 2, 3, 4, 5, 6],
        &[7, 8, 9],
        &[10, 11, 12, 13, 14, 15, 16, 17],
    ];
    let reqs: Vec<GenerationRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let spec = match i {
                0 => Speculation::On {
                    num_draft_tokens: 3,
                },
                _ => Speculation::Adaptive {
                    max_draft_tokens: 3,
                },
            };
            request(i as u64 + 1, p, 12 + 3 * i, spec)
        })
        .collect();
    let config = EngineConfig {
        max_batch_tokens: 5,
        profile: false,
        draft_deadline_steps: 1000.0,
        draft_deadline_cap: Duration::from_secs(5),
        ..EngineConfig::default()
    };
    let patient = ClientConfig {
        draft_deadline: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    let (proposer, client) = observed_drafter(
        &loaded,
        &["--mode", "taps-check", "--out", log_arg],
        patient,
    );
    let got = batch(&loaded, Some(proposer), config, &reqs);
    // Every message handled (so every log line written) before the log is read.
    assert!(
        client.lock().unwrap().barrier(),
        "the drafter handled every message"
    );
    let text = std::fs::read_to_string(&log).expect("the drafter wrote its log");
    assert!(!text.contains("torn"), "torn taps: {text}");
    for (i, g) in got.iter().enumerate() {
        let session = (i + 1).to_string();
        let mut kinds = Vec::new();
        let mut rows = 0;
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f[1] == session {
                kinds.push(f[0]);
                rows += f[2].parse::<usize>().expect("row count");
            }
        }
        assert_eq!(
            kinds.first(),
            Some(&"open"),
            "session {session}: {kinds:?} in {text}"
        );
        assert!(kinds[1..].iter().all(|k| *k == "commit" || *k == "advance"));
        let eos = usize::from(g.finish_reason == target_host::generation::FinishReason::Stop);
        let told = prompts[i].len() + g.token_ids.len() + eos;
        assert!(
            rows >= prompts[i].len() - 1 && rows < told,
            "session {session}: {rows} rows told, {told} positions"
        );
    }
    assert!(got.iter().filter(|g| !g.token_ids.is_empty()).count() >= 2);
    assert_eq!(got[0].token_ids, solo_plain(&loaded, &reqs[0]));
}

/// One line of the chaos drafter's `taps-check --rows` log.
#[derive(Debug, Clone)]
struct TapLine {
    kind: String,
    rows: usize,
    /// First row's position and one checksum per row (`None`: the message had no taps).
    at: Option<(usize, Vec<u64>)>,
}

/// The log's lines per session, in message order.
fn tap_log(text: &str) -> std::collections::HashMap<String, Vec<TapLine>> {
    let mut by = std::collections::HashMap::<String, Vec<TapLine>>::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert!(f.len() >= 3 && f[2] != "torn", "torn or short line: {line}");
        let at = match f[3] {
            "none" => None,
            _ => {
                let sums = f[5].split(',').map(|c| c.parse().expect("checksum"));
                Some((f[4].parse().expect("position"), sums.collect()))
            }
        };
        by.entry(f[1].to_string()).or_default().push(TapLine {
            kind: f[0].to_string(),
            rows: f[2].parse().expect("row count"),
            at,
        });
    }
    by
}

/// Checks one session's lines: after its last `open`, the positions `0..told - 1` arrive
/// exactly once and in order, each with taps, but for a tail held back after the session's
/// last draft (rounds without drafts reach the drafter only before its next draft); and every
/// position's taps are the same bits in every message that carried them (a re-open re-sends
/// what the first life saw). Returns the number of `open`s.
fn every_position_once(lines: &[TapLine], told: usize, what: &str) -> usize {
    let last_open = lines
        .iter()
        .rposition(|l| l.kind == "open")
        .unwrap_or_else(|| panic!("{what}: no open in {lines:?}"));
    let mut next = 0;
    for l in &lines[last_open..] {
        let (pos, sums) =
            l.at.as_ref()
                .unwrap_or_else(|| panic!("{what}: no taps: {l:?}"));
        assert_eq!(*pos, next, "{what}: a hole or a repeat at {l:?}");
        assert_eq!(sums.len(), l.rows, "{what}: {l:?}");
        next += l.rows;
    }
    assert!(
        next < told,
        "{what}: {next} positions told, {told} committed"
    );
    let mut seen = std::collections::HashMap::new();
    for l in lines {
        let Some((pos, sums)) = &l.at else { continue };
        for (i, s) in sums.iter().enumerate() {
            let first = *seen.entry(pos + i).or_insert(*s);
            assert_eq!(
                first,
                *s,
                "{what}: position {} changed between messages",
                pos + i
            );
        }
    }
    lines.iter().filter(|l| l.kind == "open").count()
}

/// A drafter process with `config`, shared so the test can read its counters.
fn observed_drafter(
    loaded: &LoadedModel,
    args: &[&str],
    config: ClientConfig,
) -> (Box<dyn Proposer>, Arc<Mutex<DrafterClient>>) {
    let spec = DrafterSpec::new(bin_path("chaos-drafter")).with_args(args.iter().copied());
    let target = target_info(&loaded.model, &loaded.tokenizer);
    let client = DrafterClient::start(spec, target, config).expect("drafter starts");
    let (shared, handle) = target_host::proposer::Shared::new(client);
    (Box::new(shared), handle)
}

fn tap_requests(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<GenerationRequest> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let spec = match i % 2 {
                0 => Speculation::On {
                    num_draft_tokens: 2,
                },
                _ => Speculation::Adaptive {
                    max_draft_tokens: 2,
                },
            };
            request(i as u64 + 1, p, max_tokens, spec)
        })
        .collect()
}

fn told(prompt: &[u32], g: &Generation) -> usize {
    let eos = usize::from(g.finish_reason == target_host::generation::FinishReason::Stop);
    prompt.len() + g.token_ids.len() + eos
}

fn slow_drafts() -> EngineConfig {
    EngineConfig {
        max_batch_tokens: 16,
        profile: false,
        draft_deadline_steps: 1000.0,
        draft_deadline_cap: Duration::from_secs(5),
        ..EngineConfig::default()
    }
}

/// A tap drafter that crashes mid-request is respawned, and the engine opens every session on
/// the new process with the taps of every committed position (not ids only): from that `Open`
/// on, each position arrives once, in order, with the same bits as before the crash.
#[test]
fn a_respawned_tap_drafter_gets_every_positions_taps_at_its_reopen() {
    let loaded = smollm_f32();
    let dir = tempfile::tempdir().expect("temp dir");
    let (log, flag) = (dir.path().join("taps.log"), dir.path().join("crashed"));
    let args = [
        "--mode",
        "taps-check",
        "--rows",
        "--out",
        log.to_str().expect("utf-8"),
        "--crash-once",
        flag.to_str().expect("utf-8"),
        "--after",
        "3",
    ];
    let config = ClientConfig {
        draft_deadline: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    let (proposer, client) = observed_drafter(&loaded, &args, config);
    let prompts: Vec<Vec<u32>> = vec![(1..9).collect(), (20..25).collect()];
    let reqs = tap_requests(&prompts, 40);
    let got = batch(&loaded, Some(proposer), slow_drafts(), &reqs);
    assert!(flag.exists(), "the drafter crashed once");
    let mut client = client.lock().unwrap();
    assert_eq!(client.stats().restarts, 1);
    assert!(client.barrier(), "the drafter handled every message");
    let by = tap_log(&std::fs::read_to_string(&log).expect("the drafter's log"));
    let mut reopened = 0;
    for (i, g) in got.iter().enumerate() {
        let lines = &by[&(i + 1).to_string()];
        let opens = every_position_once(lines, told(&prompts[i], g), &format!("session {i}"));
        reopened += usize::from(opens > 1);
        assert_eq!(g.token_ids, solo_plain(&loaded, &reqs[i]), "request {i}");
    }
    assert!(
        reopened >= 1,
        "a session was re-opened on the new process: {by:?}"
    );
}

/// An `Open` whose taps exceed the shared region is split into `Open` + `Advance`s, each fitting
/// it: the drafter still gets every position once, in order (nothing dropped), and drafts are
/// capped so a `Commit`'s rows fit too.
#[test]
fn an_open_larger_than_the_tap_region_is_split_never_dropped() {
    let loaded = smollm_f32();
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("taps.log");
    let args = [
        "--mode",
        "taps-check",
        "--rows",
        "--out",
        log.to_str().expect("utf-8"),
    ];
    // SmolLM2 taps of this drafter: 8448 bytes a row; half of 64 KiB holds 3 rows.
    let config = ClientConfig {
        draft_deadline: Duration::from_secs(5),
        region_bytes: 64 << 10,
        ..ClientConfig::default()
    };
    let (proposer, client) = observed_drafter(&loaded, &args, config);
    let prompts: Vec<Vec<u32>> = vec![(1..21).collect(), (30..41).collect()];
    let reqs = tap_requests(&prompts, 12);
    let got = batch(&loaded, Some(proposer), slow_drafts(), &reqs);
    let mut client = client.lock().unwrap();
    assert!(client.barrier(), "the drafter handled every message");
    let stats = client.stats();
    assert_eq!(stats.split_opens, 2, "{stats:?}");
    assert_eq!(stats.taps_undelivered, 0);
    let by = tap_log(&std::fs::read_to_string(&log).expect("the drafter's log"));
    for (i, g) in got.iter().enumerate() {
        let lines = &by[&(i + 1).to_string()];
        assert_eq!(every_position_once(lines, told(&prompts[i], g), "split"), 1);
        assert!(
            lines.iter().all(|l| l.rows <= 3),
            "every window fits: {lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.kind == "commit"),
            "drafts verified: {lines:?}"
        );
        assert_eq!(g.token_ids, solo_plain(&loaded, &reqs[i]), "request {i}");
    }
}

/// A second chat turn that feeds a tap drafter adopts the first turn's cached blocks (their
/// prefill is skipped) and its `Open` still carries the taps of every position before the
/// pending one: those of the adopted blocks come from the host's tap cache, bit for bit what
/// the first turn's forwards made. The first turn may be a plain request: while a tap drafter
/// is loaded, a plain prefill's taps go to the tap cache too.
#[test]
fn a_tap_drafters_second_turn_adopts_cached_blocks_with_their_taps() {
    let loaded = smollm_f32();
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    let after_spec = second_turn_taps(&loaded, spec);
    let after_plain = second_turn_taps(&loaded, Speculation::Off);
    assert!(after_plain.1.is_empty(), "a plain first turn never opens");
    // Turn 1's taps (spec case) are what both second turns were given for the adopted blocks.
    for p in 0..64 {
        assert_eq!(after_spec.1[&p], after_spec.2[&p], "position {p}");
        assert_eq!(
            after_spec.1[&p], after_plain.2[&p],
            "position {p}, plain first turn"
        );
    }
    assert_eq!(after_spec.0, after_plain.0, "the same second turn");
}

/// One tap-drafter core: a first turn under `first`, then a second turn (drafting) on the first
/// turn's prompt and answer; asserts the second adopted the first's two full blocks and was
/// opened with every position's taps. Returns (turn 2's ids, turn 1's and turn 2's tap
/// checksums by position).
fn second_turn_taps(
    loaded: &LoadedModel,
    first: Speculation,
) -> (
    Vec<u32>,
    std::collections::HashMap<usize, u64>,
    std::collections::HashMap<usize, u64>,
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("taps.log");
    let args = [
        "--mode",
        "taps-check",
        "--rows",
        "--out",
        log.to_str().expect("utf-8"),
    ];
    let config = ClientConfig {
        draft_deadline: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    let (proposer, client) = observed_drafter(loaded, &args, config);
    let slot = ProposerSlot::new(Some(proposer));
    let (mut core, counters) = counted_core(loaded, &slot, slow_drafts());
    let turn1: Vec<u32> = (0..70u32).map(|i| 100 + (i * 37) % 900).collect();
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    let first_turn = run_one(&mut core, request(1, &turn1, 8, first));
    assert_eq!(counters.snapshot().prefix_hit_tokens, 0);
    let mut turn2 = turn1.clone();
    turn2.extend(&first_turn.token_ids);
    turn2.extend([200, 201, 202]);
    let req2 = request(2, &turn2, 8, spec);
    let second = run_one(&mut core, req2.clone());
    let hits = counters.snapshot().prefix_hit_tokens;
    assert_eq!(
        hits, 64,
        "the first turn's two full blocks were adopted ({first:?})"
    );
    drop(core);
    assert!(
        client.lock().unwrap().barrier(),
        "the drafter handled every message"
    );
    let by = tap_log(&std::fs::read_to_string(&log).expect("the drafter's log"));
    if first != Speculation::Off {
        every_position_once(&by["1"], told(&turn1, &first_turn), "turn 1");
    }
    let lines = &by["2"];
    assert_eq!(
        every_position_once(lines, told(&turn2, &second), "turn 2"),
        1
    );
    assert_eq!(
        lines[0].rows,
        turn2.len() - 1,
        "one Open with the whole prompt"
    );
    let rows_of = |lines: &[TapLine]| {
        let mut m = std::collections::HashMap::new();
        for l in lines {
            let (pos, sums) = l.at.as_ref().expect("taps");
            for (i, s) in sums.iter().enumerate() {
                m.insert(pos + i, *s);
            }
        }
        m
    };
    assert_eq!(second.token_ids, solo_plain(loaded, &req2));
    let turn1_taps = by.get("1").map(|l| rows_of(l)).unwrap_or_default();
    (second.token_ids, turn1_taps, rows_of(lines))
}

/// What a [`Tapper`] was told: per session, the tap rows of each `Open` (`None`: no taps).
type Opens = Arc<Mutex<Vec<(u64, Option<usize>)>>>;

/// A tap drafter in process: wants layer `layer`'s taps, records its opens, drafts token 1.
struct Tapper {
    layer: usize,
    opens: Opens,
}

impl Proposer for Tapper {
    fn name(&self) -> &str {
        "tapper"
    }
    fn wants(&self) -> Wants {
        Wants {
            tap_layers: vec![self.layer],
            ..Wants::default()
        }
    }
    fn open(&mut self, s: u64, _: &[u32], _: &SamplingParams, taps: Option<&TapRows>) {
        self.opens.lock().unwrap().push((s, taps.map(|t| t.rows)));
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let draft = |n| Draft {
            tokens: vec![1; n],
            ..Draft::default()
        };
        batch.asks.iter().map(|a| draft(a.n)).collect()
    }
    fn commit(&mut self, _: u64, _: &Verdict<'_>) {}
    fn advance(&mut self, _: u64, _: &[u32], _: Option<&TapRows>) {}
    fn close(&mut self, _: u64) {}
}

/// A hot swap to a drafter wanting other taps re-forwards each session's context; when that
/// re-forward fails, the step goes on: that sequence runs plain (never opened on the new
/// drafter), the other is opened with every position's taps, both outputs equal solo plain, and
/// `/metrics`' drafting counters say what happened.
#[test]
fn a_failed_tap_reforward_costs_its_sequence_the_speculation_not_the_step() {
    let (_dir, loaded) = tiny_loaded("llama", 11);
    let prompts: Vec<Vec<u32>> = vec![(3..12).collect(), (20..26).collect()];
    let spec = Speculation::On {
        num_draft_tokens: 2,
    };
    let reqs: Vec<GenerationRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(i as u64 + 1, p, 24, spec))
        .collect();
    let (first, second): (Opens, Opens) = Default::default();
    let slot = ProposerSlot::new(Some(Box::new(Tapper {
        layer: 0,
        opens: first.clone(),
    })));
    let (mut core, counters) = counted_core(
        &loaded,
        &slot,
        EngineConfig {
            profile: false,
            ..EngineConfig::default()
        },
    );
    let results: Results = Arc::new(Mutex::new(vec![None; reqs.len()]));
    for (i, req) in reqs.iter().enumerate() {
        let sink = Keep {
            results: results.clone(),
            i,
        };
        core.admit(req.clone(), Box::new(sink)).expect("admitted");
    }
    // Prefill and a few rounds on the first drafter.
    for _ in 0..4 {
        core.step().expect("step");
    }
    assert_eq!(first.lock().unwrap().len(), 2, "both sessions opened");
    slot.replace(Some(Box::new(Tapper {
        layer: 1,
        opens: second.clone(),
    })));
    core.inject_resync_failures(1);
    let mut steps = 0;
    while core.has_work() {
        core.step()
            .expect("a failed re-forward does not fail the step");
        steps += 1;
        assert!(steps < 10_000, "the batch does not finish");
    }
    for (i, r) in results.lock().unwrap().iter().enumerate() {
        let g = r.clone().expect("reported").expect("generated");
        assert_eq!(g.token_ids, solo_plain(&loaded, &reqs[i]), "request {i}");
    }
    let opens = second.lock().unwrap().clone();
    assert_eq!(
        opens.len(),
        1,
        "one session re-opened, the failed one not: {opens:?}"
    );
    assert!(
        opens[0]
            .1
            .is_some_and(|rows| rows > prompts[(opens[0].0 - 1) as usize].len()),
        "re-opened with the taps of its whole context: {opens:?}"
    );
    let d = counters.snapshot().drafting;
    assert_eq!(
        (d.reforwards, d.resync_failed, d.reopened),
        (1, 1, 1),
        "{d:?}"
    );
}
