//! A single sequence's KV cache: a [`KvPool`] of its own holding one sequence, for callers that
//! run one sequence at a time ([`crate::Model::forward`] / [`crate::Model::prefill`]: the
//! two-model drafter, tests, tools). It is the packed forward's pool and kernel underneath, so a
//! row computed through a `KvCache` is bit-identical to the same row in any batch.
//!
//! The arena grows with the sequence (up to the model's context); rollback of rejected drafts is
//! [`KvCache::truncate`] / [`KvCache::trim`], a length change.

use crate::error::{Error, Result};
use crate::kv_pool::{KvLayout, KvPool, SeqId, BLOCK_SIZE};

/// Per-layer K/V of one sequence. Created by [`crate::Model::new_cache`].
#[derive(Clone, Debug)]
pub struct KvCache {
    pool: KvPool,
    seq: SeqId,
    max_len: usize,
}

impl KvCache {
    /// An empty cache for blocks of `layout`, holding at most `max_len` positions.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an invalid layout or `max_len` 0.
    pub fn new(layout: KvLayout, max_len: usize) -> Result<Self> {
        let mut pool = KvPool::new(layout, max_len.div_ceil(BLOCK_SIZE))?;
        let seq = pool.create();
        Ok(Self { pool, seq, max_len })
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.pool
            .len(self.seq)
            .expect("invariant: the cache's sequence is live")
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of stored K/V layers (slots).
    pub fn num_slots(&self) -> usize {
        self.pool.layout().slots.len()
    }

    /// Maximum number of positions (the model's context length).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The pool and the sequence underneath (read-only, e.g. for K/V views).
    pub fn pool(&self) -> (&KvPool, SeqId) {
        (&self.pool, self.seq)
    }

    pub(crate) fn pool_mut(&mut self) -> (&mut KvPool, SeqId) {
        (&mut self.pool, self.seq)
    }

    /// K and V of positions `range` in slot `slot`, as `[rows, kv_heads, head_dim]` copies.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown slot or a range past the length.
    pub fn rows(&self, slot: usize, range: std::ops::Range<usize>) -> Result<(Vec<f32>, Vec<f32>)> {
        self.pool.read_rows(self.seq, slot, range)
    }

    /// Keeps the first `keep_len` positions.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `keep_len > len()`.
    pub fn truncate(&mut self, keep_len: usize) -> Result<()> {
        self.pool.truncate(self.seq, keep_len)
    }

    /// Rolls back the last `n` positions (e.g. rejected draft tokens).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `n > len()`.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        let len = self.len();
        if n > len {
            return Err(Error::InvalidRequest {
                op: "KvCache::trim",
                reason: format!("cannot roll back {n} positions, the cache holds {len}"),
            });
        }
        self.truncate(len - n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_trim_and_rows() {
        let mut c = KvCache::new(KvLayout::uniform(2, 2, 4), 100).unwrap();
        assert!(c.is_empty());
        let (pool, seq) = c.pool_mut();
        pool.append(seq, &[1, 2, 3]).unwrap();
        for p in 0..3 {
            let (b, off) = pool.locate(seq, p).unwrap();
            let k: Vec<f32> = (0..8).map(|i| (p * 10 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            pool.write(1, b, off, &k, &v);
        }
        let (k, v) = c.rows(1, 1..3).unwrap();
        assert_eq!(k[..8], (10..18).map(|x| x as f32).collect::<Vec<_>>()[..]);
        assert_eq!(v[8], -20.0);
        c.trim(1).unwrap();
        assert_eq!(c.len(), 2);
        assert!(c.rows(1, 1..3).is_err(), "rolled-back rows are gone");
        assert!(c.trim(3).is_err());
        assert!(c.truncate(3).is_err());
        c.truncate(0).unwrap();
        assert!(c.is_empty());
        assert_eq!(c.num_slots(), 2);
    }
}
