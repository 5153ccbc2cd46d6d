//! One MTP module's forward: fuse, one causal decoder block with its own KV cache, out norm,
//! head. A port of vLLM's `DeepSeekMultiTokenPredictorLayer.forward` (`deepseek_mtp.py`),
//! `Qwen3NextMultiTokenPredictor.forward` (`qwen3_next_mtp.py`) and
//! `MiMoMultiTokenPredictorLayer.forward` (`mimo_mtp.py`), with the target's dense block.
//!
//! ```text
//! rows i = 0..n of a window at positions pos..pos+n: (h_i, e_i = embed(t_{pos+i+1}))
//!   e_0 := 0 when pos = 0 and the layout masks position 0 (DeepSeek, MiMo)
//!   x   = proj(cat[token_norm(e), hidden_norm(h)])          MiMo: cat[hidden_norm(h), token_norm(e)]
//!   x  += o_proj(attn(input_layernorm(x)))                   causal over [cache; window], RoPE at pos+i
//!   x  += mlp(post_attention_layernorm(x))                    K (after RoPE) and V rows enter the cache
//!   pre = x,  post = out_norm(x),  logits = head(post)        row i predicts t_{pos+i+2}
//! ```
//!
//! Which of `pre` / `post` a deeper step feeds back is [`crate::Recycle`].

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};
use specula_models::drafter_support::attend::{attend, host_heads, Heads};
use specula_models::layers::linear::Weight;
use specula_models::layers::{Linear, Mlp, RmsNorm, Rope};
use specula_models::weights::{Bias, Weights};

use crate::config::{MtpConfig, GATED};
use crate::{fwd, Error, Layout, Recycle};

/// The dense decoder block (HF `LlamaDecoderLayer` / `Qwen2DecoderLayer` / `Qwen3DecoderLayer`).
struct Block {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// How the module's own projections are kept (the drafter's default: [`LinearDType::Q8_0`],
/// which measured no loss of acceptance on the shipped SmolLM2 head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearDType {
    /// As the checkpoint stores them (safetensors: dense f32; GGUF: its blocks): the
    /// references' numerics.
    Stored,
    /// Dense projections requantized to Q8_0 at load (a quarter of the bytes per step through
    /// the multi-row qmatmul kernels; drafts may differ, output never does).
    Q8_0,
}

/// A loaded MTP module.
pub struct Mtp {
    config: MtpConfig,
    token_norm: RmsNorm,
    hidden_norm: RmsNorm,
    proj: Linear,
    block: Block,
    out_norm: RmsNorm,
    head: Option<Linear>,
    rope: Rope,
}

/// One session's MTP KV cache: K (after RoPE) and V of every row it holds, `[rows][kv_heads][d]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cache {
    k: Vec<f32>,
    v: Vec<f32>,
    rows: usize,
}

impl Cache {
    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Drops every row from `rows` on (the drafted rows of a round).
    pub fn truncate(&mut self, rows: usize, width: usize) {
        if rows < self.rows {
            self.k.truncate(rows * width);
            self.v.truncate(rows * width);
            self.rows = rows;
        }
    }
}

/// A window's outputs, `[n, hidden]` each.
#[derive(Debug, Clone)]
pub struct Step {
    /// The block's output before the out norm.
    pub pre: Tensor,
    /// After the out norm (what the head reads).
    pub post: Tensor,
}

impl Mtp {
    /// Loads the module `config` names from `weights`; RoPE tables (in `config.rope`'s style)
    /// cover `max_pos` positions.
    ///
    /// # Errors
    /// [`Error::Weights`] for a missing or misshapen tensor, a gated-attention q_proj.
    pub fn load(
        config: MtpConfig,
        weights: &mut Weights,
        max_pos: usize,
        dtype: LinearDType,
    ) -> Result<Self, Error> {
        let c = &config;
        let path = weights.path().to_path_buf();
        let bad = |e: specula_models::Error| Error::Weights {
            path: path.clone(),
            reason: e.to_string(),
        };
        let mut m = Self::load_dense(config.clone(), weights, max_pos)?;
        if dtype == LinearDType::Q8_0 {
            let b = &mut m.block;
            for (l, name) in [
                (&mut m.proj, c.names.proj.clone()),
                (&mut b.q_proj, format!("{}self_attn.q_proj", c.names.block)),
                (&mut b.k_proj, format!("{}self_attn.k_proj", c.names.block)),
                (&mut b.v_proj, format!("{}self_attn.v_proj", c.names.block)),
                (&mut b.o_proj, format!("{}self_attn.o_proj", c.names.block)),
                (
                    &mut b.mlp.gate_proj,
                    format!("{}mlp.gate_proj", c.names.block),
                ),
                (&mut b.mlp.up_proj, format!("{}mlp.up_proj", c.names.block)),
                (
                    &mut b.mlp.down_proj,
                    format!("{}mlp.down_proj", c.names.block),
                ),
            ] {
                requantize(l, weights, &name).map_err(bad)?;
            }
            if let (Some(head), Some(name)) = (&mut m.head, &c.names.head) {
                requantize(head, weights, name).map_err(bad)?;
            }
        }
        Ok(m)
    }

    /// The module as stored.
    fn load_dense(config: MtpConfig, weights: &mut Weights, max_pos: usize) -> Result<Self, Error> {
        let c = &config;
        let path = weights.path().to_path_buf();
        let bad = |e: specula_models::Error| Error::Weights {
            path: path.clone(),
            reason: e.to_string(),
        };
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_rows, kv_rows) = (c.num_heads * hd, c.num_kv_heads * hd);
        let zero_centred = c.zero_centred;
        let eps = c.rms_norm_eps;
        let norm = |w: &mut Weights, name: &str, dim: usize| -> Result<RmsNorm, Error> {
            let t = w.vector(&format!("{name}.weight")).map_err(bad)?;
            if t.dims1().map_err(fwd)? != dim {
                return Err(Error::Weights {
                    path: w.path().to_path_buf(),
                    reason: format!("{name}.weight has {:?} values, expected {dim}", t.dims()),
                });
            }
            match zero_centred {
                true => RmsNorm::plus_one(t, eps),
                false => RmsNorm::new(t, eps),
            }
            .map_err(bad)
        };
        let n = &c.names;
        let b = &n.block;
        let qkv_bias = match c.block.qkv_bias {
            true => Bias::Required,
            false => Bias::IfPresent,
        };
        let q_name = format!("{b}self_attn.q_proj");
        let q_proj = match weights.linear(&q_name, (q_rows, h), qkv_bias) {
            Ok(l) => l,
            Err(e) => {
                return Err(match weights.linear(&q_name, (2 * q_rows, h), qkv_bias) {
                    Ok(_) => Error::Weights {
                        path: path.clone(),
                        reason: GATED.to_string(),
                    },
                    Err(_) => bad(e),
                })
            }
        };
        let mut lin = |name: &str, dims, bias| weights.linear(&format!("{b}{name}"), dims, bias);
        let k_proj = lin("self_attn.k_proj", (kv_rows, h), qkv_bias).map_err(bad)?;
        let v_proj = lin("self_attn.v_proj", (kv_rows, h), qkv_bias).map_err(bad)?;
        let o_proj = lin("self_attn.o_proj", (h, q_rows), Bias::IfPresent).map_err(bad)?;
        let i = c.intermediate_size;
        let mlp = Mlp {
            gate_proj: lin("mlp.gate_proj", (i, h), Bias::No).map_err(bad)?,
            up_proj: lin("mlp.up_proj", (i, h), Bias::No).map_err(bad)?,
            down_proj: lin("mlp.down_proj", (h, i), Bias::No).map_err(bad)?,
        };
        let (q_norm, k_norm) = match c.block.qk_norm {
            true => (
                Some(norm(weights, &format!("{b}self_attn.q_norm"), hd)?),
                Some(norm(weights, &format!("{b}self_attn.k_norm"), hd)?),
            ),
            false => (None, None),
        };
        let block = Block {
            input_layernorm: norm(weights, &format!("{b}input_layernorm"), h)?,
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            post_attention_layernorm: norm(weights, &format!("{b}post_attention_layernorm"), h)?,
            mlp,
        };
        let head = match &n.head {
            Some(name) => Some(
                weights
                    .linear(name, (c.vocab_size, h), Bias::No)
                    .map_err(bad)?,
            ),
            None => None,
        };
        let rope = Rope::new(hd, max_pos, c.rope_theta, c.rope).map_err(bad)?;
        Ok(Mtp {
            token_norm: norm(weights, &n.token_norm, h)?,
            hidden_norm: norm(weights, &n.hidden_norm, h)?,
            proj: weights.linear(&n.proj, (h, 2 * h), Bias::No).map_err(bad)?,
            out_norm: norm(weights, &n.out_norm, h)?,
            block,
            head,
            rope,
            config,
        })
    }

    /// The configuration loaded.
    pub fn config(&self) -> &MtpConfig {
        &self.config
    }

    /// Floats per cached row (`kv_heads × head_dim`).
    pub fn row_width(&self) -> usize {
        self.config.num_kv_heads * self.config.head_dim
    }

    /// Whether the checkpoint brings its own head (DeepSeek `shared_head.head`).
    pub fn has_own_head(&self) -> bool {
        self.head.is_some()
    }

    /// Runs a window: `hidden` and `emb` are `[n, hidden]` (the target's hiddens at positions
    /// `pos..pos + n` and the embeddings of the tokens after them); appends its `n` rows to
    /// `cache`.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch or a position past the RoPE tables.
    pub fn forward(
        &self,
        cache: &mut Cache,
        hidden: &Tensor,
        emb: &Tensor,
        pos: usize,
    ) -> Result<Step, Error> {
        let n = hidden.dims2().map_err(fwd)?.0;
        let mut emb = emb.clone();
        if self.config.mask_position_zero && pos == 0 && n > 0 {
            // vLLM: inputs_embeds[positions == 0] = 0
            let zero = emb
                .narrow(0, 0, 1)
                .map_err(fwd)?
                .zeros_like()
                .map_err(fwd)?;
            let rest = emb.narrow(0, 1, n - 1).map_err(fwd)?;
            emb = Tensor::cat(&[&zero, &rest], 0).map_err(fwd)?;
        }
        let e = self.token_norm.forward(&emb).map_err(fwd)?;
        let h = self.hidden_norm.forward(hidden).map_err(fwd)?;
        let fused = match self.config.layout {
            Layout::MiMo => Tensor::cat(&[&h, &e], 1),
            Layout::DeepSeek | Layout::QwenNext => Tensor::cat(&[&e, &h], 1),
        }
        .map_err(fwd)?;
        let x = self.proj.forward(&fused).map_err(fwd)?;
        let b = &self.block;
        // PyTorch: h = x + attn(norm(x)); out = h + mlp(norm(h))
        let xn = b.input_layernorm.forward(&x).map_err(fwd)?;
        let attn = self.attend(cache, &xn, pos)?;
        let x = (x + b.o_proj.forward(&attn).map_err(fwd)?).map_err(fwd)?;
        let mlp = b
            .mlp
            .forward(&b.post_attention_layernorm.forward(&x).map_err(fwd)?)
            .map_err(fwd)?;
        let pre = (x + mlp).map_err(fwd)?;
        let post = self.out_norm.forward(&pre).map_err(fwd)?;
        Ok(Step { pre, post })
    }

    /// The hidden a deeper step feeds back, of `step`.
    pub fn recycled<'a>(&self, step: &'a Step) -> &'a Tensor {
        match self.config.recycle {
            Recycle::PreNorm => &step.pre,
            Recycle::PostNorm => &step.post,
        }
    }

    /// The module's own head (DeepSeek `shared_head.head`), when the checkpoint has one.
    pub fn head(&self) -> Option<&Linear> {
        self.head.as_ref()
    }

    /// Causal attention of the window's rows over `[cache; window]`; the window's K/V join
    /// the cache. q, k and v share their input: one pass of the quantized kernels for the
    /// three; the attention itself runs on the cache's host rows ([`attend`]), no copy of it.
    fn attend(&self, cache: &mut Cache, xn: &Tensor, pos: usize) -> Result<Tensor, Error> {
        let c = &self.config;
        let b = &self.block;
        let (n, d) = (xn.dims2().map_err(fwd)?.0, c.head_dim);
        let (nh, kvh) = (c.num_heads, c.num_kv_heads);
        let [q, k, v]: [Tensor; 3] = Linear::forward_many(&[&b.q_proj, &b.k_proj, &b.v_proj], xn)
            .map_err(fwd)?
            .try_into()
            .expect("invariant: three layers give three outputs");
        let rope = Some((&self.rope, pos));
        let q = host_heads(&q, nh, d, b.q_norm.as_ref(), rope).map_err(fwd)?;
        let k = host_heads(&k, kvh, d, b.k_norm.as_ref(), rope).map_err(fwd)?;
        let v = host_heads(&v, kvh, d, None, None).map_err(fwd)?;
        let m = cache.rows;
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
        cache.rows += n;
        let shape = Heads {
            heads: nh,
            kv_heads: kvh,
            head_dim: d,
        };
        // Row i (position pos + i) sees the cache and the window up to itself.
        let out = attend(&q, &[(&cache.k, &cache.v)], shape, |i| m + i + 1).map_err(fwd)?;
        Tensor::from_vec(out, (n, nh * d), &Device::Cpu).map_err(fwd)
    }
}

/// Replaces the dense `l` (`{name}.weight`, with `{name}.bias` when the checkpoint has it) by
/// its Q8_0 requantization; a quantized one, or one whose input width is not a multiple of the
/// 32-weight block, stays as it is.
fn requantize(l: &mut Linear, weights: &mut Weights, name: &str) -> specula_models::Result<()> {
    let Weight::Dense(w) = l.weight() else {
        return Ok(());
    };
    if !w.dims2()?.1.is_multiple_of(32) {
        return Ok(());
    }
    let q = QTensor::quantize(&w.to_dtype(DType::F32)?, GgmlDType::Q8_0)?;
    let bias = format!("{name}.bias");
    let bias = match weights.contains(&bias) {
        true => Some(weights.vector(&bias)?),
        false => None,
    };
    *l = Linear::quantized(Arc::new(q), bias)?;
    Ok(())
}

/// Maximum over the last dim, as ids.
///
/// # Errors
/// [`Error::Forward`] on a tensor failure.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, Error> {
    logits
        .argmax(D::Minus1)
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(fwd)
}
