//! The gated SiLU MLP of the llama family: `down(silu(gate(x)) * up(x))`.

use candle_core::Tensor;

use crate::error::Result;
use crate::layers::Linear;

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
        // PyTorch: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(xs)?)?;
        let up = self.up_proj.forward(xs)?;
        self.down_proj.forward(&(gate * up)?)
    }
}
