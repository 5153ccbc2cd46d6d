//! [`Core`]: the sequences, their K/V, the drafter records and the controller, advanced one
//! step at a time. The CLI runs a batch of one through it; the server's worker thread runs
//! every request through it.
//!
//! One step:
//! 1. admit waiting requests that fit; drop the ones whose consumer went away (their K/V is
//!    freed at once);
//! 2. plan: every running sequence contributes `[pending, d1..dk]` with its own k (0: a plain
//!    decode row) chosen by the [`Controller`] (or fixed by the request); prefill chunks share
//!    the rest of the token budget;
//! 3. draft: one batched call to the proposer for every sequence with k > 0. Under the
//!    controller the host cuts each draft where the drafter's own confidences fall below the
//!    break-even reach of one more verify row (`confidence_floor`); a fixed k
//!    ([`Speculation::On`]) verifies every draft sent, uncut. Drafters only report
//!    confidences: this is the one place a draft is shortened by them. A sequence under a
//!    grammar keeps only the draft prefix its grammar allows
//!    ([`crate::grammar::Constraint::check_draft`]);
//! 4. one target forward over all rows ([`Target::forward`]), logits only where verified;
//! 5. per sequence: verify (greedy argmax or rejection sampling, each row under the grammar's
//!    mask when there is one, [`crate::verify`]), roll the K/V back to what was accepted,
//!    commit the tokens (advancing the grammar), tell the drafter (commit or advance, with the
//!    taps of exactly the committed positions).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Tensor, D};
use specula_models::kv_pool::{chain_keys, BlockKey, BLOCK_SIZE};
use specula_models::tokenizer::Tokenizer;
use specula_models::Model;
use tracing::warn;

use super::controller::{Acceptance, Candidate, Controller, CostTable};
use super::drafting::{Drafting, DraftingCounters};
use super::scheduler::{Refusal, Scheduler};
use super::sequence::{Sequence, Sink};
use super::tap_cache::TapCache;
use super::target::{self, Rows, RowsOut, Target};
use super::{Counters, EngineConfig};
use crate::generation::{FinishReason, GenerationError, GenerationRequest, Speculation};
use crate::proposer::{Draft, DraftAsk, ProposerSlot, SessionId, TapRows, Verdict};
use crate::verify::{verify, verify_greedy};

/// A running sequence and the engine's bookkeeping around it.
struct Live<'a> {
    seq: Sequence<'a>,
    /// KV positions reserved at admission.
    need: usize,
    /// The prefix keys of the prompt's full blocks (all but its last id).
    keys: Vec<BlockKey>,
    /// Whether it has K/V in the pool yet: an admitted sequence waits outside it while an
    /// earlier one computes blocks of its prompt (see [`Core::place`]).
    placed: bool,
    /// Whether it waited so.
    waited: bool,
    acceptance: Acceptance,
    /// Taps of the prompt so far, for the drafter's `Open`.
    prompt_taps: Option<TapRows>,
    /// Why it failed, when it did.
    error: Option<GenerationError>,
}

/// One sequence's part of the step being built.
struct Part {
    /// Index into `Core::live`.
    at: usize,
    kind: PartKind,
}

/// Where a sequence placed in the pool gets its prompt's computed prefix.
enum Share {
    /// An earlier sequence is computing more of it: wait a step.
    Wait,
    /// The prefix index's cached full blocks.
    Cache,
    /// The first `len` positions of live sequence `from`.
    Fork { from: SessionId, len: usize },
}

enum PartKind {
    /// `[pending, drafts]`: `asked` drafts wanted, `draft` what came.
    Decode { asked: usize, draft: Draft },
    /// The next `chunk` uncomputed ids.
    Prefill { chunk: usize },
}

/// The engine's state, advanced by [`Core::step`].
pub struct Core<'a> {
    tokenizer: &'a Tokenizer,
    slot: &'a ProposerSlot,
    config: EngineConfig,
    target: Target<'a>,
    sched: Scheduler<Sequence<'a>>,
    live: Vec<Live<'a>>,
    controller: Controller,
    drafting: Drafting,
    /// Taps of prefix-cached blocks, so tap sessions adopt cached blocks too.
    tap_cache: TapCache,
    counters: Arc<Counters>,
    /// The drafting counters as last published (the shared totals get the difference).
    published: DraftingCounters,
    /// Tap re-forwards to fail on purpose ([`Core::inject_resync_failures`]).
    resync_faults: usize,
}

impl<'a> Core<'a> {
    /// An engine core over `model`, drafting through `slot`. Profiles the forward cost for the
    /// controller first (a few short forwards) when `config.profile` is set.
    ///
    /// # Errors
    /// The KV pool cannot be made.
    pub fn new(
        model: &'a Model,
        tokenizer: &'a Tokenizer,
        slot: &'a ProposerSlot,
        config: EngineConfig,
    ) -> anyhow::Result<Self> {
        Self::with_counters(model, tokenizer, slot, config, Arc::default())
    }

    /// As [`Core::new`], publishing into `counters`.
    ///
    /// # Errors
    /// The KV pool cannot be made.
    pub fn with_counters(
        model: &'a Model,
        tokenizer: &'a Tokenizer,
        slot: &'a ProposerSlot,
        config: EngineConfig,
        counters: Arc<Counters>,
    ) -> anyhow::Result<Self> {
        let points = match config.profile {
            true => target::profile(model, 16).unwrap_or_else(|e| {
                warn!("profiling the target failed ({e:#}); starting from a guessed cost table");
                guessed_costs()
            }),
            false => guessed_costs(),
        };
        tracing::debug!(?points, "verify cost table (rows, ms)");
        let limits = config.limits(model.context_len());
        counters.set_limits(&limits);
        let mut core = Core {
            tokenizer,
            slot,
            target: Target::new(
                model,
                limits.pool_tokens,
                limits.max_running,
                config.prefix_cache_mib << 20,
            )?,
            sched: Scheduler::new(limits),
            live: Vec::new(),
            controller: Controller::new(CostTable::new(points)),
            drafting: Drafting::default(),
            tap_cache: TapCache::new(config.tap_cache_mib << 20),
            counters,
            published: DraftingCounters::default(),
            resync_faults: 0,
            config,
        };
        // A core built after a panic starts from zero: the counters say so at once.
        core.publish();
        Ok(core)
    }

    /// Makes the next `n` tap re-forwards fail, as a failed forward would: for the tests of a
    /// re-sync's failure (the sequence runs plain, the step goes on).
    #[doc(hidden)]
    pub fn inject_resync_failures(&mut self, n: usize) {
        self.resync_faults = n;
    }

    /// Whether anything is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.live.is_empty() || self.sched.waiting() > 0
    }

    /// Queues `req`, streaming to `sink`. An invalid request is reported to `sink` at once.
    ///
    /// # Errors
    /// [`Refusal`] when the queue is full or the request can never fit the pool.
    pub fn admit(
        &mut self,
        req: GenerationRequest,
        sink: Box<dyn Sink + 'a>,
    ) -> Result<(), Refusal> {
        let context = self.target.model().context_len();
        let invalid = check(&req, context);
        let need = need(&req, context);
        let seq = Sequence::new(req, sink, self.tokenizer);
        if let Some(why) = invalid {
            seq.report(Some(why));
            return Ok(());
        }
        let out = self.sched.offer(seq, need);
        self.publish();
        out.map_err(|(seq, refusal)| {
            seq.report(Some(refusal.clone().into()));
            refusal
        })
    }

    /// Runs one step (see the module docs).
    ///
    /// # Errors
    /// Only on a broken invariant; a failed forward fails the sequences in it, not the engine.
    pub fn step(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        self.reap();
        self.admit_waiting();
        let (swapped, proposer) = {
            let mut cur = self.slot.lock();
            (self.drafting.refresh(&mut cur), cur.is_some())
        };
        if swapped {
            self.controller.reset_drafter();
        }
        self.tap_cache.follow(self.drafting.wants());
        let mut parts = self.plan(proposer);
        self.resync_taps(&mut parts);
        let draft_ms = self.draft(&mut parts);
        let mut forward_ms = 0.0;
        if !parts.is_empty() {
            forward_ms = self.run(parts, draft_ms);
        }
        self.place();
        self.reap();
        self.publish();
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        self.counters.time(step_ms, forward_ms, draft_ms);
        Ok(())
    }

    fn admit_waiting(&mut self) {
        for seq in self.sched.drop_waiting(Sequence::is_closed) {
            seq.report(None);
        }
        for (seq, need) in self.sched.admit() {
            let keys = chain_keys(&seq.context[..seq.context.len() - 1]);
            self.live.push(Live {
                seq,
                need,
                keys,
                placed: false,
                waited: false,
                acceptance: Acceptance::default(),
                prompt_taps: None,
                error: None,
            });
        }
        self.place();
    }

    /// Gives every admitted sequence not yet in the pool its K/V there: the longest prefix of
    /// its prompt that is computed already — cached full blocks (the prefix index), or the
    /// computed positions of an earlier live sequence with the same leading ids (forked: full
    /// blocks shared, a partial last block copied) — unless an earlier sequence is still
    /// prefilling more of that prompt (in-flight prefix sharing, SGLang's radix-cache
    /// behaviour for a burst). Then it waits outside the pool and is placed again right after
    /// the next forward (before the writer can finish and release what it wrote), so a
    /// common prefix of prompts arriving together is computed once.
    fn place(&mut self) {
        for i in 0..self.live.len() {
            let l = &self.live[i];
            if l.placed || l.seq.finish().is_some() || l.error.is_some() {
                continue;
            }
            let share = match self.config.prefix_dedup {
                true => self.sharing(i),
                false => Share::Cache,
            };
            match share {
                Share::Wait => {
                    if !std::mem::replace(&mut self.live[i].waited, true) {
                        self.counters.shared_wait();
                    }
                }
                Share::Cache => self.create(i),
                Share::Fork { from, len } => {
                    let l = &mut self.live[i];
                    l.placed = true;
                    match self.target.fork(l.seq.session(), from, len) {
                        Ok(held) => {
                            l.seq.computed = held;
                            l.seq.stats.cached_tokens = held;
                        }
                        Err(e) => l.error = Some(GenerationError::failed(&e)),
                    }
                }
            }
        }
    }

    /// How `live[i]` gets its prompt's computed prefix (see [`Core::place`]). Sequences only
    /// wait for earlier ones, which prefill first (oldest first), so every wait ends.
    fn sharing(&self, i: usize) -> Share {
        let l = &self.live[i];
        let prompt = &l.seq.context[..l.seq.context.len() - 1];
        // A tap drafter's `Open` needs the taps of every adopted position: only whole blocks
        // whose taps the host cached (see `create`), never a forked partial block.
        let taps = self.taps_needed(&l.seq);
        let grain = |n: usize| match taps {
            true => n / BLOCK_SIZE * BLOCK_SIZE,
            false => n,
        };
        let cached = self.target.cached(prompt);
        let (mut best, mut from, mut coming) = (cached, None, 0);
        for p in &self.live[..i] {
            if !p.placed || p.error.is_some() {
                continue;
            }
            let common = prompt
                .iter()
                .zip(&p.seq.context)
                .take_while(|(a, b)| a == b)
                .count();
            let have = grain(common.min(p.seq.computed));
            if have > best {
                (best, from) = (have, Some(p.seq.session()));
            }
            if !p.seq.is_running() && p.seq.finish().is_none() {
                coming = coming.max(grain(common));
            }
        }
        // Waiting costs a step: worth it for a block, or for half the rows left to compute.
        let gain = coming.saturating_sub(best);
        let left = prompt.len() + 1 - best;
        if gain > 0 && (gain >= BLOCK_SIZE || 2 * gain >= left) {
            return Share::Wait;
        }
        match from {
            Some(from) if !taps && best > cached => Share::Fork { from, len: best },
            _ => Share::Cache,
        }
    }

    /// Whether `seq` feeds a tap drafter (its prefill must produce or adopt taps).
    fn taps_needed(&self, seq: &Sequence<'_>) -> bool {
        seq.req.speculation != Speculation::Off && !self.drafting.wants().is_empty()
    }

    /// Creates `live[i]` in the pool (see [`Core::place`]).
    fn create(&mut self, i: usize) {
        // A prefix-cache hit skips the shared prefill, and with it the taps of those
        // positions: a sequence feeding a tap drafter adopts only the cached blocks whose
        // taps the host kept (see `tap_cache`), and its `Open` carries them.
        let taps_needed = self.taps_needed(&self.live[i].seq);
        let live = &mut self.live[i];
        let seq = &mut live.seq;
        let prompt = &seq.context[..seq.context.len() - 1];
        let reuse = match taps_needed {
            false => prompt,
            true => &prompt[..self.tap_cache.leading(&live.keys) * BLOCK_SIZE],
        };
        live.placed = true;
        match self.target.create(seq.session(), reuse) {
            Ok(hit) => {
                seq.computed = hit;
                seq.stats.cached_tokens = hit;
                if taps_needed && hit > 0 {
                    live.prompt_taps = self.tap_cache.prefix(&live.keys[..hit / BLOCK_SIZE]);
                }
            }
            // Reaped (its reservation released, its error reported) after this step.
            Err(e) => live.error = Some(GenerationError::failed(&e)),
        }
    }

    /// Chooses every sequence's rows for this step.
    fn plan(&mut self, proposer: bool) -> Vec<Part> {
        let context = self.target.model().context_len();
        let limits = self.sched.limits();
        let (mut decode, mut prefill) = (Vec::new(), Vec::new());
        for (at, live) in self.live.iter_mut().enumerate() {
            if !live.placed || live.seq.finish().is_some() || live.error.is_some() {
                continue;
            }
            match live.seq.is_running() {
                // No position left for the pending row: the context is full.
                true if live.seq.computed >= context => live.seq.end(FinishReason::Length),
                true => decode.push(at),
                false => prefill.push(at),
            }
        }
        let wants: Vec<usize> = prefill
            .iter()
            .map(|&at| self.live[at].seq.uncomputed().len())
            .collect();
        // Per decode sequence: a fixed k, or a candidate for the controller.
        let mut fixed = vec![0usize; decode.len()];
        let mut cands = Vec::new();
        let mut cand_of = Vec::new();
        // Drafts share the budget left by the decode rows with prefill, which is guaranteed
        // half of it (when it wants that much): neither can starve the other.
        let free = limits.batch_tokens.saturating_sub(decode.len());
        let mut room = free - wants.iter().sum::<usize>().min(free / 2);
        for (j, &at) in decode.iter().enumerate() {
            let seq = &self.live[at].seq;
            // A round commits drafts plus one target token: never draft past max_tokens or
            // past the context.
            let cap = seq
                .budget()
                .saturating_sub(1)
                .min(context.saturating_sub(seq.context.len()));
            let cap = if proposer && self.drafting.has(seq.session()) {
                cap
            } else {
                0
            };
            match seq.req.speculation {
                Speculation::Off => {}
                Speculation::On { num_draft_tokens } => {
                    fixed[j] = num_draft_tokens.min(cap).min(room);
                    room -= fixed[j];
                }
                Speculation::Adaptive { max_draft_tokens } => {
                    let acceptance = &self.live[at].acceptance;
                    cands.push(Candidate {
                        alpha: acceptance.alpha(self.controller.prior()),
                        hit: acceptance.hit(self.controller.prior_hit()),
                        max: max_draft_tokens.min(cap).min(acceptance.reach()),
                    });
                    cand_of.push(j);
                }
            }
        }
        let rows = decode.len()
            + fixed.iter().sum::<usize>()
            + self.sched.prefill_room(decode.len(), &wants);
        let chosen = self.controller.allocate(rows, room, &cands);
        let mut ks = fixed;
        for (c, &j) in cand_of.iter().enumerate() {
            ks[j] = chosen[c];
        }
        let plan = self.sched.plan(decode.len(), ks.iter().sum(), &wants);
        debug_assert_eq!(plan.drafts, ks.iter().sum::<usize>(), "drafts fit the room");
        let mut parts = Vec::with_capacity(decode.len() + prefill.len());
        for (&at, &k) in decode.iter().zip(&ks) {
            if k == 0 {
                self.live[at].acceptance.idle();
            }
            parts.push(Part {
                at,
                kind: PartKind::Decode {
                    asked: k,
                    draft: Draft::default(),
                },
            });
        }
        for (&at, &chunk) in prefill.iter().zip(&plan.chunks) {
            if chunk > 0 {
                parts.push(Part {
                    at,
                    kind: PartKind::Prefill { chunk },
                });
            }
        }
        parts
    }

    /// Re-forwards the contexts of sessions about to draft on a drafter that lacks their taps
    /// (after a hot swap), so their re-`Open` carries every position's taps. A re-forward that
    /// fails costs that sequence its speculation, not the step: it runs plain from now on, its
    /// drafter session closed.
    fn resync_taps(&mut self, parts: &mut [Part]) {
        let sessions: Vec<_> = parts
            .iter()
            .filter(|p| matches!(p.kind, PartKind::Decode { asked, .. } if asked > 0))
            .map(|p| self.live[p.at].seq.session())
            .collect();
        let todo = {
            let cur = self.slot.lock();
            self.drafting.needs_reforward(&cur, &sessions)
        };
        let wants = self.drafting.wants().clone();
        for r in todo {
            let Some(live) = self.live.iter().find(|l| l.seq.session() == r.session) else {
                continue;
            };
            let ctx = &live.seq.context[..live.seq.context.len() - 1];
            let taps = match self.resync_faults.checked_sub(1) {
                Some(left) => {
                    self.resync_faults = left;
                    Err(anyhow::anyhow!("a re-forward failure injected by a test"))
                }
                None => self.target.taps_of(r.session, ctx, &wants),
            };
            match taps {
                Ok(taps) => self.drafting.resync(r.session, taps),
                Err(e) => {
                    warn!(
                        session = r.session,
                        "tap re-sync failed; the sequence runs plain: {e:#}"
                    );
                    self.drafting.counters.resync_failed += 1;
                    self.drafting.close(&mut self.slot.lock(), r.session);
                    for p in parts.iter_mut() {
                        if let PartKind::Decode { asked, .. } = &mut p.kind {
                            if self.live[p.at].seq.session() == r.session {
                                *asked = 0;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Asks the proposer for every decode part's drafts in one call; returns its time (ms).
    fn draft(&mut self, parts: &mut [Part]) -> f64 {
        let asks: Vec<DraftAsk> = parts
            .iter()
            .filter_map(|p| match p.kind {
                PartKind::Decode { asked, .. } if asked > 0 => Some(DraftAsk {
                    session: self.live[p.at].seq.session(),
                    n: asked,
                }),
                _ => None,
            })
            .collect();
        if asks.is_empty() {
            return 0.0;
        }
        // The step this draft feeds, without its drafts: what a plain step would cost.
        let plain: usize = parts
            .iter()
            .map(|p| match &p.kind {
                PartKind::Decode { .. } => 1,
                PartKind::Prefill { chunk } => *chunk,
            })
            .sum();
        let deadline = self.deadline(plain);
        let vocab = self.target.model().config().vocab_size;
        let started = Instant::now();
        let drafts = {
            let live = &self.live;
            let mut cur = self.slot.lock();
            self.drafting.draft(&mut cur, &asks, deadline, vocab, |s| {
                live.iter()
                    .find(|l| l.seq.session() == s)
                    .map_or(&[][..], |l| &l.seq.context[..])
            })
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let longest = asks.iter().map(|a| a.n).max().unwrap_or(0);
        self.controller.observe_draft(longest, ms);
        let floor = self.confidence_floor(parts);
        let mut drafts = drafts.into_iter();
        for p in parts.iter_mut() {
            if let PartKind::Decode { asked, draft } = &mut p.kind {
                if *asked > 0 {
                    *draft = drafts.next().unwrap_or_default();
                    // The host alone cuts by confidence, and only what its controller chose:
                    // a fixed k verifies every draft the drafter sent.
                    let seq = &mut self.live[p.at].seq;
                    if seq.req.speculation.is_adaptive() {
                        let sent = draft.tokens.len();
                        trim_by_confidence(draft, floor);
                        seq.stats.confidence_cut += sent - draft.tokens.len();
                    }
                    // Drafts the grammar forbids would only be rejected: they get no row.
                    if let Some(g) = &mut self.live[p.at].seq.grammar {
                        let valid = g.check_draft(&draft.tokens);
                        cut(draft, valid);
                    }
                }
            }
        }
        ms
    }

    /// The reach (probability of being reached and accepted) below which a drafted token is
    /// verified at a loss: one more row's cost over what the step commits per millisecond.
    /// On a CPU a row costs ~0.4 of a one-row step; on a GPU nearly nothing, where
    /// [`CONFIDENCE_FLOOR`] remains.
    fn confidence_floor(&self, parts: &[Part]) -> f32 {
        let (mut rows, mut seqs) = (0, 0);
        for p in parts {
            match &p.kind {
                PartKind::Decode { .. } => {
                    rows += 1;
                    seqs += 1;
                }
                PartKind::Prefill { chunk } => rows += chunk,
            }
        }
        let cost = &self.controller.cost;
        let step = cost.cost(rows.max(1));
        let row = cost.cost(rows.max(1) + 1) - step;
        ((row * seqs as f64 / step) as f32).max(CONFIDENCE_FLOOR)
    }

    /// How long the proposer may take: a few target steps of the size planned, at least
    /// [`MIN_DEADLINE_MS`], never past the configured cap (which wins when it is shorter).
    fn deadline(&self, rows: usize) -> Duration {
        let step = self.controller.cost.cost(rows);
        let cap = self.config.draft_deadline_cap.as_secs_f64() * 1e3;
        let ms = (self.config.draft_deadline_steps * step)
            .max(MIN_DEADLINE_MS)
            .min(cap);
        Duration::from_secs_f64(ms / 1e3)
    }

    fn rows(&self, p: &Part) -> Rows {
        let live = &self.live[p.at];
        let seq = &live.seq;
        let speculating = self.taps_needed(seq);
        match &p.kind {
            PartKind::Decode { draft, .. } => {
                let mut tokens = Vec::with_capacity(1 + draft.tokens.len());
                tokens.push(seq.pending());
                tokens.extend_from_slice(&draft.tokens);
                Rows {
                    session: seq.session(),
                    logits: tokens.len(),
                    tokens,
                    taps: speculating,
                }
            }
            PartKind::Prefill { chunk } => {
                let left = seq.uncomputed();
                // A plain sequence's prompt taps go to the tap cache only, so that a later tap
                // sequence adopts its blocks too; worth it only when they extend a cached
                // prefix (a block is usable only after every block before it).
                let extends = || {
                    live.prompt_taps.is_some()
                        || self.tap_cache.leading(&live.keys) * BLOCK_SIZE >= seq.computed
                };
                Rows {
                    session: seq.session(),
                    tokens: left[..*chunk].to_vec(),
                    logits: usize::from(*chunk == left.len()),
                    taps: speculating || (!self.drafting.wants().is_empty() && extends()),
                }
            }
        }
    }

    /// The forward and everything after it; returns the forward's time (ms).
    fn run(&mut self, parts: Vec<Part>, draft_ms: f64) -> f64 {
        let work: Vec<Rows> = parts.iter().map(|p| self.rows(p)).collect();
        let n_rows: usize = work.iter().map(|r| r.tokens.len()).sum();
        let wants = self.drafting.wants().clone();
        match self.target.forward(&work, &wants) {
            Ok((outs, forward_ms)) => {
                self.controller.cost.observe(n_rows, forward_ms);
                let ks: Vec<usize> = parts
                    .iter()
                    .filter_map(|p| match &p.kind {
                        PartKind::Decode { draft, .. } => Some(draft.tokens.len()),
                        PartKind::Prefill { .. } => None,
                    })
                    .collect();
                self.counters.step(n_rows, &ks);
                for (part, out) in parts.into_iter().zip(outs) {
                    let at = part.at;
                    let live = &mut self.live[at];
                    live.seq.stats.forward_ms += forward_ms;
                    live.seq.stats.draft_ms += draft_ms;
                    if let Err(e) = self.finish(part, out) {
                        let live = &mut self.live[at];
                        live.error = Some(GenerationError::failed(&e));
                    }
                }
                forward_ms
            }
            Err(e) => {
                warn!("target forward failed: {e:#}");
                for part in &parts {
                    let live = &mut self.live[part.at];
                    // The failed forward appended nothing that stays.
                    let _ = self.target.truncate(live.seq.session(), live.seq.computed);
                    live.error = Some(GenerationError::failed(&e));
                }
                0.0
            }
        }
    }

    /// Verifies and commits one sequence's rows.
    fn finish(&mut self, part: Part, out: RowsOut) -> anyhow::Result<()> {
        let live = &mut self.live[part.at];
        let session = live.seq.session();
        match part.kind {
            PartKind::Prefill { chunk } => {
                live.seq.computed += chunk;
                self.target.index(session);
                if let Some(t) = &out.taps {
                    let taps = live.prompt_taps.get_or_insert_with(TapRows::default);
                    taps.extend(t);
                    self.tap_cache
                        .insert(&self.target.block_keys(session), taps);
                }
                if out.logits.dim(0)? > 0 {
                    // The chunk ran the last prompt id: its row samples the first token.
                    let picked = Picked::fetch(&out.logits, choice(&live.seq))?;
                    let seq = &mut live.seq;
                    let next = match &picked {
                        Picked::Rows(rows) => {
                            let grammar = seq.grammar.as_mut();
                            verify(&mut seq.sampler, rows, &[], None, &mut seq.context, grammar)?
                                .next
                        }
                        Picked::Argmax(ids) => verify_greedy(ids, &[]).next,
                    };
                    seq.commit(next, picked.row(0))?;
                }
                // The prompt is computed (the chunk sampled the first token, or stopped right
                // before the pending last prompt id): the drafter hears of the session now,
                // with the taps of every position before the pending one.
                let seq = &live.seq;
                let opens = seq.is_running()
                    && seq.req.speculation != Speculation::Off
                    && seq.finish().is_none()
                    && !self.drafting.has(session);
                if opens {
                    let taps = live.prompt_taps.take();
                    let mut cur = self.slot.lock();
                    self.drafting
                        .open(&mut cur, session, &seq.context, &seq.req.sampling, taps);
                } else if seq.is_running() {
                    // A plain sequence's prompt taps are in the tap cache now.
                    live.prompt_taps = None;
                }
            }
            PartKind::Decode { asked, draft } => {
                let seq = &mut live.seq;
                let base = seq.computed;
                let picked = Picked::fetch(&out.logits, choice(seq))?;
                let acceptance = match &picked {
                    Picked::Rows(rows) => verify(
                        &mut seq.sampler,
                        rows,
                        &draft.tokens,
                        draft.q.as_deref(),
                        &mut seq.context,
                        seq.grammar.as_mut(),
                    )?,
                    Picked::Argmax(ids) => verify_greedy(ids, &draft.tokens),
                };
                let accepted = acceptance.accepted;
                // Keep pending + accepted drafts; the correction/bonus becomes pending.
                self.target.truncate(session, base + 1 + accepted)?;
                seq.computed = base + 1 + accepted;
                let mut committed = draft.tokens[..accepted].to_vec();
                committed.push(acceptance.next);
                seq.stats.target_forwards += 1;
                if !draft.tokens.is_empty() {
                    seq.stats.rounds += 1;
                    seq.stats.drafted += draft.tokens.len();
                    seq.stats.accepted += accepted;
                }
                live.acceptance.observe(asked, draft.tokens.len(), accepted);
                self.controller
                    .global
                    .observe(asked, draft.tokens.len(), accepted);
                if self.drafting.has(session) {
                    let taps = out.taps.map(|t| t.head(accepted + 1));
                    let mut cur = self.slot.lock();
                    match draft.tokens.is_empty() {
                        true => self
                            .drafting
                            .advance(&mut cur, session, &committed, taps.as_ref()),
                        false => self.drafting.commit(
                            &mut cur,
                            session,
                            &Verdict {
                                drafted: draft.tokens.len(),
                                accepted,
                                committed: &committed,
                                taps: taps.as_ref(),
                            },
                        ),
                    }
                }
                for (i, &id) in committed.iter().enumerate() {
                    seq.commit(id, picked.row(i))?;
                    if seq.finish().is_some() {
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes finished, failed and abandoned sequences, freeing their K/V at once.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.live.len() {
            let live = &mut self.live[i];
            if live.seq.is_closed() {
                live.seq.end(FinishReason::Cancelled);
            }
            if live.seq.finish().is_none() && live.error.is_none() {
                i += 1;
                continue;
            }
            let live = self.live.remove(i);
            let session = live.seq.session();
            // Its full blocks stay in the prefix cache: so do their taps.
            self.target.index(session);
            if let Some(taps) = self.drafting.kept(session) {
                self.tap_cache
                    .insert(&self.target.block_keys(session), taps);
            }
            {
                let mut cur = self.slot.lock();
                self.drafting.close(&mut cur, session);
            }
            self.target.release(session);
            self.sched.release(live.need);
            self.counters.finished();
            live.seq.report(live.error);
        }
    }

    fn publish(&mut self) {
        let pool = self.target.stats();
        let now = self.drafting.counters;
        self.counters.drafting(&now, &self.published);
        self.published = now;
        self.counters.publish(
            self.sched.running(),
            self.sched.waiting(),
            self.sched.reserved(),
            &pool,
        );
    }
}

impl Drop for Core<'_> {
    /// A core dropped with sequences running (after a panic) ends their drafter sessions, so
    /// a drafter that outlives the core does not keep them.
    fn drop(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let mut cur = self.slot.lock();
        for live in &self.live {
            self.drafting.close(&mut cur, live.seq.session());
        }
    }
}

/// The lowest reach (the product of the drafter's per-token confidences: the probability that
/// a draft token is reached and accepted) worth a verify row, however cheap rows are.
const CONFIDENCE_FLOOR: f32 = 0.1;

/// Cuts a draft where the drafter's own confidences say the rest is reached less often than
/// `floor` (DSpark's confidence-scheduled length; SpecDec++'s stopping rule). Drafts without
/// confidences are kept whole. Applied to controller-chosen drafts only (see the module docs).
fn trim_by_confidence(draft: &mut Draft, floor: f32) {
    let Some(conf) = &draft.confidence else {
        return;
    };
    let mut reach = 1.0f32;
    let keep = conf
        .iter()
        .take_while(|&&c| {
            reach *= c;
            reach >= floor
        })
        .count();
    cut(draft, keep);
}

/// Keeps the first `keep` drafted tokens (with their q rows and confidences).
fn cut(draft: &mut Draft, keep: usize) {
    draft.tokens.truncate(keep);
    if let Some(q) = &mut draft.q {
        q.truncate(keep);
    }
    if let Some(c) = &mut draft.confidence {
        c.truncate(keep);
    }
}

/// The shortest draft deadline, whatever the step time.
const MIN_DEADLINE_MS: f64 = 5.0;

/// A cost table before anything is measured: verify rows priced like a CPU (the controller
/// corrects it with every step).
fn guessed_costs() -> Vec<(usize, f64)> {
    vec![(1, 10.0), (2, 14.0), (4, 22.0), (8, 37.0), (16, 70.0)]
}

/// Why `req` cannot run at all, if it cannot.
fn check(req: &GenerationRequest, context: usize) -> Option<GenerationError> {
    if let Err(e) = req.sampling.validate() {
        return Some(GenerationError::Invalid(format!("{e:#}")));
    }
    let n = req.prompt_ids.len();
    if n == 0 {
        return Some(GenerationError::Invalid("the prompt is empty".into()));
    }
    (n >= context).then(|| {
        GenerationError::Invalid(format!(
            "prompt of {n} tokens does not fit the model's context of {context} tokens \
             (it needs room for at least one generated token)"
        ))
    })
}

/// KV positions `req` may use at most.
pub(super) fn need(req: &GenerationRequest, context: usize) -> usize {
    (req.prompt_ids.len() + req.max_tokens).min(context)
}

/// What verification needs from a sequence's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// Every row, on the host: sampling, penalties, grammar masks and logprobs look at whole
    /// rows.
    Rows,
    /// Plain greedy: only each row's argmax, taken on the device (one `u32` per row copied
    /// back instead of a vocabulary of floats).
    Argmax,
}

fn choice(seq: &Sequence<'_>) -> Choice {
    let (req, s) = (&seq.req, &seq.req.sampling);
    let plain = !s.processes_logits() && req.logprobs.is_none() && seq.grammar.is_none();
    match s.is_greedy() && plain {
        true => Choice::Argmax,
        false => Choice::Rows,
    }
}

/// A sequence's logits brought to the host as [`Choice`] asked.
enum Picked {
    Rows(Vec<Vec<f32>>),
    Argmax(Vec<u32>),
}

impl Picked {
    fn fetch(logits: &Tensor, choice: Choice) -> anyhow::Result<Self> {
        Ok(match choice {
            Choice::Rows => Picked::Rows(logits.to_vec2()?),
            // Like sampling::argmax, candle keeps the lowest index of tied maxima.
            Choice::Argmax => Picked::Argmax(logits.argmax(D::Minus1)?.to_vec1()?),
        })
    }

    /// Row `i`'s logits, when they were copied.
    fn row(&self, i: usize) -> Option<&[f32]> {
        match self {
            Picked::Rows(rows) => rows.get(i).map(Vec::as_slice),
            Picked::Argmax(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidences_cut_a_draft_where_it_stops_paying() {
        let mut d = Draft {
            tokens: vec![1, 2, 3, 4],
            q: None,
            confidence: Some(vec![0.9, 0.5, 0.2, 0.9]),
        };
        let whole = d.clone();
        trim_by_confidence(&mut d, CONFIDENCE_FLOOR);
        // 0.9, 0.45, then 0.09 < 0.1: two kept.
        assert_eq!(d.tokens, vec![1, 2]);
        assert_eq!(d.confidence, Some(vec![0.9, 0.5]));
        // Where a row costs 0.5 of what the step commits, 0.45 is not worth it.
        let mut cpu = whole;
        trim_by_confidence(&mut cpu, 0.5);
        assert_eq!(cpu.tokens, vec![1]);
        let mut plain = Draft {
            tokens: vec![1, 2, 3],
            ..Draft::default()
        };
        trim_by_confidence(&mut plain, 0.9);
        assert_eq!(plain.tokens.len(), 3, "no confidences: kept whole");
    }
}
