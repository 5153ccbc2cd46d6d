//! RMS norm (`x / sqrt(mean(x^2) + eps) * weight`), as in HF `LlamaRMSNorm`; Gemma's
//! `(1 + weight)` form is [`RmsNorm::plus_one`], its weightless one [`RmsNorm::unit`].

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

    /// Gemma's norm `x̂ · (1 + weight)` (HF `Gemma3RMSNorm`), from a checkpoint's `weight`.
    ///
    /// # Errors
    /// As [`RmsNorm::new`].
    pub fn plus_one(weight: Tensor, eps: f64) -> Result<Self> {
        // PyTorch: output * (1.0 + self.weight.float()), the sum taken in f32 as here.
        Self::new((weight.to_dtype(DType::F32)? + 1.0)?, eps)
    }

    /// A norm without a weight (`x̂` alone: Gemma 4's `v_norm`).
    ///
    /// # Errors
    /// If the tensor cannot be allocated.
    pub fn unit(dim: usize, eps: f64, device: &candle_core::Device) -> Result<Self> {
        Self::new(Tensor::ones(dim, DType::F32, device)?, eps)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn plus_one_and_unit_scale_the_normalised_row() {
        let xs = Tensor::new(&[[3.0f32, -4.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[0.5f32, -1.0], &Device::Cpu).unwrap();
        // mean(x^2) = 12.5; x̂ = x / sqrt(12.5)
        let r = 12.5f32.sqrt();
        let got = RmsNorm::plus_one(w.clone(), 0.0)
            .unwrap()
            .forward(&xs)
            .unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), [[3.0 / r * 1.5, 0.0]]);
        let got = RmsNorm::new(w, 0.0).unwrap().forward(&xs).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), [[3.0 / r * 0.5, 4.0 / r]]);
        let got = RmsNorm::unit(2, 0.0, &Device::Cpu)
            .unwrap()
            .forward(&xs)
            .unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), [[3.0 / r, -4.0 / r]]);
    }
}
