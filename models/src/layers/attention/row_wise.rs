//! CPU attention for decode steps and verify windows (f32 K/V): one kernel over all rows of
//! the chunk, each row attending to exactly the prefix a decode step at its position would see.
//!
//! Row `i` of a chunk at cache position `pos` reads K/V rows `0..pos + i + 1` and nothing else,
//! with the same instructions whatever the chunk size, so a verify row is bit-identical to the
//! one-token decode step at that position (the law: speculation never changes the output). It
//! replaces per-row candle matmuls, which cost tensor allocations and a thread-count lookup per
//! call (candle reads `/proc/cpuinfo` for every f32 matmul).
//!
//! ```text
//!  q   [n_heads, seq, d]        K, V  [kv_heads, capacity, d]   (cache views, rows 0..total)
//!  for each (row i, head h) in parallel:            kv = h / (n_heads / kv_heads)
//!    s[t] = (q[h, i] . K[kv, t]) / sqrt(d)          t < pos + i + 1
//!    p = exp(s - max s);  out[i, h] = (Σ_t p[t] V[kv, t]) / Σ_t p[t]
//! ```

use std::cell::RefCell;

use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// What every (row, head) of one call reads: the shapes and the q, K, V data.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    groups: usize,
    seq: usize,
    d: usize,
    pos: usize,
    /// Elements between two KV heads in the cache buffers.
    head_stride: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

thread_local! {
    /// Attention scores of one (row, head), reused across calls.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attends `q` `[n_heads, seq, head_dim]` (row `i` at position `pos + i`) to the cache views
/// `k`, `v` `[kv_heads, pos + seq, head_dim]`, returning `[seq, n_heads * head_dim]`; `None`
/// when the tensors are not f32 on the CPU (the caller then uses candle's ops).
///
/// # Errors
/// On inconsistent shapes.
pub(super) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> Result<Option<Tensor>> {
    let f32_cpu = |t: &Tensor| t.dtype() == DType::F32 && t.device().is_cpu();
    if !(f32_cpu(q) && f32_cpu(k) && f32_cpu(v)) {
        return Ok(None);
    }
    let (n_heads, seq, d) = q.dims3()?;
    let (kv_heads, total, kd) = k.dims3()?;
    if v.dims3()? != (kv_heads, total, kd)
        || kd != d
        || total != pos + seq
        || n_heads % kv_heads != 0
    {
        return Err(crate::error::Error::InvalidRequest {
            op: "attention",
            reason: format!(
                "q {:?} with k {:?}, v {:?} at position {pos}",
                q.dims(),
                k.dims(),
                v.dims()
            ),
        });
    }
    let q: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(kc), Storage::Cpu(vc)) = (&*ks, &*vs) else {
        return Ok(None);
    };
    // The cache views are `narrow`s of [kv_heads, capacity, d] buffers: rows contiguous,
    // heads `stride[0]` apart, and K and V share that layout.
    let (kst, vst) = (kl.stride(), vl.stride());
    if kst != vst || kst[1] != d || kst[2] != 1 {
        return Ok(None);
    }
    let inputs = Inputs {
        groups: n_heads / kv_heads,
        seq,
        d,
        pos,
        head_stride: kst[0],
        q: &q,
        k: &kc.as_slice::<f32>()?[kl.start_offset()..],
        v: &vc.as_slice::<f32>()?[vl.start_offset()..],
    };
    let mut out = vec![0f32; seq * n_heads * d];
    // Chunk `c` is (row c / n_heads, head c % n_heads): out is [seq, n_heads * d] row-major.
    out.par_chunks_mut(d).enumerate().for_each(|(c, out)| {
        let (i, h) = (c / n_heads, c % n_heads);
        SCORES.with(|s| head_row(inputs, i, h, &mut s.borrow_mut(), out));
    });
    Ok(Some(Tensor::from_vec(
        out,
        (seq, n_heads * d),
        &Device::Cpu,
    )?))
}

/// Row `i`, head `h`: softmax(q K^T / sqrt(d)) V over positions `0..pos + i + 1`.
fn head_row(inputs: Inputs, i: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { head_row_avx2(inputs, i, h, scores, out) };
    }
    head_row_body(inputs, i, h, scores, out)
}

/// [`head_row_body`] compiled for AVX2 so its fixed-width loops vectorize.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_row_avx2(
    inputs: Inputs,
    i: usize,
    h: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    head_row_body(inputs, i, h, scores, out)
}

#[inline(always)]
fn head_row_body(inputs: Inputs, i: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    let Inputs { d, q, k, v, .. } = inputs;
    let len = inputs.pos + i + 1;
    let base = (h / inputs.groups) * inputs.head_stride;
    let qv = &q[(h * inputs.seq + i) * d..(h * inputs.seq + i + 1) * d];
    let scale = 1.0 / (d as f32).sqrt();
    scores.resize(len, 0.0);
    // PyTorch: attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
    for (t, s) in scores.iter_mut().enumerate() {
        *s = dot(qv, &k[base + t * d..base + (t + 1) * d]) * scale;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        let vt = &v[base + t * d..base + (t + 1) * d];
        for (o, &x) in out.iter_mut().zip(vt) {
            *o += p * x;
        }
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// `a . b` in eight interleaved partial sums (a fixed order the compiler can vectorize).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = (a8.remainder().iter().zip(b8.remainder()))
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(shape: (usize, usize, usize), seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = shape.0 * shape.1 * shape.2;
        let data: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// The candle formulation (masked softmax over full products) for one chunk.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, pos: usize) -> Tensor {
        let (n_heads, seq, d) = q.dims3().unwrap();
        let kv_heads = k.dim(0).unwrap();
        let groups = n_heads / kv_heads;
        let rows: Vec<Tensor> = (0..n_heads)
            .map(|h| {
                let (kh, vh) = (k.get(h / groups).unwrap(), v.get(h / groups).unwrap());
                let s = (q.get(h).unwrap().matmul(&kh.t().unwrap()).unwrap() / (d as f64).sqrt())
                    .unwrap();
                let mask = crate::layers::attention::causal_mask(pos, seq, &Device::Cpu)
                    .unwrap()
                    .unwrap_or_else(|| {
                        Tensor::zeros((1, pos + 1), DType::F32, &Device::Cpu).unwrap()
                    });
                let p = candle_nn::ops::softmax_last_dim(&s.broadcast_add(&mask).unwrap()).unwrap();
                p.matmul(&vh).unwrap() // [seq, d]
            })
            .collect();
        Tensor::stack(&rows, 1)
            .unwrap()
            .reshape((seq, n_heads * d))
            .unwrap()
    }

    /// Matches the masked-softmax formulation, and row i of a chunk equals a one-row call at
    /// position pos + i bit for bit, over a cache view narrower than its buffer.
    #[test]
    fn rows_match_reference_and_decode_steps() {
        let (n_heads, kv_heads, d, pos, seq, cap) = (6, 2, 64, 37, 5, 64);
        let q = randn((n_heads, seq, d), 1);
        let buf_k = randn((kv_heads, cap, d), 2);
        let buf_v = randn((kv_heads, cap, d), 3);
        let (k, v) = (
            buf_k.narrow(1, 0, pos + seq).unwrap(),
            buf_v.narrow(1, 0, pos + seq).unwrap(),
        );
        let ours = attend(&q, &k, &v, pos).unwrap().unwrap();
        let theirs = reference(&q, &k.contiguous().unwrap(), &v.contiguous().unwrap(), pos);
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5, "{diff}");
        let ours: Vec<Vec<f32>> = ours.to_vec2().unwrap();
        for (i, row) in ours.iter().enumerate() {
            let step = attend(
                &q.narrow(1, i, 1).unwrap(),
                &buf_k.narrow(1, 0, pos + i + 1).unwrap(),
                &buf_v.narrow(1, 0, pos + i + 1).unwrap(),
                pos + i,
            )
            .unwrap()
            .unwrap();
            let step: Vec<f32> = step.flatten_all().unwrap().to_vec1().unwrap();
            let same = row
                .iter()
                .zip(&step)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "row {i} of the chunk differs from the decode step");
        }
    }

    #[test]
    fn rejects_mismatched_shapes_and_skips_other_dtypes() {
        let q = randn((4, 2, 8), 4);
        let k = randn((2, 5, 8), 5);
        assert!(attend(&q, &k, &k, 2).is_err(), "total must be pos + seq");
        let half = q.to_dtype(DType::F16).unwrap();
        let (kh, vh) = (
            k.to_dtype(DType::F16).unwrap(),
            k.to_dtype(DType::F16).unwrap(),
        );
        assert!(attend(&half, &kh, &vh, 3).unwrap().is_none());
    }
}
