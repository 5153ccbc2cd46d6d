//! [`Model`]: the contract the target host and the drafters code against.
//!
//! - [`Model::forward_batch`]: one packed forward over the rows of several sequences in a
//!   [`KvPool`] ([`crate::batch`]), the engine's step.
//! - [`Model::forward`] / [`Model::prefill`]: one sequence over its own [`KvCache`], for drafters,
//!   tests and tools. Both are a one-sequence batch through the same code.
//!
//! The driver here is shared by every architecture ([`crate::arch::Architecture`]): embed the
//! packed rows, run the decoder layers, record taps, final norm, then `lm_head` over only the
//! rows that want logits. Every step treats rows independently, so a row's logits, taps and
//! K/V are bit-identical whatever else is in the batch and however its sequence was chunked.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::arch::Architecture;
use crate::batch::{Batch, BatchOutput, Rows, SeqRows};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::kv_pool::{KvLayout, KvPool, BLOCK_SIZE};
use crate::layers::attention::{AttnBatch, Span};
use crate::layers::Embedding;

/// A hidden state a caller can tap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TapId {
    /// Output of decoder layer `l` (HF `hidden_states[l + 1]`).
    Layer(usize),
    /// Output of the final norm (what `lm_head` sees).
    FinalNorm,
}

/// What a one-sequence forward should return.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardRequest {
    /// Rows of the call that get logits.
    pub logits: Rows,
    /// Hidden states to return.
    pub taps: Vec<TapId>,
    /// Rows of the call that get taps.
    pub tap_rows: Rows,
}

impl Default for ForwardRequest {
    /// Next-token logits, no taps.
    fn default() -> Self {
        Self {
            logits: Rows::Last(1),
            taps: Vec::new(),
            tap_rows: Rows::Last(1),
        }
    }
}

/// Result of a one-sequence forward.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `[logit rows, vocab]` f32.
    pub logits: Tensor,
    /// One `[tap rows, hidden]` f32 tensor per requested tap, in request order.
    pub taps: Vec<(TapId, Tensor)>,
}

/// Row selections of a validated batch, in packed (global) row indices.
struct Plan {
    logits: Vec<u32>,
    taps: Vec<u32>,
    logit_rows: Vec<std::ops::Range<usize>>,
    tap_rows: Vec<std::ops::Range<usize>>,
}

/// A loaded model, ready to run.
#[derive(Clone, Debug)]
pub struct Model {
    net: Arc<dyn Architecture>,
    config: ModelConfig,
    weights_path: PathBuf,
    prefill_chunk: usize,
    device: Device,
}

impl Model {
    /// Assembles a model from its parts (used by [`crate::loader`]).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `prefill_chunk` is 0.
    pub fn from_parts(
        net: Arc<dyn Architecture>,
        config: ModelConfig,
        weights_path: &Path,
        prefill_chunk: usize,
        device: &Device,
    ) -> Result<Self> {
        if prefill_chunk == 0 {
            return Err(Error::InvalidRequest {
                op: "load",
                reason: "prefill_chunk must be at least 1".into(),
            });
        }
        Ok(Self {
            net,
            config,
            weights_path: weights_path.to_path_buf(),
            prefill_chunk,
            device: device.clone(),
        })
    }

    /// The architecture's network (its embedding, `lm_head`, layer count).
    pub fn arch(&self) -> &dyn Architecture {
        self.net.as_ref()
    }

    /// The token embedding table.
    pub fn embedding(&self) -> &Embedding {
        self.net.embedding()
    }

    /// What one KV block of this model stores.
    pub fn kv_layout(&self) -> KvLayout {
        self.net.kv_layout()
    }

    /// A pool of `capacity_blocks` blocks for this model's K/V (see [`KvPool`]).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for zero capacity.
    pub fn new_pool(&self, capacity_blocks: usize) -> Result<KvPool> {
        KvPool::new(self.kv_layout(), capacity_blocks)
    }

    /// The device the weights, the cache and the logits live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// An empty cache sized for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.kv_layout(), self.context_len())
            .expect("invariant: a loaded model has a valid layout and context")
    }

    /// Maximum number of positions (prompt + generated).
    pub fn context_len(&self) -> usize {
        self.config.max_position_embeddings
    }

    /// The GGUF file or HF directory the weights came from.
    pub fn weights_path(&self) -> &Path {
        &self.weights_path
    }

    /// Projects final-norm hidden states (a [`TapId::FinalNorm`] tap, `[rows, hidden]`) to
    /// logits `[rows, vocab]`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.net.lm_head(hidden)
    }

    /// Runs the rows of every sequence of `batch` in one forward, appending their K/V to
    /// `pool`. Each sequence continues at its length in the pool.
    ///
    /// All or nothing: on error every sequence is rolled back to its length before the call.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an empty batch, a sequence that is empty, unknown to the
    /// pool or listed twice, rows out of range, an unknown tap layer, a pool of another layout
    /// or an out-of-vocabulary token; [`Error::ContextOverflow`] when a sequence would pass the
    /// context; [`Error::KvPoolFull`] when the pool cannot hold the new positions.
    pub fn forward_batch(&self, batch: &Batch, pool: &mut KvPool) -> Result<BatchOutput> {
        let plan = self.plan(batch, pool)?;
        let starts: Vec<usize> = batch
            .seqs
            .iter()
            .map(|s| pool.len(s.seq))
            .collect::<Result<_>>()?;
        let rollback = |pool: &mut KvPool, upto: usize| {
            for (s, &len) in batch.seqs[..upto].iter().zip(&starts) {
                pool.truncate(s.seq, len)
                    .expect("invariant: a sequence of the batch is live and grew");
            }
        };
        for (i, s) in batch.seqs.iter().enumerate() {
            if let Err(e) = pool.append(s.seq, &s.tokens) {
                rollback(pool, i);
                return Err(e);
            }
        }
        // Our kernels' loops run on `crate::par`; candle's own parallel ops run on rayon, and
        // from outside rayon's pool each would block the caller on a futex until the pool
        // finishes (a wake-up and a sleep per op). So the whole forward runs on that pool.
        let mut run = || self.run(batch, &plan, &starts, pool);
        let out = match rayon::current_thread_index() {
            Some(_) => run(),
            None => rayon::scope(|_| run()),
        };
        match out {
            Ok(out) => {
                for s in &batch.seqs {
                    pool.index_full_blocks(s.seq)?;
                }
                Ok(out)
            }
            Err(e) => {
                rollback(pool, batch.seqs.len());
                Err(e)
            }
        }
    }

    fn plan(&self, batch: &Batch, pool: &KvPool) -> Result<Plan> {
        let bad = |reason: String| {
            Err(Error::InvalidRequest {
                op: "forward",
                reason,
            })
        };
        if batch.seqs.is_empty() {
            return bad("the batch has no sequences".into());
        }
        if *pool.layout() != self.kv_layout() {
            return bad("the KV pool was made for another model's layout".into());
        }
        let layers = self.net.num_layers();
        if let Some(TapId::Layer(l)) = batch
            .taps
            .iter()
            .find(|t| matches!(t, TapId::Layer(l) if *l >= layers))
        {
            return bad(format!("tap Layer({l}) but the model has {layers} layers"));
        }
        let mut plan = Plan {
            logits: Vec::new(),
            taps: Vec::new(),
            logit_rows: Vec::new(),
            tap_rows: Vec::new(),
        };
        let mut row = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if batch.seqs[..i].iter().any(|o| o.seq == s.seq) {
                return bad(format!("sequence {:?} is in the batch twice", s.seq));
            }
            let n = s.tokens.len();
            if n == 0 {
                return bad(format!("sequence {:?} has no tokens", s.seq));
            }
            let got = pool.len(s.seq)? + n;
            if got > self.context_len() {
                return Err(Error::ContextOverflow {
                    got,
                    max: self.context_len(),
                });
            }
            let (l0, t0) = (plan.logits.len(), plan.taps.len());
            let global = |r: usize| (row + r) as u32;
            plan.logits
                .extend(s.logits.resolve(n)?.into_iter().map(global));
            plan.taps.extend(s.taps.resolve(n)?.into_iter().map(global));
            plan.logit_rows.push(l0..plan.logits.len());
            plan.tap_rows.push(t0..plan.taps.len());
            row += n;
        }
        Ok(plan)
    }

    /// The forward proper, after the pool holds blocks for every new position.
    fn run(
        &self,
        batch: &Batch,
        plan: &Plan,
        starts: &[usize],
        pool: &mut KvPool,
    ) -> Result<BatchOutput> {
        let total: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        let mut attn = AttnBatch {
            spans: Vec::with_capacity(batch.seqs.len()),
            positions: Vec::with_capacity(total),
            targets: Vec::with_capacity(total),
            ids: Vec::with_capacity(total),
        };
        for (s, &pos) in batch.seqs.iter().zip(starts) {
            let blocks = pool.blocks(s.seq)?.to_vec();
            let n = s.tokens.len();
            for p in pos..pos + n {
                attn.targets.push((blocks[p / BLOCK_SIZE], p % BLOCK_SIZE));
            }
            attn.positions.extend(pos..pos + n);
            attn.spans.push(Span {
                row: attn.ids.len(),
                rows: n,
                pos,
                blocks,
            });
            attn.ids.extend_from_slice(&s.tokens);
        }
        let select = |xs: &Tensor, rows: &[u32]| -> Result<Tensor> {
            match rows.len() == total {
                true => Ok(xs.clone()),
                false => Ok(xs.index_select(&Tensor::new(rows, &self.device)?, 0)?),
            }
        };
        let hidden = self.net.hidden_size();
        let empty = |cols: usize| Tensor::zeros((0, cols), DType::F32, &self.device);
        let mut taps: Vec<Option<Tensor>> = vec![None; batch.taps.len()];
        let mut record = |id: TapId, xs: &Tensor| -> Result<()> {
            for (slot, _) in taps.iter_mut().zip(&batch.taps).filter(|(_, t)| **t == id) {
                *slot = Some(match plan.taps.is_empty() {
                    true => empty(hidden)?,
                    false => select(xs, &plan.taps)?,
                });
            }
            Ok(())
        };
        let mut xs = self.net.embed(&attn.ids)?;
        for l in 0..self.net.num_layers() {
            xs = self.net.layer(l, &xs, &attn, pool)?;
            record(TapId::Layer(l), &xs)?;
        }
        let xs = self.net.final_norm(&xs)?;
        record(TapId::FinalNorm, &xs)?;
        let logits = match plan.logits.is_empty() {
            true => empty(self.config.vocab_size)?,
            false => self.net.lm_head(&select(&xs, &plan.logits)?)?,
        };
        let taps = batch
            .taps
            .iter()
            .zip(taps)
            .map(|(id, t)| (*id, t.expect("invariant: every valid tap is recorded")))
            .collect();
        Ok(BatchOutput {
            logits,
            logit_rows: plan.logit_rows.clone(),
            taps,
            tap_rows: plan.tap_rows.clone(),
        })
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their K/V to `cache`: a batch of
    /// one sequence.
    ///
    /// On error the cache is rolled back to its length before the call.
    ///
    /// # Errors
    /// As [`Model::forward_batch`]; also [`Error::InvalidRequest`] for a cache of another
    /// model.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
    ) -> Result<ForwardOutput> {
        let (pool, seq) = cache.pool_mut();
        let batch = Batch {
            seqs: vec![SeqRows {
                seq,
                tokens: tokens.to_vec(),
                logits: req.logits.clone(),
                taps: req.tap_rows.clone(),
            }],
            taps: req.taps.clone(),
        };
        let out = self.forward_batch(&batch, pool)?;
        Ok(ForwardOutput {
            logits: out.logits,
            taps: out.taps,
        })
    }

    /// Same as [`Model::forward`], in chunks of `prefill_chunk` tokens (bounding the work per
    /// forward); returns the rows `req` asks for, as `forward` would, bit for bit.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn prefill(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
    ) -> Result<ForwardOutput> {
        self.forward_chunked(tokens, cache, req, self.prefill_chunk)
    }

    /// [`Model::forward`] in chunks of `chunk` tokens.
    ///
    /// # Errors
    /// As [`Model::forward`]; [`Error::InvalidRequest`] for `chunk` 0.
    pub fn forward_chunked(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
        chunk: usize,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        if chunk == 0 || n == 0 {
            return Err(Error::InvalidRequest {
                op: "forward",
                reason: format!("{n} tokens in chunks of {chunk}"),
            });
        }
        let (logit_rows, tap_rows) = (req.logits.resolve(n)?, req.tap_rows.resolve(n)?);
        let start = cache.len();
        let within = |rows: &[usize], c: usize| -> Rows {
            Rows::Only(
                rows.iter()
                    .filter(|&&r| (c..c + chunk).contains(&r))
                    .map(|r| r - c)
                    .collect(),
            )
        };
        let mut logits = Vec::new();
        let mut taps: Vec<Vec<Tensor>> = vec![Vec::new(); req.taps.len()];
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let c = i * chunk;
            let sub = ForwardRequest {
                logits: within(&logit_rows, c),
                taps: req.taps.clone(),
                tap_rows: within(&tap_rows, c),
            };
            let out = match self.forward(part, cache, &sub) {
                Ok(out) => out,
                Err(e) => {
                    cache.truncate(start)?;
                    return Err(e);
                }
            };
            logits.push(out.logits);
            for (acc, (_, t)) in taps.iter_mut().zip(out.taps) {
                acc.push(t);
            }
        }
        let taps = req
            .taps
            .iter()
            .zip(taps)
            .map(|(id, parts)| Ok((*id, Tensor::cat(&parts, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput {
            logits: Tensor::cat(&logits, 0)?,
            taps,
        })
    }
}

#[cfg(test)]
mod tests;
