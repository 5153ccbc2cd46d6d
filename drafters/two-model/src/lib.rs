//! The two-model drafter: a small language model sharing the target's tokenizer drafts `k` ids
//! autoregressively; the target verifies them in one forward.
//!
//! References: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
//! (2023, <https://arxiv.org/abs/2211.17192>) and mlx-lm's `speculative_generate_step`
//! (<https://github.com/ml-explore/mlx-lm>, `generate.py`), whose cache-rewind rule
//! [`session`] follows.
//!
//! - Greedy requests get argmax drafts and no `q`; sampled requests get drafts drawn from the
//!   request's sampler over the draft logits, with those distributions as `q` (lossless
//!   rejection sampling needs them).
//! - Each session keeps its own KV cache, prefilled at `Open` with the prompt minus its pending
//!   last id (in chunks of `--prefill-chunk`).
//! - Closed (and re-opened) sessions leave their cache in a bounded LRU of [`checkpoints`], so
//!   a re-open after a drafter swap or a chat turn sharing history only prefills the new part.
//! - The handshake refuses a target whose tokenizer fingerprint or vocabulary size differs.

pub mod checkpoints;
pub mod session;

use std::collections::HashMap;

use specula_models::tokenizer::Tokenizer;
use specula_models::Model;
use specula_protocol::sdk::{CommitArgs, Drafter, DrafterInfo, OpenArgs, Proposal};
use specula_protocol::wire::{Capabilities, SessionId, TargetInfo};
use tracing::{debug, warn};

use crate::checkpoints::Checkpoints;
use crate::session::DraftSession;

/// Settings of a [`TwoModelDrafter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TwoModelConfig {
    /// The most drafts proposed per round.
    pub max_draft_len: u32,
    /// How many closed sessions' caches are kept for reuse (0: none).
    pub checkpoints: usize,
}

impl Default for TwoModelConfig {
    fn default() -> Self {
        TwoModelConfig {
            max_draft_len: 16,
            checkpoints: 4,
        }
    }
}

/// A draft model serving the sessions of one target.
#[derive(Debug)]
pub struct TwoModelDrafter {
    model: Model,
    fingerprint: String,
    config: TwoModelConfig,
    sessions: HashMap<SessionId, DraftSession>,
    checkpoints: Checkpoints,
}

impl TwoModelDrafter {
    /// A drafter running `model`, whose tokenizer is `tokenizer`.
    pub fn new(model: Model, tokenizer: &Tokenizer, config: TwoModelConfig) -> Self {
        TwoModelDrafter {
            model,
            fingerprint: tokenizer.fingerprint().to_string(),
            config,
            sessions: HashMap::new(),
            checkpoints: Checkpoints::new(config.checkpoints),
        }
    }

    /// The session's state, when it is open (for inspection and tests).
    pub fn session(&self, session: SessionId) -> Option<&DraftSession> {
        self.sessions.get(&session)
    }

    /// Number of checkpoints held for reuse.
    pub fn checkpoints_held(&self) -> usize {
        self.checkpoints.len()
    }
}

/// Why the draft model cannot serve `target`, if it cannot: the drafts would be ids of another
/// vocabulary.
///
/// # Errors
/// A reason naming both fingerprints and vocabulary sizes.
pub fn check_target(
    fingerprint: &str,
    vocab_size: usize,
    target: &TargetInfo,
) -> std::result::Result<(), String> {
    if fingerprint == target.tokenizer_fingerprint && vocab_size == target.vocab_size as usize {
        return Ok(());
    }
    Err(format!(
        "tokenizer mismatch: the draft model's tokenizer (fingerprint {fingerprint}, vocab \
         {vocab_size}) differs from the target's (fingerprint {}, vocab {}); a draft model must \
         share the target's tokenizer",
        target.tokenizer_fingerprint, target.vocab_size
    ))
}

impl Drafter for TwoModelDrafter {
    fn info(&self) -> DrafterInfo {
        let caps = Capabilities::tokens_only(self.config.max_draft_len);
        DrafterInfo::new("two-model", env!("CARGO_PKG_VERSION"), caps)
    }

    fn accept_target(&mut self, target: &TargetInfo) -> std::result::Result<(), String> {
        check_target(&self.fingerprint, self.model.config().vocab_size, target)
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let pending = args.prompt.len().saturating_sub(1);
        let reuse = self.checkpoints.take_longest(&args.prompt[..pending]);
        let reused = reuse.as_ref().map_or(0, |c| c.ids.len());
        let mut state = DraftSession::new(&self.model, args.prompt, args.sampling, reuse);
        if let Err(e) = state.prefill(&self.model) {
            // The first draft retries; the session must exist so its commits are tracked.
            warn!(session, error = %e, "draft prefill failed");
        }
        debug!(session, prompt = args.prompt.len(), reused, "opened");
        self.sessions.insert(session, state);
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        let Some(state) = self.sessions.get_mut(&session) else {
            return Proposal::none();
        };
        state.extend(new_tokens);
        state.draft(&self.model, n).unwrap_or_else(|e| {
            warn!(session, error = %e, "drafting failed; verifying without drafts");
            Proposal::none()
        })
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        if let Some(state) = self.sessions.get_mut(&session) {
            state.extend(args.ids);
        }
    }

    fn close(&mut self, session: SessionId) {
        if let Some(state) = self.sessions.remove(&session) {
            self.checkpoints.put(state.into_checkpoint());
        }
    }
}

#[cfg(test)]
mod tests;
