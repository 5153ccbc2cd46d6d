//! Structured output: a [`Constraint`] keeps one sequence's output inside a grammar (a JSON
//! schema, any JSON object, or a Lark grammar), compiled and run by `llguidance`.
//!
//! The engine asks it for the [`Mask`] of tokens allowed next, advances it through every
//! committed token, and under speculation walks it through the drafts:
//!
//! ```text
//!   committed state S ── check_draft([d1..dk]) ──▶ n valid drafts, masks m0..mn cached
//!   verify row i uses m_i (the state after S + d1..d(i-1)); advance(d_i) per accepted draft;
//!   rollback(accepted) restores S, and committing the tokens advances it for real.
//! ```
//!
//! Each mask is a function of the committed tokens alone (tested against a fresh replay), so
//! greedy output under a grammar is the same with any drafter, and sampled output has exactly
//! the masked target distribution. EOS is allowed only where the grammar accepts; once the
//! grammar can take nothing more, [`Constraint::is_complete`] says so and the sequence stops.

mod vocab;

use std::time::{Duration, Instant};

use serde_json::Value;
use toktrie::SimpleVob;

pub use vocab::Vocab;

/// Whitespace allowed between JSON tokens, unless the schema's `x-guidance` says otherwise:
/// any JSON whitespace, at most 24 characters at a time (enough to indent pretty-printed
/// JSON; unbounded whitespace lets a small model pad until `max_tokens` and never close).
pub const WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,24}";

/// A grammar that cannot be compiled, or a constraint that broke while running.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The JSON schema is invalid, or (strict) uses a part llguidance cannot enforce.
    #[error("the JSON schema cannot be enforced: {0}")]
    Schema(String),
    /// The Lark grammar does not compile.
    #[error("the grammar does not compile: {0}")]
    Lark(String),
    /// The matcher failed on a token (a token outside the mask was forced on it).
    #[error("the grammar constraint failed: {0}")]
    Failed(String),
}

/// The set of tokens a grammar allows next.
#[derive(Clone, PartialEq, Eq)]
pub struct Mask(SimpleVob);

impl Mask {
    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets every disallowed logit (and any beyond the vocabulary) to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Number of allowed tokens.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

impl std::fmt::Debug for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mask({} allowed)", self.count())
    }
}

/// One sequence's grammar state.
///
/// # Invariants
/// Outside [`Constraint::check_draft`] the matcher has consumed exactly the tokens passed to
/// [`Constraint::advance`] and not rolled back; `ahead[i]` is the mask after the first `i` of
/// `path` on top of that state.
#[derive(Clone)]
pub struct Constraint {
    matcher: llguidance::Matcher,
    eos: Vec<u32>,
    /// What was compiled, for logs.
    kind: &'static str,
    /// Masks computed by `check_draft` ahead of the state: `ahead[0]` is the current one.
    ahead: Vec<Mask>,
    /// The drafts `ahead[1..]` assume.
    path: Vec<u32>,
    /// Masks computed so far.
    masks: usize,
    /// Time spent in the matcher (masks, advances, rollbacks).
    spent: Duration,
    /// An EOS advanced through after the grammar was complete: the only token a complete
    /// grammar allows, which the matcher cannot consume (a stopped matcher errors for good on
    /// any token), so it is counted here instead. At most one: nothing follows an EOS.
    eos_after_end: usize,
}

impl Constraint {
    /// Output must be JSON valid under `schema`. `strict`: a keyword or format llguidance
    /// cannot enforce is an error naming it; otherwise it is ignored (the output is still
    /// JSON, checked for every part that is enforced). llguidance's options may be given in
    /// the schema's `x-guidance` object; whitespace runs are bounded ([`WHITESPACE`]) unless
    /// it sets `whitespace_flexible` or `whitespace_pattern`.
    ///
    /// # Errors
    /// [`GrammarError::Schema`] naming what is wrong.
    pub fn json_schema(vocab: &Vocab, schema: &Value, strict: bool) -> Result<Self, GrammarError> {
        let Value::Object(obj) = schema else {
            return Err(GrammarError::Schema(format!(
                "a schema must be a JSON object, got {schema}"
            )));
        };
        let mut obj = obj.clone();
        let mut options = match obj.remove("x-guidance") {
            Some(Value::Object(o)) => o,
            Some(other) => {
                return Err(GrammarError::Schema(format!(
                    "x-guidance must be an object, got {other}"
                )))
            }
            None => serde_json::Map::new(),
        };
        options.insert("lenient".into(), Value::Bool(!strict));
        let says_whitespace = ["whitespace_flexible", "whitespace_pattern"]
            .iter()
            .any(|k| options.contains_key(*k));
        if !says_whitespace {
            options.insert("whitespace_pattern".into(), WHITESPACE.into());
        }
        obj.insert("x-guidance".into(), Value::Object(options));
        let grammar = llguidance::api::TopLevelGrammar::from_json_schema(Value::Object(obj));
        Self::compile(vocab, grammar, "json_schema").map_err(GrammarError::Schema)
    }

    /// Output must be one JSON object (OpenAI's `json_object` response format).
    pub fn json_object(vocab: &Vocab) -> Self {
        let schema = serde_json::json!({"type": "object"});
        Self::json_schema(vocab, &schema, true).expect("invariant: {type: object} compiles")
    }

    /// Output must match a Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON
    /// schema, `/regex/` terminals, `start` is the start rule).
    ///
    /// # Errors
    /// [`GrammarError::Lark`] with the compiler's message.
    pub fn lark(vocab: &Vocab, grammar: &str) -> Result<Self, GrammarError> {
        let grammar = llguidance::api::TopLevelGrammar::from_lark(grammar.to_string());
        Self::compile(vocab, grammar, "lark").map_err(GrammarError::Lark)
    }

    fn compile(
        vocab: &Vocab,
        grammar: llguidance::api::TopLevelGrammar,
        kind: &'static str,
    ) -> Result<Self, String> {
        let parser = vocab
            .factory
            .create_parser(grammar)
            .map_err(|e| format!("{e:#}"))?;
        let matcher = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            eos: vocab.eos.clone(),
            kind,
            ahead: Vec::new(),
            path: Vec::new(),
            masks: 0,
            spent: Duration::ZERO,
            eos_after_end: 0,
        })
    }

    /// The tokens allowed next (only EOS once the grammar is complete).
    ///
    /// # Errors
    /// [`GrammarError::Failed`] when the matcher is in an error state.
    pub fn allowed(&mut self) -> Result<&Mask, GrammarError> {
        if self.ahead.is_empty() {
            let started = Instant::now();
            let m = self.compute();
            self.spent += started.elapsed();
            let m = m?;
            self.ahead.push(m);
            self.path.clear();
        }
        Ok(&self.ahead[0])
    }

    fn compute(&mut self) -> Result<Mask, GrammarError> {
        self.masks += 1;
        self.matcher
            .compute_mask_or_eos()
            .map(Mask)
            .map_err(|e| GrammarError::Failed(format!("{e:#}")))
    }

    /// Masks computed so far, and the time spent in the matcher (masks, advances and
    /// rollbacks).
    pub fn cost(&self) -> (usize, Duration) {
        (self.masks, self.spent)
    }

    /// Consumes `token`.
    ///
    /// # Errors
    /// [`GrammarError::Failed`] when the grammar does not allow it (the constraint is then
    /// broken for good).
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.path.first() == Some(&token) {
            self.path.remove(0);
            self.ahead.remove(0);
        } else {
            self.ahead.clear();
            self.path.clear();
        }
        let started = Instant::now();
        let out = self.consume(token);
        self.spent += started.elapsed();
        out.map_err(|e| GrammarError::Failed(format!("{e:#}")))
    }

    /// Consumes `token` in the matcher, or counts an EOS after the end.
    fn consume(&mut self, token: u32) -> anyhow::Result<()> {
        if self.is_eos(token) && self.is_complete() && self.eos_after_end == 0 {
            self.eos_after_end = 1;
            return Ok(());
        }
        self.matcher.consume_token(token)
    }

    /// Undoes the last `n` consumed tokens (an EOS after the end first).
    fn unconsume(&mut self, n: usize) -> anyhow::Result<()> {
        let phantom = self.eos_after_end.min(n);
        self.eos_after_end -= phantom;
        match n - phantom {
            0 => Ok(()),
            rest => self.matcher.rollback(rest),
        }
    }

    /// Undoes the last `n` [`Constraint::advance`]s.
    ///
    /// # Errors
    /// [`GrammarError::Failed`] when fewer than `n` tokens were consumed.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n == 0 {
            return Ok(());
        }
        self.ahead.clear();
        self.path.clear();
        let started = Instant::now();
        let out = self.unconsume(n);
        self.spent += started.elapsed();
        out.map_err(|e| GrammarError::Failed(format!("{e:#}")))
    }

    /// Whether the output so far is a complete match (EOS allowed now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar can take no more tokens: the output is complete.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Whether `token` is one of the vocabulary's EOS ids.
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }

    /// Length of the longest prefix of `draft` the grammar allows token by token (cut after
    /// an EOS: nothing follows it). The state is unchanged; the masks it computed are kept
    /// for [`Constraint::allowed`] as the verified drafts are advanced through.
    pub fn check_draft(&mut self, draft: &[u32]) -> usize {
        self.ahead.clear();
        self.path.clear();
        let started = Instant::now();
        let n = self.walk(draft);
        self.spent += started.elapsed();
        n
    }

    fn walk(&mut self, draft: &[u32]) -> usize {
        let mut n = 0;
        for i in 0..=draft.len() {
            let Ok(mask) = self.compute() else { break };
            let ok = draft.get(i).is_some_and(|&d| mask.allows(d));
            self.ahead.push(mask);
            if !ok || self.consume(draft[i]).is_err() {
                break;
            }
            n += 1;
            self.path.push(draft[i]);
            if self.is_eos(draft[i]) {
                break;
            }
        }
        if self.unconsume(n).is_err() {
            // Only a matcher already broken fails to roll back: drop the cache, keep no draft.
            self.ahead.clear();
            self.path.clear();
            return 0;
        }
        // Masks for states past the last draft kept are not needed.
        self.ahead.truncate(n + 1);
        self.path.truncate(n);
        n
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.kind)
            .field("complete", &self.is_complete())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
pub(crate) mod tests;
