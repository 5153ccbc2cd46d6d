//! The gated MLP `down(act(gate(x)) * up(x))`: SiLU for the llama family, GELU (tanh
//! approximation) for Gemma.

use candle_core::Tensor;

use crate::error::Result;
use crate::layers::Linear;

/// The activation of the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (HF `silu`): llama, qwen.
    Silu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (HF `gelu_pytorch_tanh`): Gemma.
    GeluTanh,
}

/// Gated MLP (`LlamaMLP` in HF).
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `gate_proj` `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `up_proj` `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `down_proj` `[hidden, intermediate]`.
    pub down_proj: Linear,
}

impl Mlp {
    /// `xs`: `[rows, hidden]` f32 → `[rows, hidden]` f32.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward_act(xs, Activation::Silu)
    }

    /// As [`Mlp::forward`] with the gate activation `act`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_act(&self, xs: &Tensor, act: Activation) -> Result<Tensor> {
        // PyTorch: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        let gate = self.gate_proj.forward(xs)?;
        let gate = match act {
            Activation::Silu => candle_nn::ops::silu(&gate)?,
            // candle's `gelu` is the tanh approximation (`gelu_erf` is the exact one).
            Activation::GeluTanh => gate.gelu()?,
        };
        let up = self.up_proj.forward(xs)?;
        self.down_proj.forward(&(gate * up)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn gelu_tanh_gate_follows_the_pytorch_formula() {
        let eye = |n: usize| {
            Linear::dense(
                Tensor::eye(n, candle_core::DType::F32, &Device::Cpu).unwrap(),
                None,
            )
            .unwrap()
        };
        let mlp = Mlp {
            gate_proj: eye(3),
            up_proj: eye(3),
            down_proj: eye(3),
        };
        let x = [-2.0f32, 0.5, 3.0];
        let xs = Tensor::new(&[x], &Device::Cpu).unwrap();
        let got = mlp
            .forward_act(&xs, Activation::GeluTanh)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let silu = mlp.forward(&xs).unwrap().to_vec2::<f32>().unwrap();
        for i in 0..3 {
            let v = x[i] as f64;
            // PyTorch gelu(approximate="tanh"), times up(x) = x
            let g = 0.5
                * v
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh());
            assert!(
                (got[0][i] as f64 - g * v).abs() < 1e-5,
                "{i}: {} vs {}",
                got[0][i],
                g * v
            );
            let s = v / (1.0 + (-v).exp()) * v;
            assert!((silu[0][i] as f64 - s).abs() < 1e-5);
        }
    }
}
