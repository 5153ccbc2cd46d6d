//! The one interface between the verify loop and wherever drafts come from.
//!
//! The verify loop owns the truth (target model, KV cache, sampler); a [`Proposer`] only ever
//! suggests tokens. Whatever a proposer returns is checked by the loop, so a proposer can change
//! speed, never output.

use specula_models::sampling::SamplingParams;

/// Identifies one request (a session) across the loop and its proposer.
pub type SessionId = u64;

/// Which target activations a proposer wants to see after every verify forward.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wants {
    /// Hidden-state taps: layer ids (output of layer `l`); `None` entries are not used.
    pub tap_layers: Vec<usize>,
    /// Whether the post-final-norm hidden is wanted as its own tap.
    pub final_hidden: bool,
    /// Layers whose K/V rows the proposer wants to read.
    pub kv_layers: Vec<usize>,
}

impl Wants {
    /// Whether nothing is wanted.
    pub fn is_empty(&self) -> bool {
        self.tap_layers.is_empty() && !self.final_hidden && self.kv_layers.is_empty()
    }
}

/// Drafts proposed for one round, already validated against the vocabulary and `n`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    /// Proposed token ids, at most the `n` asked for.
    pub tokens: Vec<u32>,
    /// The proposer's probability rows for each drafted token (`q`), when it sampled them.
    /// `None` means the drafts were chosen deterministically (`q` is one-hot).
    pub q: Option<Vec<Vec<f32>>>,
}

/// What the verify loop learned in one round, handed back to the proposer.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict<'a> {
    /// How many drafts were offered for verification.
    pub drafted: usize,
    /// How many of them the target accepted.
    pub accepted: usize,
    /// The ids committed this round: the accepted drafts plus the target's own next token.
    pub committed: &'a [u32],
    /// Target activations of the verified window rows `[pending, d1..d_accepted]`, when asked for.
    pub taps: Option<&'a TapRows>,
}

/// Target activations for a window of positions, row-major `f32`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TapRows {
    /// Absolute position of the first row.
    pub pos: usize,
    /// Number of rows.
    pub rows: usize,
    /// One entry per requested layer tap (same order as [`Wants::tap_layers`]): `rows × hidden`.
    pub layers: Vec<Vec<f32>>,
    /// Post-final-norm hidden, `rows × hidden`, when [`Wants::final_hidden`].
    pub final_hidden: Option<Vec<f32>>,
    /// K and V rows per requested layer (same order as [`Wants::kv_layers`]):
    /// `rows × kv_heads × head_dim` each.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

/// Where drafts come from, as the verify loop sees it. Implemented by the out-of-process drafter
/// client ([`crate::drafter`]) and by in-process adapters used for benchmarks and tests.
///
/// Calls for one session always come in the order `open, (draft, verdict)*, close`. A proposer
/// that fails returns an empty draft: the loop then decodes one token without speculation.
pub trait Proposer: Send {
    /// A short name for logs and metrics.
    fn name(&self) -> &str;
    /// What the proposer wants to see after each verify forward.
    fn wants(&self) -> Wants;
    /// Starts a session whose context is `prompt` (all prompt ids, including the pending last one),
    /// with `prompt_taps` holding the activations of the whole prompt when [`Proposer::wants`] asked.
    fn open(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        sampling: &SamplingParams,
        prompt_taps: Option<&TapRows>,
    );
    /// Asks for up to `n` drafts. `new_tokens` are ids committed to the context that the proposer
    /// has not been told of, neither by `open` nor by a [`Verdict::committed`] (usually empty; not
    /// empty after rounds decoded without this proposer, e.g. while it was restarting).
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft;
    /// Reports how the last draft fared.
    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>);
    /// Ends a session.
    fn close(&mut self, session: SessionId);
}

/// The proposer currently in use, swappable while requests run (hot-swap).
///
/// A request opens its session on whatever proposer is current; at every round boundary it
/// compares the slot's epoch with the one it opened on and, when a swap happened, opens the
/// session again on the new proposer with the whole context so far.
#[derive(Default)]
pub struct ProposerSlot {
    inner: std::sync::Mutex<Current>,
}

/// The slot's content: the current proposer and the epoch it was installed at.
#[derive(Default)]
pub struct Current {
    /// Bumped by every [`ProposerSlot::replace`].
    pub epoch: u64,
    /// The proposer, or `None` when speculation is off.
    pub proposer: Option<Box<dyn Proposer>>,
}

impl ProposerSlot {
    /// A slot holding `proposer`.
    pub fn new(proposer: Option<Box<dyn Proposer>>) -> Self {
        ProposerSlot {
            inner: std::sync::Mutex::new(Current { epoch: 0, proposer }),
        }
    }

    /// Installs `proposer` and returns the previous one, which the caller shuts down (by
    /// dropping it) outside the lock.
    pub fn replace(&self, proposer: Option<Box<dyn Proposer>>) -> Option<Box<dyn Proposer>> {
        let mut cur = self.lock();
        cur.epoch += 1;
        std::mem::replace(&mut cur.proposer, proposer)
    }

    /// Locks the slot. Hold it only across proposer calls, never across a target forward.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        // A panic while holding the lock leaves a proposer in an unknown state, but the slot
        // itself (epoch + box) is always consistent, so poisoning is not an error here.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A proposer shared between the slot (where the verify loop drives it) and an observer that
/// reads its status or counters (the admin API, a benchmark). Calls lock it for their length.
pub struct Shared<P> {
    inner: std::sync::Arc<std::sync::Mutex<P>>,
    name: String,
}

impl<P: Proposer> Shared<P> {
    /// Shares `proposer`; the returned handle observes it.
    pub fn new(proposer: P) -> (Self, std::sync::Arc<std::sync::Mutex<P>>) {
        let name = proposer.name().to_string();
        let inner = std::sync::Arc::new(std::sync::Mutex::new(proposer));
        (
            Shared {
                inner: inner.clone(),
                name,
            },
            inner,
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, P> {
        // Proposer state stays usable after a panic in another holder: every call is
        // self-contained, and a broken drafter only costs speed.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<P: Proposer> Proposer for Shared<P> {
    fn name(&self) -> &str {
        &self.name
    }
    fn wants(&self) -> Wants {
        self.lock().wants()
    }
    fn open(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        sampling: &SamplingParams,
        prompt_taps: Option<&TapRows>,
    ) {
        self.lock().open(session, prompt, sampling, prompt_taps);
    }
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft {
        self.lock().draft(session, new_tokens, n)
    }
    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.lock().verdict(session, verdict);
    }
    fn close(&mut self, session: SessionId) {
        self.lock().close(session);
    }
}
