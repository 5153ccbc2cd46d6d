//! Quantized matmul for the GGUF block types that candle's CPU backend only runs with scalar
//! code (`Q4_1`, `Q5_0`: candle 0.11 has SIMD `vec_dot`s for `Q4_0`, `Q8_0` and the k-quants).
//!
//! Each weight block is unpacked to 32 `i8` once and dotted against the matching block of
//! every activation row (activations quantized to 8 bits once per call, as ggml's `Q8_1`),
//! so a k-token chunk reads the weights once instead of k times. Output rows are split across
//! rayon; the inner 32-wide `i8` dot is compiled for AVX2 when the CPU has it.
//!
//! ```text
//!  W  [n, k] as n rows of k/32 blocks      X  [m, k] f32 -> m rows of k/32 (q[32], d, sum)
//!  for each weight row j (parallel):
//!    for each block b:  w = unpack(W[j, b])                    (once)
//!      for each activation row r:  acc[r] += dot(w, X[r, b].q) * d_w * X[r, b].d (+ min term)
//! ```
//!
//! Block layouts follow ggml (`ggml-common.h`): `Q4_1 = {f16 d, f16 m, u8 qs[16]}`,
//! `Q5_0 = {f16 d, u8 qh[4], u8 qs[16]}`.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};

/// Elements per block of every type handled here.
const QK: usize = 32;

/// Whether [`matmul`] handles weights of this type.
pub fn supports(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_0)
}

/// One activation block quantized to 8 bits: `x[i] ≈ d * q[i]`, `sum = d * Σ q[i]`.
#[derive(Clone, Copy)]
struct ActBlock {
    q: [i8; QK],
    d: f32,
    sum: f32,
}

fn quantize_row(xs: &[f32], out: &mut Vec<ActBlock>) {
    for block in xs.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0i8; QK];
        let mut s = 0i32;
        for (qi, x) in q.iter_mut().zip(block) {
            *qi = (x * inv).round() as i8;
            s += *qi as i32;
        }
        out.push(ActBlock {
            q,
            d,
            sum: d * s as f32,
        });
    }
}

/// Unpacks one weight block to `i8` values, returning `(scale, min)`: `w[i] = scale * q[i] + min`.
#[inline(always)]
fn unpack(dtype: GgmlDType, block: &[u8], q: &mut [i8; QK]) -> (f32, f32) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    match dtype {
        GgmlDType::Q4_1 => {
            let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
            let qs = &block[4..20];
            for j in 0..QK / 2 {
                q[j] = (qs[j] & 0x0F) as i8;
                q[j + QK / 2] = (qs[j] >> 4) as i8;
            }
            (d, m)
        }
        // Q5_0: the 5th bit of element j is bit j of qh; values are centred by -16.
        _ => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            let qs = &block[6..22];
            for j in 0..QK / 2 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                q[j] = ((qs[j] & 0x0F) | h0) as i8 - 16;
                q[j + QK / 2] = ((qs[j] >> 4) | h1) as i8 - 16;
            }
            (d, 0.0)
        }
    }
}

#[inline(always)]
fn dot_i8(a: &[i8; QK], b: &[i8; QK]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as i16 as i32 * y as i16 as i32)
        .sum()
}

/// Dot products of weight rows `rows` (of `n`) against all activation rows; writes
/// `out[(j - rows.start) * m + r]`.
#[inline(always)]
fn kernel(
    dtype: GgmlDType,
    weights: &[u8],
    row_bytes: usize,
    acts: &[ActBlock],
    m: usize,
    j0: usize,
    out: &mut [f32],
) {
    let blocks = acts.len() / m;
    let block_bytes = row_bytes / blocks;
    let mut wq = [0i8; QK];
    for (jj, acc) in out.chunks_exact_mut(m).enumerate() {
        let row = &weights[(j0 + jj) * row_bytes..(j0 + jj + 1) * row_bytes];
        acc.fill(0.0);
        for b in 0..blocks {
            let (d, min) = unpack(dtype, &row[b * block_bytes..(b + 1) * block_bytes], &mut wq);
            for (r, a) in acc.iter_mut().enumerate() {
                let act = &acts[r * blocks + b];
                *a += dot_i8(&wq, &act.q) as f32 * d * act.d + min * act.sum;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_avx2(
    dtype: GgmlDType,
    weights: &[u8],
    row_bytes: usize,
    acts: &[ActBlock],
    m: usize,
    j0: usize,
    out: &mut [f32],
) {
    kernel(dtype, weights, row_bytes, acts, m, j0, out)
}

/// Output rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// `xs` `[rows, k]` f32 times `w^T` (`w`: `[n, k]` of a type [`supports`] accepts) →
/// `[rows, n]` f32.
///
/// # Errors
/// If `w` is not 2-D, not on the CPU, of an unsupported type, or `k` does not match.
pub fn matmul(w: &QTensor, xs: &Tensor) -> Result<Tensor> {
    let (n, k) = w.shape().dims2()?;
    let (m, xk) = xs.dims2()?;
    if xk != k || k % QK != 0 || !supports(w.dtype()) || !w.device().is_cpu() {
        return Err(Error::InvalidRequest {
            op: "qmatmul",
            reason: format!(
                "weight {:?} {:?} (cpu: {}) with input {:?}",
                w.shape(),
                w.dtype(),
                w.device().is_cpu(),
                xs.shape()
            ),
        });
    }
    let data = w.data()?;
    let row_bytes = k / QK * w.dtype().type_size();
    let xs: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    let mut acts = Vec::with_capacity(m * k / QK);
    for row in xs.chunks_exact(k) {
        quantize_row(row, &mut acts);
    }
    // out_t[j * m + r] = y[r, j]: each task owns a contiguous range of weight rows.
    let mut out_t = vec![0f32; n * m];
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2");
    let dtype = w.dtype();
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(t, out)| {
            let j0 = t * ROWS_PER_TASK;
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU supports AVX2 (checked above).
                unsafe { kernel_avx2(dtype, &data, row_bytes, &acts, m, j0, out) };
                return;
            }
            kernel(dtype, &data, row_bytes, &acts, m, j0, out)
        });
    let out_t = Tensor::from_vec(out_t, (n, m), &Device::Cpu)?;
    Ok(out_t.t()?.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;
    use rand::{Rng, SeedableRng};

    fn randn(rng: &mut rand::rngs::StdRng, shape: (usize, usize)) -> Tensor {
        let data: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// Same products as candle's (scalar) `QMatMul`, for every row count the decoder uses.
    #[test]
    fn matches_candle_qmatmul() {
        let (n, k) = (40, 128);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let w = randn(&mut rng, (n, k));
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_0] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let reference = candle_core::quantized::QMatMul::from_qtensor(
                QTensor::quantize(&w, dtype).unwrap(),
            )
            .unwrap();
            for m in [1, 3, 8, 17] {
                let xs = randn(&mut rng, (m, k));
                let ours = matmul(&q, &xs).unwrap();
                let theirs = reference.forward(&xs).unwrap();
                let diff = (ours - &theirs)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                // Both quantize activations to 8 bits; candle rounds the scales to f16.
                let scale = theirs
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    diff < 2e-3 * scale,
                    "{dtype:?} m={m}: {diff} (max |y| {scale})"
                );
            }
        }
        let bad = Tensor::zeros((2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        assert!(matmul(&q, &bad).is_err());
    }
}
