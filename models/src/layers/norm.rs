//! RMS norm (`x / sqrt(mean(x^2) + eps) * weight`), as in HF `LlamaRMSNorm`.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// RMS norm over the last dimension, weight kept in f32.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// Wraps a `[dim]` weight (converted to f32).
    ///
    /// # Errors
    /// If the weight is not 1-D or cannot be converted.
    pub fn new(weight: Tensor, eps: f64) -> Result<Self> {
        weight.dims1()?;
        Ok(Self {
            weight: weight.to_dtype(DType::F32)?,
            eps: eps as f32,
        })
    }

    /// Normalises `xs` (`[.., dim]`, f32) over its last dimension.
    ///
    /// # Errors
    /// On a shape mismatch with the weight.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &xs.contiguous()?,
            &self.weight,
            self.eps,
        )?)
    }
}
