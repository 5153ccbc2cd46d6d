//! The DFlash backbone (also DSpark's): context rows from the target's taps become K/V of the
//! draft layers; the block `[anchor, MASK × (B − 1)]` attends to them and to itself, in both
//! directions. A port of z-lab `dflash/model.py` (`DFlashDraftModel.forward`,
//! `Qwen3DFlashAttention`), the same forward as DeepSpec's `Qwen3DSparkModel._forward_backbone`.
//!
//! ```text
//! h_ctx = hidden_norm(fc(concat taps))                 one row per accepted position (cached)
//! per layer:  K_ctx = rope(k_norm(k_proj(h_ctx)))  V_ctx = v_proj(h_ctx)       (no input norm)
//!             xn = input_layernorm(x)                   x: the block rows
//!             q, k, v of xn (q/k normed per head, rope at the block's positions)
//!             x += o_proj(softmax(q [K_ctx; k]^T / √d) [V_ctx; v])             (no mask)
//!             x += mlp(post_attention_layernorm(x))
//! out = norm(x)
//!
//! scores of one K/V head, g query heads per K/V head, block of B rows:
//!             ctx columns (0..n)        block columns (n..n+B)
//!  q rows   [ all visible             | all visible ]       (g × B rows)
//! ```

use candle_core::{Tensor, D};
use specula_models::layers::{Linear, Mlp, RmsNorm, Rope, RopeStyle};

use crate::config::DraftConfig;
use crate::tensors::Tensors;
use crate::Error;

/// One draft decoder layer.
struct Layer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// The backbone's weights.
pub struct Backbone {
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

/// A session's context: per layer, K (after k_norm and RoPE) and V of every accepted position
/// the drafter has taps for, `[positions, kv_heads × head_dim]` row-major.
#[derive(Debug, Clone, Default)]
pub struct Context {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    rows: usize,
}

impl Context {
    /// Number of cached positions.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// One session's block in a batched forward.
pub struct BlockAsk<'a> {
    /// The session's cached context.
    pub context: &'a Context,
    /// `[B, hidden]` block embeddings.
    pub embeddings: Tensor,
    /// Absolute position of the anchor (the block's first row).
    pub pos: usize,
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}

impl Backbone {
    /// Loads the backbone from the drafter's tensors; RoPE tables cover `max_pos` positions.
    ///
    /// # Errors
    /// [`Error::Weights`] for a missing or misshapen tensor.
    pub fn load(c: &DraftConfig, t: &Tensors, max_pos: usize) -> Result<Self, Error> {
        let (h, hd, eps) = (c.hidden_size, c.head_dim, c.rms_norm_eps);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let layers = (0..c.num_layers)
            .map(|l| {
                let p = format!("layers.{l}");
                let a = format!("{p}.self_attn");
                let i = c.intermediate_size;
                Ok(Layer {
                    input_layernorm: t.norm(&format!("{p}.input_layernorm"), h, eps)?,
                    q_proj: t.linear(&format!("{a}.q_proj"), q, h, c.attention_bias)?,
                    k_proj: t.linear(&format!("{a}.k_proj"), kv, h, c.attention_bias)?,
                    v_proj: t.linear(&format!("{a}.v_proj"), kv, h, c.attention_bias)?,
                    o_proj: t.linear(&format!("{a}.o_proj"), h, q, c.attention_bias)?,
                    q_norm: t.norm(&format!("{a}.q_norm"), hd, eps)?,
                    k_norm: t.norm(&format!("{a}.k_norm"), hd, eps)?,
                    post_attention_layernorm: t.norm(
                        &format!("{p}.post_attention_layernorm"),
                        h,
                        eps,
                    )?,
                    mlp: Mlp {
                        gate_proj: t.linear(&format!("{p}.mlp.gate_proj"), i, h, false)?,
                        up_proj: t.linear(&format!("{p}.mlp.up_proj"), i, h, false)?,
                        down_proj: t.linear(&format!("{p}.mlp.down_proj"), h, i, false)?,
                    },
                })
            })
            .collect::<Result<_, Error>>()?;
        let taps = c.target_layer_ids.len();
        Ok(Backbone {
            fc: t.linear("fc", h, taps * h, false)?,
            hidden_norm: t.norm("hidden_norm", h, eps)?,
            layers,
            norm: t.norm("norm", h, eps)?,
            rope: Rope::new(hd, max_pos, c.rope_theta, RopeStyle::HalfSplit).map_err(err)?,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
        })
    }

    /// Appends positions `pos..pos + rows` to `context` from their concatenated tap features
    /// `[rows, n_taps × hidden]`.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch or positions past the RoPE tables.
    pub fn extend(
        &self,
        context: &mut Context,
        features: &Tensor,
        pos: usize,
    ) -> Result<(), Error> {
        let rows = features.dims2().map_err(err)?.0;
        if rows == 0 {
            return Ok(());
        }
        // PyTorch: target_hidden = self.hidden_norm(self.fc(target_hidden))
        let h_ctx = self
            .hidden_norm
            .forward(&self.fc.forward(features).map_err(err)?)
            .map_err(err)?;
        if context.k.is_empty() {
            context.k = vec![Vec::new(); self.layers.len()];
            context.v = vec![Vec::new(); self.layers.len()];
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let k = self.heads(
                &layer.k_proj.forward(&h_ctx).map_err(err)?,
                self.num_kv_heads,
            )?;
            let k = self.rope_heads(&layer_norm_heads(&layer.k_norm, &k)?, pos)?;
            // [kv_heads, rows, d] -> [rows, kv_heads * d]
            let k = k.transpose(0, 1).map_err(err)?.flatten_all().map_err(err)?;
            let v = layer
                .v_proj
                .forward(&h_ctx)
                .map_err(err)?
                .flatten_all()
                .map_err(err)?;
            context.k[l].extend(k.to_vec1::<f32>().map_err(err)?);
            context.v[l].extend(v.to_vec1::<f32>().map_err(err)?);
        }
        context.rows += rows;
        Ok(())
    }

    /// Rotates `[heads, rows, d]`, row `r` at position `pos + r` (the runtime's [`Rope`] works
    /// in place on host rows laid out `[rows][heads][d]`).
    fn rope_heads(&self, xs: &Tensor, pos: usize) -> Result<Tensor, Error> {
        let (heads, rows, d) = xs.dims3().map_err(err)?;
        let mut data: Vec<f32> = xs
            .transpose(0, 1)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .map_err(err)?;
        let positions: Vec<usize> = (pos..pos + rows).collect();
        self.rope.apply(&mut data, heads, &positions).map_err(err)?;
        Tensor::from_vec(data, (rows, heads, d), xs.device())
            .and_then(|t| t.transpose(0, 1))
            .and_then(|t| t.contiguous())
            .map_err(err)
    }

    /// `[rows, heads × d]` → `[heads, rows, d]` (contiguous).
    fn heads(&self, xs: &Tensor, heads: usize) -> Result<Tensor, Error> {
        let rows = xs.dims2().map_err(err)?.0;
        xs.reshape((rows, heads, self.head_dim))
            .and_then(|x| x.transpose(0, 1))
            .and_then(|x| x.contiguous())
            .map_err(err)
    }

    /// Runs every ask's block through the layers in one batch (row-wise ops over all rows,
    /// attention per session) and returns each block's normed hidden rows `[B, hidden]`.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch or positions past the RoPE tables.
    pub fn forward(&self, asks: &[BlockAsk<'_>]) -> Result<Vec<Tensor>, Error> {
        if asks.is_empty() {
            return Ok(Vec::new());
        }
        let sizes: Vec<usize> = asks
            .iter()
            .map(|a| a.embeddings.dims2().map(|d| d.0))
            .collect::<candle_core::Result<_>>()
            .map_err(err)?;
        let embeddings: Vec<&Tensor> = asks.iter().map(|a| &a.embeddings).collect();
        let mut x = Tensor::cat(&embeddings, 0).map_err(err)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = layer.input_layernorm.forward(&x).map_err(err)?;
            let q = layer.q_proj.forward(&xn).map_err(err)?;
            let k = layer.k_proj.forward(&xn).map_err(err)?;
            let v = layer.v_proj.forward(&xn).map_err(err)?;
            let mut outs = Vec::with_capacity(asks.len());
            let mut at = 0;
            for (ask, &b) in asks.iter().zip(&sizes) {
                let rows = |t: &Tensor| t.narrow(0, at, b).map_err(err);
                outs.push(self.attend(l, layer, ask, &rows(&q)?, &rows(&k)?, &rows(&v)?)?);
                at += b;
            }
            let attn = Tensor::cat(&outs, 0).map_err(err)?;
            x = (x + layer.o_proj.forward(&attn).map_err(err)?).map_err(err)?;
            let mlp = layer
                .mlp
                .forward(&layer.post_attention_layernorm.forward(&x).map_err(err)?)
                .map_err(err)?;
            x = (x + mlp).map_err(err)?;
        }
        let out = self.norm.forward(&x).map_err(err)?;
        let mut at = 0;
        sizes
            .iter()
            .map(|&b| {
                let t = out.narrow(0, at, b).map_err(err);
                at += b;
                t
            })
            .collect()
    }

    /// One session's attention in layer `l`: block queries over `[context; block]` keys.
    fn attend(
        &self,
        l: usize,
        layer: &Layer,
        ask: &BlockAsk<'_>,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, Error> {
        let (b, d) = (q.dims2().map_err(err)?.0, self.head_dim);
        let (nh, kvh) = (self.num_heads, self.num_kv_heads);
        let groups = nh / kvh;
        let q = self.rope_heads(
            &layer_norm_heads(&layer.q_norm, &self.heads(q, nh)?)?,
            ask.pos,
        )?;
        let kb = self.rope_heads(
            &layer_norm_heads(&layer.k_norm, &self.heads(k, kvh)?)?,
            ask.pos,
        )?;
        let vb = self.heads(v, kvh)?;
        let n = ask.context.rows;
        let device = q.device();
        let (keys, values) = match n {
            0 => (kb, vb),
            _ => {
                let ctx = |data: &[f32]| {
                    Tensor::from_slice(data, (n, kvh, d), device)
                        .and_then(|t| t.transpose(0, 1))
                        .map_err(err)
                };
                let kc = ctx(&ask.context.k[l])?;
                let vc = ctx(&ask.context.v[l])?;
                (
                    Tensor::cat(&[&kc, &kb], 1).map_err(err)?,
                    Tensor::cat(&[&vc, &vb], 1).map_err(err)?,
                )
            }
        };
        // Query head h = kv * groups + g shares K/V head kv (HF repeat_kv).
        let q = q.reshape((kvh, groups * b, d)).map_err(err)?;
        let scale = 1.0 / (d as f64).sqrt();
        let scores = (q
            .matmul(&keys.t().map_err(err)?.contiguous().map_err(err)?)
            .map_err(err)?
            * scale)
            .map_err(err)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores).map_err(err)?;
        let out = probs
            .matmul(&values.contiguous().map_err(err)?)
            .map_err(err)?;
        out.reshape((nh, b, d))
            .and_then(|o| o.transpose(0, 1))
            .and_then(|o| o.reshape((b, nh * d)))
            .map_err(err)
    }
}

/// RMSNorm over the last dim of `[heads, rows, d]`.
fn layer_norm_heads(norm: &RmsNorm, xs: &Tensor) -> Result<Tensor, Error> {
    norm.forward(xs).map_err(err)
}

/// Maximum over the last dim, as ids.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, Error> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(err)
}
