//! The law with the DFlash / DSpark drafter.
//!
//! - Greedy, end to end: on SmolLM2-135M with the drafters trained for it
//!   (`drafters/weights/smollm2-135m/`, found by the drafter from the target's identity), output
//!   equals `--no-speculation` on every prompt, and drafts are accepted at all.
//! - Sampled: on the tiny random Qwen3 target of the parity fixtures with its random DFlash and
//!   DSpark drafters (in process: thousands of seeded runs), the tokens committed through
//!   rejection sampling with the drafter's own `q` rows pass the chi-square test against plain
//!   sampling, while the drafter's proposals alone fail it (the test has power).
//! - Faults, in process on SmolLM2: a hot swap to and from DFlash mid-request, and torn taps
//!   (shared-memory views the writer lapped): output unchanged, drafting back to what an
//!   undisturbed drafter proposes. The respawn after a kill runs the real processes
//!   (`chaos::dflash_respawn_*`).

use std::path::Path;
use std::sync::{Arc, Mutex};

use dflash::{DFlash, Options, VocabChoice, WeightsSource};
use ngram::{NgramConfig, NgramDrafter};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk, Drafter, DrafterInfo, OpenArgs, Proposal, Taps,
};
use specula_protocol::shm::{ShmReader, ShmWriter, TensorRef, TensorView};
use specula_tests::proposers::{check_confidence_cut, Recording, Round};
use specula_tests::stats::{chi_square, critical};
use specula_tests::tiny::write_tiny_tokenizer;
use specula_tests::{bin_path, cli_generate_json, json_ids, model_path, workspace_root};
use target_host::drafter::InProcess;
use target_host::drafter_args::target_info;
use target_host::engine::EngineConfig;
use target_host::generation::{
    generate as run_engine, Flow, Generation, GenerationRequest, Speculation,
};
use target_host::proposer::{Proposer, ProposerSlot, SessionId};

const MAX_TOKENS: usize = 40;

/// A chat prompt of each workload kind, and a plain completion.
const PROMPTS: &[(&str, &str)] = &[
    (
        "chat",
        "Write a Python function that returns the factorial of n.",
    ),
    (
        "chat",
        "Summarize in one sentence: The city council met on Tuesday to discuss the new bike \
         lanes. The council approved the bike lanes on Main Street and asked for a study of Oak \
         Street.",
    ),
    ("chat", "What are three good habits for writing clear code?"),
    (
        "prompt",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ),
];

/// `target-host generate --json` with `extra`; returns (generated ids, accepted drafts).
fn generate(kind: &str, text: &str, extra: &[&str]) -> (Vec<u32>, u64) {
    let model = model_path("smollm2-135m");
    let model = model.to_str().expect("utf-8 path");
    let v = cli_generate_json(model, kind, text, MAX_TOKENS, extra);
    let accepted = v["stats"]["accepted"].as_u64().unwrap_or(0);
    (json_ids(&v, "token_ids"), accepted)
}

fn check(kind_arg: &str) {
    let drafter = bin_path("dflash");
    let drafter = drafter.to_str().expect("utf-8 path");
    let mut accepted = 0;
    for (kind, text) in PROMPTS {
        let (plain, _) = generate(kind, text, &["--no-speculation"]);
        let args = [
            "--drafter",
            drafter,
            &format!("--drafter-arg=--kind={kind_arg}"),
            "--num-draft-tokens",
            "7",
            // A fixed k and patient deadlines: every round is drafted and verified, so the
            // accepted count does not hang on the controller's or a loaded machine's timing.
            "--fixed-draft",
            "--draft-deadline-steps",
            "1000",
            "--draft-deadline-ms",
            "10000",
        ];
        let (spec, acc) = generate(kind, text, &args);
        assert_eq!(
            spec, plain,
            "{kind_arg} changed the greedy output of {text:?}"
        );
        accepted += acc;
    }
    assert!(accepted > 0, "{kind_arg}: no draft was ever accepted");
}

#[test]
fn dflash_greedy_equals_plain_smollm2() {
    check("dflash");
}

#[test]
fn dspark_greedy_equals_plain_smollm2() {
    check("dspark");
}

/// The tiny random Qwen3 target the parity fixtures were made on (vocabulary 128, 6 layers),
/// with a word-level tokenizer so that the real loader takes it.
fn fixture_target() -> (tempfile::TempDir, LoadedModel) {
    let src = workspace_root().join("tests/fixtures/dflash/target");
    let dir = tempfile::tempdir().expect("temp dir");
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy the fixture target");
    }
    write_tiny_tokenizer(dir.path(), 128).expect("write tokenizer");
    let loaded = load(dir.path(), &LoadOptions::default()).expect("load the fixture target");
    (dir, loaded)
}

/// Per position, how often each id was committed over `runs` seeded runs at temperature 1; with
/// `drafter` (a fixture folder) also the histogram of its first proposal and the totals
/// (drafted, accepted).
fn histograms(
    loaded: &LoadedModel,
    drafter: Option<&Path>,
    runs: u64,
) -> (Vec<Vec<usize>>, Vec<usize>, (usize, usize)) {
    const PROMPT: [u32; 5] = [11, 12, 13, 40, 7];
    const POSITIONS: usize = 3;
    let vocab = loaded.model.config().vocab_size;
    let info = target_info(&loaded.model, &loaded.tokenizer);
    let mut hist = vec![vec![0usize; vocab]; POSITIONS];
    let mut firsts = vec![0usize; vocab];
    let mut totals = (0, 0);
    for seed in 0..runs {
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let proposer: Option<Box<dyn Proposer>> = drafter.map(|dir| {
            let options = Options {
                draft_vocab: VocabChoice::Shipped,
                ..Options::default()
            };
            let source = WeightsSource::Path(dir.to_path_buf());
            let mut d = DFlash::new(source, options).expect("config");
            d.load(&info)
                .expect("the fixture drafter fits the fixture target");
            Box::new(Recording::new(Box::new(InProcess::new(d)), 0, &rounds)) as Box<dyn Proposer>
        });
        let speculation = match drafter {
            Some(_) => Speculation::On {
                num_draft_tokens: 3,
            },
            None => Speculation::Off,
        };
        let req = GenerationRequest {
            session: 1,
            prompt_ids: PROMPT.to_vec(),
            max_tokens: POSITIONS,
            sampling: SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            stop: vec![],
            speculation,
            logprobs: None,
            grammar: None,
        };
        let slot = ProposerSlot::new(proposer);
        let out = run_engine(
            &loaded.model,
            &loaded.tokenizer,
            &slot,
            &EngineConfig::default(),
            &req,
            &mut |_| Flow::Continue,
        )
        .expect("generate");
        for (i, &t) in out.token_ids.iter().enumerate() {
            hist[i][t as usize] += 1;
        }
        if let Some(r) = rounds.lock().expect("lock").first() {
            firsts[r.tokens[0] as usize] += 1;
        }
        totals.0 += out.stats.drafted;
        totals.1 += out.stats.accepted;
    }
    (hist, firsts, totals)
}

/// Sampled output with DFlash and DSpark (the drafter's `q` rows, the target's rejection
/// sampler) has the target's distribution at every position.
#[test]
fn sampled_dflash_and_dspark_keep_the_target_distribution() {
    let (_dir, loaded) = fixture_target();
    let runs = 2000;
    let (plain, _, _) = histograms(&loaded, None, runs);
    let fixtures = workspace_root().join("tests/fixtures/dflash");
    // DFlash over a draft vocabulary: the 96 ids of the fixture vocabulary other than each
    // fourth, so q is zero on a quarter of the ids the target samples.
    let subset = tempfile::tempdir().expect("temp dir");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures.join("dflash").join(f), subset.path().join(f)).expect("copy");
    }
    let ids: Vec<u32> = (0..128).filter(|i| i % 4 != 0).collect();
    let list =
        serde_json::json!({"format": "specula-draft-vocab/1", "vocab_size": 128, "ids": ids});
    std::fs::write(subset.path().join("draft_vocab.json"), list.to_string()).expect("write");
    let drafters = [
        fixtures.join("dflash"),
        fixtures.join("dspark_gated_conf"),
        subset.path().to_path_buf(),
    ];
    for dir in &drafters {
        let drafter = dir.display();
        let (spec, firsts, (drafted, accepted)) = histograms(&loaded, Some(dir), runs);
        for (i, (p, s)) in plain.iter().zip(&spec).enumerate() {
            let (stat, df) = chi_square(p, s);
            assert!(
                stat < critical(df),
                "{drafter} position {i}: chi2 {stat:.1} >= {:.1} (df {df})",
                critical(df)
            );
        }
        // The drafts were really verified, and some were accepted and some rejected.
        assert!(
            accepted > drafted / 20 && accepted < drafted,
            "{drafter}: {accepted} of {drafted} drafts accepted"
        );
        // Power: the drafter's own first proposals are far from the target's first token.
        // (A run whose first token ends it never drafts: nearly every run has a first round.)
        let drafted_first = firsts.iter().sum::<usize>();
        assert!(
            drafted_first * 100 >= runs as usize * 99,
            "{drafter}: {drafted_first}"
        );
        let (stat, df) = chi_square(&plain[0], &firsts);
        assert!(
            stat > critical(df),
            "{drafter}: the test cannot tell q from p (chi2 {stat:.1}, df {df})"
        );
    }
}

/// SmolLM2-135M in process, with a chat prompt in its template.
fn smollm2() -> (LoadedModel, Vec<u32>) {
    let loaded = load(&model_path("smollm2-135m"), &LoadOptions::default()).expect("load SmolLM2");
    let template = loaded
        .chat_template
        .as_ref()
        .expect("SmolLM2 has a template");
    let text = template
        .render(
            &[ChatMessage::new(
                "user",
                "Write a Python function that returns the factorial of n.",
            )],
            GenerationPrompt::Add,
        )
        .expect("render");
    let ids = loaded
        .tokenizer
        .encode(&text, Special::Parse)
        .expect("encode");
    (loaded, ids)
}

/// The shipped DFlash drafter for `loaded`, in process, wrapped by `wrap`.
fn shipped<D: Drafter + Send + 'static>(
    loaded: &LoadedModel,
    wrap: impl FnOnce(DFlash) -> D,
) -> Box<dyn Proposer> {
    let root = workspace_root().join("drafters/weights");
    let source = WeightsSource::Shipped {
        root,
        kind: "dflash".into(),
    };
    let mut d = DFlash::new(source, Options::default()).expect("options");
    d.load(&target_info(&loaded.model, &loaded.tokenizer))
        .expect("weights shipped for SmolLM2");
    Box::new(InProcess::new(wrap(d)))
}

/// A greedy generation of `max_tokens` with a fixed k; `on_token(n)` runs after the n-th token.
fn greedy(
    loaded: &LoadedModel,
    prompt: &[u32],
    slot: &ProposerSlot,
    max_tokens: usize,
    on_token: &mut dyn FnMut(usize),
) -> Vec<u32> {
    let speculation = match slot.lock().is_some() {
        true => Speculation::On {
            num_draft_tokens: 7,
        },
        false => Speculation::Off,
    };
    greedy_with(loaded, prompt, slot, max_tokens, speculation, on_token).token_ids
}

/// Plain greedy decoding of `prompt` (no drafter): what every faulted run must equal.
fn plain(loaded: &LoadedModel, prompt: &[u32]) -> Vec<u32> {
    greedy(
        loaded,
        prompt,
        &ProposerSlot::new(None),
        FAULT_TOKENS,
        &mut |_| {},
    )
}

/// Greedy decoding through the engine with the given speculation mode (the whole generation,
/// stats included); `on_token` gets the count of tokens streamed so far.
fn greedy_with(
    loaded: &LoadedModel,
    prompt: &[u32],
    slot: &ProposerSlot,
    max_tokens: usize,
    speculation: Speculation,
    on_token: &mut dyn FnMut(usize),
) -> Generation {
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        speculation,
        logprobs: None,
        grammar: None,
    };
    let mut n = 0;
    run_engine(
        &loaded.model,
        &loaded.tokenizer,
        slot,
        &EngineConfig::default(),
        &req,
        &mut |_| {
            n += 1;
            on_token(n);
            Flow::Continue
        },
    )
    .expect("generate")
}

/// The rounds of `after` that `clean` also drafted from the same anchor position, paired.
fn shared<'a>(clean: &'a [Round], after: &[&'a Round]) -> Vec<(&'a Round, &'a Round)> {
    after
        .iter()
        .filter_map(|r| clean.iter().find(|c| c.pos == r.pos).map(|c| (c, *r)))
        .collect()
}

/// Of `pairs`, how many drafted the same tokens (on their common length).
fn same_drafts(pairs: &[(&Round, &Round)]) -> usize {
    pairs
        .iter()
        .filter(|(c, r)| {
            let n = c.tokens.len().min(r.tokens.len());
            c.tokens[..n] == r.tokens[..n]
        })
        .count()
}

const FAULT_TOKENS: usize = 64;

/// A hot swap dflash → ngram → dflash in the middle of a request: the output equals plain
/// decoding, and the re-opened DFlash drafts exactly what an undisturbed one drafts from the
/// same positions (its context was rebuilt in full), from its first round on.
#[test]
fn swap_to_and_from_dflash_mid_request() {
    let (loaded, prompt) = smollm2();
    let plain = plain(&loaded, &prompt);
    let clean_rounds = Arc::new(Mutex::new(Vec::new()));
    let slot = ProposerSlot::new(Some(Box::new(Recording::new(
        shipped(&loaded, |d| d),
        0,
        &clean_rounds,
    ))));
    assert_eq!(
        greedy(&loaded, &prompt, &slot, FAULT_TOKENS, &mut |_| {}),
        plain
    );
    let clean = clean_rounds.lock().expect("lock").clone();

    let rounds = Arc::new(Mutex::new(Vec::new()));
    let slot = ProposerSlot::new(Some(Box::new(Recording::new(
        shipped(&loaded, |d| d),
        0,
        &rounds,
    ))));
    let mut swap = |n: usize| {
        let next: Box<dyn Proposer> = match n {
            16 => {
                let ngram = NgramDrafter::new(NgramConfig::default(), 16);
                Box::new(Recording::new(Box::new(InProcess::new(ngram)), 1, &rounds))
            }
            28 => Box::new(Recording::new(shipped(&loaded, |d| d), 2, &rounds)),
            _ => return,
        };
        slot.replace(Some(next));
    };
    assert_eq!(
        greedy(&loaded, &prompt, &slot, FAULT_TOKENS, &mut swap),
        plain
    );
    let rounds = rounds.lock().expect("lock").clone();
    let instances: Vec<usize> = rounds.iter().map(|r| r.instance).collect();
    assert!(
        instances.contains(&0) && instances.contains(&2),
        "every DFlash instance drafted: {instances:?}"
    );
    let reopened: Vec<&Round> = rounds.iter().filter(|r| r.instance == 2).collect();
    let pairs = shared(&clean, &reopened);
    let (same, compared) = (same_drafts(&pairs), pairs.len());
    assert!(
        compared >= 2 && same == compared,
        "after the re-open {same} of {compared} rounds drafted as an undisturbed DFlash \
         did:\n{reopened:?}\nclean: {clean:?}"
    );
}

/// An SDK drafter whose `at`-th commit gets its taps torn: views into a shared-memory ring that
/// the writer laps before the drafter reads them (the host outrunning a slow drafter).
struct Tearing<D> {
    inner: D,
    at: usize,
    commits: usize,
}

impl<D: Drafter> Drafter for Tearing<D> {
    fn info(&self) -> DrafterInfo {
        self.inner.info()
    }
    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        self.inner.open(session, args);
    }
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        self.inner.draft(session, new_tokens, n)
    }
    fn draft_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Proposal> {
        self.inner.draft_batch(asks)
    }
    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        self.commits += 1;
        let Some(taps) = args.taps.as_ref().filter(|_| self.commits == self.at) else {
            return self.inner.commit(session, args);
        };
        let data: Vec<Vec<f32>> = taps
            .tensors()
            .map(|t| t.to_f32().expect("in-process taps"))
            .collect();
        let bytes: usize = data.iter().map(|d| d.len() * 4).sum();
        let mut w = ShmWriter::new(0, bytes).expect("ring");
        let r = ShmReader::new(0, w.handle()).expect("reader");
        let views: Vec<TensorView> = data
            .iter()
            .map(|d| w.write_f32(d, &[d.len() as u32]).expect("write"))
            .collect();
        let refs: Vec<TensorRef<'_>> = views.iter().map(|v| r.view(v).expect("view")).collect();
        // The next lap overwrites every one of them while they are borrowed.
        for d in &data {
            w.write_f32(d, &[d.len() as u32]).expect("write");
        }
        assert!(
            refs.iter().all(|t| t.check().is_err()),
            "the views are torn"
        );
        let n_layers = taps.layers.len();
        let mut refs = refs.into_iter();
        let torn = Taps {
            pos: taps.pos,
            rows: taps.rows,
            layers: refs.by_ref().take(n_layers).collect(),
            final_hidden: taps.final_hidden.as_ref().and_then(|_| refs.next()),
            kv: Vec::new(),
        };
        self.inner.commit(
            session,
            CommitArgs {
                taps: Some(torn),
                ..args
            },
        );
    }
    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        self.inner.advance(session, args)
    }
    fn close(&mut self, session: SessionId) {
        self.inner.close(session);
    }
}

/// Torn taps on one commit: the drafter leaves those rows out (never reads torn values), skips
/// the next round (the host decodes it plainly), the output equals plain decoding, and a few
/// rounds later it drafts as an undisturbed DFlash does again.
#[test]
fn torn_taps_are_dropped_and_drafting_recovers() {
    let (loaded, prompt) = smollm2();
    let plain = plain(&loaded, &prompt);
    let run = |tear_at: usize| {
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let proposer = shipped(&loaded, |d| Tearing {
            inner: d,
            at: tear_at,
            commits: 0,
        });
        let slot = ProposerSlot::new(Some(Box::new(Recording::new(proposer, 0, &rounds))));
        let out = greedy(&loaded, &prompt, &slot, FAULT_TOKENS, &mut |_| {});
        let rounds = rounds.lock().expect("lock").clone();
        (out, rounds)
    };
    let (out, clean) = run(0);
    assert_eq!(out, plain);
    let (out, torn) = run(3);
    assert_eq!(out, plain, "torn taps changed the output");
    // Rounds 0..3 are the clean run's; the torn commit ended round 2.
    assert_eq!(torn[..3], clean[..3]);
    let resumed = clean[2].pos + clean[2].accepted + 1;
    assert!(
        torn[3].pos > resumed,
        "the round after the torn commit (at {resumed}) was skipped: {torn:?}"
    );
    // The hole (the torn window's rows) stays in the context, so later blocks differ in their
    // tails; what they get accepted is what an undisturbed drafter gets.
    let later: Vec<&Round> = torn[3..].iter().skip(2).collect();
    let pairs = shared(&clean, &later);
    let accepted = |pick: fn(&(&Round, &Round)) -> usize| pairs.iter().map(pick).sum::<usize>();
    let (now, before) = (accepted(|p| p.1.accepted), accepted(|p| p.0.accepted));
    let same = pairs
        .iter()
        .filter(|(c, r)| c.accepted == r.accepted)
        .count();
    assert!(
        pairs.len() >= 4 && same * 4 >= pairs.len() * 3,
        "after the fault {same} of {} rounds had the undisturbed acceptance ({now} vs {before} \
         accepted):\n{torn:?}\nclean: {clean:?}",
        pairs.len()
    );
}

/// A hot swap through the admin API with real processes, mid-request: a server drafting with
/// the DFlash process streams a long greedy answer while the drafter is swapped to ngram and
/// back to a new DFlash process. The text equals plain decoding, the new DFlash process is
/// opened with the taps of every position before the pending one, and from its first round it
/// drafts exactly what an undisturbed DFlash drafted at any position both drafted at (the same
/// request run before on the first process) and has its acceptance over the same span.
#[test]
fn admin_api_swap_to_and_from_dflash_mid_request() {
    use super::chaos::{drafts_without_holes, DrafterEvent};
    use super::server::{chat_body, generate_chat, send, wait_until, Server, ADMIN_TOKEN};
    use serde_json::json;
    use std::io::Read;
    use std::time::Duration;

    let question = "List the numbers from 1 to 100, separated by commas.";
    let tokens = 160;
    let plain = generate_chat(question, tokens, &["--no-speculation"]);
    let plain = plain["text"].as_str().expect("text");
    let dflash = bin_path("dflash");
    let ngram = bin_path("ngram");
    let bin_dir = dflash.parent().expect("bin dir").to_str().expect("utf-8");
    let srv = Server::start_env(
        &[
            "--drafter",
            dflash.to_str().expect("utf-8"),
            "--num-draft-tokens",
            "4",
            "--fixed-draft",
            "--draft-deadline-ms",
            "10000",
            // The deadline is also a few measured steps: a loaded machine's miss would halve
            // the drafter's budget and change the drafts this test compares.
            "--draft-deadline-steps",
            "1000",
            "--drafter-dir",
            bin_dir,
        ],
        &[
            ("SPECULA_ADMIN_TOKEN", ADMIN_TOKEN),
            ("RUST_LOG", "info,dflash=debug"),
            ("NO_COLOR", "1"),
        ],
    );
    let events =
        |log: &str| -> Vec<DrafterEvent> { log.lines().filter_map(DrafterEvent::parse).collect() };
    // The undisturbed run, on the first DFlash process.
    let clean = srv.post("/v1/chat/completions", &chat_body(question, tokens));
    assert_eq!(clean.status, 200, "{}", clean.text());
    let text = clean.json()["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    assert_eq!(text, plain, "dflash changed the output");
    let before = events(&srv.log());
    let first_pid = before.first().expect("the drafter logged its rounds").pid;
    let clean_drafts = drafts_without_holes(&before.iter().collect::<Vec<_>>());
    assert!(!clean_drafts.is_empty(), "the clean run drafted nothing");

    // The same request streamed, swapped dflash → ngram → dflash while it runs.
    let mut body = chat_body(question, tokens);
    body["stream"] = json!(true);
    let s = send(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    let stream = std::thread::spawn(move || {
        let mut raw = String::new();
        std::io::BufReader::new(s)
            .read_to_string(&mut raw)
            .expect("read the stream");
        raw
    });
    wait_until("the stream to start", Duration::from_secs(60), || {
        srv.get("/health").json()["queue_depth"] == 1
    });
    for path in [&ngram, &dflash] {
        std::thread::sleep(Duration::from_millis(300));
        let body = json!({"path": path});
        let r = srv.admin("POST", "/admin/drafters", Some(&body));
        assert!(
            r.status < 300,
            "swap to {}: {} {}",
            path.display(),
            r.status,
            r.text()
        );
    }
    assert_eq!(
        srv.get("/health").json()["queue_depth"],
        1,
        "the swaps happened mid-stream"
    );
    let raw = stream.join().expect("stream thread");
    let text: String = super::server::sse_data(&raw)
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .filter_map(|e| {
            let v: serde_json::Value = serde_json::from_str(e).expect("an SSE chunk");
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, plain, "the swaps changed the output\n{}", srv.log());

    let all = events(&srv.log());
    let after: Vec<&DrafterEvent> = all.iter().filter(|e| e.pid != first_pid).collect();
    let open = after
        .iter()
        .find(|e| e.event == "open")
        .unwrap_or_else(|| panic!("the new dflash process was never opened:\n{}", srv.log()));
    assert_eq!(
        (open.num("rows"), open.num("missing")),
        (open.num("pos"), 0),
        "the re-open carries the taps of every position before the pending one: {open:?}"
    );
    let new_drafts = drafts_without_holes(&after);
    let compared: Vec<_> = new_drafts
        .iter()
        .filter_map(|(pos, t)| {
            let clean = clean_drafts.iter().find(|(p, _)| p == pos)?;
            Some((*pos, *t == clean.1))
        })
        .collect();
    assert!(
        compared.iter().all(|(_, same)| *same),
        "after the swap back: {compared:?}\nnew {new_drafts:?}\nclean {clean_drafts:?}"
    );
    // Rounds land where acceptance put them, so the two runs may share no position (the
    // phase after the ngram rounds is the scheduler's): the acceptance over the same span
    // says the new process drafts as well as the undisturbed one did there.
    let span = new_drafts.first().map_or(0, |d| d.0)..=new_drafts.last().map_or(0, |d| d.0);
    let acceptance = |events: &[&DrafterEvent]| {
        let (drafted, accepted) = events
            .iter()
            .filter(|e| e.event == "commit" && span.contains(&e.num("pos")))
            .fold((0, 0), |(d, a), e| {
                (d + e.num("drafted"), a + e.num("accepted"))
            });
        (accepted as f64 / drafted.max(1) as f64, drafted)
    };
    let (now, drafted) = acceptance(&after);
    let (then, _) = acceptance(&before.iter().collect::<Vec<_>>());
    assert!(
        drafted >= 8 && now >= 0.9 * then,
        "after the swap back {now:.2} of {drafted} drafts accepted, undisturbed {then:.2} over \
         the same span {span:?}\nnew {new_drafts:?}\nclean {clean_drafts:?}"
    );
}

/// DFlash has no confidence head: its calibrated per-draft confidences reach the host, which
/// cuts drafts by them under the controller only; a fixed k verifies every draft, uncut. The
/// cut follows its rule whatever the measured costs (see `check_confidence_cut`), and drafts
/// made unsure (confidences scaled under every floor) are all cut. The output is plain
/// decoding's every time.
#[test]
fn dflash_confidences_reach_the_host_and_only_the_controller_cuts() {
    let (loaded, prompt) = smollm2();
    let plain = plain(&loaded, &prompt);
    let run = |speculation: Speculation, scale: f32| {
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let recording =
            Recording::new(shipped(&loaded, |d| d), 0, &rounds).scaling_confidences(scale);
        let slot = ProposerSlot::new(Some(Box::new(recording)));
        let out = greedy_with(
            &loaded,
            &prompt,
            &slot,
            FAULT_TOKENS,
            speculation,
            &mut |_| {},
        );
        assert_eq!(
            out.token_ids, plain,
            "{speculation:?}, confidences x{scale}"
        );
        let rounds = rounds.lock().expect("lock").clone();
        (out.stats, rounds)
    };
    let fixed_k = Speculation::On {
        num_draft_tokens: 7,
    };
    let (stats, fixed) = run(fixed_k, 1.0);
    assert!(fixed.len() >= 4, "too few rounds: {fixed:?}");
    for r in &fixed {
        assert_eq!(
            r.confidences.len(),
            r.tokens.len(),
            "one confidence per draft: {r:?}"
        );
        assert_eq!(
            r.verified,
            r.tokens.len(),
            "a fixed k verifies every draft: {r:?}"
        );
    }
    assert_eq!(stats.confidence_cut, 0, "a fixed k is never cut");
    let controller = Speculation::Adaptive {
        max_draft_tokens: 7,
    };
    let (stats, adaptive) = run(controller, 1.0);
    check_confidence_cut(&adaptive, stats.confidence_cut);
    let (stats, unsure) = run(controller, 0.05);
    assert!(!unsure.is_empty(), "the controller never asked the drafter");
    let sent: usize = unsure.iter().map(|r| r.tokens.len()).sum();
    assert_eq!(
        check_confidence_cut(&unsure, stats.confidence_cut),
        sent,
        "{unsure:?}"
    );
    assert_eq!(
        stats.confidence_cut, sent,
        "every unsure draft cut: {unsure:?}"
    );
    let (stats, _) = run(fixed_k, 0.05);
    assert_eq!(
        stats.confidence_cut, 0,
        "a fixed k never cuts, however unsure"
    );
}
