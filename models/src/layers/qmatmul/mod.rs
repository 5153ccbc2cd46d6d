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
//!   scale per 32 values); each weight row is unpacked into a common 32-element form
//!   ([`unpack`]) and dotted with each activation row ([`dot`]). A decode step (one row) skips
//!   the buffer: [`fused`] unpacks each block in registers and dots it at once, with the same
//!   arithmetic (tested bit for bit).
//! - k-quants (`Q4_K`, `Q6_K`): activations in ggml's `q8_K` (one scale per 256 values), integer
//!   sums across each 256-weight super-block and one float multiply-add per super-block
//!   ([`kquant`]); each super-block is unpacked in registers once for a group of rows.
//!
//! ```text
//!  W  [n, k] raw GGUF blocks               X  [m, k] f32 -> m rows of 8-bit values + scales
//!  for each weight row j (rayon, ROWS_PER_TASK per task):
//!    32-element types: unpack W[j] -> k/32 Blocks (once per call, in L1)
//!                      for each activation row r: y[r, j] = dot(Blocks, X[r])
//!    k-quants:         for each group of rows g: y[g, j] = kquant(W[j], X[g])
//! ```
//!
//! Reference: ggml's `vec_dot_q*_q8_*` (`ggml-cpu/arch/x86/quants.c`); the per-lane integer
//! sums and the sign trick of the AVX2 build come from there.

mod dot;
#[cfg(target_arch = "x86_64")]
mod fused;
mod kquant;
mod unpack;

use std::cell::RefCell;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::layers::simd::{Isa, Level};
use dot::ActRow;
use unpack::{Block, QK};

/// Weight rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// Whether [`matmul`] handles weights of this type.
pub fn supports(dtype: GgmlDType) -> bool {
    unpack::supports(dtype) || kquant::supports(dtype)
}

/// Elements per stored block of `dtype` (32, or 256 for the k-quants).
fn block_elems(dtype: GgmlDType) -> usize {
    if kquant::supports(dtype) {
        kquant::QK_K
    } else {
        QK
    }
}

/// Activation rows quantized to 8 bits per 32 values (see [`ActRow`]).
struct Acts {
    q: Vec<u8>,
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

    /// [`Acts::quantize`] compiled for AVX2 (vectorized rounding).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_avx2(xs: &[f32], k: usize) -> Acts {
        Self::quantize_body(xs, k)
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
                *q = (v + 128) as u8;
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

thread_local! {
    /// One unpacked weight row per worker thread, reused across calls.
    static UNPACKED: RefCell<Vec<Block>> = const { RefCell::new(Vec::new()) };
}

/// One matmul call's operands, shared by every task.
#[derive(Clone, Copy)]
struct Operands<'a> {
    isa: Isa,
    dtype: GgmlDType,
    /// Packed weight rows, `row_bytes` each.
    weights: &'a [u8],
    row_bytes: usize,
    acts: &'a Acts,
}

/// The products of weight rows `j0..j0 + out.len() / m` with all activation rows:
/// `out[(j - j0) * m + r] = y[r, j]`.
#[inline(always)]
fn rows_task(
    ops: Operands,
    unpack_row: impl Fn(GgmlDType, &[u8], &mut [Block]),
    j0: usize,
    out: &mut [f32],
) {
    let Operands {
        isa,
        dtype,
        weights,
        row_bytes,
        acts,
    } = ops;
    let rows = acts.rows();
    let has_min = unpack::has_min(dtype);
    UNPACKED.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(acts.k / QK, Block::default());
        for (jj, ys) in out.chunks_exact_mut(rows.len()).enumerate() {
            let j = j0 + jj;
            unpack_row(
                dtype,
                &weights[j * row_bytes..(j + 1) * row_bytes],
                &mut buf,
            );
            dot::dot_rows(isa, &buf, has_min, &rows, ys);
        }
    })
}

/// [`rows_task`] with the AVX2 unpacking.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_task_avx2(ops: Operands, j0: usize, out: &mut [f32]) {
    // SAFETY: the caller guarantees the features.
    let unpack_row =
        |dtype, row: &[u8], out: &mut [Block]| unsafe { unpack::x86::unpack_row(dtype, row, out) };
    rows_task(ops, unpack_row, j0, out)
}

/// `xs` `[rows, k]` f32 times `w^T` (`w`: `[n, k]` of a type [`supports`] accepts) →
/// `[rows, n]` f32, on the SIMD path `isa`.
///
/// # Errors
/// If `w` is not 2-D, not on the CPU, of an unsupported type, or `k` does not match.
pub fn matmul(isa: Isa, w: &QTensor, xs: &Tensor) -> Result<Tensor> {
    let (n, k) = w.shape().dims2()?;
    let (m, xk) = xs.dims2()?;
    let dtype = w.dtype();
    if xk != k || !supports(dtype) || k % block_elems(dtype) != 0 || !w.device().is_cpu() {
        return Err(Error::InvalidRequest {
            op: "qmatmul",
            reason: format!(
                "weight {:?} {dtype:?} (cpu: {}) with input {:?}",
                w.shape(),
                w.device().is_cpu(),
                xs.shape()
            ),
        });
    }
    let data = w.data()?;
    let row_bytes = k / block_elems(dtype) * dtype.type_size();
    let xs: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    // out_t[j * m + r] = y[r, j]: each task owns a contiguous range of weight rows.
    let mut out_t = vec![0f32; n * m];
    if kquant::supports(dtype) {
        matmul_k(isa, dtype, &data, row_bytes, &xs, k, &mut out_t);
    } else {
        matmul_blocks(isa, dtype, &data, row_bytes, &xs, k, &mut out_t);
    }
    let ys = match m {
        1 => out_t,
        _ => (0..m)
            .flat_map(|r| (0..n).map(move |j| (r, j)))
            .map(|(r, j)| out_t[j * m + r])
            .collect(),
    };
    Ok(Tensor::from_vec(ys, (m, n), &Device::Cpu)?)
}

/// The k-quants ([`kquant`]): `out_t[j * m + r] = y[r, j]`.
fn matmul_k(
    isa: Isa,
    dtype: GgmlDType,
    weights: &[u8],
    row_bytes: usize,
    xs: &[f32],
    k: usize,
    out_t: &mut [f32],
) {
    let acts = kquant::Acts::quantize(isa, xs, k);
    let rows = acts.rows();
    let m = rows.len();
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(t, out)| {
            let j0 = t * ROWS_PER_TASK;
            // Activation groups outside, weight rows inside: a group's activations stay in L1
            // across the task's weight rows, and those rows stay in L1 across the groups.
            for (g, a) in rows.chunks(kquant::GROUP).enumerate() {
                for (jj, ys) in out.chunks_exact_mut(m).enumerate() {
                    let j = j0 + jj;
                    let w = &weights[j * row_bytes..(j + 1) * row_bytes];
                    let ys = &mut ys[g * kquant::GROUP..][..a.len()];
                    kquant::dot_rows(isa, dtype, w, a, ys);
                }
            }
        });
}

/// The 32-element block types ([`unpack`], [`dot`], [`fused`]): `out_t[j * m + r] = y[r, j]`.
fn matmul_blocks(
    isa: Isa,
    dtype: GgmlDType,
    weights: &[u8],
    row_bytes: usize,
    xs: &[f32],
    k: usize,
    out_t: &mut [f32],
) {
    let acts = Acts::quantize(isa, xs, k);
    let m = xs.len() / k;
    let ops = Operands {
        isa,
        dtype,
        weights,
        row_bytes,
        acts: &acts,
    };
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(t, out)| {
            let j0 = t * ROWS_PER_TASK;
            #[cfg(target_arch = "x86_64")]
            if ops.isa.level() != Level::Scalar && m == 1 {
                // A decode step: unpack in registers (bit-identical to the buffered path).
                let rows = ops.acts.rows();
                for (jj, y) in out.iter_mut().enumerate() {
                    let j = j0 + jj;
                    let w = &ops.weights[j * row_bytes..(j + 1) * row_bytes];
                    // SAFETY: a non-scalar `Isa` token proves its features; the type and the
                    // row length were checked by `matmul`.
                    *y = unsafe { fused::dot(ops.isa, dtype, w, rows[0]) };
                }
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if ops.isa.level() != Level::Scalar {
                // SAFETY: every non-scalar `Isa` token implies AVX2, FMA and F16C.
                unsafe { rows_task_avx2(ops, j0, out) };
                return;
            }
            rows_task(ops, unpack::unpack_row, j0, out)
        });
}

#[cfg(test)]
mod tests;
