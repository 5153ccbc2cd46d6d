//! In-process proposers for tests: drafters whose behaviour a test controls exactly.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specula_models::sampling::SamplingParams;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use target_host::proposer::{
    Draft, DraftAsk, DraftBatch, Health, Proposer, SessionId, TapRows, Verdict, Wants,
};

/// Drafts for one session through the batched interface, with a deadline long enough for a
/// loaded test machine (the proposer's own configured deadline still applies).
pub fn draft(p: &mut dyn Proposer, session: SessionId, n: usize) -> Draft {
    let asks = [DraftAsk { session, n }];
    let batch = DraftBatch {
        asks: &asks,
        deadline: Duration::from_secs(3600),
    };
    p.draft(&batch).pop().unwrap_or_default()
}

/// Proposes random tokens. With `sampled`, drafts are drawn from a fixed, deliberately wrong
/// distribution `q` (mass piled on a few ids) and `q` is sent; otherwise one fixed id is
/// proposed deterministically.
pub struct BadProposer {
    vocab: usize,
    rng: StdRng,
    q: Option<Vec<f32>>,
}

impl BadProposer {
    /// A bad proposer over `vocab` ids.
    pub fn new(vocab: usize, sampled: bool, seed: u64) -> Self {
        let q = sampled.then(|| {
            let mut q: Vec<f32> = (0..vocab)
                .map(|i| if i % 7 == 3 { 8.0 } else { 0.2 })
                .collect();
            let s: f32 = q.iter().sum();
            q.iter_mut().for_each(|x| *x /= s);
            q
        });
        BadProposer {
            vocab,
            rng: StdRng::seed_from_u64(seed),
            q,
        }
    }

    /// The `q` row the proposer samples from, when it samples.
    pub fn q(&self) -> Option<&[f32]> {
        self.q.as_deref()
    }

    fn one(&mut self) -> u32 {
        match &self.q {
            None => (self.vocab / 2) as u32,
            Some(q) => {
                let mut r: f32 = self.rng.random();
                for (i, &p) in q.iter().enumerate() {
                    r -= p;
                    if r < 0.0 {
                        return i as u32;
                    }
                }
                (self.vocab - 1) as u32
            }
        }
    }
}

impl Proposer for BadProposer {
    fn name(&self) -> &str {
        "bad"
    }
    fn wants(&self) -> Wants {
        Wants::default()
    }
    fn open(&mut self, _: SessionId, _: &[u32], _: &SamplingParams, _: Option<&TapRows>) {}
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let mut out = Vec::with_capacity(batch.asks.len());
        for ask in batch.asks {
            let tokens: Vec<u32> = (0..ask.n).map(|_| self.one()).collect();
            let q = self.q.clone().map(|q| vec![q; tokens.len()]);
            out.push(Draft {
                tokens,
                q,
                confidence: None,
            });
        }
        out
    }
    fn commit(&mut self, _: SessionId, _: &Verdict<'_>) {}
    fn advance(&mut self, _: SessionId, _: &[u32], _: Option<&TapRows>) {}
    fn close(&mut self, _: SessionId) {}
}

/// Proposes exactly the given continuation of the prompt (an oracle): accepted in full when it
/// is the target's own greedy output.
pub struct ScriptProposer {
    /// Prompt followed by the continuation.
    full: Vec<u32>,
    context: Vec<u32>,
    /// Sent with every drafted token, when set.
    confidence: Option<f32>,
    /// Draft tokens sent so far.
    sent: Arc<AtomicUsize>,
}

impl ScriptProposer {
    /// Proposes `script` as the continuation of `prompt`.
    pub fn new(prompt: &[u32], script: &[u32]) -> Self {
        ScriptProposer {
            full: prompt.iter().chain(script).copied().collect(),
            context: Vec::new(),
            confidence: None,
            sent: Arc::default(),
        }
    }

    /// Reports `confidence` for every drafted token (however right the drafts are).
    pub fn with_confidence(mut self, confidence: f32) -> Self {
        self.confidence = Some(confidence);
        self
    }

    /// Counts the draft tokens this proposer sends.
    pub fn sent(&self) -> Arc<AtomicUsize> {
        self.sent.clone()
    }
}

impl Proposer for ScriptProposer {
    fn name(&self) -> &str {
        "script"
    }
    fn wants(&self) -> Wants {
        Wants::default()
    }
    fn open(&mut self, _: SessionId, context: &[u32], _: &SamplingParams, _: Option<&TapRows>) {
        self.context = context.to_vec();
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let done = self.context.len();
        let draft = |n: usize| {
            let tokens: Vec<u32> = self.full.iter().skip(done).take(n).copied().collect();
            self.sent.fetch_add(tokens.len(), Ordering::Relaxed);
            Draft {
                confidence: self.confidence.map(|c| vec![c; tokens.len()]),
                tokens,
                q: None,
            }
        };
        batch.asks.iter().map(|a| draft(a.n)).collect()
    }
    fn commit(&mut self, _: SessionId, v: &Verdict<'_>) {
        self.context.extend_from_slice(v.committed);
    }
    fn advance(&mut self, _: SessionId, ids: &[u32], _: Option<&TapRows>) {
        self.context.extend_from_slice(ids);
    }
    fn close(&mut self, _: SessionId) {}
}

/// One round with drafts as the proposer saw it: the anchor's position, the drafts, how many
/// the target accepted, and which proposer instance drafted (a swap makes a new one); also the
/// confidences that came with the drafts and how many drafts the host verified (0 when it cut
/// them all).
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    pub instance: usize,
    pub pos: usize,
    pub tokens: Vec<u32>,
    pub accepted: usize,
    pub confidences: Vec<f32>,
    pub verified: usize,
}

/// A proposer that records the rounds it drafted (a batch of one session) into a shared list.
pub struct Recording {
    inner: Box<dyn Proposer>,
    instance: usize,
    rounds: Arc<Mutex<Vec<Round>>>,
    pos: usize,
    /// Whether the last recorded round still awaits its verdict (a later round's commit must
    /// not overwrite it).
    awaiting: bool,
    /// Factor on every confidence the drafter sends, before the host sees it.
    scale: f32,
}

impl Recording {
    pub fn new(inner: Box<dyn Proposer>, instance: usize, rounds: &Arc<Mutex<Vec<Round>>>) -> Self {
        Recording {
            inner,
            instance,
            rounds: rounds.clone(),
            pos: 0,
            awaiting: false,
            scale: 1.0,
        }
    }

    /// Multiplies every confidence the drafter sends by `scale` before the host sees it (and
    /// records what the host saw): a drafter made as unsure as a test needs.
    pub fn scaling_confidences(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }
}

impl Proposer for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn wants(&self) -> Wants {
        self.inner.wants()
    }
    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        self.pos = context.len() - 1;
        self.inner.open(session, context, sampling, taps);
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let mut drafts = self.inner.draft(batch);
        for c in drafts.iter_mut().filter_map(|d| d.confidence.as_mut()) {
            c.iter_mut().for_each(|x| *x *= self.scale);
        }
        if let Some(d) = drafts.first().filter(|d| !d.tokens.is_empty()) {
            self.rounds.lock().expect("lock").push(Round {
                instance: self.instance,
                pos: self.pos,
                tokens: d.tokens.clone(),
                accepted: 0,
                confidences: d.confidence.clone().unwrap_or_default(),
                verified: 0,
            });
            self.awaiting = true;
        }
        drafts
    }
    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        if std::mem::take(&mut self.awaiting) {
            if let Some(r) = self.rounds.lock().expect("lock").last_mut() {
                r.accepted = verdict.accepted;
                r.verified = verdict.drafted;
            }
        }
        self.pos += verdict.committed.len();
        self.inner.commit(session, verdict);
    }
    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        // A round whose drafts the host cut whole commits through `advance`: none verified.
        self.awaiting = false;
        self.pos += ids.len();
        self.inner.advance(session, ids, taps);
    }
    fn health(&self) -> Health {
        self.inner.health()
    }
    fn incarnation(&self) -> u64 {
        self.inner.incarnation()
    }
    fn close(&mut self, session: SessionId) {
        self.inner.close(session);
    }
}

/// The lowest confidence floor of the host's cut (`CONFIDENCE_FLOOR` in the engine; the floor
/// in force is this or higher, from the measured verify cost).
pub const LOWEST_CONFIDENCE_FLOOR: f32 = 0.1;

/// Checks the host's confidence cut over recorded controller rounds against the rule, which
/// holds whatever the measured costs: a round's verified drafts are a prefix whose reach (the
/// product of the confidences) is at or above [`LOWEST_CONFIDENCE_FLOOR`], and every draft sent
/// and not verified is counted in `confidence_cut` (the sum of the runs' stats). Returns how
/// many drafts were under the lowest floor (cut whatever the floor).
///
/// # Panics
/// When a round breaks the rule.
pub fn check_confidence_cut(rounds: &[Round], confidence_cut: usize) -> usize {
    let mut unsure = 0;
    for r in rounds {
        assert_eq!(
            r.confidences.len(),
            r.tokens.len(),
            "one confidence a draft: {r:?}"
        );
        let mut reach = 1.0f32;
        let sure = r
            .confidences
            .iter()
            .take_while(|&&c| {
                reach *= c;
                reach >= LOWEST_CONFIDENCE_FLOOR
            })
            .count();
        unsure += r.tokens.len() - sure;
        assert!(
            r.verified <= sure,
            "the host verified a draft under the lowest floor: {r:?}"
        );
    }
    let unverified: usize = rounds.iter().map(|r| r.tokens.len() - r.verified).sum();
    assert_eq!(
        confidence_cut, unverified,
        "every draft sent and not verified is counted as cut: {rounds:?}"
    );
    unsure
}
