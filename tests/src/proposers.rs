//! In-process proposers for tests: drafters whose behaviour a test controls exactly.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specula_models::sampling::SamplingParams;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use target_host::proposer::{
    Draft, DraftAsk, DraftBatch, Proposer, SessionId, TapRows, Verdict, Wants,
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
