//! The target side of a step: the sequences' K/V and one forward over the rows every sequence
//! contributes.
//!
//! ```text
//!   work:   seq A [pending d1 d2]   seq B [pending]   seq C [c0 c1 ... c31]  (prefill chunk)
//!   rows:   logits for every row of A and B, the last row of C when it ends the prompt;
//!           taps (when the drafter wants any) for every row.
//! ```
//!
//! Each sequence's rows run at positions `len(seq)..` of its own K/V; a row's logits, taps and
//! K/V depend only on its sequence, never on what else is in the step (the law under batching).
//! [`Target::truncate`] rolls a sequence back after verification (rejected drafts).

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Context;
use candle_core::{IndexOp, Tensor};
use specula_models::{ForwardOutput, ForwardRequest, KvCache, Model, TapId};

use crate::proposer::{SessionId, TapRows, Wants};

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
    caches: HashMap<SessionId, KvCache>,
}

impl<'m> Target<'m> {
    /// No sequences yet.
    pub fn new(model: &'m Model) -> Self {
        Target {
            model,
            caches: HashMap::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Starts an empty sequence.
    pub fn create(&mut self, session: SessionId) {
        self.caches.insert(session, self.model.new_cache());
    }

    /// Frees a sequence's K/V at once.
    pub fn release(&mut self, session: SessionId) {
        self.caches.remove(&session);
    }

    /// Positions held by `session`.
    pub fn len(&self, session: SessionId) -> usize {
        self.caches.get(&session).map_or(0, KvCache::len)
    }

    /// Positions held by all sequences.
    pub fn used(&self) -> usize {
        self.caches.values().map(KvCache::len).sum()
    }

    /// Keeps the first `len` positions of `session`.
    ///
    /// # Errors
    /// `len` past the sequence's length.
    pub fn truncate(&mut self, session: SessionId, len: usize) -> anyhow::Result<()> {
        let cache = self.cache(session)?;
        cache.truncate(len)?;
        Ok(())
    }

    fn cache(&mut self, session: SessionId) -> anyhow::Result<&mut KvCache> {
        self.caches
            .get_mut(&session)
            .with_context(|| format!("invariant: sequence {session} has a KV cache"))
    }

    /// Runs every sequence's rows (see the module docs), tapping what `wants` names. Returns
    /// one output per entry of `work` and the forward's time.
    ///
    /// # Errors
    /// A failed forward (the sequences' K/V are rolled back to their lengths before the call).
    pub fn forward(&mut self, work: &[Rows], wants: &Wants) -> anyhow::Result<(Vec<RowsOut>, f64)> {
        let started = Instant::now();
        let model = self.model;
        let tap_ids = tap_ids(wants);
        let mut outs = Vec::with_capacity(work.len());
        for rows in work {
            let cache = self.cache(rows.session)?;
            let pos = cache.len();
            let want_taps = rows.taps && !wants.is_empty();
            let req = ForwardRequest {
                last_k: rows.logits,
                taps: if want_taps {
                    tap_ids.clone()
                } else {
                    Vec::new()
                },
                taps_all_positions: true,
            };
            let out = model
                .forward(&rows.tokens, cache, &req)
                .with_context(|| format!("target forward of sequence {}", rows.session))?;
            let taps = match want_taps {
                true => Some(collect_taps(&out, cache, wants, pos, rows.tokens.len())?),
                false => None,
            };
            outs.push(RowsOut {
                logits: out.logits,
                taps,
            });
        }
        Ok((outs, started.elapsed().as_secs_f64() * 1e3))
    }
}

impl Target<'_> {
    /// The taps of `ids` run from position 0 on a scratch sequence (a re-sync after a hot
    /// swap, when the engine did not keep them). Rows are bit-identical to the ones the
    /// sequence's own forwards produced: a row depends only on its sequence's tokens.
    ///
    /// # Errors
    /// A failed forward.
    pub fn taps_of(&self, ids: &[u32], wants: &Wants) -> anyhow::Result<TapRows> {
        if ids.is_empty() || wants.is_empty() {
            return Ok(TapRows::default());
        }
        let mut cache = self.model.new_cache();
        let req = ForwardRequest {
            last_k: 0,
            taps: tap_ids(wants),
            taps_all_positions: true,
        };
        let out = self.model.prefill(ids, &mut cache, &req)?;
        collect_taps(&out, &cache, wants, 0, ids.len())
    }
}

fn tap_ids(wants: &Wants) -> Vec<TapId> {
    let mut ids: Vec<TapId> = wants.tap_layers.iter().map(|&l| TapId::Layer(l)).collect();
    if wants.final_hidden {
        ids.push(TapId::FinalNorm);
    }
    ids
}

/// Copies the forward's taps and the K/V rows at `pos..pos + rows` into plain vectors for the
/// proposer.
fn collect_taps(
    out: &ForwardOutput,
    cache: &KvCache,
    wants: &Wants,
    pos: usize,
    rows: usize,
) -> anyhow::Result<TapRows> {
    let take = |t: &Tensor| -> anyhow::Result<Vec<f32>> {
        Ok(t.i(..rows)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let find = |id: TapId| out.taps.iter().find(|(t, _)| *t == id).map(|(_, x)| x);
    let mut layers = Vec::with_capacity(wants.tap_layers.len());
    for &l in &wants.tap_layers {
        let t = find(TapId::Layer(l)).with_context(|| format!("tap of layer {l} missing"))?;
        layers.push(take(t)?);
    }
    let final_hidden = match find(TapId::FinalNorm) {
        Some(t) if wants.final_hidden => Some(take(t)?),
        _ => None,
    };
    let mut kv = Vec::with_capacity(wants.kv_layers.len());
    for &l in &wants.kv_layers {
        let (k, v) = cache.layer(l);
        // [kv_heads, len, head_dim] → rows × kv_heads × head_dim
        let rows_of = |t: Tensor| -> anyhow::Result<Vec<f32>> {
            Ok(t.narrow(1, pos, rows)?
                .transpose(0, 1)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        kv.push((rows_of(k)?, rows_of(v)?));
    }
    Ok(TapRows {
        pos,
        rows,
        layers,
        final_hidden,
        kv,
    })
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
    let req = ForwardRequest::default();
    let mut points = Vec::new();
    let mut rows = 1;
    // Some context first, so attention is not measured over nothing.
    let warm: Vec<u32> = (0..32u32).collect();
    model.forward(&warm, &mut cache, &req)?;
    while rows <= max_rows.max(1) {
        let ids: Vec<u32> = (0..rows as u32).map(|i| i % 64).collect();
        let mut best = f64::MAX;
        for _ in 0..2 {
            let t = Instant::now();
            let out = model.forward(
                &ids,
                &mut cache,
                &ForwardRequest {
                    last_k: rows,
                    ..req.clone()
                },
            )?;
            // The copy to the host is the sync point of an asynchronous device.
            drop(out.logits.to_device(&candle_core::Device::Cpu)?);
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
            cache.truncate(warm.len())?;
        }
        points.push((rows, best));
        rows *= 2;
    }
    Ok(points)
}
