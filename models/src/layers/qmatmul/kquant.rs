//! Activations for the k-quants ([`super::kpacked`]'s `Q4_K`, [`super::k6packed`]'s `Q6_K`):
//! ggml's `q8_K`, one scale per 256 values, so that the weight kernels sum integers across a
//! whole 256-weight super-block and run one float multiply-add per super-block.
//!
//! ```text
//!  row of k values -> k / 256 blocks:  q[256] i8 = round(x / d),  d = max|x| / 127
//!                                      bsums[16] i16 = Σ q over each 16 values
//! ```
//!
//! Each row is quantized on its own (its bits never depend on the other rows), with the same
//! IEEE operations on every path.

use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Elements per super-block (and per activation scale).
pub(super) const QK_K: usize = 256;

/// Activation rows quantized to i8 per 256 values: `x ≈ d[b] * q`, and `bsums[16 b + j]` the
/// sum of `q[256 b + 16 j..][..16]`.
pub(super) struct Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    bsums: Vec<i16>,
    k: usize,
}

/// One row of [`Acts`].
#[derive(Clone, Copy)]
pub(super) struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub bsums: &'a [i16],
}

impl Acts {
    /// Quantizes `xs` (`rows * k` values, row-major, `k` a multiple of 256); each row on its
    /// own.
    pub(super) fn quantize(isa: Isa, xs: &[f32], k: usize) -> Acts {
        #[cfg(target_arch = "x86_64")]
        if isa.level() != Level::Scalar {
            // SAFETY: every non-scalar `Isa` token was made after checking AVX2 and FMA.
            return unsafe { Self::quantize_avx2(xs, k) };
        }
        let _ = isa;
        Self::quantize_body(xs, k)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_avx2(xs: &[f32], k: usize) -> Acts {
        Self::quantize_body(xs, k)
    }

    #[inline(always)]
    fn quantize_body(xs: &[f32], k: usize) -> Acts {
        let blocks = xs.len() / QK_K;
        let mut acts = Acts {
            q: vec![0; xs.len()],
            d: Vec::with_capacity(blocks),
            bsums: Vec::with_capacity(blocks * 16),
            k,
        };
        for (x, q) in xs.chunks_exact(QK_K).zip(acts.q.chunks_exact_mut(QK_K)) {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v * inv).round_ties_even() as i8;
            }
            acts.d.push(d);
            for q16 in q.chunks_exact(16) {
                acts.bsums.push(q16.iter().map(|&v| v as i16).sum());
            }
        }
        acts
    }

    pub(super) fn rows(&self) -> Vec<ActRow<'_>> {
        let kb = self.k / QK_K;
        (self.q.chunks_exact(self.k))
            .zip(
                self.d
                    .chunks_exact(kb)
                    .zip(self.bsums.chunks_exact(16 * kb)),
            )
            .map(|(q, (d, bsums))| ActRow { q, d, bsums })
            .collect()
    }
}
