//! The target side of a step: every sequence's K/V in one paged [`KvPool`] and one packed
//! forward ([`Model::forward_batch`]) over the rows every sequence contributes.
//!
//! ```text
//!   work:   seq A [pending d1 d2]   seq B [pending]   seq C [c0 c1 ... c31]  (prefill chunk)
//!   packed: a0 a1 a2 b0 c0 ... c31                      one [T, hidden] pass per layer
//!   logits: every row of A and B, the last row of C when it ends the prompt;
//!   taps:   (when the drafter wants any) every row.
//! ```
//!
//! Each sequence's rows run at positions `len(seq)..` of its own blocks; a row's logits, taps
//! and K/V depend only on its sequence, never on what else is in the step (the forward's
//! batch-invariance, which is what keeps the law under batching). [`Target::truncate`] rolls a
//! sequence back after verification (rejected drafts): a length change.
//!
//! **Prefix cache.** A new sequence adopts the longest chain of cached full blocks that starts
//! its prompt ([`KvPool::adopt_prefix`], vLLM-style hash chain); its prefill starts after them.
//! Blocks are entered into the index once their K/V is written (after each prefill chunk and
//! when a sequence ends, so a second chat turn finds the first turn's answer too).
//!
//! **K/V donors.** When the proposer reads its `kv_layers` in place ([`Wants::kv_views`]), the
//! pool keeps those slots in its shared donor region ([`KvPool::export_donors`]) and the taps
//! carry each sequence's block table ([`DonorRef`]) instead of copied K/V rows.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::Tensor;
use specula_models::kv_pool::{BlockKey, PoolStats, BLOCK_SIZE};
use specula_models::{Batch, ForwardRequest, KvPool, Model, Rows as Select, SeqId, SeqRows, TapId};

use crate::proposer::{DonorRef, DonorRegion, SessionId, TapRows, Wants};

/// One sequence's rows in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    /// The sequence.
    pub session: SessionId,
    /// Ids to run at positions `len(session)..`.
    pub tokens: Vec<u32>,
    /// Logits are wanted for the last `logits` rows (0: none).
    pub logits: usize,
    /// Taps are wanted for every row.
    pub taps: bool,
}

/// What one sequence's rows produced.
#[derive(Debug)]
pub struct RowsOut {
    /// `[logits, vocab]` f32 (on the model's device).
    pub logits: Tensor,
    /// The taps of every row, when asked.
    pub taps: Option<TapRows>,
}

/// The sequences' K/V and the forward over them.
pub struct Target<'m> {
    model: &'m Model,
    pool: KvPool,
    seqs: HashMap<SessionId, SeqId>,
    /// The pool's donor region as last handed out (re-made when the pool's region changes).
    donor: Option<Arc<DonorRegion>>,
}

impl<'m> Target<'m> {
    /// A pool of at least `positions` positions for `model`, with one spare block per
    /// sequence of `max_running` (partly filled last blocks), keeping at most `cache_bytes` of
    /// blocks no sequence holds for the prefix cache.
    ///
    /// # Errors
    /// A pool that cannot be made (zero capacity).
    pub fn new(
        model: &'m Model,
        positions: usize,
        max_running: usize,
        cache_bytes: usize,
    ) -> anyhow::Result<Self> {
        let blocks = positions.div_ceil(BLOCK_SIZE) + max_running;
        let mut pool = model.new_pool(blocks).context("creating the KV pool")?;
        pool.set_cache_budget(cache_bytes / pool.block_bytes());
        Ok(Target {
            model,
            pool,
            seqs: HashMap::new(),
            donor: None,
        })
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Starts a sequence for `prompt`, adopting the longest cached prefix of its first
    /// `reuse` ids; returns how many positions it already holds.
    ///
    /// # Errors
    /// A pool error (an invariant: the session is new).
    pub fn create(&mut self, session: SessionId, prompt: &[u32]) -> anyhow::Result<usize> {
        let seq = self.pool.create();
        self.seqs.insert(session, seq);
        Ok(self.pool.adopt_prefix(seq, prompt)?)
    }

    /// Positions of `prompt` the prefix index would give a new sequence now.
    pub fn cached(&self, prompt: &[u32]) -> usize {
        self.pool.cached_prefix(prompt)
    }

    /// Starts a sequence holding the first `len` positions of `from` (computed ones: full
    /// blocks shared, a partial last block copied); returns `len`.
    ///
    /// # Errors
    /// `from` unknown or shorter than `len`, or no block for the copy.
    pub fn fork(
        &mut self,
        session: SessionId,
        from: SessionId,
        len: usize,
    ) -> anyhow::Result<usize> {
        let seq = self.pool.fork(self.seq(from)?, len)?;
        self.seqs.insert(session, seq);
        Ok(len)
    }

    /// Frees a sequence's blocks at once; its full blocks stay findable by the prefix index
    /// until evicted.
    pub fn release(&mut self, session: SessionId) {
        if let Some(seq) = self.seqs.remove(&session) {
            let _ = self.pool.index_full_blocks(seq);
            let _ = self.pool.release(seq);
        }
    }

    /// Enters `session`'s full blocks into the prefix index (their K/V is written).
    pub fn index(&mut self, session: SessionId) {
        if let Some(&seq) = self.seqs.get(&session) {
            let _ = self.pool.index_full_blocks(seq);
        }
    }

    /// The prefix keys of `session`'s full blocks entered into the index so far.
    pub fn block_keys(&self, session: SessionId) -> Vec<BlockKey> {
        self.seqs
            .get(&session)
            .and_then(|&seq| self.pool.block_keys(seq).ok())
            .map_or_else(Vec::new, <[BlockKey]>::to_vec)
    }

    /// The pool's counters (blocks used and cached, prefix hits).
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Keeps the first `len` positions of `session`.
    ///
    /// # Errors
    /// `len` past the sequence's length.
    pub fn truncate(&mut self, session: SessionId, len: usize) -> anyhow::Result<()> {
        let seq = self.seq(session)?;
        self.pool.truncate(seq, len)?;
        Ok(())
    }

    /// Exports the donor slots `wants` reads in place (or moves them back when it reads none).
    fn sync_donors(&mut self, wants: &Wants) -> anyhow::Result<()> {
        let layers: Vec<(usize, u32)> = match wants.kv_views {
            // A layer's slot is its index: the donors are layers that own their K/V, which
            // come before any layer that shares an earlier one's.
            true => wants.kv_layers.iter().map(|&l| (l, l as u32)).collect(),
            false => Vec::new(),
        };
        self.pool
            .export_donors(&layers)
            .context("exporting the K/V donor layers")?;
        Ok(())
    }

    /// The donor region, handed out anew whenever the pool's changed.
    fn donor_region(&mut self) -> Option<Arc<DonorRegion>> {
        let id = self.pool.donor_region()?;
        if self.donor.as_ref().is_none_or(|d| d.id != id) {
            let (id, shm, layout) = self.pool.donor_share()?;
            self.donor = Some(Arc::new(DonorRegion { id, shm, layout }));
        }
        self.donor.clone()
    }

    /// `session`'s donor K/V of positions `0..len`, when the pool exports donors.
    fn donor_ref(&mut self, seq: SeqId, len: usize) -> anyhow::Result<Option<DonorRef>> {
        let Some(table) = self.pool.donor_table(seq, len)? else {
            return Ok(None);
        };
        Ok(self.donor_region().map(|region| DonorRef { region, table }))
    }

    /// Bytes the pool moved into bigger donor regions as it grew (host memory, never sent).
    pub fn donor_regrow_bytes(&self) -> u64 {
        self.pool.donor_regrow_bytes()
    }

    fn seq(&self, session: SessionId) -> anyhow::Result<SeqId> {
        self.seqs
            .get(&session)
            .copied()
            .with_context(|| format!("invariant: sequence {session} is in the pool"))
    }

    /// Runs every sequence's rows in one packed forward (see the module docs), tapping what
    /// `wants` names. Returns one output per entry of `work` and the forward's time (ms, the
    /// copy of the logits to the host included: the sync point of an asynchronous device).
    ///
    /// # Errors
    /// A failed forward (all or nothing: every sequence keeps its length before the call).
    pub fn forward(&mut self, work: &[Rows], wants: &Wants) -> anyhow::Result<(Vec<RowsOut>, f64)> {
        let started = Instant::now();
        self.sync_donors(wants)?;
        let tap_ids = tap_ids(wants);
        let seqs = work
            .iter()
            .map(|r| {
                Ok(SeqRows {
                    seq: self.seq(r.session)?,
                    tokens: r.tokens.clone(),
                    logits: Select::Last(r.logits),
                    taps: match r.taps && !tap_ids.is_empty() {
                        true => Select::All,
                        false => Select::Last(0),
                    },
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let starts: Vec<usize> = seqs
            .iter()
            .map(|s| self.pool.len(s.seq))
            .collect::<Result<_, _>>()?;
        let batch = Batch {
            seqs,
            taps: tap_ids,
        };
        let out = self
            .model
            .forward_batch(&batch, &mut self.pool)
            .context("target forward")?;
        let mut outs = Vec::with_capacity(work.len());
        for (i, (rows, &pos)) in work.iter().zip(&starts).enumerate() {
            let taps = match rows.taps && !wants.is_empty() {
                true => Some(self.collect_taps(&out, i, batch.seqs[i].seq, wants, pos)?),
                false => None,
            };
            outs.push(RowsOut {
                logits: out.logits_of(i)?,
                taps,
            });
        }
        Ok((outs, started.elapsed().as_secs_f64() * 1e3))
    }

    /// Sequence `i`'s taps of the batch output and its K/V rows at `pos..`, as plain vectors
    /// for the proposer.
    fn collect_taps(
        &mut self,
        out: &specula_models::BatchOutput,
        i: usize,
        seq: SeqId,
        wants: &Wants,
        pos: usize,
    ) -> anyhow::Result<TapRows> {
        let rows = out.tap_rows[i].len();
        let take = |id: TapId| -> anyhow::Result<Vec<f32>> {
            Ok(out.tap_of(id, i)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let layers = wants
            .tap_layers
            .iter()
            .map(|&l| take(TapId::Layer(l)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let final_hidden = match wants.final_hidden {
            true => Some(take(TapId::FinalNorm)?),
            false => None,
        };
        let donor = match wants.kv_views {
            true => self.donor_ref(seq, pos + rows)?,
            false => None,
        };
        let kv = match donor.is_some() {
            true => Vec::new(),
            false => wants
                .kv_layers
                .iter()
                .map(|&l| Ok(self.pool.read_rows(seq, l, pos..pos + rows)?))
                .collect::<anyhow::Result<Vec<_>>>()?,
        };
        Ok(TapRows {
            pos,
            rows,
            layers,
            final_hidden,
            kv,
            donor,
        })
    }

    /// The taps of `session`'s first positions `ids`, run from position 0 on a scratch
    /// sequence (a re-sync after a hot swap, when the engine did not keep them): bit-identical
    /// to the rows the sequence's own forwards produced, since a row depends only on its
    /// sequence's tokens. K/V read in place come from the session's own blocks.
    ///
    /// # Errors
    /// A failed forward.
    pub fn taps_of(
        &mut self,
        session: SessionId,
        ids: &[u32],
        wants: &Wants,
    ) -> anyhow::Result<TapRows> {
        if ids.is_empty() || wants.is_empty() {
            return Ok(TapRows::default());
        }
        self.sync_donors(wants)?;
        let donor = match wants.kv_views {
            true => {
                let seq = self.seq(session)?;
                self.donor_ref(seq, ids.len())?
            }
            false => None,
        };
        let mut cache = self.model.new_cache();
        let req = ForwardRequest {
            logits: Select::Last(0),
            taps: tap_ids(wants),
            tap_rows: Select::All,
        };
        let out = self.model.prefill(ids, &mut cache, &req)?;
        let find = |id: TapId| -> anyhow::Result<Vec<f32>> {
            let (_, t) = out
                .taps
                .iter()
                .find(|(t, _)| *t == id)
                .with_context(|| format!("tap {id:?} missing"))?;
            Ok(t.flatten_all()?.to_vec1::<f32>()?)
        };
        Ok(TapRows {
            pos: 0,
            rows: ids.len(),
            layers: wants
                .tap_layers
                .iter()
                .map(|&l| find(TapId::Layer(l)))
                .collect::<anyhow::Result<_>>()?,
            final_hidden: match wants.final_hidden {
                true => Some(find(TapId::FinalNorm)?),
                false => None,
            },
            kv: match donor.is_some() {
                true => Vec::new(),
                false => wants
                    .kv_layers
                    .iter()
                    .map(|&l| Ok(cache.rows(l, 0..ids.len())?))
                    .collect::<anyhow::Result<_>>()?,
            },
            donor,
        })
    }
}

fn tap_ids(wants: &Wants) -> Vec<TapId> {
    let mut ids: Vec<TapId> = wants.tap_layers.iter().map(|&l| TapId::Layer(l)).collect();
    if wants.final_hidden {
        ids.push(TapId::FinalNorm);
    }
    ids
}

/// Profiles forward time against rows (1, 2, 4, … `max_rows`) on a scratch sequence: the
/// controller's starting cost table. Each size is run twice, the faster kept. The result is
/// kept per weights file and device for the life of the process (a CLI or benchmark that
/// runs many batches of one profiles once).
///
/// # Errors
/// A failed forward.
pub fn profile(model: &Model, max_rows: usize) -> anyhow::Result<Vec<(usize, f64)>> {
    type Key = (std::path::PathBuf, String, usize);
    type Profiles = Vec<(Key, Vec<(usize, f64)>)>;
    static DONE: std::sync::Mutex<Profiles> = std::sync::Mutex::new(Vec::new());
    let key = (
        model.weights_path().to_path_buf(),
        format!("{:?}", model.device().location()),
        max_rows,
    );
    let cached = |done: &Profiles| done.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone());
    if let Some(points) = cached(&DONE.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(points);
    }
    let points = measure(model, max_rows)?;
    DONE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key, points.clone()));
    Ok(points)
}

fn measure(model: &Model, max_rows: usize) -> anyhow::Result<Vec<(usize, f64)>> {
    let mut cache = model.new_cache();
    let mut points = Vec::new();
    let mut rows = 1;
    // Some context first, so attention is not measured over nothing.
    let warm: Vec<u32> = (0..32u32).collect();
    model.forward(&warm, &mut cache, &ForwardRequest::default())?;
    while rows <= max_rows.max(1) {
        let ids: Vec<u32> = (0..rows as u32).map(|i| i % 64).collect();
        let req = ForwardRequest {
            logits: Select::Last(rows),
            ..ForwardRequest::default()
        };
        let mut best = f64::MAX;
        for _ in 0..2 {
            let t = Instant::now();
            let out = model.forward(&ids, &mut cache, &req)?;
            drop(out.logits.to_device(&candle_core::Device::Cpu)?);
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
            cache.truncate(warm.len())?;
        }
        points.push((rows, best));
        rows *= 2;
    }
    Ok(points)
}
