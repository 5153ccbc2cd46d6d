//! One request inside the engine: its context, what of it the target has computed, and the
//! commit rule that turns verified tokens into text exactly as plain decoding would.
//!
//! ```text
//!   context:  p0 p1 ... p(n-1) t1 t2 ... t(m-1) | pending
//!   computed: [------- positions with K/V -------]           (= the sequence's KV length)
//!
//!   prefilling: computed < context.len() - 1   → the step runs a chunk of context[computed..]
//!   running:    computed = context.len() - 1   → the step runs [pending, d1..dk]
//! ```
//!
//! A prefill chunk that reaches the end of the prompt runs the last prompt id as well and its
//! row samples the first token (a k = 0 decode row), so the first token costs no extra step.

use std::time::Instant;

use specula_models::sampling::{log_softmax, Sampler};
use specula_models::tokenizer::{StreamDecoder, Tokenizer};

use crate::generation::{
    FinishReason, Flow, Generation, GenerationError, GenerationRequest, GenerationStats,
    TokenEvent, TokenLogprob,
};
use crate::grammar::Constraint;
use crate::proposer::SessionId;
use crate::text::{StopMatcher, StopScan};

/// Where a request's tokens go: the HTTP stream, or the CLI's closure.
pub trait Sink {
    /// A committed token; [`Flow::Cancel`] ends the request (the consumer went away).
    fn token(&mut self, ev: TokenEvent<'_>) -> Flow;
    /// The request ended; called exactly once, last.
    fn done(&mut self, result: Result<Generation, GenerationError>);
    /// Whether the consumer is gone already (checked before every step, so a disconnected
    /// request frees its blocks without waiting for its next token).
    fn is_closed(&self) -> bool;
}

/// One request's state in the engine.
pub struct Sequence<'t> {
    /// The request.
    pub req: GenerationRequest,
    sink: Box<dyn Sink + 't>,
    tokenizer: &'t Tokenizer,
    /// The sampler, whose RNG advances only on committed tokens.
    pub sampler: Sampler,
    /// Prompt + committed ids; the last one is pending once the prompt is computed.
    pub context: Vec<u32>,
    /// The request's grammar, advanced through every committed token.
    pub grammar: Option<Constraint>,
    /// Positions whose K/V the target holds.
    pub computed: usize,
    ids: Vec<u32>,
    decoder: StreamDecoder<'t>,
    text: String,
    emitted: usize,
    stops: StopMatcher,
    stopped_by_string: bool,
    finish: Option<FinishReason>,
    /// Counters.
    pub stats: GenerationStats,
    started: Instant,
    first_token: Option<Instant>,
}

impl<'t> Sequence<'t> {
    /// A sequence for `req` (already validated), streaming to `sink`.
    pub fn new(
        mut req: GenerationRequest,
        sink: Box<dyn Sink + 't>,
        tokenizer: &'t Tokenizer,
    ) -> Self {
        let finish = (req.max_tokens == 0).then_some(FinishReason::Length);
        Sequence {
            grammar: req.grammar.take(),
            // Presence/frequency penalties count generated tokens: the history's tail.
            sampler: Sampler::for_prompt(req.sampling.clone(), req.prompt_ids.len()),
            context: req.prompt_ids.clone(),
            computed: 0,
            ids: Vec::new(),
            decoder: tokenizer.stream_decoder(),
            text: String::new(),
            emitted: 0,
            stops: StopMatcher::new(&req.stop),
            stopped_by_string: false,
            finish,
            stats: GenerationStats {
                prompt_tokens: req.prompt_ids.len(),
                ..GenerationStats::default()
            },
            started: Instant::now(),
            first_token: None,
            req,
            sink,
            tokenizer,
        }
    }

    /// The session id (also the sequence's KV handle).
    pub fn session(&self) -> SessionId {
        self.req.session
    }

    /// Context ids the target has not run yet (the pending id once running).
    pub fn uncomputed(&self) -> &[u32] {
        &self.context[self.computed..]
    }

    /// Whether the prompt is computed and the sequence decodes `[pending, drafts]` rounds.
    pub fn is_running(&self) -> bool {
        self.computed + 1 == self.context.len()
    }

    /// The pending id (last of the context).
    pub fn pending(&self) -> u32 {
        *self
            .context
            .last()
            .expect("invariant: the prompt is not empty")
    }

    /// Why it ended, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tokens still allowed by `max_tokens`.
    pub fn budget(&self) -> usize {
        self.req.max_tokens.saturating_sub(self.ids.len())
    }

    /// Whether the consumer went away.
    pub fn is_closed(&self) -> bool {
        self.sink.is_closed()
    }

    /// Ends the sequence for `reason` without committing more.
    pub fn end(&mut self, reason: FinishReason) {
        self.finish.get_or_insert(reason);
    }

    /// Commits one token exactly as plain decoding would: EOS, stop strings and a complete
    /// grammar end the text, `max_tokens` ends the generation. `logits` (the row it was chosen
    /// from) feeds logprobs.
    ///
    /// # Errors
    /// Detokenization failures; a token the grammar does not allow.
    pub fn commit(&mut self, id: u32, logits: Option<&[f32]>) -> anyhow::Result<()> {
        self.first_token.get_or_insert_with(Instant::now);
        self.context.push(id);
        if self.tokenizer.eos_ids().contains(&id) {
            self.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        if let Some(g) = &mut self.grammar {
            g.advance(id)?;
            if g.is_complete() {
                self.finish = Some(FinishReason::Stop);
            }
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
        let flow = self.sink.token(TokenEvent {
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

    /// Reports the result to the sink (the sequence is done with).
    pub fn report(mut self, error: Option<GenerationError>) {
        let result = match error {
            Some(e) => Err(e),
            None => self.result(),
        };
        self.sink.done(result);
    }

    fn result(&mut self) -> Result<Generation, GenerationError> {
        if !self.stopped_by_string {
            // Text held back for an incomplete character or a stop string that never came.
            match self.decoder.flush() {
                Ok(Some(piece)) => self.text.push_str(&piece),
                Ok(None) => {}
                Err(e) => return Err(GenerationError::failed(e)),
            }
        }
        let mut stats = std::mem::take(&mut self.stats);
        let first = self.first_token.unwrap_or(self.started);
        stats.generated_tokens = self.ids.len();
        stats.prefill_ms = ms(self.started, first);
        stats.decode_ms = ms(first, Instant::now());
        stats.host_ms = (stats.decode_ms - stats.forward_ms - stats.draft_ms).max(0.0);
        if let Some(g) = &self.grammar {
            let (masks, spent) = g.cost();
            stats.grammar_masks = masks;
            stats.grammar_ms = spent.as_secs_f64() * 1e3;
        }
        stats.decode_tokens_per_s = rate(stats.generated_tokens, stats.decode_ms);
        stats.mean_accepted_per_round = ratio(stats.accepted, stats.rounds);
        stats.acceptance_rate = ratio(stats.accepted, stats.drafted);
        Ok(Generation {
            text: std::mem::take(&mut self.text),
            token_ids: std::mem::take(&mut self.ids),
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            stats,
        })
    }
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

fn ms(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1e3
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
