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
        // gate and up share their input: one pass of the quantized kernels for both.
        let [gate, up]: [Tensor; 2] = Linear::forward_many(&[&self.gate_proj, &self.up_proj], xs)?
            .try_into()
            .expect("invariant: two layers give two outputs");
        let hidden = match act {
            Activation::Silu if gate.device().is_cpu() => silu_mul(&gate, &up)?,
            Activation::Silu => (candle_nn::ops::silu(&gate)? * up)?,
            // candle's `gelu` is the tanh approximation (`gelu_erf` is the exact one).
            Activation::GeluTanh => (gate.gelu()? * up)?,
        };
        self.down_proj.forward(&hidden)
    }
}

/// `silu(gate) * up` on the host in one pass, with candle's f32 operations (`g / (1 + e^-g)`,
/// then the product), so the same bits as its two ops without their intermediate tensor.
fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let g: Vec<f32> = gate.flatten_all()?.to_vec1()?;
    let u: Vec<f32> = up.flatten_all()?.to_vec1()?;
    let mut out = vec![0f32; g.len()];
    const CHUNK: usize = 1 << 14;
    crate::par::chunks_mut(&mut out, CHUNK, |c, o| {
        let (g, u) = (&g[c * CHUNK..], &u[c * CHUNK..]);
        for (o, (&g, &u)) in o.iter_mut().zip(g.iter().zip(u)) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    });
    Ok(Tensor::from_vec(out, gate.shape(), gate.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The fused host `silu(gate) * up` gives candle's two ops' bits, below and above the
    /// parallel chunk size.
    #[test]
    fn silu_mul_equals_candles_ops() {
        for n in [7, 40_000] {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 201) as f32 - 100.0) * 0.173)
                .collect();
            let u: Vec<f32> = (0..n)
                .map(|i| ((i * 11 % 97) as f32 - 48.0) * 0.05)
                .collect();
            let g = Tensor::from_vec(g, (1, n), &Device::Cpu).unwrap();
            let u = Tensor::from_vec(u, (1, n), &Device::Cpu).unwrap();
            let want = (candle_nn::ops::silu(&g).unwrap() * &u).unwrap();
            let got = silu_mul(&g, &u).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            };
            assert_eq!(got.dims(), want.dims());
            assert_eq!(bits(&got), bits(&want), "{n} values");
        }
    }

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
