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

use crate::error::{Error, Result};

/// Which pairs of a head's dimensions are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(x[i], x[i + d/2])`: HF checkpoints, GGUF qwen2/qwen3.
    HalfSplit,
    /// `(x[2i], x[2i + 1])`: GGUF llama (q/k permuted by the converter).
    Interleaved,
}

/// Precomputed cos/sin tables (host memory) for every position of the context.
///
/// Rotation is elementwise per row, so a row's result depends only on its own position: the
/// packed forward rotates the rows of many sequences, each at its own position, in one call.
#[derive(Clone, Debug)]
pub struct Rope {
    /// `[max_pos][head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    max_pos: usize,
    style: RopeStyle,
}

impl Rope {
    /// Tables for positions `0..max_pos` of heads of width `head_dim` (even).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a `head_dim` that is not a positive even number.
    pub fn new(head_dim: usize, max_pos: usize, theta: f64, style: RopeStyle) -> Result<Self> {
        Self::proportional(head_dim, max_pos, theta, 1.0, style)
    }

    /// Gemma 4's proportional rope (transformers `_compute_proportional_rope_parameters`):
    /// only the first `partial_rotary_factor · head_dim / 2` pairs rotate, with the
    /// frequencies of the full width; the other pairs pass through (frequency 0).
    ///
    /// # Errors
    /// As [`Rope::new`]; also for a factor outside `0..=1`.
    pub fn proportional(
        head_dim: usize,
        max_pos: usize,
        theta: f64,
        partial_rotary_factor: f64,
        style: RopeStyle,
    ) -> Result<Self> {
        if !head_dim.is_multiple_of(2) || head_dim == 0 {
            return Err(Error::InvalidRequest {
                op: "rope",
                reason: format!("head_dim {head_dim} is not a positive even number"),
            });
        }
        if !(0.0..=1.0).contains(&partial_rotary_factor) {
            return Err(Error::InvalidRequest {
                op: "rope",
                reason: format!("partial_rotary_factor {partial_rotary_factor} is not in 0..=1"),
            });
        }
        let half = head_dim / 2;
        // PyTorch: rope_angles = int(rope_proportion * head_dim // 2)
        let rotated = (partial_rotary_factor * head_dim as f64 / 2.0).floor() as usize;
        // inv_freq[i] = theta^(-2i/d); angles in f64 so that large positions stay exact.
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| match i < rotated {
                true => theta.powf(-((2 * i) as f64) / head_dim as f64),
                false => 0.0,
            })
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
            cos,
            sin,
            half,
            max_pos,
            style,
        })
    }

    /// The tables, `[max_pos][head_dim / 2]` row-major: cos, then sin (for a rotation done
    /// elsewhere, e.g. candle's `rope_thd` on an accelerator).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// The layout this rope rotates.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Rotates `xs` (`[rows][heads][head_dim]` row-major) in place, row `r` at position
    /// `positions[r]`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a position past the table or a length mismatch.
    pub fn apply(&self, xs: &mut [f32], heads: usize, positions: &[usize]) -> Result<()> {
        let d = 2 * self.half;
        let bad = |reason: String| Error::InvalidRequest { op: "rope", reason };
        if xs.len() != positions.len() * heads * d {
            return Err(bad(format!(
                "{} values for {} rows of {heads} heads of {d}",
                xs.len(),
                positions.len()
            )));
        }
        if let Some(p) = positions.iter().find(|&&p| p >= self.max_pos) {
            return Err(bad(format!(
                "position {p} past the table of {}",
                self.max_pos
            )));
        }
        for (row, &p) in xs.chunks_exact_mut(heads * d).zip(positions) {
            let cos = &self.cos[p * self.half..(p + 1) * self.half];
            let sin = &self.sin[p * self.half..(p + 1) * self.half];
            for x in row.chunks_exact_mut(d) {
                match self.style {
                    // PyTorch: q * cos + rotate_half(q) * sin
                    RopeStyle::HalfSplit => {
                        let (a, b) = x.split_at_mut(self.half);
                        for i in 0..self.half {
                            let (x0, x1) = (a[i], b[i]);
                            a[i] = x0 * cos[i] - x1 * sin[i];
                            b[i] = x1 * cos[i] + x0 * sin[i];
                        }
                    }
                    RopeStyle::Interleaved => {
                        for (i, pair) in x.chunks_exact_mut(2).enumerate() {
                            let (x0, x1) = (pair[0], pair[1]);
                            pair[0] = x0 * cos[i] - x1 * sin[i];
                            pair[1] = x1 * cos[i] + x0 * sin[i];
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two styles are the same rotation up to a permutation of the head dimensions, and
    /// match candle's `rope` / `rope_i` kernels.
    #[test]
    fn styles_agree_up_to_permutation_and_match_candle() {
        use candle_core::{Device, Tensor};
        let (d, rows, heads) = (8, 3, 2);
        let xs: Vec<f32> = (0..rows * heads * d)
            .map(|i| i as f32 * 0.1 - 1.0)
            .collect();
        let positions = [5, 0, 9];
        let half = Rope::new(d, 16, 10_000.0, RopeStyle::HalfSplit).unwrap();
        let inter = Rope::new(d, 16, 10_000.0, RopeStyle::Interleaved).unwrap();
        // half-split index of interleaved slot j: 2i -> i, 2i+1 -> i + d/2.
        let perm: Vec<usize> = (0..d)
            .map(|j| if j % 2 == 0 { j / 2 } else { j / 2 + d / 2 })
            .collect();
        let permute = |x: &[f32]| -> Vec<f32> {
            x.chunks(d)
                .flat_map(|h| perm.iter().map(|&p| h[p]))
                .collect()
        };
        let mut a = xs.clone();
        half.apply(&mut a, heads, &positions).unwrap();
        let mut b = permute(&xs);
        inter.apply(&mut b, heads, &positions).unwrap();
        let max = permute(&a)
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max < 1e-5, "{max}");
        // Position 0 is the identity rotation.
        assert_eq!(a[heads * d..2 * heads * d], xs[heads * d..2 * heads * d]);
        // candle's kernel over [1, heads, 1, d] at position 5 (row 0).
        let x0 =
            Tensor::from_vec(xs[..heads * d].to_vec(), (1, heads, 1, d), &Device::Cpu).unwrap();
        let cs = |t: &[f32]| {
            Tensor::from_vec(t[5 * d / 2..6 * d / 2].to_vec(), (1, d / 2), &Device::Cpu).unwrap()
        };
        let theirs = candle_nn::rotary_emb::rope(&x0, &cs(&half.cos), &cs(&half.sin)).unwrap();
        let theirs: Vec<f32> = theirs.flatten_all().unwrap().to_vec1().unwrap();
        let max = theirs
            .iter()
            .zip(&a[..heads * d])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max < 1e-6, "{max}");
    }

    #[test]
    fn rejects_positions_past_the_table_and_bad_shapes() {
        let r = Rope::new(4, 8, 10_000.0, RopeStyle::HalfSplit).unwrap();
        assert!(r.apply(&mut [0.0; 4], 1, &[8]).is_err());
        assert!(r.apply(&mut [0.0; 5], 1, &[0]).is_err());
        assert!(Rope::new(3, 8, 10_000.0, RopeStyle::HalfSplit).is_err());
    }
}
