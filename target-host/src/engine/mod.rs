//! The batched engine: continuous batching with speculation over one target model.
//!
//! Requests join and leave between steps; every step runs one target forward over the rows of
//! all running sequences (`[pending, drafts]` each, or a prefill chunk) and verifies each
//! sequence over its own rows. The CLI's `generate` is a batch of one through the same
//! [`Core::step`]; `serve` runs every request through it on one worker thread.
//!
//! | module | job |
//! |---|---|
//! | [`scheduler`] | admission (bounded queue, pool reservations), the per-step token budget |
//! | [`sequence`] | one request's state and its commit rule (EOS, stop strings, max_tokens) |
//! | [`step`] | [`Core`]: plan, batched draft, one forward, per-sequence verify and commit |
//! | [`target`] | the sequences' K/V and the forward over their rows |
//! | [`controller`] | per-sequence k from a profiled cost table and acceptance |
//! | [`drafting`] | what each drafter session is told and given; re-sync after a swap or respawn |
//! | [`tap_cache`] | drafter taps of prefix-cached blocks, so tap sessions adopt them too |
//!
//! Requests that arrive together and share leading prompt blocks no cache holds yet compute
//! them once: the first prefills them, the others wait for them and adopt them from the prefix
//! index (`--no-prefix-dedup` turns this off; see [`Core`]'s `place`).
//!
//! Requests arrive from any thread (the HTTP handlers) through [`Engine::submit`], which
//! refuses at once (HTTP 429 with a retry delay) when the bounded queue is full, and stream
//! their tokens back over a channel; dropping the receiving end cancels the request before the
//! next step and frees its K/V.

pub mod controller;
pub mod drafting;
pub mod scheduler;
pub mod sequence;
pub mod step;
pub mod tap_cache;
pub mod target;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use specula_models::chat::ChatTemplate;
use specula_models::kv_pool::{PoolStats, BLOCK_SIZE};
use specula_models::loader::LoadedModel;
use specula_models::tokenizer::Tokenizer;
use specula_models::Model;
use tokio::sync::mpsc as tokio_mpsc;

use crate::generation::{
    Flow, Generation, GenerationError, GenerationRequest, TokenEvent, TokenLogprob,
};
use crate::proposer::{Health, Proposer, ProposerSlot, SessionId};

pub use drafting::DraftingCounters;
pub use scheduler::{Limits, Refusal};
pub use sequence::Sink;
pub use step::Core;

/// The engine's limits and knobs (`serve` and `generate` flags).
#[derive(Args, Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Most sequences running (decoding or prefilling) at once.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Requests that may wait for a running slot; one more is refused (HTTP 429).
    #[arg(long, default_value_t = 64)]
    pub max_waiting: usize,
    /// Target rows per step: decode rows, drafts and prefill chunks together (at least
    /// `--max-running`).
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// KV pool capacity in positions for all running sequences together (0: room for
    /// `--max-running` sequences at the full context).
    #[arg(long, default_value_t = 0)]
    pub kv_pool_tokens: usize,
    /// The draft deadline, in measured plain target steps (the step this draft feeds, without
    /// its drafts).
    #[arg(long, default_value_t = 4.0)]
    pub draft_deadline_steps: f64,
    /// KV pool memory kept for the prefix cache once no running sequence holds it, in MiB:
    /// blocks past it are reused least recently released first, so the pool's memory stops
    /// growing at the running sequences' peak plus this (0: no prefix cache).
    #[arg(long, default_value_t = 128)]
    pub prefix_cache_mib: usize,
    /// Host memory for the drafter taps of prefix-cached blocks, in MiB (0: sequences that
    /// feed a tap drafter prefill their whole prompt instead of adopting cached blocks).
    #[arg(long, default_value_t = 256)]
    pub tap_cache_mib: usize,
    /// Compute a common prompt prefix of requests arriving together once: a request whose
    /// prompt starts with blocks an earlier one is still prefilling waits for them and adopts
    /// them (`--no-prefix-dedup`: every request prefills what the cache does not hold).
    #[arg(long = "no-prefix-dedup", action = clap::ArgAction::SetFalse)]
    pub prefix_dedup: bool,
    /// The longest draft deadline (set from `--draft-deadline-ms`).
    #[arg(skip = Duration::from_millis(500))]
    pub draft_deadline_cap: Duration,
    /// Profile the forward cost at start-up (off in unit tests of tiny models).
    #[arg(skip = true)]
    pub profile: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 16,
            max_waiting: 64,
            max_batch_tokens: 256,
            kv_pool_tokens: 0,
            prefix_cache_mib: 128,
            draft_deadline_steps: 4.0,
            tap_cache_mib: 256,
            prefix_dedup: true,
            draft_deadline_cap: Duration::from_millis(500),
            profile: true,
        }
    }
}

impl EngineConfig {
    /// The scheduler's limits for a model of `context` positions.
    pub fn limits(&self, context: usize) -> Limits {
        let max_running = self.max_running.max(1);
        Limits {
            max_running,
            max_waiting: self.max_waiting,
            batch_tokens: self.max_batch_tokens.max(max_running),
            pool_tokens: match self.kv_pool_tokens {
                0 => max_running * context,
                n => n,
            },
        }
    }

    /// Checks the flags.
    ///
    /// # Errors
    /// A zero limit or a batch smaller than the running sequences.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.max_running > 0, "--max-running must be at least 1");
        anyhow::ensure!(
            self.max_batch_tokens >= self.max_running,
            "--max-batch-tokens ({}) must be at least --max-running ({}): every running \
             sequence needs a row per step",
            self.max_batch_tokens,
            self.max_running
        );
        anyhow::ensure!(
            self.draft_deadline_steps > 0.0 && self.draft_deadline_steps.is_finite(),
            "--draft-deadline-steps must be a positive number"
        );
        Ok(())
    }
}

/// The engine's live counters, for `/metrics` (plain atomics; [`Counters::snapshot`] reads
/// them).
#[derive(Debug, Default)]
pub struct Counters {
    running: AtomicUsize,
    waiting: AtomicUsize,
    pool_capacity: AtomicUsize,
    pool_reserved: AtomicUsize,
    pool_used: AtomicUsize,
    pool_cached: AtomicUsize,
    pool_arena: AtomicUsize,
    steps: AtomicU64,
    batch_rows: AtomicU64,
    last_batch_rows: AtomicUsize,
    drafts_chosen: AtomicU64,
    decode_rows: AtomicU64,
    last_mean_k_milli: AtomicU64,
    finished: AtomicU64,
    prefix_lookups: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    shared_waits: AtomicU64,
    refused: AtomicU64,
    step_us: AtomicU64,
    forward_us: AtomicU64,
    draft_us: AtomicU64,
    reopened: AtomicU64,
    reforwards: AtomicU64,
    taps_over_budget: AtomicU64,
    resync_failed: AtomicU64,
}

/// A reading of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    /// Sequences running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// KV pool capacity (positions).
    pub pool_capacity: usize,
    /// Positions reserved by running sequences.
    pub pool_reserved: usize,
    /// Positions in blocks referenced by running sequences (whole blocks).
    pub pool_used: usize,
    /// Positions in unreferenced blocks kept for the prefix cache (evictable).
    pub pool_cached: usize,
    /// Positions the pool's arena has materialised (its host memory; it never shrinks).
    pub pool_arena: usize,
    /// Steps run.
    pub steps: u64,
    /// Target rows over all steps.
    pub batch_rows: u64,
    /// Rows of the last step.
    pub last_batch_rows: usize,
    /// Drafts verified over all steps (the controller's k, as drafted).
    pub drafts: u64,
    /// Decode rows over all steps (sequences verified).
    pub decode_rows: u64,
    /// Mean k over the sequences of the last step.
    pub last_mean_k: f64,
    /// Sequences finished.
    pub finished: u64,
    /// Prompt positions (in full blocks) looked up in the prefix cache.
    pub prefix_lookups: u64,
    /// Prompt positions served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Requests that waited for an earlier one to compute blocks their prompts start with
    /// (in-flight prefix sharing), then adopted them.
    pub shared_waits: u64,
    /// Requests refused (queue full).
    pub refused: u64,
    /// Time in steps, µs (the split below, plus the host's own work: planning,
    /// verification, commits, drafter messages, detokenization).
    pub step_us: u64,
    /// Time in target forwards, µs.
    pub forward_us: u64,
    /// Time waiting for drafts, µs.
    pub draft_us: u64,
    /// What the drafters were told: sessions re-opened, contexts re-forwarded for their taps,
    /// kept taps over budget, re-forwards that failed (totals over every core's life).
    pub drafting: DraftingCounters,
}

impl Counters {
    fn set_limits(&self, limits: &Limits) {
        self.pool_capacity
            .store(limits.pool_tokens, Ordering::Relaxed);
    }

    fn publish(&self, running: usize, waiting: usize, reserved: usize, pool: &PoolStats) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.pool_reserved.store(reserved, Ordering::Relaxed);
        self.pool_used
            .store(pool.used_blocks * BLOCK_SIZE, Ordering::Relaxed);
        self.pool_cached
            .store(pool.cached_blocks * BLOCK_SIZE, Ordering::Relaxed);
        self.pool_arena
            .store(pool.arena_blocks * BLOCK_SIZE, Ordering::Relaxed);
        self.prefix_lookups
            .store(pool.prefix_query_tokens, Ordering::Relaxed);
        self.prefix_hit_tokens
            .store(pool.prefix_hit_tokens, Ordering::Relaxed);
    }

    fn step(&self, rows: usize, ks: &[usize]) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.batch_rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.last_batch_rows.store(rows, Ordering::Relaxed);
        let drafts: usize = ks.iter().sum();
        self.drafts_chosen
            .fetch_add(drafts as u64, Ordering::Relaxed);
        self.decode_rows
            .fetch_add(ks.len() as u64, Ordering::Relaxed);
        let mean = match ks.len() {
            0 => 0,
            n => (drafts as u64 * 1000) / n as u64,
        };
        self.last_mean_k_milli.store(mean, Ordering::Relaxed);
    }

    fn shared_wait(&self) {
        self.shared_waits.fetch_add(1, Ordering::Relaxed);
    }

    fn finished(&self) {
        self.finished.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds what the drafting counters gained since `last` (a core's own counters start at
    /// zero; these totals span cores).
    fn drafting(&self, now: &DraftingCounters, last: &DraftingCounters) {
        let add = |a: &AtomicU64, now: u64, last: u64| {
            a.fetch_add(now.saturating_sub(last), Ordering::Relaxed);
        };
        add(&self.reopened, now.reopened, last.reopened);
        add(&self.reforwards, now.reforwards, last.reforwards);
        add(
            &self.taps_over_budget,
            now.taps_over_budget,
            last.taps_over_budget,
        );
        add(&self.resync_failed, now.resync_failed, last.resync_failed);
    }

    /// Where one step's time went (ms).
    fn time(&self, step: f64, forward: f64, draft: f64) {
        let us = |ms: f64| (ms * 1e3).max(0.0) as u64;
        self.step_us.fetch_add(us(step), Ordering::Relaxed);
        self.forward_us.fetch_add(us(forward), Ordering::Relaxed);
        self.draft_us.fetch_add(us(draft), Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> EngineCounters {
        let r = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        let q = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineCounters {
            running: r(&self.running),
            waiting: r(&self.waiting),
            pool_capacity: r(&self.pool_capacity),
            pool_reserved: r(&self.pool_reserved),
            pool_used: r(&self.pool_used),
            pool_cached: r(&self.pool_cached),
            pool_arena: r(&self.pool_arena),
            steps: q(&self.steps),
            batch_rows: q(&self.batch_rows),
            last_batch_rows: r(&self.last_batch_rows),
            drafts: q(&self.drafts_chosen),
            decode_rows: q(&self.decode_rows),
            last_mean_k: q(&self.last_mean_k_milli) as f64 / 1000.0,
            finished: q(&self.finished),
            prefix_lookups: q(&self.prefix_lookups),
            prefix_hit_tokens: q(&self.prefix_hit_tokens),
            shared_waits: q(&self.shared_waits),
            refused: q(&self.refused),
            step_us: q(&self.step_us),
            forward_us: q(&self.forward_us),
            draft_us: q(&self.draft_us),
            drafting: DraftingCounters {
                reopened: q(&self.reopened),
                reforwards: q(&self.reforwards),
                taps_over_budget: q(&self.taps_over_budget),
                resync_failed: q(&self.resync_failed),
            },
        }
    }
}

/// What a submitted request streams back.
#[derive(Debug)]
pub enum Event {
    /// A committed token and the text it made safe to show.
    Token {
        /// Token id.
        id: u32,
        /// Text delta (may be empty).
        text: String,
        /// Log-probabilities, when asked for.
        logprob: Option<TokenLogprob>,
    },
    /// The request ended; always the last event.
    Done(Result<Generation, GenerationError>),
}

/// A refused request and when to try again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{refusal}")]
pub struct Rejected {
    /// Why.
    pub refusal: Refusal,
    /// For [`Refusal::Busy`]: a suggested wait before retrying.
    pub retry_after: Option<Duration>,
}

/// What the worker is sent.
enum Job {
    /// A request and the sink that answers it. The sink is made at submission, so a job the
    /// worker never takes (it stopped) still fails its request when dropped.
    Run(Box<GenerationRequest>, ChannelSink),
    /// Panic inside the worker ([`Engine::inject_panic`]).
    Panic,
}

/// The server's sink: a channel to the HTTP handler.
struct ChannelSink {
    events: tokio_mpsc::UnboundedSender<Event>,
    outstanding: Arc<AtomicUsize>,
    durations: Arc<Mutex<DurationEma>>,
    started: Instant,
    /// `done` was called: the request has left the queue.
    finished: bool,
}

impl Drop for ChannelSink {
    /// A sink dropped unfinished (its core dropped after a panic) fails its request, so the
    /// client hears why and the queue count stays true.
    fn drop(&mut self) {
        if !self.finished {
            self.done(Err(GenerationError::Failed(
                "the engine failed while serving this request (see the server log)".into(),
            )));
        }
    }
}

/// Clears the engine's alive flag when the worker thread ends, however it ends.
struct Alive(Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Sink for ChannelSink {
    fn token(&mut self, ev: TokenEvent<'_>) -> Flow {
        let sent = self.events.send(Event::Token {
            id: ev.id,
            text: ev.text.to_string(),
            logprob: ev.logprob,
        });
        match sent {
            Ok(()) => Flow::Continue,
            Err(_) => Flow::Cancel,
        }
    }
    fn done(&mut self, result: Result<Generation, GenerationError>) {
        self.finished = true;
        if let Err(e) = &result {
            tracing::warn!("generation failed: {e}");
        }
        // The request leaves the queue before its client hears it is done.
        self.outstanding.fetch_sub(1, Ordering::SeqCst);
        self.durations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(self.started.elapsed());
        let _ = self.events.send(Event::Done(result));
    }
    fn is_closed(&self) -> bool {
        self.events.is_closed()
    }
}

/// Mean request duration (EMA), for the retry delay of a refused request.
#[derive(Debug, Default)]
struct DurationEma(Option<f64>);

impl DurationEma {
    fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        self.0 = Some(self.0.map_or(s, |m| 0.9 * m + 0.1 * s));
    }
}

/// A handle to the engine's worker; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    /// Cleared when the worker thread ends (see [`Engine::start`]).
    alive: Arc<AtomicBool>,
    slot: Arc<ProposerSlot>,
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    limits: Limits,
    outstanding: Arc<AtomicUsize>,
    durations: Arc<Mutex<DurationEma>>,
    counters: Arc<Counters>,
    next_session: Arc<AtomicU64>,
}

impl Engine {
    /// Starts the worker thread over `loaded`, drafting with `proposer` (if any), and waits
    /// until it is ready (its cost table profiled).
    ///
    /// A panic inside a step (a bug, or an in-process proposer's) fails the requests in
    /// flight, each with an error event, and the worker starts over with a fresh core: the
    /// server keeps serving. Only when a fresh core cannot be built does the engine stop:
    /// then [`Engine::submit`] refuses with [`Refusal::Stopped`] and [`Engine::is_alive`] is
    /// false.
    ///
    /// # Errors
    /// Invalid `config` ([`EngineConfig::validate`]), or a core that cannot be built.
    pub fn start(
        loaded: LoadedModel,
        proposer: Option<Box<dyn Proposer>>,
        config: EngineConfig,
    ) -> anyhow::Result<Engine> {
        config.validate()?;
        let model = Arc::new(loaded.model);
        let tokenizer = Arc::new(loaded.tokenizer);
        let slot = Arc::new(ProposerSlot::new(proposer));
        let counters = Arc::new(Counters::default());
        let limits = config.limits(model.context_len());
        let (jobs, rx) = mpsc::channel::<Job>();
        let outstanding = Arc::new(AtomicUsize::new(0));
        let durations = Arc::new(Mutex::new(DurationEma::default()));
        let alive = Arc::new(AtomicBool::new(true));
        let (ready, started) = mpsc::sync_channel::<anyhow::Result<()>>(1);
        {
            let (model, tokenizer, slot, counters) = (
                model.clone(),
                tokenizer.clone(),
                slot.clone(),
                counters.clone(),
            );
            let alive = Alive(alive.clone());
            thread::Builder::new()
                .name("engine".into())
                .spawn(move || {
                    let _alive = alive;
                    // The worker never refuses: `submit` bounds the queue before sending.
                    let config = EngineConfig {
                        max_waiting: usize::MAX,
                        ..config
                    };
                    // Logprob bytes are built on first use; build them before any request waits.
                    let _ = tokenizer.token_bytes(0);
                    let mut ready = Some(ready);
                    loop {
                        let core = Core::with_counters(
                            &model,
                            &tokenizer,
                            &slot,
                            config.clone(),
                            counters.clone(),
                        );
                        let mut core = match (core, ready.take()) {
                            (Ok(core), first) => {
                                if let Some(ready) = first {
                                    let _ = ready.send(Ok(()));
                                }
                                core
                            }
                            (Err(e), Some(ready)) => return drop(ready.send(Err(e))),
                            (Err(e), None) => {
                                return tracing::error!("the engine cannot restart: {e:#}")
                            }
                        };
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            worker(&mut core, &rx)
                        }));
                        match run {
                            // The queue closed: the server is stopping.
                            Ok(()) => return,
                            // Dropping the core fails its requests (see `ChannelSink`'s drop).
                            Err(panic) => tracing::error!(
                                "the engine panicked ({}): its requests fail, and it restarts",
                                crate::proposer::panic_message(&*panic)
                            ),
                        }
                    }
                })
                .expect("invariant: the OS can spawn the engine thread");
        }
        started
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread ended before it was ready"))?
            .context("the engine cannot start")?;
        Ok(Engine {
            jobs,
            alive,
            slot,
            model,
            tokenizer,
            chat_template: loaded.chat_template.map(Arc::new),
            limits,
            outstanding,
            durations,
            counters,
            next_session: Arc::new(AtomicU64::new(1)),
        })
    }

    /// Queues `req` and returns the stream of its events. The session id of `req` is replaced
    /// by a fresh one. Dropping the receiver cancels the request.
    ///
    /// # Errors
    /// [`Rejected`] when the waiting queue is full (with a retry delay), the request can
    /// never fit the KV pool, or the engine has stopped.
    pub fn submit(
        &self,
        mut req: GenerationRequest,
    ) -> Result<tokio_mpsc::UnboundedReceiver<Event>, Rejected> {
        if !self.is_alive() {
            return Err(Rejected {
                refusal: Refusal::Stopped,
                retry_after: None,
            });
        }
        let need = step::need(&req, self.model.context_len());
        if need > self.limits.pool_tokens {
            return Err(Rejected {
                refusal: Refusal::TooLarge {
                    need,
                    pool: self.limits.pool_tokens,
                },
                retry_after: None,
            });
        }
        let outstanding = self.outstanding.fetch_add(1, Ordering::SeqCst);
        let running = self.counters.running.load(Ordering::Relaxed);
        let waiting = outstanding.saturating_sub(running);
        if outstanding >= self.limits.max_running && waiting >= self.limits.max_waiting {
            self.outstanding.fetch_sub(1, Ordering::SeqCst);
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Rejected {
                refusal: Refusal::Busy { running, waiting },
                retry_after: Some(self.retry_after(waiting)),
            });
        }
        req.session = self.new_session();
        let (events, rx) = tokio_mpsc::unbounded_channel();
        let sink = ChannelSink {
            events,
            outstanding: self.outstanding.clone(),
            durations: self.durations.clone(),
            started: Instant::now(),
            finished: false,
        };
        if let Err(mpsc::SendError(job)) = self.jobs.send(Job::Run(Box::new(req), sink)) {
            if let Job::Run(_, mut sink) = job {
                // Leaves the queue count as it was; nobody reads the events.
                sink.finished = true;
            }
            self.outstanding.fetch_sub(1, Ordering::SeqCst);
            return Err(Rejected {
                refusal: Refusal::Stopped,
                retry_after: None,
            });
        }
        Ok(rx)
    }

    /// Makes the worker panic between two steps, as a bug in a step would: for the tests of
    /// the engine's recovery.
    #[doc(hidden)]
    pub fn inject_panic(&self) {
        let _ = self.jobs.send(Job::Panic);
    }

    /// How long a refused client should wait: the queue ahead of it drained at the measured
    /// request rate, at least a second.
    fn retry_after(&self, waiting: usize) -> Duration {
        let mean = self
            .durations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .unwrap_or(1.0);
        let secs = (waiting as f64 + 1.0) * mean / self.limits.max_running as f64;
        Duration::from_secs(secs.ceil().clamp(1.0, 120.0) as u64)
    }

    /// A fresh session id.
    pub fn new_session(&self) -> SessionId {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The drafter slot, for hot-swapping and inspection.
    pub fn slot(&self) -> &Arc<ProposerSlot> {
        &self.slot
    }

    /// The current drafter's health (`None` without a drafter).
    pub fn drafter_health(&self) -> Option<Health> {
        self.slot.health()
    }

    /// The target model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The target's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The target's chat template, when it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_deref()
    }

    /// Requests waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.outstanding.load(Ordering::SeqCst)
    }

    /// Whether the worker is running (false only once it could not start over; see
    /// [`Engine::start`]).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// The engine's counters (running, waiting, pool, batch rows, chosen k, prefix cache).
    pub fn counters(&self) -> EngineCounters {
        self.counters.snapshot()
    }
}

fn worker(core: &mut Core<'_>, jobs: &mpsc::Receiver<Job>) {
    loop {
        // Block for work only when idle; otherwise take what arrived and step.
        let first = match core.has_work() {
            true => jobs.try_recv().ok(),
            false => match jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            },
        };
        for job in first
            .into_iter()
            .chain(std::iter::from_fn(|| jobs.try_recv().ok()))
        {
            let (req, mut sink) = match job {
                Job::Run(req, sink) => (req, sink),
                Job::Panic => panic!("a panic injected into the engine"),
            };
            // The retry delay's mean is of service time, not of time queued.
            sink.started = Instant::now();
            if let Err(e) = core.admit(*req, Box::new(sink)) {
                // Unreachable with an unbounded worker queue; reported, never dropped.
                tracing::error!("engine refused an admitted request: {e}");
            }
        }
        if let Err(e) = core.step() {
            tracing::error!("engine step failed: {e:#}");
        }
    }
}

/// Whether a series only goes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeriesKind {
    /// A value that goes up and down.
    Gauge,
    /// A running total (its name ends in `_total`).
    Counter,
}

/// One engine series for `/metrics`: name, kind, help text and current value.
pub type EngineSeries = (&'static str, SeriesKind, &'static str, f64);

impl EngineCounters {
    /// The counters as metric series, in a fixed order (the same names at every call).
    pub fn series(&self) -> [EngineSeries; 24] {
        [
            (
                "specula_engine_running",
                SeriesKind::Gauge,
                "Sequences running (decoding or prefilling).",
                self.running as f64,
            ),
            (
                "specula_engine_waiting",
                SeriesKind::Gauge,
                "Requests waiting for a running slot.",
                self.waiting as f64,
            ),
            (
                "specula_kv_pool_capacity_tokens",
                SeriesKind::Gauge,
                "KV pool capacity in positions.",
                self.pool_capacity as f64,
            ),
            (
                "specula_kv_pool_reserved_tokens",
                SeriesKind::Gauge,
                "KV positions reserved by running sequences.",
                self.pool_reserved as f64,
            ),
            (
                "specula_kv_pool_used_tokens",
                SeriesKind::Gauge,
                "KV positions in blocks of running sequences.",
                self.pool_used as f64,
            ),
            (
                "specula_kv_pool_cached_tokens",
                SeriesKind::Gauge,
                "KV positions cached for prefix reuse (evictable).",
                self.pool_cached as f64,
            ),
            (
                "specula_kv_pool_arena_tokens",
                SeriesKind::Gauge,
                "KV positions the pool's host memory holds (running peak plus the prefix cache).",
                self.pool_arena as f64,
            ),
            (
                "specula_engine_steps_total",
                SeriesKind::Counter,
                "Engine steps (one target forward each).",
                self.steps as f64,
            ),
            (
                "specula_engine_batch_rows_total",
                SeriesKind::Counter,
                "Target rows over all steps.",
                self.batch_rows as f64,
            ),
            (
                "specula_engine_last_batch_rows",
                SeriesKind::Gauge,
                "Target rows of the last step.",
                self.last_batch_rows as f64,
            ),
            (
                "specula_engine_drafts_total",
                SeriesKind::Counter,
                "Drafts verified (the controller's k, as drafted).",
                self.drafts as f64,
            ),
            (
                "specula_engine_decode_rows_total",
                SeriesKind::Counter,
                "Sequence verifications over all steps.",
                self.decode_rows as f64,
            ),
            (
                "specula_engine_last_mean_k",
                SeriesKind::Gauge,
                "Mean draft length over the sequences of the last step.",
                self.last_mean_k,
            ),
            (
                "specula_prefix_cache_query_tokens_total",
                SeriesKind::Counter,
                "Prompt positions (full blocks) looked up in the prefix cache.",
                self.prefix_lookups as f64,
            ),
            (
                "specula_prefix_cache_hit_tokens_total",
                SeriesKind::Counter,
                "Prompt positions served from the prefix cache.",
                self.prefix_hit_tokens as f64,
            ),
            (
                "specula_prefix_inflight_waits_total",
                SeriesKind::Counter,
                "Requests that waited for an earlier one to compute their common prompt prefix.",
                self.shared_waits as f64,
            ),
            (
                "specula_engine_refused_total",
                SeriesKind::Counter,
                "Requests refused with 429 (queue full).",
                self.refused as f64,
            ),
            (
                "specula_engine_step_seconds_total",
                SeriesKind::Counter,
                "Time in engine steps (forward, drafting and the host's own work).",
                self.step_us as f64 / 1e6,
            ),
            (
                "specula_engine_forward_seconds_total",
                SeriesKind::Counter,
                "Time in target forwards.",
                self.forward_us as f64 / 1e6,
            ),
            (
                "specula_engine_draft_seconds_total",
                SeriesKind::Counter,
                "Time waiting for drafts.",
                self.draft_us as f64 / 1e6,
            ),
            (
                "specula_drafter_reopened_total",
                SeriesKind::Counter,
                "Drafter sessions re-opened on a new drafter (a hot swap) or a new life of it (a respawn).",
                self.drafting.reopened as f64,
            ),
            (
                "specula_drafter_tap_reforwards_total",
                SeriesKind::Counter,
                "Contexts re-forwarded to rebuild the taps a re-opened drafter session needs.",
                self.drafting.reforwards as f64,
            ),
            (
                "specula_drafter_taps_over_budget_total",
                SeriesKind::Counter,
                "Sessions whose kept taps went over the host's budget (re-forwarded if needed).",
                self.drafting.taps_over_budget as f64,
            ),
            (
                "specula_drafter_tap_reforward_failures_total",
                SeriesKind::Counter,
                "Tap re-forwards that failed (those sequences ran on without speculation).",
                self.drafting.resync_failed as f64,
            ),
        ]
    }
}
