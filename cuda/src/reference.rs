//! The step's forward on the CPU, in f32, rounding to bf16 exactly where the kernels do (the
//! normed activations, the attention output, SiLU·mul, the KV cache). The device check
//! compares the GPU against it; it is written for clarity, not speed (tiny models only).

use half::bf16;
use rand::{Rng, SeedableRng};

use crate::device::Gpu;
use crate::error::Result;
use crate::shape::Shape;
use crate::step::{rope_tables, LayerWeights, Weights};

/// One layer's weights on the host as bf16 bits, in the kernels' layout (`gate_up`
/// interleaved: row `2j` gate, `2j + 1` up).
#[derive(Clone)]
pub struct HostLayer {
    pub attn_norm: Vec<u16>,
    pub qkv: Vec<u16>,
    pub qkv_bias: Option<Vec<u16>>,
    pub q_norm: Option<Vec<u16>>,
    pub k_norm: Option<Vec<u16>>,
    pub o: Vec<u16>,
    pub mlp_norm: Vec<u16>,
    pub gate_up: Vec<u16>,
    pub down: Vec<u16>,
}

/// All weights on the host (`lm_head` `None` when tied to the embedding).
#[derive(Clone)]
pub struct HostWeights {
    pub embed: Vec<u16>,
    pub layers: Vec<HostLayer>,
    pub final_norm: Vec<u16>,
    pub lm_head: Option<Vec<u16>>,
}

fn bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

fn f(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

impl HostWeights {
    /// Random weights for `shape` (std 0.02 projections, norms near 1 so that their
    /// multiplies are exercised), from `seed`.
    pub fn random(shape: &Shape, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut proj = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| bits(rng.random_range(-0.0346f32..0.0346)))
                .collect()
        };
        let mut rng2 = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
        let mut norm = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| bits(rng2.random_range(0.5f32..1.5)))
                .collect()
        };
        let (h, hd) = (shape.hidden, shape.head_dim);
        let layers = (0..shape.layers)
            .map(|_| HostLayer {
                attn_norm: norm(h),
                qkv: proj(shape.qkv_width() * h),
                qkv_bias: shape.qkv_bias.then(|| proj(shape.qkv_width())),
                q_norm: shape.qk_norm.then(|| norm(hd)),
                k_norm: shape.qk_norm.then(|| norm(hd)),
                o: proj(h * shape.heads * hd),
                mlp_norm: norm(h),
                gate_up: proj(2 * shape.intermediate * h),
                down: proj(h * shape.intermediate),
            })
            .collect();
        Self {
            embed: proj(shape.vocab * h),
            layers,
            final_norm: norm(h),
            lm_head: (!shape.tied_embeddings).then(|| proj(shape.vocab * h)),
        }
    }

    /// Copies the weights to the GPU.
    pub fn upload(&self, gpu: &Gpu) -> Result<Weights> {
        let up = |v: &Vec<u16>| -> Result<crate::device::DeviceBuffer> {
            let b = gpu.alloc(2 * v.len())?;
            gpu.upload(&b, 0, v)?;
            gpu.sync()?;
            Ok(b)
        };
        let opt = |v: &Option<Vec<u16>>| v.as_ref().map(up).transpose();
        let mut layers = Vec::new();
        for l in &self.layers {
            layers.push(LayerWeights {
                attn_norm: up(&l.attn_norm)?,
                qkv: up(&l.qkv)?,
                qkv_bias: opt(&l.qkv_bias)?,
                q_norm: opt(&l.q_norm)?,
                k_norm: opt(&l.k_norm)?,
                o: up(&l.o)?,
                mlp_norm: up(&l.mlp_norm)?,
                gate_up: up(&l.gate_up)?,
                down: up(&l.down)?,
            });
        }
        Ok(Weights {
            embed: up(&self.embed)?,
            layers,
            final_norm: up(&self.final_norm)?,
            lm_head: opt(&self.lm_head)?,
        })
    }
}

/// `y[m, n] = sum_k x[m, k] w[n, k]` over bf16 weights.
pub fn matmul(x: &[f32], rows: usize, w: &[u16], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * n];
    for m in 0..rows {
        let xr = &x[m * k..(m + 1) * k];
        for (j, out) in y[m * n..(m + 1) * n].iter_mut().enumerate() {
            let wr = &w[j * k..(j + 1) * k];
            *out = xr
                .iter()
                .zip(wr)
                .map(|(&a, &b)| a as f64 * f(b) as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

/// RMS norm of each row, rounded to bf16 as the kernel's output is.
pub fn rmsnorm(x: &[f32], w: &[u16], eps: f32) -> Vec<f32> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter().zip(w).map(move |(&v, &g)| round(v * r * f(g)))
        })
        .collect()
}

/// The CPU forward with its own KV cache (f32 values rounded to bf16, as the GPU stores them).
pub struct Reference {
    shape: Shape,
    w: HostWeights,
    cos: Vec<f32>,
    sin: Vec<f32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    max_ctx: usize,
}

impl Reference {
    pub fn new(shape: Shape, w: HostWeights, max_ctx: usize) -> Self {
        let (cos, sin) = rope_tables(&shape, max_ctx);
        let cache = shape.kv_heads * max_ctx * shape.head_dim;
        let k = vec![vec![0f32; cache]; shape.layers];
        let v = k.clone();
        Self {
            shape,
            w,
            cos,
            sin,
            k,
            v,
            max_ctx,
        }
    }

    /// Logits `[rows, vocab]` of `tokens` at positions `pos0..`, as [`crate::Step::forward`].
    pub fn forward(&mut self, tokens: &[u32], pos0: usize) -> Vec<f32> {
        let sh = self.shape.clone();
        let (h, hd, rows) = (sh.hidden, sh.head_dim, tokens.len());
        let half = hd / 2;
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| {
                self.w.embed[t as usize * h..(t as usize + 1) * h]
                    .iter()
                    .map(|&b| f(b))
            })
            .collect();
        let group = sh.heads / sh.kv_heads;
        for l in 0..sh.layers {
            let lw = self.w.layers[l].clone();
            let xn = rmsnorm(&x, &lw.attn_norm, sh.rms_eps);
            let mut qkv = matmul(&xn, rows, &lw.qkv, sh.qkv_width(), h);
            if let Some(b) = &lw.qkv_bias {
                for row in qkv.chunks_mut(sh.qkv_width()) {
                    row.iter_mut().zip(b).for_each(|(v, &bb)| *v += f(bb));
                }
            }
            let mut q = vec![0f32; rows * sh.heads * hd];
            for m in 0..rows {
                let pos = pos0 + m;
                for head in 0..sh.heads + 2 * sh.kv_heads {
                    let src = &qkv[m * sh.qkv_width() + head * hd..][..hd];
                    if head >= sh.heads + sh.kv_heads {
                        let kv = head - sh.heads - sh.kv_heads;
                        let at = (kv * self.max_ctx + pos) * hd;
                        for (d, &s) in src.iter().enumerate() {
                            self.v[l][at + d] = round(s);
                        }
                        continue;
                    }
                    let mut a: Vec<f32> = src.to_vec();
                    let nw = if head < sh.heads {
                        &lw.q_norm
                    } else {
                        &lw.k_norm
                    };
                    if let Some(nw) = nw {
                        let r = 1.0
                            / (a.iter().map(|v| v * v).sum::<f32>() / hd as f32 + sh.rms_eps)
                                .sqrt();
                        a.iter_mut().zip(nw).for_each(|(v, &g)| *v = *v * r * f(g));
                    }
                    let mut out = vec![0f32; hd];
                    for i in 0..half {
                        let (c, s) = (self.cos[pos * half + i], self.sin[pos * half + i]);
                        out[i] = a[i] * c - a[i + half] * s;
                        out[i + half] = a[i + half] * c + a[i] * s;
                    }
                    if head < sh.heads {
                        q[(m * sh.heads + head) * hd..][..hd].copy_from_slice(&out);
                    } else {
                        let at = ((head - sh.heads) * self.max_ctx + pos) * hd;
                        for (dst, &v) in self.k[l][at..at + hd].iter_mut().zip(&out) {
                            *dst = round(v);
                        }
                    }
                }
            }
            let scale = 1.0 / (hd as f32).sqrt();
            let mut attn = vec![0f32; rows * sh.heads * hd];
            for m in 0..rows {
                for head in 0..sh.heads {
                    let kv = head / group;
                    let qr = &q[(m * sh.heads + head) * hd..][..hd];
                    let n = pos0 + m + 1;
                    let scores: Vec<f32> = (0..n)
                        .map(|j| {
                            let kr = &self.k[l][(kv * self.max_ctx + j) * hd..][..hd];
                            qr.iter().zip(kr).map(|(a, b)| a * scale * b).sum()
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    for d in 0..hd {
                        let o: f32 = (0..n)
                            .map(|j| e[j] * self.v[l][(kv * self.max_ctx + j) * hd + d])
                            .sum();
                        attn[(m * sh.heads + head) * hd + d] = round(o / sum);
                    }
                }
            }
            let o = matmul(&attn, rows, &lw.o, h, sh.heads * hd);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rmsnorm(&x, &lw.mlp_norm, sh.rms_eps);
            let gu = matmul(&xn, rows, &lw.gate_up, 2 * sh.intermediate, h);
            let act: Vec<f32> = gu
                .chunks(2)
                .map(|p| round(p[0] / (1.0 + (-p[0]).exp()) * p[1]))
                .collect();
            let d = matmul(&act, rows, &lw.down, h, sh.intermediate);
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
        let xn = rmsnorm(&x, &self.w.final_norm, sh.rms_eps);
        let lm = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        matmul(&xn, rows, lm, sh.vocab, h)
    }
}

/// `|a - b| / |b|` over two vectors (the check's error measure).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(qk_norm: bool, bias: bool) -> Shape {
        Shape {
            vocab: 64,
            hidden: 64,
            intermediate: 96,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rms_eps: 1e-6,
            rope_theta: 10_000.0,
            tied_embeddings: bias,
            qkv_bias: bias,
            qk_norm,
        }
    }

    #[test]
    fn a_window_gives_the_logits_of_its_rows_run_one_by_one() {
        for (qk, bias) in [(false, false), (true, false), (false, true)] {
            let shape = tiny(qk, bias);
            let w = HostWeights::random(&shape, 7);
            let tokens = [3u32, 17, 40, 9, 63, 0];
            let mut window = Reference::new(shape.clone(), w.clone(), 16);
            window.forward(&tokens[..2], 0);
            let all = window.forward(&tokens[2..], 2);
            let mut single = Reference::new(shape.clone(), w, 16);
            single.forward(&tokens[..2], 0);
            for (i, &t) in tokens[2..].iter().enumerate() {
                let row = single.forward(&[t], 2 + i);
                let err = rel_err(&row, &all[i * shape.vocab..(i + 1) * shape.vocab]);
                assert!(err < 1e-5, "row {i} (qk_norm {qk}, bias {bias}): {err}");
            }
        }
    }

    #[test]
    fn rewriting_positions_forgets_what_was_there() {
        // A verify window that was rejected is overwritten by the next one: the logits after
        // the rewrite equal those of a sequence that never held the rejected tokens.
        let shape = tiny(true, false);
        let w = HostWeights::random(&shape, 3);
        let mut a = Reference::new(shape.clone(), w.clone(), 16);
        a.forward(&[1, 2, 3], 0);
        a.forward(&[50, 51, 52, 53], 3);
        let after = a.forward(&[4, 5], 3);
        let mut b = Reference::new(shape, w, 16);
        b.forward(&[1, 2, 3], 0);
        assert_eq!(after, b.forward(&[4, 5], 3));
        assert_ne!(after, a.forward(&[6, 5], 3), "the tokens must matter");
    }

    #[test]
    fn rmsnorm_and_matmul_compute_their_definitions() {
        let w = [bits(1.0), bits(2.0)];
        // rms of (3, 4) is sqrt(12.5).
        let y = rmsnorm(&[3.0, 4.0], &w, 0.0);
        let r = 12.5f32.sqrt();
        assert_eq!(y, vec![round(3.0 / r), round(8.0 / r)]);
        let m = matmul(
            &[1.0, 2.0, 3.0, 4.0],
            2,
            &[bits(1.0), bits(0.5), bits(-1.0), bits(2.0)],
            2,
            2,
        );
        assert_eq!(m, vec![2.0, 3.0, 5.0, 5.0]);
    }
}
