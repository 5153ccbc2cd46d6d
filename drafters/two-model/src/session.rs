//! One session of the draft model: its context, its own KV cache and how it drafts.
//!
//! # Rewind rule
//! The cache is never rewound eagerly. It remembers which ids its rows hold (`cached`); the
//! context (`tokens`) is what the target committed. Before each draft the cache is truncated to
//! the longest common prefix of the two (but never past the pending last id, whose logits we
//! need) and the rest of the context is fed in one forward:
//!
//! ```text
//!  after drafting d1..dk:   cached = ctx p d1 .. d(k-1)        (dk was never fed)
//!  all accepted (+ t):      tokens = ctx p d1 .. dk t   → keep ctx p d1..d(k-1), feed dk t
//!  a < k accepted (+ t):    tokens = ctx p d1 .. da t   → keep ctx p d1..da,     feed t
//! ```
//!
//! This is mlx-lm's rule (rewind by `max(d - a - 1, 0)`, re-feed the last draft after an
//! all-accept round) derived from the ids instead of the counts, so it also covers re-opens,
//! checkpoints and a target that commits something unexpected.

use specula_models::kv_cache::KvCache;
use specula_models::sampling::{argmax, Sampler, SamplingParams};
use specula_models::{ForwardRequest, Model, Result, Rows};
use specula_protocol::sdk::Proposal;
use specula_protocol::wire::SamplingSpec;

use crate::checkpoints::{common_prefix, Checkpoint};

/// How a session picks its drafts.
#[derive(Debug)]
enum Pick {
    /// Argmax; no `q` is sent (the target verifies greedily).
    Greedy,
    /// Draws from the request's filtered distribution and sends it as `q`.
    Sample(Box<Sampler>),
}

/// The draft model's state for one target session.
///
/// # Invariants
/// `cache.len() == cached.len()`, and row `i` of `cache` holds the K/V of `cached[i]` at
/// position `i`.
#[derive(Debug)]
pub struct DraftSession {
    tokens: Vec<u32>,
    cached: Vec<u32>,
    cache: KvCache,
    pick: Pick,
    fed: usize,
}

/// The models runtime's sampling parameters for a session's [`SamplingSpec`].
pub fn sampling_params(spec: &SamplingSpec) -> SamplingParams {
    SamplingParams {
        temperature: spec.temperature,
        top_k: spec.top_k.map(|k| k as usize),
        top_p: spec.top_p,
        min_p: spec.min_p,
        // The wire spec carries no penalty: q is the draft model's own filtered distribution.
        repetition_penalty: 1.0,
        seed: spec.seed,
        ..SamplingParams::default()
    }
}

impl DraftSession {
    /// A session over `prompt` (its last id pending), reusing `checkpoint`'s rows when given.
    pub fn new(
        model: &Model,
        prompt: &[u32],
        sampling: &SamplingSpec,
        checkpoint: Option<Checkpoint>,
    ) -> Self {
        let params = sampling_params(sampling);
        let pick = match params.is_greedy() {
            true => Pick::Greedy,
            false => Pick::Sample(Box::new(Sampler::new(params))),
        };
        let (cached, cache) = match checkpoint {
            Some(c) => (c.ids, c.cache),
            None => (Vec::new(), model.new_cache()),
        };
        DraftSession {
            tokens: prompt.to_vec(),
            cached,
            cache,
            pick,
            fed: 0,
        }
    }

    /// The committed context (its last id is pending).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Positions run through the draft model so far (prefill, catch-up and draft steps).
    pub fn fed(&self) -> usize {
        self.fed
    }

    /// Appends committed ids to the context; the cache catches up at the next draft.
    pub fn extend(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// Runs the context minus its pending id, so the first draft only feeds one position.
    ///
    /// # Errors
    /// A failed forward (the cache is left as it was before the failing chunk).
    pub fn prefill(&mut self, model: &Model) -> Result<()> {
        let upto = self.tokens.len().saturating_sub(1);
        self.catch_up(model, upto, 0).map(drop)
    }

    /// Proposes up to `n` ids after the context (fewer near the end of the draft model's
    /// context window, none for an empty context).
    ///
    /// # Errors
    /// A failed forward; the session stays usable (the next draft re-syncs the cache).
    pub fn draft(&mut self, model: &Model, n: usize) -> Result<Proposal> {
        if self.tokens.is_empty() || n == 0 {
            return Ok(Proposal::none());
        }
        let Some(logits) = self.catch_up(model, self.tokens.len(), 1)? else {
            return Ok(Proposal::none());
        };
        let mut logits = logits;
        let mut drafts = Vec::with_capacity(n);
        let mut q = Vec::new();
        let mut history = self.tokens.clone();
        loop {
            let id = match &mut self.pick {
                Pick::Greedy => argmax(&logits),
                Pick::Sample(sampler) => {
                    let dist = sampler.distribution(&logits, &history);
                    let id = sampler.draw(&dist);
                    q.push(dist.to_dense(logits.len()));
                    id
                }
            };
            drafts.push(id);
            history.push(id);
            // The last draft is not fed: the target may reject it (see the module doc).
            if drafts.len() == n || self.cache.len() >= model.context_len() {
                break;
            }
            logits = self.step(model, &[id])?;
            self.cached.push(id);
        }
        let q = matches!(self.pick, Pick::Sample(_)).then_some(q);
        Ok(Proposal {
            tokens: drafts,
            q,
            confidence: None,
        })
    }

    /// Gives the cache back as a checkpoint of the ids it holds.
    pub fn into_checkpoint(self) -> Checkpoint {
        Checkpoint {
            ids: self.cached,
            cache: self.cache,
        }
    }

    /// Makes the cache hold `tokens[..upto]`: keeps the rows shared with the context, feeds
    /// the rest and returns the logits of the last fed position when `last_k == 1` (`None`
    /// when nothing was fed or the draft model's window is full).
    fn catch_up(&mut self, model: &Model, upto: usize, last_k: usize) -> Result<Option<Vec<f32>>> {
        // Keep at most `upto - last_k` rows: the last position must be run to get its logits.
        let keep = common_prefix(&self.cached, &self.tokens[..upto]).min(upto - last_k.min(upto));
        self.cache.truncate(keep)?;
        self.cached.truncate(keep);
        let feed = &self.tokens[keep..upto];
        if feed.is_empty() || upto > model.context_len() {
            return Ok(None);
        }
        let req = ForwardRequest {
            logits: Rows::Last(last_k),
            ..ForwardRequest::default()
        };
        let out = model.prefill(feed, &mut self.cache, &req)?;
        self.fed += feed.len();
        self.cached.extend_from_slice(feed);
        match last_k {
            0 => Ok(None),
            _ => Ok(Some(out.logits.squeeze(0)?.to_vec1::<f32>()?)),
        }
    }

    /// Feeds `ids` and returns the logits of the last one.
    fn step(&mut self, model: &Model, ids: &[u32]) -> Result<Vec<f32>> {
        let out = model.forward(ids, &mut self.cache, &ForwardRequest::default())?;
        self.fed += ids.len();
        Ok(out.logits.squeeze(0)?.to_vec1::<f32>()?)
    }
}
