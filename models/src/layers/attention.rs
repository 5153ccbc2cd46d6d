//! Grouped-query self-attention over `[cache ++ chunk]` with a causal mask for the chunk rows.
//!
//! Query heads are grouped by the KV head they share, so K/V are never repeated:
//!
//! ```text
//!  q  [n_heads, seq, d] ──reshape──> [kv_heads, groups*seq, d]     (head h = kv*groups + g)
//!  k  [kv_heads, total, d]   (cache view, total = cache_len + seq)
//!  scores = q k^T / sqrt(d)  [kv_heads, groups*seq, total]
//!
//!  mask for the chunk rows (row i is at position cache_len + i):
//!             cache_len columns      seq columns
//!  row 0    [ 0 0 ... 0            | 0 -inf -inf ]
//!  row 1    [ 0 0 ... 0            | 0  0   -inf ]
//!  row 2    [ 0 0 ... 0            | 0  0    0   ]
//! ```
//!
//! On the CPU, verify windows (up to `ROW_WISE_MAX_ROWS` rows) attend row by row so that
//! they are bit-identical to one-token decode steps. On a GPU that would be a kernel launch
//! storm per layer, so every chunk there takes one masked product: bit-identity across chunk
//! sizes is a CPU guarantee, and on a GPU greedy speculative output equals plain output except
//! where two logits are within rounding of each other (as in every GPU server).

use candle_core::{Device, Tensor};

mod row_wise;

use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, Rope};

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

/// Chunks up to this many rows (verify windows) attend row by row; longer ones (prefill) use
/// one masked product.
const ROW_WISE_MAX_ROWS: usize = 16;

/// The additive causal mask `[seq, cache_len + seq]` for a chunk of `seq` rows after
/// `cache_len` cached positions, or `None` when a single row needs no mask.
///
/// # Errors
/// If the tensor cannot be allocated.
pub fn causal_mask(cache_len: usize, seq: usize, device: &Device) -> Result<Option<Tensor>> {
    if seq <= 1 {
        return Ok(None);
    }
    let total = cache_len + seq;
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| {
            (0..total).map(move |j| match j > cache_len + i {
                true => f32::NEG_INFINITY,
                false => 0.0,
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(mask, (seq, total), device)?))
}

impl Attention {
    /// Splits `[seq, heads * head_dim]` into `[heads, seq, head_dim]` (contiguous), with the
    /// optional per-head norm.
    fn heads(&self, xs: &Tensor, heads: usize, norm: Option<&RmsNorm>) -> Result<Tensor> {
        let seq = xs.dim(0)?;
        let xs = xs.reshape((seq, heads, self.head_dim))?;
        let xs = match norm {
            Some(n) => n.forward(&xs)?,
            None => xs,
        };
        Ok(xs.transpose(0, 1)?.contiguous()?)
    }

    /// Attends the chunk `xs` (`[seq, hidden]` f32, positions `cache.len()..`) to the cache
    /// and itself; appends the chunk's K/V to layer `layer` of `cache`.
    ///
    /// # Errors
    /// On shape mismatches or a full cache.
    pub fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
        layer: usize,
    ) -> Result<Tensor> {
        let seq = xs.dim(0)?;
        let pos = cache.layer_len(layer);
        let q = self.heads(
            &self.q_proj.forward(xs)?,
            self.n_heads,
            self.q_norm.as_ref(),
        )?;
        let k = self.heads(
            &self.k_proj.forward(xs)?,
            self.kv_heads,
            self.k_norm.as_ref(),
        )?;
        let v = self.heads(&self.v_proj.forward(xs)?, self.kv_heads, None)?;
        let q = rope.apply(&q, pos)?;
        let k = rope.apply(&k, pos)?;
        let (k, v) = cache.append(layer, &k, &v)?;
        // CPU decode steps and verify windows over an f32 cache share one kernel whose rows
        // never depend on the chunk size (see `row_wise`); other dtypes fall through.
        let cpu_rows = match seq <= ROW_WISE_MAX_ROWS && xs.device().is_cpu() {
            true => row_wise::attend(&q, &k, &v, pos)?,
            false => None,
        };
        let out = if let Some(out) = cpu_rows {
            out
        } else if seq > 1 && seq <= ROW_WISE_MAX_ROWS && xs.device().is_cpu() {
            // Verify windows attend row by row, each with exactly the shapes of a one-token
            // decode step, so a verified token's logits are bit-identical to plain decoding's:
            // quantized activations would amplify a different summation order into visibly
            // different logits, and speculation must never change the output.
            let rows = (0..seq)
                .map(|i| {
                    let len = pos + i + 1;
                    self.attend(
                        &q.narrow(1, i, 1)?,
                        &k.narrow(1, 0, len)?,
                        &v.narrow(1, 0, len)?,
                        None,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&rows, 0)?
        } else {
            self.attend(&q, &k, &v, mask)?
        };
        self.o_proj.forward(&out)
    }

    /// Softmax attention of `q` `[n_heads, seq, d]` over `k`, `v` `[kv_heads, total, d]`
    /// (with an additive `mask` `[seq, total]`), returning `[seq, n_heads * d]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let seq = q.dim(1)?;
        let total = k.dim(1)?;
        let groups = self.n_heads / self.kv_heads;
        let q = q.reshape((self.kv_heads, groups * seq, self.head_dim))?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        // PyTorch: attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = match mask {
            Some(m) => scores
                .reshape((self.kv_heads, groups, seq, total))?
                .broadcast_add(m)?
                .reshape((self.kv_heads, groups * seq, total))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(v)?; // [kv_heads, groups*seq, d]
        Ok(out
            .reshape((self.n_heads, seq, self.head_dim))?
            .transpose(0, 1)?
            .reshape((seq, self.n_heads * self.head_dim))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_is_causal_for_chunk_rows() {
        let m = causal_mask(2, 3, &Device::Cpu).unwrap().unwrap();
        let m: Vec<Vec<f32>> = m.to_vec2().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(
            m,
            vec![
                vec![0., 0., 0., inf, inf],
                vec![0., 0., 0., 0., inf],
                vec![0., 0., 0., 0., 0.],
            ]
        );
        assert!(causal_mask(7, 1, &Device::Cpu).unwrap().is_none());
    }
}
