//! A linear projection `y = x W^T (+ b)` over weights kept `[out, in]`, either quantized
//! (candle `QMatMul` over GGUF blocks) or dense in f32/f16/bf16.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::error::Result;
use crate::layers::qmatmul;

/// How the weight is stored.
#[derive(Clone, Debug)]
pub enum Weight {
    /// GGUF blocks; candle dequantizes F32/F16 GGUF tensors to a dense tensor itself.
    Quantized(QMatMul),
    /// GGUF blocks run by [`crate::layers::qmatmul`] (the types of the models we serve): one
    /// kernel for decode and verify rows, bit-identical per row.
    RowBatched {
        /// The blocks.
        weight: Arc<QTensor>,
        /// candle over the same blocks, for chunks longer than any verify window (prefill),
        /// where candle has a tiled SIMD kernel for the type (`Q4_K`, `Q6_K`, `Q8_0`).
        prefill: Option<QMatMul>,
    },
    /// Dense `[out, in]` in any float dtype.
    Dense(Tensor),
}

/// Linear layer with optional bias (bias kept in f32).
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

impl Linear {
    /// A quantized projection.
    ///
    /// # Errors
    /// If candle cannot wrap the tensor.
    pub fn quantized(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let weight = match qmatmul::supports(weight.dtype()) && weight.device().is_cpu() {
            true => Weight::RowBatched {
                prefill: match weight.dtype() {
                    GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0 => {
                        Some(QMatMul::from_arc(weight.clone())?)
                    }
                    _ => None,
                },
                weight,
            },
            false => Weight::Quantized(QMatMul::from_arc(weight)?),
        };
        Ok(Self {
            weight,
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
        })
    }

    /// A dense projection over `weight` `[out, in]`.
    ///
    /// # Errors
    /// If the bias cannot be converted to f32.
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Self {
            weight: Weight::Dense(weight),
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
        })
    }

    /// The stored weight.
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// `xs` `[rows, in]` f32 → `[rows, out]` f32.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let ys = match &self.weight {
            Weight::Quantized(q) if needs_row_wise(q, xs) => {
                // candle's single-row kernels may sum in another order than its multi-row ones
                // (Q6K does); running verify-window rows one by one keeps them bit-identical to
                // decoding for the types `qmatmul` does not cover.
                let rows = (0..xs.dim(0)?)
                    .map(|i| q.forward(&xs.narrow(0, i, 1)?.contiguous()?))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)?
            }
            Weight::Quantized(q) => q.forward(&xs.contiguous()?)?,
            Weight::RowBatched {
                prefill: Some(q), ..
            } if xs.dim(0)? > MAX_VERIFY_ROWS => q.forward(&xs.contiguous()?)?,
            Weight::RowBatched { weight, .. } => qmatmul::matmul(weight, xs)?,
            Weight::Dense(w) if w.dtype() == DType::F32 => xs.matmul(&w.t()?)?,
            // Half-precision weights: multiply in their dtype (no dequantized copy of W).
            Weight::Dense(w) => xs
                .to_dtype(w.dtype())?
                .matmul(&w.t()?)?
                .to_dtype(DType::F32)?,
        };
        match &self.bias {
            Some(b) => Ok(ys.broadcast_add(b)?),
            None => Ok(ys),
        }
    }
}

/// The longest verify window (attention's `ROW_WISE_MAX_ROWS`): chunks up to this many rows
/// must give each row exactly the result of a one-row call; longer ones (prefill) need not.
const MAX_VERIFY_ROWS: usize = 16;

/// Whether a small chunk of rows must go through `q` one row at a time to get exactly the
/// results of single-row calls (see [`Linear::forward`]): any block-quantized type left to
/// candle (dense F32/F16 GGUF tensors are dequantized and use an ordinary matmul).
fn needs_row_wise(q: &QMatMul, xs: &Tensor) -> bool {
    let rows = xs.dims().first().copied().unwrap_or(1);
    xs.rank() == 2
        && (2..=MAX_VERIFY_ROWS).contains(&rows)
        && matches!(q, QMatMul::QTensor(t) if !matches!(t.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16))
}
