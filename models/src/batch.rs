//! The packed forward's request and result: the rows of several sequences in one forward
//! ([`crate::Model::forward_batch`]), each sequence saying which of its rows want logits and
//! which want taps.
//!
//! ```text
//!  Batch { seqs: [A: tokens a0 a1 a2 (logits Last(3)), B: tokens b0 (logits Last(1))], taps }
//!  packed rows:      a0 a1 a2 b0          T = 4, one [T, hidden] matmul per projection
//!  positions:        40 41 42  7          each sequence continues at its pool length
//!  logits [4, vocab] rows a0 a1 a2 b0     logit_rows = [0..3, 3..4]
//! ```
//!
//! Positions are not passed: a sequence's rows always continue its K/V in the pool, so a row
//! cannot claim a position its sequence does not have.

use std::ops::Range;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kv_pool::SeqId;
use crate::model::TapId;

/// Rows of one sequence's tokens in a forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rows {
    /// The last `n` rows (`Last(0)`: none).
    Last(usize),
    /// Every row.
    All,
    /// These rows (indices into the sequence's tokens of this forward), ascending, distinct.
    Only(Vec<usize>),
}

impl Default for Rows {
    /// The last row (next-token logits).
    fn default() -> Self {
        Rows::Last(1)
    }
}

impl Rows {
    /// The row indices among `n` rows.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for rows past `n`, or indices not ascending and distinct.
    pub fn resolve(&self, n: usize) -> Result<Vec<usize>> {
        let bad = |reason: String| {
            Err(Error::InvalidRequest {
                op: "forward",
                reason,
            })
        };
        match self {
            Rows::Last(k) if *k > n => bad(format!("{k} last rows of a call of {n} tokens")),
            Rows::Last(k) => Ok((n - k..n).collect()),
            Rows::All => Ok((0..n).collect()),
            Rows::Only(rows) => {
                if let Some(&r) = rows.iter().find(|&&r| r >= n) {
                    return bad(format!("row {r} of a call of {n} tokens"));
                }
                if rows.windows(2).any(|w| w[0] >= w[1]) {
                    return bad(format!("rows {rows:?} are not ascending and distinct"));
                }
                Ok(rows.clone())
            }
        }
    }
}

/// One sequence's part of a [`Batch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqRows {
    /// The sequence (its K/V so far is in the pool; these tokens continue it).
    pub seq: SeqId,
    /// Tokens to run, at positions `pool.len(seq)..`.
    pub tokens: Vec<u32>,
    /// Rows that get logits.
    pub logits: Rows,
    /// Rows that get the batch's taps.
    pub taps: Rows,
}

/// One packed forward over several sequences (each at most once).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The sequences, in the order their rows are packed.
    pub seqs: Vec<SeqRows>,
    /// Hidden states to return for the tap rows of every sequence.
    pub taps: Vec<TapId>,
}

/// What a [`Batch`] returns.
#[derive(Clone, Debug)]
pub struct BatchOutput {
    /// `[L, vocab]` f32: the logit rows of every sequence, in batch order.
    pub logits: Tensor,
    /// Per sequence, its rows of `logits`.
    pub logit_rows: Vec<Range<usize>>,
    /// One `[R, hidden]` f32 tensor per requested tap, in request order.
    pub taps: Vec<(TapId, Tensor)>,
    /// Per sequence, its rows of every tap tensor.
    pub tap_rows: Vec<Range<usize>>,
}

impl BatchOutput {
    /// The logits `[rows, vocab]` of sequence `i` of the batch.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for `i` past the batch.
    pub fn logits_of(&self, i: usize) -> Result<Tensor> {
        let r = self.logit_rows.get(i).ok_or_else(|| out_of_batch(i))?;
        Ok(self.logits.narrow(0, r.start, r.len())?)
    }

    /// Tap `tap` `[rows, hidden]` of sequence `i` of the batch.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for `i` past the batch or a tap not requested.
    pub fn tap_of(&self, tap: TapId, i: usize) -> Result<Tensor> {
        let r = self.tap_rows.get(i).ok_or_else(|| out_of_batch(i))?;
        let (_, t) =
            self.taps
                .iter()
                .find(|(id, _)| *id == tap)
                .ok_or_else(|| Error::InvalidRequest {
                    op: "BatchOutput::tap_of",
                    reason: format!("tap {tap:?} was not requested"),
                })?;
        Ok(t.narrow(0, r.start, r.len())?)
    }
}

fn out_of_batch(i: usize) -> Error {
    Error::InvalidRequest {
        op: "BatchOutput",
        reason: format!("sequence {i} is not in the batch"),
    }
}
