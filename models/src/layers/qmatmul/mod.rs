//! Quantized matmul `y = x W^T` for the GGUF block types of the models we serve (`Q4_0`,
//! `Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q6_K`), built so that a k-token verify chunk costs little
//! more than one decode step *and* every row is bit-identical whatever the number of rows in
//! the call: one decode row, a verify window, a 512-row prefill chunk, rows of several
//! sequences.
//!
//! Why a row's bits cannot depend on the others: activations are quantized to 8 bits per row,
//! each row on its own, and every kernel sums integers exactly and runs its f32 operations in
//! one fixed order per output, whichever tile or group of rows the row lands in. Two families:
//!
//! - 32-element block types (`Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`): activations in ggml's `Q8_1` (one
//!   scale per 32 values); the weights are repacked at load ([`QWeight::new`]) so that one SIMD
//!   lane holds one weight row ([`packed`]): 16 outputs per register, no horizontal sums, and
//!   the same kernel for one decode row and for groups of up to 8 activation rows.
//! - k-quants (`Q4_K`, `Q6_K`): activations in ggml's `q8_K` (one scale per 256 values,
//!   [`kquant`]), integer sums across each 256-weight super-block and one float multiply-add
//!   per super-block, repacked at load the same way ([`kpacked`], [`k6packed`]).
//!
//! Every layout shares the group-of-16-rows storage and task loop of [`groups`].
//!
//! ```text
//!  W  [n, k] packed groups of 16 rows      X  [m, k] f32 -> m rows of 8-bit values + scales
//!  `par` over tasks of ROWS_PER_TASK weight rows:
//!    per group of 16 weight rows, per 8 activation rows: 16 x 8 outputs
//!  (several weights on one input, q|k|v or gate|up: one loop over all their tasks)
//! ```
//!
//! Reference: ggml's `vec_dot_q*_q8_*` (`ggml-cpu/arch/x86/quants.c`) and its repacked
//! `gemv`/`gemm` kernels (`ggml-cpu/repack.cpp`).

#[cfg(target_arch = "x86_64")]
mod amx;
mod groups;
mod k6packed;
mod kpacked;
mod kquant;
mod packed;

use std::fmt;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::layers::simd::{Isa, Level};
use groups::{Columns, LANES};
use packed::{Packed, QK};

/// Weight rows per parallel task: enough work to amortise scheduling (a multiple of [`LANES`]).
const ROWS_PER_TASK: usize = 2 * LANES;

/// Whether [`QWeight::new`] takes weights of this type.
pub fn supports(dtype: GgmlDType) -> bool {
    packed::supports(dtype) || kpacked::supports(dtype) || k6packed::supports(dtype)
}

/// One activation row quantized to 8 bits per 32-element block.
///
/// # Invariants
/// `q.len() == QK * d.len() == QK * s.len()`; `q` holds `round(x / d)` (within ±127) and
/// `s[b] = d[b] * Σ q[32 b..][..32]`.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
}

/// A quantized `[n, k]` weight ready for [`matmul`], repacked one row per lane (see
/// [`packed`], [`kpacked`], [`k6packed`]).
pub struct QWeight {
    dtype: GgmlDType,
    inner: Inner,
}

enum Inner {
    Packed(Packed),
    KPacked(kpacked::KPacked),
    K6Packed(k6packed::K6Packed),
}

impl fmt::Debug for QWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (n, k) = self.shape();
        write!(f, "QWeight({:?} [{n}, {k}])", self.dtype)
    }
}

impl QWeight {
    /// Takes a 2-D CPU weight of a type [`supports`] accepts, repacked.
    ///
    /// # Errors
    /// If `w` is not 2-D, not on the CPU, of an unsupported type, or its width is not a whole
    /// number of blocks.
    pub fn new(w: Arc<QTensor>) -> Result<QWeight> {
        let dtype = w.dtype();
        let bad = |why: &str| Error::InvalidRequest {
            op: "qmatmul",
            reason: format!("weight {:?} {dtype:?}: {why}", w.shape()),
        };
        let (n, k) = w.shape().dims2().map_err(|_| bad("not 2-D"))?;
        if !supports(dtype) {
            return Err(bad("unsupported block type"));
        }
        if !w.device().is_cpu() {
            return Err(bad("not on the CPU"));
        }
        if k % block_elems(dtype) != 0 {
            return Err(bad("width not a whole number of blocks"));
        }
        let inner = match dtype {
            t if packed::supports(t) => Inner::Packed(Packed::new(dtype, &w.data()?, n, k)),
            t if kpacked::supports(t) => Inner::KPacked(kpacked::KPacked::new(&w.data()?, n, k)),
            _ => Inner::K6Packed(k6packed::K6Packed::new(&w.data()?, n, k)),
        };
        Ok(QWeight { dtype, inner })
    }

    /// `[n, k]`.
    pub fn shape(&self) -> (usize, usize) {
        match &self.inner {
            Inner::Packed(p) => (p.rows(), p.cols()),
            Inner::KPacked(p) => (p.rows(), p.cols()),
            Inner::K6Packed(p) => (p.rows(), p.cols()),
        }
    }

    /// The GGUF block type.
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// The weight made of output rows `ids` (row `i` of the result is row `ids[i]`), in the same
    /// storage and bit for bit: a drafter's lm_head restricted to a draft vocabulary.
    ///
    /// # Errors
    /// If an id is past the weight's rows.
    pub fn select_rows(&self, ids: &[u32]) -> Result<QWeight> {
        let n = self.shape().0;
        let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        if let Some(&bad) = ids.iter().find(|&&i| i >= n) {
            return Err(Error::InvalidRequest {
                op: "qmatmul",
                reason: format!("row {bad} of a {n}-row weight"),
            });
        }
        let inner = match &self.inner {
            Inner::Packed(p) => Inner::Packed(p.select_rows(&ids)),
            Inner::KPacked(p) => Inner::KPacked(p.select_rows(&ids)),
            Inner::K6Packed(p) => Inner::K6Packed(p.select_rows(&ids)),
        };
        Ok(QWeight {
            dtype: self.dtype,
            inner,
        })
    }
}

/// Elements per stored block of `dtype` (32, or 256 for the k-quants).
fn block_elems(dtype: GgmlDType) -> usize {
    if packed::supports(dtype) {
        QK
    } else {
        kquant::QK_K
    }
}

/// Activation rows quantized to 8 bits per 32 values (see [`ActRow`]).
struct Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    k: usize,
}

impl Acts {
    /// Quantizes `xs` (`rows * k` values, row-major); each row independently of the others.
    fn quantize(isa: Isa, xs: &[f32], k: usize) -> Acts {
        #[cfg(target_arch = "x86_64")]
        if isa.level() != Level::Scalar {
            // SAFETY: every non-scalar `Isa` token was made after checking AVX2 and FMA.
            return unsafe { Self::quantize_avx2(xs, k) };
        }
        Self::quantize_body(xs, k)
    }

    /// [`Acts::quantize`] with AVX2 intrinsics: the same IEEE operations per value (max of
    /// magnitudes, `amax / 127`, `1 / d`, `x * inv`, round half to even), so the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_avx2(xs: &[f32], k: usize) -> Acts {
        use std::arch::x86_64::*;
        let blocks = xs.len() / QK;
        let mut acts = Acts {
            q: vec![0; xs.len()],
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
            k,
        };
        let sign = _mm256_set1_ps(-0.0);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (x, q) in xs.chunks_exact(QK).zip(acts.q.chunks_exact_mut(QK)) {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let i = v.map(|v| {
                let r = _mm256_round_ps(
                    _mm256_mul_ps(v, inv),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                );
                _mm256_cvtps_epi32(r)
            });
            let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let sum = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256(sum, 1),
            );
            let sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 1)));
            let p16 = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            let p8 = _mm256_permutevar8x32_epi32(p16, order);
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, p8);
            acts.d.push(d);
            acts.s.push(d * sum as f32);
        }
        acts
    }

    #[inline(always)]
    fn quantize_body(xs: &[f32], k: usize) -> Acts {
        let blocks = xs.len() / QK;
        let mut acts = Acts {
            q: vec![0; xs.len()],
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
            k,
        };
        for (x, q) in xs.chunks_exact(QK).zip(acts.q.chunks_exact_mut(QK)) {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in q.iter_mut().zip(x) {
                let v = (v * inv).round_ties_even() as i32;
                sum += v;
                *q = v as i8;
            }
            acts.d.push(d);
            acts.s.push(d * sum as f32);
        }
        acts
    }

    fn rows(&self) -> Vec<ActRow<'_>> {
        let kb = self.k / QK;
        (self.q.chunks_exact(self.k))
            .zip(self.d.chunks_exact(kb).zip(self.s.chunks_exact(kb)))
            .map(|(q, (d, s))| ActRow { q, d, s })
            .collect()
    }
}

/// `xs` `[rows, k]` f32 times `w^T` (`w`: `[n, k]`) → `[rows, n]` f32, on the SIMD path `isa`.
///
/// # Errors
/// If `xs` is not 2-D or `k` does not match.
pub fn matmul(isa: Isa, w: &QWeight, xs: &Tensor) -> Result<Tensor> {
    Ok(matmul_many(isa, &[w], xs)?.remove(0))
}

/// `xs` times each `ws[i]^T` (projections that share an input: q|k|v, gate|up): the
/// activations are quantized once per kind and one parallel loop runs every weight's tasks, so
/// a decode step pays one fork-join instead of one per weight. Output `i` is
/// [`matmul`]`(isa, ws[i], xs)` bit for bit (the same kernels on the same quantized rows).
///
/// # Errors
/// If `xs` is not 2-D or a weight's `k` does not match.
pub fn matmul_many(isa: Isa, ws: &[&QWeight], xs: &Tensor) -> Result<Vec<Tensor>> {
    let (m, k) = xs.dims2()?;
    for w in ws {
        let (n, wk) = w.shape();
        if wk != k {
            return Err(Error::InvalidRequest {
                op: "qmatmul",
                reason: format!(
                    "weight [{n}, {wk}] {:?} with input {:?}",
                    w.dtype,
                    xs.shape()
                ),
            });
        }
    }
    let xs: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    // Each task writes its own columns (a range of weight rows) of an output in place.
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.shape().0]).collect();
    if m > 0 {
        let packed = |w: &&QWeight| matches!(w.inner, Inner::Packed(_));
        let a32 = ws.iter().any(packed).then(|| Acts::quantize(isa, &xs, k));
        let ak = (!ws.iter().all(packed)).then(|| kquant::Acts::quantize(isa, &xs, k));
        let r32 = a32.as_ref().map(Acts::rows).unwrap_or_default();
        let rk = ak.as_ref().map(kquant::Acts::rows).unwrap_or_default();
        let mut tasks = Vec::new();
        for (i, (out, w)) in outs.iter_mut().zip(ws).enumerate() {
            let columns = Columns::split(out, m, w.shape().0, ROWS_PER_TASK);
            tasks.extend(columns.into_iter().enumerate().map(|(t, c)| (i, t, c)));
        }
        crate::par::for_each_mut(&mut tasks, |_, (i, t, out)| {
            let g0 = *t * ROWS_PER_TASK / LANES;
            match &ws[*i].inner {
                Inner::Packed(p) => p.rows_task(isa, &r32, g0, out),
                Inner::KPacked(p) => p.rows_task(isa, &rk, g0, out),
                Inner::K6Packed(p) => p.rows_task(isa, &rk, g0, out),
            }
        });
    }
    (ws.iter().zip(outs))
        .map(|(w, ys)| Ok(Tensor::from_vec(ys, (m, w.shape().0), &Device::Cpu)?))
        .collect()
}

#[cfg(test)]
mod tests;
