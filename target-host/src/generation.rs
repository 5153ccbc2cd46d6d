//! What a generation request is and what it yields: the vocabulary shared by the engine, the
//! CLI and the HTTP layer, and [`generate`], one request run to completion as a batch of one
//! through the engine's step (the same code path the server runs every request through).
//!
//! The loop itself lives in [`crate::engine`]: every committed token comes from
//! [`crate::verify`] over the target's own logits, whatever the drafter proposed.

use serde::Serialize;
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Tokenizer;
use specula_models::Model;

use crate::engine::{Core, EngineConfig, Sink};
use crate::grammar::Constraint;
use crate::proposer::{ProposerSlot, SessionId};

/// Whether and how much to speculate for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    /// Decode one token per target forward; the drafter is not asked.
    Off,
    /// Ask the current drafter for `num_draft_tokens` tokens every round and verify all it
    /// sends: its confidences, if any, cut nothing (a fixed k is the caller's choice).
    On {
        /// Drafts per round (k).
        num_draft_tokens: usize,
    },
    /// Ask for up to `max_draft_tokens` per round, the engine choosing each round's k (0
    /// included) to maximise committed tokens per second ([`crate::engine::controller`]), and
    /// cutting each draft where the drafter's confidences say the rest does not pay.
    Adaptive {
        /// Most drafts per round.
        max_draft_tokens: usize,
    },
}

impl Speculation {
    /// Whether the engine chooses k (and cuts drafts by confidence).
    pub fn is_adaptive(self) -> bool {
        matches!(self, Speculation::Adaptive { .. })
    }
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
    /// Structured output: every token is chosen under this grammar's mask (fresh: nothing
    /// consumed yet).
    pub grammar: Option<Constraint>,
}

/// Why generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop string, or a grammar that was complete.
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
    /// Prompt positions not computed for this request: adopted from the prefix cache or from
    /// a live sequence with the same leading tokens (counted in `prompt_tokens` too).
    pub cached_tokens: usize,
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
    /// Drafted tokens the host did not verify because the drafter's own confidences said
    /// they would not pay (the controller's confidence cut; always 0 under a fixed k).
    pub confidence_cut: usize,
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
    /// Grammar masks computed (structured output; 0 without a grammar).
    pub grammar_masks: usize,
    /// Time in the grammar engine: masks, advances, rollbacks, draft checks.
    pub grammar_ms: f64,
    /// Decode time outside forwards and drafting: verification, sampling, cache rollback,
    /// verdicts, detokenization. The speculative loop's own overhead.
    pub host_ms: f64,
}

/// Why a request ended without a generation; the HTTP layer answers by its kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// The request cannot run as asked (invalid sampling parameters, an empty prompt, one that
    /// does not fit the context): the client's to fix (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// Admission refused it (HTTP 429, 400 or 503 by the refusal).
    #[error(transparent)]
    Refused(#[from] crate::engine::Refusal),
    /// The server failed it: a failed forward, a broken invariant (HTTP 500).
    #[error("{0}")]
    Failed(String),
}

impl GenerationError {
    /// A [`GenerationError::Failed`] from any error, with its context chain.
    pub fn failed(e: impl std::fmt::Display) -> Self {
        GenerationError::Failed(format!("{e:#}"))
    }
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

/// Runs `req` to completion as a batch of one through the engine's step, calling `sink` for
/// every committed token.
///
/// # Errors
/// A prompt that is empty or does not fit the context or the KV pool, invalid sampling
/// parameters, or a failed target forward. Drafter failures are never errors: they cost speed
/// only.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    slot: &ProposerSlot,
    config: &EngineConfig,
    req: &GenerationRequest,
    sink: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
) -> anyhow::Result<Generation> {
    // Declared before the core, which borrows it through the sink.
    let mut result = None;
    let config = EngineConfig {
        // The cost table matters only when the controller chooses k.
        profile: config.profile && matches!(req.speculation, Speculation::Adaptive { .. }),
        ..config.clone()
    };
    let mut core = Core::new(model, tokenizer, slot, config)?;
    let one = OneSink {
        sink,
        result: &mut result,
    };
    core.admit(req.clone(), Box::new(one))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    while core.has_work() {
        core.step()?;
    }
    drop(core);
    result
        .expect("invariant: a finished sequence reported its result")
        .map_err(anyhow::Error::from)
}

/// The sink of [`generate`]: forwards tokens to a closure and keeps the result.
struct OneSink<'s, 'r> {
    sink: &'s mut dyn FnMut(TokenEvent<'_>) -> Flow,
    result: &'r mut Option<Result<Generation, GenerationError>>,
}

impl Sink for OneSink<'_, '_> {
    fn token(&mut self, ev: TokenEvent<'_>) -> Flow {
        (self.sink)(ev)
    }
    fn done(&mut self, result: Result<Generation, GenerationError>) {
        *self.result = Some(result);
    }
    fn is_closed(&self) -> bool {
        false
    }
}
