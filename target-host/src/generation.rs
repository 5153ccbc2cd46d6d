//! One request, start to finish: prefill, then draft → verify → commit rounds until a stop.
//!
//! ```text
//!   context:  p0 p1 ... p(n-2) | pending | d1 d2 .. dk      (one target forward per round)
//!   cache:    [---- prefilled ----]  ← trimmed back to pending + accepted after each round
//! ```
//!
//! Plain decoding is the same loop with zero drafts, so there is one code path whose output the
//! drafters cannot change: every committed token comes from [`crate::verify::verify`].

use std::time::Instant;

use candle_core::{IndexOp, Tensor, D};
use serde::Serialize;
use specula_models::sampling::{log_softmax, Sampler, SamplingParams};
use specula_models::tokenizer::{StreamDecoder, Tokenizer};
use specula_models::KvCache;
use specula_models::{ForwardOutput, ForwardRequest, Model, TapId};

use crate::proposer::{Draft, ProposerSlot, SessionId, TapRows, Verdict, Wants};
use crate::text::{StopMatcher, StopScan};
use crate::verify::{verify, verify_greedy};

/// Whether and how much to speculate for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    /// Decode one token per target forward; the drafter is not asked.
    Off,
    /// Ask the current drafter for up to `num_draft_tokens` tokens per round.
    On {
        /// Drafts per round (k).
        num_draft_tokens: usize,
    },
    /// Ask for up to `max_draft_tokens` per round, the host choosing each round's k from the
    /// request's observed acceptance and draft cost ([`crate::adaptive`]).
    Adaptive {
        /// Most drafts per round.
        max_draft_tokens: usize,
    },
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Identifies the request to the drafter.
    pub session: SessionId,
    /// The tokenized prompt (at least one id).
    pub prompt_ids: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Strings that end the generation; the text stops before them.
    pub stop: Vec<String>,
    /// Speculation settings.
    pub speculation: Speculation,
    /// `Some(n)`: report the chosen token's log-probability and the `n` most likely alternatives.
    pub logprobs: Option<usize>,
}

/// Why generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
    /// The consumer went away.
    Cancelled,
}

/// Log-probabilities of one generated token under the raw target distribution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// One committed token as the consumer sees it.
#[derive(Debug, Clone)]
pub struct TokenEvent<'a> {
    /// The token id.
    pub id: u32,
    /// Text that became safe to show with this token (may be empty: held back).
    pub text: &'a str,
    /// Log-probabilities, when asked for.
    pub logprob: Option<TokenLogprob>,
}

/// Whether the consumer wants more tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now (client disconnected).
    Cancel,
}

/// Counters of one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GenerationStats {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens generated (EOS not counted).
    pub generated_tokens: usize,
    /// Time to prefill the prompt.
    pub prefill_ms: f64,
    /// Time from the end of prefill to the end of generation.
    pub decode_ms: f64,
    /// `generated_tokens / decode time`.
    pub decode_tokens_per_s: f64,
    /// Drafts offered to the target.
    pub drafted: usize,
    /// Drafts the target accepted.
    pub accepted: usize,
    /// Rounds that had at least one draft.
    pub rounds: usize,
    /// Target forward passes after prefill.
    pub target_forwards: usize,
    /// `accepted / rounds` (0 with no rounds).
    pub mean_accepted_per_round: f64,
    /// `accepted / drafted` (0 with no drafts).
    pub acceptance_rate: f64,
    /// Time inside target forwards after prefill, logits copied to the host included.
    pub forward_ms: f64,
    /// Time waiting for drafts (IPC and the drafter's own work for out-of-process drafters).
    pub draft_ms: f64,
    /// Decode time outside forwards and drafting: verification, sampling, cache rollback,
    /// verdicts, detokenization. The speculative loop's own overhead.
    pub host_ms: f64,
}

/// The result of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The whole generated text (stop strings and EOS excluded). Token events may have held
    /// back its tail (a possible stop-string prefix, an incomplete character): a streaming
    /// consumer that has shown `shown` bytes shows `text[shown..]` at the end.
    pub text: String,
    /// The generated ids (EOS excluded).
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Counters.
    pub stats: GenerationStats,
}

/// The target side of generation: model, tokenizer and the cache it decodes into.
pub struct Target<'a> {
    /// The target model.
    pub model: &'a Model,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
}

/// Runs `req` to completion, calling `sink` for every committed token.
///
/// # Errors
/// A prompt that is empty or does not fit the context, invalid sampling parameters, or a failed
/// target forward. Drafter failures are never errors: they cost speed only.
pub fn generate(
    target: &Target<'_>,
    cache: &mut KvCache,
    slot: &ProposerSlot,
    req: &GenerationRequest,
    sink: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
) -> anyhow::Result<Generation> {
    req.sampling.validate()?;
    let model = target.model;
    let n_prompt = req.prompt_ids.len();
    anyhow::ensure!(n_prompt > 0, "the prompt is empty");
    let context = model.context_len();
    anyhow::ensure!(
        n_prompt < context,
        "prompt of {n_prompt} tokens does not fit the model's context of {context} tokens"
    );

    let started = Instant::now();
    let mut run = Run::new(target, req);
    cache.truncate(0)?;
    let mut drafter = DrafterSession::new(req.session, req.sampling.clone());
    let wants = match req.speculation {
        Speculation::On { .. } | Speculation::Adaptive { .. } => drafter.wants(slot),
        Speculation::Off => Wants::default(),
    };
    // The last prompt token stays pending: it is the first row of the first verify window.
    let pending_ids = &req.prompt_ids[..n_prompt - 1];
    let prompt_taps = if pending_ids.is_empty() {
        None
    } else {
        let fwd = ForwardRequest {
            last_k: 1,
            taps: tap_ids(&wants),
            taps_all_positions: true,
        };
        let out = model.prefill(pending_ids, cache, &fwd)?;
        (!wants.is_empty()).then(|| collect_taps(&out, cache, &wants, 0, pending_ids.len()))
    };
    let prompt_taps = prompt_taps.transpose()?;
    run.stats.prefill_ms = ms(started);
    if req.speculation != Speculation::Off {
        drafter.open(slot, &req.prompt_ids, prompt_taps.as_ref());
    }

    let choice = Choice::for_request(req);
    let decode_start = Instant::now();
    let mut pending = req.prompt_ids[n_prompt - 1];
    while run.finish.is_none() {
        let room = context.saturating_sub(cache.len() + 1);
        if room == 0 {
            run.finish = Some(FinishReason::Length);
            break;
        }
        let budget = req.max_tokens - run.ids.len();
        // The round commits drafts plus one target token: never draft past the budget.
        let k = req
            .speculation
            .draft_len(&run.stats)
            .min(budget.saturating_sub(1))
            .min(room);
        let draft_start = Instant::now();
        let draft = if k > 0 {
            drafter.draft(slot, &run.context, k, model.config().vocab_size)
        } else {
            Draft::default()
        };
        run.stats.draft_ms += ms(draft_start);

        let mut window = Vec::with_capacity(draft.tokens.len() + 1);
        window.push(pending);
        window.extend_from_slice(&draft.tokens);
        let base = cache.len();
        let fwd = ForwardRequest {
            last_k: window.len(),
            taps: tap_ids(&wants),
            taps_all_positions: false,
        };
        let forward_start = Instant::now();
        let out = model.forward(&window, cache, &fwd)?;
        run.stats.target_forwards += 1;
        // The copy to the host is the sync point of an asynchronous device: it stays inside
        // the timed forward.
        let picked = Picked::fetch(&out.logits, choice)?;
        run.stats.forward_ms += ms(forward_start);
        let acceptance = match &picked {
            Picked::Rows(rows) => verify(
                &mut run.sampler,
                rows,
                &draft.tokens,
                draft.q.as_deref(),
                &mut run.context,
            ),
            Picked::Argmax(ids) => verify_greedy(ids, &draft.tokens),
        };
        // Keep pending + accepted drafts in the cache; the correction/bonus becomes pending.
        cache.truncate(base + 1 + acceptance.accepted)?;
        let mut committed = draft.tokens[..acceptance.accepted].to_vec();
        committed.push(acceptance.next);
        if !draft.tokens.is_empty() {
            run.stats.rounds += 1;
            run.stats.drafted += draft.tokens.len();
            run.stats.accepted += acceptance.accepted;
            let taps = if wants.is_empty() {
                None
            } else {
                Some(collect_taps(
                    &out,
                    cache,
                    &wants,
                    base,
                    acceptance.accepted + 1,
                )?)
            };
            drafter.verdict(
                slot,
                &run.context,
                &Verdict {
                    drafted: draft.tokens.len(),
                    accepted: acceptance.accepted,
                    committed: &committed,
                    taps: taps.as_ref(),
                },
            );
        }
        for (i, &id) in committed.iter().enumerate() {
            run.commit(id, picked.row(i), sink)?;
            if run.finish.is_some() {
                break;
            }
        }
        pending = acceptance.next;
    }
    drafter.close(slot);
    if !run.stopped_by_string {
        // Text held back for an incomplete character or a stop string that never came.
        if let Some(piece) = run.decoder.flush()? {
            run.text.push_str(&piece);
        }
    }

    let finish_reason = run.finish.unwrap_or(FinishReason::Length);
    let mut stats = run.stats;
    stats.prompt_tokens = n_prompt;
    stats.generated_tokens = run.ids.len();
    stats.decode_ms = ms(decode_start);
    stats.host_ms = (stats.decode_ms - stats.forward_ms - stats.draft_ms).max(0.0);
    stats.decode_tokens_per_s = rate(stats.generated_tokens, stats.decode_ms);
    stats.mean_accepted_per_round = ratio(stats.accepted, stats.rounds);
    stats.acceptance_rate = ratio(stats.accepted, stats.drafted);
    Ok(Generation {
        text: run.text,
        token_ids: run.ids,
        finish_reason,
        stats,
    })
}

/// Per-request mutable state: committed ids, their text and the stop decision.
struct Run<'a> {
    target: &'a Target<'a>,
    req: &'a GenerationRequest,
    sampler: Sampler,
    /// Prompt + committed ids: the history for penalties and for the drafter.
    context: Vec<u32>,
    ids: Vec<u32>,
    decoder: StreamDecoder<'a>,
    text: String,
    emitted: usize,
    stops: StopMatcher,
    stopped_by_string: bool,
    finish: Option<FinishReason>,
    stats: GenerationStats,
}

impl<'a> Run<'a> {
    fn new(target: &'a Target<'a>, req: &'a GenerationRequest) -> Self {
        let finish = (req.max_tokens == 0).then_some(FinishReason::Length);
        Run {
            target,
            req,
            // Presence/frequency penalties count generated tokens: the history's tail.
            sampler: Sampler::for_prompt(req.sampling.clone(), req.prompt_ids.len()),
            context: req.prompt_ids.clone(),
            ids: Vec::new(),
            decoder: target.tokenizer.stream_decoder(),
            text: String::new(),
            emitted: 0,
            stops: StopMatcher::new(&req.stop),
            stopped_by_string: false,
            finish,
            stats: GenerationStats::default(),
        }
    }

    /// Commits one token exactly as plain decoding would: EOS and stop strings end the text,
    /// `max_tokens` ends the generation.
    fn commit(
        &mut self,
        id: u32,
        logits: Option<&[f32]>,
        sink: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> anyhow::Result<()> {
        self.context.push(id);
        if self.target.tokenizer.eos_ids().contains(&id) {
            self.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        self.ids.push(id);
        let checked = self.text.len();
        if let Some(piece) = self.decoder.step(id)? {
            self.text.push_str(&piece);
        }
        let upto = match self.stops.scan(&self.text, checked) {
            StopScan::Stopped(at) => {
                self.finish = Some(FinishReason::Stop);
                self.stopped_by_string = true;
                self.text.truncate(at);
                at
            }
            StopScan::SafeUpTo(end) => end,
        }
        .max(self.emitted);
        if self.finish.is_none() && self.ids.len() >= self.req.max_tokens {
            self.finish = Some(FinishReason::Length);
        }
        let logprob = self
            .req
            .logprobs
            .zip(logits)
            .map(|(n, logits)| token_logprob(logits, id, n));
        let flow = sink(TokenEvent {
            id,
            text: &self.text[self.emitted..upto],
            logprob,
        });
        self.emitted = upto;
        if flow == Flow::Cancel {
            self.finish = Some(FinishReason::Cancelled);
        }
        Ok(())
    }
}

/// What the verify step needs from a forward's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// Every row, on the host: sampling, penalties and logprobs look at whole rows.
    Rows,
    /// Plain greedy: only each row's argmax, taken on the device (one `u32` per row copied
    /// back instead of a vocabulary of floats).
    Argmax,
}

impl Choice {
    fn for_request(req: &GenerationRequest) -> Self {
        let s = &req.sampling;
        match s.is_greedy() && !s.processes_logits() && req.logprobs.is_none() {
            true => Choice::Argmax,
            false => Choice::Rows,
        }
    }
}

/// A forward's logits brought to the host as [`Choice`] asked.
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

/// The request's view of the proposer slot: which epoch it opened on and what the proposer has
/// been told so far.
struct DrafterSession {
    session: SessionId,
    sampling: SamplingParams,
    /// Epoch of the proposer this session is open on.
    epoch: Option<u64>,
    /// How many context ids the proposer knows of.
    told: usize,
}

impl DrafterSession {
    fn new(session: SessionId, sampling: SamplingParams) -> Self {
        DrafterSession {
            session,
            sampling,
            epoch: None,
            told: 0,
        }
    }

    fn wants(&self, slot: &ProposerSlot) -> Wants {
        slot.lock()
            .proposer
            .as_ref()
            .map(|p| p.wants())
            .unwrap_or_default()
    }

    fn open(&mut self, slot: &ProposerSlot, context: &[u32], taps: Option<&TapRows>) {
        let mut cur = slot.lock();
        let epoch = cur.epoch;
        if let Some(p) = cur.proposer.as_mut() {
            p.open(self.session, context, &self.sampling, taps);
            self.epoch = Some(epoch);
            self.told = context.len();
        }
    }

    /// Asks the current proposer for drafts, (re)opening the session on it after a hot swap.
    fn draft(&mut self, slot: &ProposerSlot, context: &[u32], n: usize, vocab: usize) -> Draft {
        let mut cur = slot.lock();
        let epoch = cur.epoch;
        let Some(p) = cur.proposer.as_mut() else {
            return Draft::default();
        };
        if self.epoch != Some(epoch) {
            // A new drafter: it learns the whole context (without taps: it joined mid-request).
            p.open(self.session, context, &self.sampling, None);
            self.epoch = Some(epoch);
            self.told = context.len();
        }
        let draft = p.draft(self.session, &context[self.told..], n);
        self.told = context.len();
        sanitize(draft, n, vocab)
    }

    fn verdict(&mut self, slot: &ProposerSlot, context: &[u32], verdict: &Verdict<'_>) {
        let mut cur = slot.lock();
        if Some(cur.epoch) != self.epoch {
            return;
        }
        if let Some(p) = cur.proposer.as_mut() {
            p.verdict(self.session, verdict);
            // `context` does not hold this round's tokens yet; the verdict told them.
            self.told = context.len() + verdict.committed.len();
        }
    }

    fn close(&mut self, slot: &ProposerSlot) {
        let mut cur = slot.lock();
        if Some(cur.epoch) == self.epoch {
            if let Some(p) = cur.proposer.as_mut() {
                p.close(self.session);
            }
        }
    }
}

/// Last line of defence: whatever a proposer returns, the loop only verifies in-vocabulary
/// drafts, at most `n`, with well-formed `q` rows (or none); anything else costs the round.
fn sanitize(draft: Draft, n: usize, vocab: usize) -> Draft {
    match crate::drafter::validate::check(&draft.tokens, draft.q.as_deref(), n, vocab as u32) {
        Ok(()) => draft,
        Err(why) => {
            tracing::warn!(%why, "draft discarded");
            Draft::default()
        }
    }
}

fn tap_ids(wants: &Wants) -> Vec<TapId> {
    let mut ids: Vec<TapId> = wants.tap_layers.iter().map(|&l| TapId::Layer(l)).collect();
    if wants.final_hidden {
        ids.push(TapId::FinalNorm);
    }
    ids
}

/// Copies the first `rows` rows of the forward's taps, and the K/V rows at `pos..pos+rows`,
/// into plain vectors for the proposer.
fn collect_taps(
    out: &ForwardOutput,
    cache: &KvCache,
    wants: &Wants,
    pos: usize,
    rows: usize,
) -> anyhow::Result<TapRows> {
    let take = |t: &Tensor| -> anyhow::Result<Vec<f32>> {
        Ok(t.i(..rows)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let find = |id: TapId| out.taps.iter().find(|(t, _)| *t == id).map(|(_, x)| x);
    let mut layers = Vec::with_capacity(wants.tap_layers.len());
    for &l in &wants.tap_layers {
        let t = find(TapId::Layer(l)).ok_or_else(|| anyhow::anyhow!("tap of layer {l} missing"))?;
        layers.push(take(t)?);
    }
    let final_hidden = match find(TapId::FinalNorm) {
        Some(t) if wants.final_hidden => Some(take(t)?),
        _ => None,
    };
    let mut kv = Vec::with_capacity(wants.kv_layers.len());
    for &l in &wants.kv_layers {
        let (k, v) = cache.layer(l);
        // [kv_heads, len, head_dim] → rows × kv_heads × head_dim
        let rows_of = |t: Tensor| -> anyhow::Result<Vec<f32>> {
            Ok(t.narrow(1, pos, rows)?
                .transpose(0, 1)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        kv.push((rows_of(k)?, rows_of(v)?));
    }
    Ok(TapRows {
        pos,
        rows,
        layers,
        final_hidden,
        kv,
    })
}

fn token_logprob(logits: &[f32], id: u32, n: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    let n = n.min(order.len());
    let by = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]);
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, by);
    }
    order.truncate(n);
    order.sort_unstable_by(by);
    TokenLogprob {
        token: id,
        logprob: lp[id as usize],
        top: order.into_iter().map(|t| (t, lp[t as usize])).collect(),
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 / (ms / 1e3)
    } else {
        0.0
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b > 0 {
        a as f64 / b as f64
    } else {
        0.0
    }
}
