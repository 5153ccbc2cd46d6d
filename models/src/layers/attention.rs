//! Grouped-query self-attention of one block over the packed batch: q/k/v projections of all
//! rows at once, rope at each row's own position, K/V written into the [`KvPool`], then the one
//! attention [`kernel`] per (sequence, KV head) against that sequence's blocks.
//!
//! ```text
//!  xs [T, hidden] (rows of every sequence, packed)      spans: seq A rows 0..3 at pos 40,
//!   ├─ q_proj ─> q [T][n_heads][d]   rope(positions)           seq B rows 3..4 at pos 7
//!   ├─ k_proj ─> k [T][kv_heads][d]  rope(positions) ─┐
//!   └─ v_proj ─> v [T][kv_heads][d] ──────────────────┴─> pool.write(slot, block, offset)
//!  kernel::attend(q, spans, pool) ─> [T][n_heads][d] ─ o_proj ─> [T, hidden]
//! ```
//!
//! The kernel runs on the host over the host pool whatever the model's device: on a GPU the
//! projections stay on the device and q/k/v cross to the host once per layer. That keeps one
//! code path (and the batch-invariance guarantee) everywhere; a device pool with its own kernel
//! is the GPU issue's work.

use candle_core::Tensor;

pub mod kernel;

use crate::error::Result;
use crate::kv_pool::{BlockId, KvPool};
use crate::layers::{Linear, RmsNorm, Rope};

pub use kernel::Span;

/// Self-attention of one block (`LlamaAttention` / `Qwen2Attention` / `Qwen3Attention`).
#[derive(Clone, Debug)]
pub struct Attention {
    /// `q_proj` `[n_heads * head_dim, hidden]`.
    pub q_proj: Linear,
    /// `k_proj` `[kv_heads * head_dim, hidden]`.
    pub k_proj: Linear,
    /// `v_proj` `[kv_heads * head_dim, hidden]`.
    pub v_proj: Linear,
    /// `o_proj` `[hidden, n_heads * head_dim]`.
    pub o_proj: Linear,
    /// Per-head RMS norm of q before rope (qwen3).
    pub q_norm: Option<RmsNorm>,
    /// Per-head RMS norm of k before rope (qwen3).
    pub k_norm: Option<RmsNorm>,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// The packed batch as attention sees it: where each sequence's rows are and where each row's
/// K/V goes.
#[derive(Clone, Debug)]
pub struct AttnBatch {
    /// One span per sequence, rows in batch order.
    pub spans: Vec<Span>,
    /// Position of every row.
    pub positions: Vec<usize>,
    /// `(block, offset)` every row's K/V is written to.
    pub targets: Vec<(BlockId, usize)>,
    /// Token id of every row (Gemma 4's per-layer embeddings look them up in every layer).
    pub ids: Vec<u32>,
}

/// Which stored K/V a layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSlot {
    /// The layer computes K/V and stores them in this slot.
    Own(usize),
    /// The layer reads the slot of an earlier layer and computes no K/V (Gemma KV sharing).
    Shared(usize),
}

/// Projected rows `ys` `[T, heads * head_dim]` as host values, with the optional per-head norm
/// (over `[T, heads, head_dim]`).
///
/// # Errors
/// On a shape mismatch.
pub(crate) fn host_heads(
    ys: &Tensor,
    heads: usize,
    head_dim: usize,
    norm: Option<&RmsNorm>,
) -> Result<Vec<f32>> {
    let t = ys.dim(0)?;
    let ys = match norm {
        Some(n) => n.forward(&ys.reshape((t, heads, head_dim))?)?,
        None => ys.clone(),
    };
    Ok(ys.flatten_all()?.to_vec1::<f32>()?)
}

/// Writes row `r`'s K and V (`[T, kv_heads * head_dim]` host values) to its target position
/// `batch.targets[r]` in `slot`.
pub(crate) fn write_rows(pool: &mut KvPool, slot: usize, batch: &AttnBatch, k: &[f32], v: &[f32]) {
    let w = k.len() / batch.targets.len().max(1);
    for (r, &(block, offset)) in batch.targets.iter().enumerate() {
        pool.write(
            slot,
            block,
            offset,
            &k[r * w..(r + 1) * w],
            &v[r * w..(r + 1) * w],
        );
    }
}

impl Attention {
    /// Attends the rows `xs` (`[T, hidden]` f32) of `batch` to their sequences' K/V in `pool`
    /// (after writing theirs, for [`KvSlot::Own`]), over the last `window` positions of each
    /// row when set.
    ///
    /// # Errors
    /// On shape mismatches or a position past the rope table.
    pub fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        batch: &AttnBatch,
        pool: &mut KvPool,
        kv: KvSlot,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let t = xs.dim(0)?;
        let d = self.head_dim;
        // q, k and v share their input: one pass of the quantized kernels for the three.
        let proj = match kv {
            KvSlot::Own(_) => {
                Linear::forward_many(&[&self.q_proj, &self.k_proj, &self.v_proj], xs)?
            }
            KvSlot::Shared(_) => vec![self.q_proj.forward(xs)?],
        };
        let mut q = host_heads(&proj[0], self.n_heads, d, self.q_norm.as_ref())?;
        rope.apply(&mut q, self.n_heads, &batch.positions)?;
        let slot = match kv {
            KvSlot::Own(slot) => {
                let mut k = host_heads(&proj[1], self.kv_heads, d, self.k_norm.as_ref())?;
                rope.apply(&mut k, self.kv_heads, &batch.positions)?;
                let v = host_heads(&proj[2], self.kv_heads, d, None)?;
                write_rows(pool, slot, batch, &k, &v);
                slot
            }
            KvSlot::Shared(slot) => slot,
        };
        let shape = kernel::Shape {
            n_heads: self.n_heads,
            kv_heads: self.kv_heads,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            window,
        };
        let out = kernel::attend(&q, &batch.spans, pool, slot, shape);
        let out = Tensor::from_vec(out, (t, self.n_heads * d), xs.device())?;
        self.o_proj.forward(&out)
    }
}
