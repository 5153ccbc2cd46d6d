//! Attention for a drafter's own small K/V cache (MTP's causal cache, DFlash's context rows plus
//! its block): a few query rows over a few hundred keys, on host slices, with no tensor copies.
//! The engine's [`crate::layers::attention`] kernel serves the paged pool; a drafter round is
//! too small for candle's batched matmuls, whose transposes and copies of the whole cache cost
//! more than the arithmetic (about half of an MTP round).
//!
//! ```text
//! q       [rows][heads][d]     (after norm and rope)
//! keys    segments of [positions][kv_heads][d], read in order as one key sequence
//! row r, head h (kv head h / (heads / kv_heads)), keys 0..visible(r):
//!   s_j = (q · k_j) / √d,  p = softmax(s),  out[r][h] = Σ_j p_j v_j
//! ```
//!
//! Sums run in 16-lane partial accumulators, compiled for AVX2 + FMA and for the baseline, picked
//! at run time by the process's SIMD path ([`Isa::selected`], `SPECULA_ISA`): a different order
//! from a matmul's, within f32 rounding of it.

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::layers::simd::{Isa, Level};
use crate::layers::{RmsNorm, Rope};

/// The head layout of one attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (divides `heads`; query head `h` reads K/V head `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// Projected rows `xs` `[rows, heads × d]` as host values `[rows][heads][d]`, each head normed
/// by `norm` (qwen3's q/k norm) and rotated at `pos..pos + rows` when asked.
///
/// # Errors
/// On a shape mismatch or a position past the rope tables.
pub fn host_heads(
    xs: &Tensor,
    heads: usize,
    head_dim: usize,
    norm: Option<&RmsNorm>,
    rope: Option<(&Rope, usize)>,
) -> Result<Vec<f32>> {
    let rows = xs.dims2()?.0;
    let xs = match norm {
        Some(n) => n.forward(&xs.reshape((rows, heads, head_dim))?)?,
        None => xs.clone(),
    };
    let mut data: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    if let Some((rope, pos)) = rope {
        let positions: Vec<usize> = (pos..pos + rows).collect();
        rope.apply(&mut data, heads, &positions)?;
    }
    Ok(data)
}

/// Attends `q` (`[rows][heads][d]`) to the keys and values of `segments` (`(K, V)` pairs of
/// `[positions][kv_heads][d]`, taken in order as one sequence); row `r` sees the first
/// `visible(r)` keys (at least one). Returns `[rows][heads][d]`.
///
/// # Errors
/// [`Error::InvalidRequest`] when a length does not fit `shape` or a row sees no key or more
/// keys than there are, or `SPECULA_ISA` names a path this CPU lacks.
pub fn attend(
    q: &[f32],
    segments: &[(&[f32], &[f32])],
    shape: Heads,
    visible: impl Fn(usize) -> usize,
) -> Result<Vec<f32>> {
    attend_on(Isa::selected()?, q, segments, shape, visible)
}

/// [`attend`] on the SIMD path `isa` (tests compare paths).
///
/// # Errors
/// As [`attend`].
pub fn attend_on(
    isa: Isa,
    q: &[f32],
    segments: &[(&[f32], &[f32])],
    shape: Heads,
    visible: impl Fn(usize) -> usize,
) -> Result<Vec<f32>> {
    let Heads {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let bad = |reason: String| Error::InvalidRequest {
        op: "drafter attention",
        reason,
    };
    let width = kv_heads * d;
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || !q.len().is_multiple_of(heads * d) {
        return Err(bad(format!(
            "{} query values for {heads} heads over {kv_heads} K/V heads of {d}",
            q.len()
        )));
    }
    if let Some((k, v)) =
        (segments.iter()).find(|(k, v)| k.len() != v.len() || k.len() % width != 0)
    {
        return Err(bad(format!(
            "a segment of {} keys and {} values, rows of {width}",
            k.len(),
            v.len()
        )));
    }
    let total: usize = segments.iter().map(|(k, _)| k.len() / width).sum();
    let rows = q.len() / (heads * d);
    if let Some(r) = (0..rows).find(|&r| !(1..=total).contains(&visible(r))) {
        return Err(bad(format!("row {r} sees {} of {total} keys", visible(r))));
    }
    let mut out = vec![0f32; q.len()];
    let visible: Vec<usize> = (0..rows).map(visible).collect();
    let run = Run {
        q,
        segments,
        shape,
        visible: &visible,
        total,
    };
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an Isa at or above Avx2 exists only when the CPU runs AVX2 and FMA.
        Level::Avx2 | Level::AvxVnni | Level::Avx512 => unsafe { run.avx2(&mut out) },
        _ => run.body(&mut out),
    }
    Ok(out)
}

/// One call's operands, checked.
struct Run<'a> {
    q: &'a [f32],
    segments: &'a [(&'a [f32], &'a [f32])],
    shape: Heads,
    visible: &'a [usize],
    total: usize,
}

impl Run<'_> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(&self, out: &mut [f32]) {
        self.body(out);
    }

    #[inline(always)]
    fn body(&self, out: &mut [f32]) {
        let Heads {
            heads,
            kv_heads,
            head_dim: d,
        } = self.shape;
        let (q, segments) = (self.q, self.segments);
        let width = kv_heads * d;
        let groups = heads / kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let mut scores = Vec::with_capacity(self.total);
        for (r, &seen) in self.visible.iter().enumerate() {
            for h in 0..heads {
                let at = (r * heads + h) * d;
                let (qh, kv) = (&q[at..at + d], (h / groups) * d);
                scores.clear();
                for (k, _) in segments {
                    for key in k.chunks_exact(width) {
                        if scores.len() == seen {
                            break;
                        }
                        scores.push(dot(qh, &key[kv..kv + d]) * scale);
                    }
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in &mut scores {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let o = &mut out[at..at + d];
                let mut j = 0;
                for (_, v) in segments {
                    for value in v.chunks_exact(width) {
                        if j == seen {
                            break;
                        }
                        axpy(scores[j], &value[kv..kv + d], o);
                        j += 1;
                    }
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// `a · b` in 16 partial sums (the compiler keeps them in vector registers).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: f32 = (ca.remainder().iter().zip(cb.remainder()))
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `o += p · v`.
#[inline(always)]
fn axpy(p: f32, v: &[f32], o: &mut [f32]) {
    for (o, &v) in o.iter_mut().zip(v) {
        *o += p * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};

    /// The reference: candle's softmax(q Kᵀ / √d + mask) V per head, keys repeated per group.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: Heads,
        visible: &dyn Fn(usize) -> usize,
    ) -> Vec<f32> {
        let Heads {
            heads,
            kv_heads,
            head_dim: d,
        } = shape;
        let (rows, total) = (q.len() / (heads * d), k.len() / (kv_heads * d));
        let cpu = &Device::Cpu;
        let mut out = vec![0f32; q.len()];
        for h in 0..heads {
            let kv = h / (heads / kv_heads);
            let pick = |x: &[f32], n: usize, hs: usize, h: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|r| x[(r * hs + h) * d..][..d].to_vec())
                    .collect()
            };
            let qh = Tensor::from_vec(pick(q, rows, heads, h), (rows, d), cpu).unwrap();
            let kh = Tensor::from_vec(pick(k, total, kv_heads, kv), (total, d), cpu).unwrap();
            let vh = Tensor::from_vec(pick(v, total, kv_heads, kv), (total, d), cpu).unwrap();
            let mask: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    (0..total).map(move |j| {
                        if j < visible(r) {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (rows, total), cpu).unwrap();
            let s = ((qh.matmul(&kh.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap() + mask)
                .unwrap();
            let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
            let o: Vec<Vec<f32>> = p.matmul(&vh).unwrap().to_vec2().unwrap();
            for (r, row) in o.iter().enumerate() {
                out[(r * heads + h) * d..][..d].copy_from_slice(row);
            }
        }
        out
    }

    #[test]
    fn matches_masked_softmax_attention_over_split_segments() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let shape = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: 40,
        };
        let (rows, total, split) = (3, 37, 29);
        let w = shape.kv_heads * shape.head_dim;
        let mut r =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let q = r(rows * shape.heads * shape.head_dim);
        let (k, v) = (r(total * w), r(total * w));
        let segs = [
            (&k[..split * w], &v[..split * w]),
            (&k[split * w..], &v[split * w..]),
        ];
        // Causal over the last rows, then every key.
        let causal = |r: usize| total - rows + 1 + r;
        let all = |_: usize| total;
        for (isa, visible) in Isa::available()
            .into_iter()
            .flat_map(|isa| [(isa, &causal as &dyn Fn(usize) -> usize), (isa, &all)])
        {
            let got = attend_on(isa, &q, &segs, shape, visible).unwrap();
            let want = reference(&q, &k, &v, shape, visible);
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{isa}: {diff}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let shape = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let (q, k) = (vec![0f32; 8], vec![0f32; 8]);
        assert!(attend(&q, &[(&k, &k)], shape, |_| 2).is_ok());
        assert!(
            attend(&q, &[(&k, &k)], shape, |_| 3).is_err(),
            "past the keys"
        );
        assert!(attend(&q, &[(&k, &k)], shape, |_| 0).is_err(), "no key");
        assert!(attend(&q[..7], &[(&k, &k)], shape, |_| 1).is_err());
        assert!(attend(&q, &[(&k[..7], &k[..7])], shape, |_| 1).is_err());
        assert!(attend(&q, &[(&k, &k[..4])], shape, |_| 1).is_err());
    }
}
