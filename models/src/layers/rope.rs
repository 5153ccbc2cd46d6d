//! Rotary position embeddings (RoFormer, <https://arxiv.org/abs/2104.09864>).
//!
//! Two layouts of the same rotation exist in checkpoints:
//!
//! ```text
//!  HalfSplit (HF, NeoX):  pairs (x[i], x[i + d/2])   -> candle_nn::rotary_emb::rope
//!  Interleaved (GPT-J):   pairs (x[2i], x[2i + 1])   -> candle_nn::rotary_emb::rope_i
//! ```
//!
//! llama.cpp's converter permutes the q/k rows of `llama`-arch GGUF files into the interleaved
//! layout, so those use [`RopeStyle::Interleaved`]; GGUF qwen2/qwen3 and all HF safetensors
//! use [`RopeStyle::HalfSplit`].

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// Which pairs of a head's dimensions are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(x[i], x[i + d/2])`: HF checkpoints, GGUF qwen2/qwen3.
    HalfSplit,
    /// `(x[2i], x[2i + 1])`: GGUF llama (q/k permuted by the converter).
    Interleaved,
}

/// Precomputed cos/sin tables for every position of the context.
#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl Rope {
    /// Tables for positions `0..max_pos` of heads of width `head_dim` (even).
    ///
    /// # Errors
    /// If the tables cannot be allocated.
    pub fn new(
        head_dim: usize,
        max_pos: usize,
        theta: f64,
        style: RopeStyle,
        device: &Device,
    ) -> Result<Self> {
        let half = head_dim / 2;
        // inv_freq[i] = theta^(-2i/d); angles in f64 so that large positions stay exact.
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_pos, half), device)?,
            sin: Tensor::from_vec(sin, (max_pos, half), device)?,
            style,
        })
    }

    /// The layout this rope rotates.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Rotates `xs` (`[heads, seq_len, head_dim]`, contiguous f32) whose rows are at positions
    /// `pos..pos + seq_len`.
    ///
    /// # Errors
    /// If the positions exceed the table or shapes disagree.
    pub fn apply(&self, xs: &Tensor, pos: usize) -> Result<Tensor> {
        let (_heads, seq_len, _d) = xs.dims3()?;
        let cos = self.cos.narrow(0, pos, seq_len)?;
        let sin = self.sin.narrow(0, pos, seq_len)?;
        let xs = xs.unsqueeze(0)?.to_dtype(DType::F32)?.contiguous()?;
        let out = match self.style {
            RopeStyle::HalfSplit => candle_nn::rotary_emb::rope(&xs, &cos, &sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&xs, &cos, &sin)?,
        };
        Ok(out.squeeze(0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two styles are the same rotation up to a permutation of the head dimensions.
    #[test]
    fn styles_agree_up_to_permutation() {
        let d = 8;
        let xs = Tensor::arange(0f32, (2 * 3 * d) as f32, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, d))
            .unwrap()
            .affine(0.1, -1.0)
            .unwrap();
        let half = Rope::new(d, 16, 10_000.0, RopeStyle::HalfSplit, &Device::Cpu).unwrap();
        let inter = Rope::new(d, 16, 10_000.0, RopeStyle::Interleaved, &Device::Cpu).unwrap();
        // half-split index of interleaved slot j: 2i -> i, 2i+1 -> i + d/2.
        let perm: Vec<u32> = (0..d as u32)
            .map(|j| {
                if j % 2 == 0 {
                    j / 2
                } else {
                    j / 2 + d as u32 / 2
                }
            })
            .collect();
        let perm = Tensor::new(perm, &Device::Cpu).unwrap();
        let a = half.apply(&xs, 5).unwrap().index_select(&perm, 2).unwrap();
        let b = inter.apply(&xs.index_select(&perm, 2).unwrap(), 5).unwrap();
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        let a0 = half.apply(&xs, 0).unwrap();
        // Position 0 is the identity rotation only for the first row.
        let row0 = (a0.narrow(1, 0, 1).unwrap() - xs.narrow(1, 0, 1).unwrap()).unwrap();
        assert_eq!(
            row0.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }
}
