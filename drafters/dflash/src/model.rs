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

use candle_core::{Device, Tensor, D};
use specula_models::drafter_support::attend::{attend, host_heads, Heads};
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
        let (kvh, d) = (self.num_kv_heads, self.head_dim);
        for (l, layer) in self.layers.iter().enumerate() {
            let [k, v]: [Tensor; 2] = Linear::forward_many(&[&layer.k_proj, &layer.v_proj], &h_ctx)
                .map_err(err)?
                .try_into()
                .expect("invariant: two layers give two outputs");
            let rope = Some((&self.rope, pos));
            let k = host_heads(&k, kvh, d, Some(&layer.k_norm), rope).map_err(err)?;
            context.k[l].extend(k);
            context.v[l].extend(host_heads(&v, kvh, d, None, None).map_err(err)?);
        }
        context.rows += rows;
        Ok(())
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
            // q, k and v share their input: one pass of the quantized kernels for the three.
            let [q, k, v]: [Tensor; 3] =
                Linear::forward_many(&[&layer.q_proj, &layer.k_proj, &layer.v_proj], &xn)
                    .map_err(err)?
                    .try_into()
                    .expect("invariant: three layers give three outputs");
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

    /// One session's attention in layer `l`: block queries over `[context; block]` keys, every
    /// key visible to every row, on the context's host rows ([`attend`]: no copy of them).
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
        let rope = Some((&self.rope, ask.pos));
        let q = host_heads(q, nh, d, Some(&layer.q_norm), rope).map_err(err)?;
        let kb = host_heads(k, kvh, d, Some(&layer.k_norm), rope).map_err(err)?;
        let vb = host_heads(v, kvh, d, None, None).map_err(err)?;
        let shape = Heads {
            heads: nh,
            kv_heads: kvh,
            head_dim: d,
        };
        let ctx = &ask.context;
        let (kc, vc): (&[f32], &[f32]) = match ctx.rows {
            0 => (&[], &[]),
            _ => (&ctx.k[l], &ctx.v[l]),
        };
        let keys = ctx.rows + b;
        let out = attend(&q, &[(kc, vc), (&kb, &vb)], shape, |_| keys).map_err(err)?;
        Tensor::from_vec(out, (b, nh * d), &Device::Cpu).map_err(err)
    }
}

/// Maximum over the last dim, as ids.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, Error> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(err)
}
