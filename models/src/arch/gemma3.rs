//! Gemma 3 (text): HF `modeling_gemma3.py` (`Gemma3ForCausalLM`) over the shared layers and the
//! packed batch (see [`crate::arch::Architecture`]).
//!
//! What sets it apart from the llama block:
//!
//! ```text
//!  x = embed(ids) · √hidden
//!  per layer (kind: sliding, or every 6th global):
//!    h = x + post_attention_norm(attn(input_norm(x)))        sandwich norms
//!    x = h + post_ffw_norm(mlp_gelu_tanh(pre_ffw_norm(h)))
//!    attn: q/k per-head norms, rope base 10k (sliding) or rope_theta (global),
//!          scores · query_pre_attn_scalar^-½, sliding layers see the last `sliding_window` keys
//!  logits = lm_head(norm(x)), then cap · tanh(logits / cap) when final_logit_softcapping is set
//! ```
//!
//! Every norm is Gemma's `(1 + w) · x̂`. HF checkpoints store `w`; llama.cpp's converter stores
//! `1 + w` already (and transformers' GGUF loader subtracts the 1 again), so the offset is
//! added for HF weights only. The hyper-parameters a GGUF leaves out are resolved in one place,
//! [`crate::config::gemma3_defaults`]. The attention here is the shared kernel
//! ([`crate::layers::attention::kernel`]) with Gemma's scale, norms and windows; Gemma 4 and the
//! assistant drafter reuse [`GemmaAttention`].

use candle_core::Tensor;

use crate::arch::{Architecture, Checkpoint};
use crate::config::{LayerType, ModelConfig};
use crate::error::{Error, Result};
use crate::kv_pool::{KvLayout, KvPool};
use crate::layers::attention::{self, kernel, AttnBatch, KvSlot};
use crate::layers::mlp::Activation;
use crate::layers::{Embedding, Linear, Mlp, RmsNorm, Rope, RopeStyle};
use crate::loader::WeightSource;
use crate::weights::Bias;

/// The K/V projections of a layer that computes its own K/V.
#[derive(Clone, Debug)]
pub(crate) struct KvProj {
    /// `k_proj` `[kv_heads * head_dim, hidden]`.
    pub k_proj: Linear,
    /// `v_proj`; `None` when V is K before its norm (Gemma 4 `attention_k_eq_v`).
    pub v_proj: Option<Linear>,
    /// Per-head norm of K before rope.
    pub k_norm: RmsNorm,
    /// Per-head norm of V without a weight (Gemma 4), if any.
    pub v_norm: Option<RmsNorm>,
}

/// Gemma's self-attention: q/k (and v) head norms, a configured score scale and an optional
/// sliding window, over the shared kernel and the [`KvPool`].
#[derive(Clone, Debug)]
pub(crate) struct GemmaAttention {
    /// `q_proj` `[n_heads * head_dim, hidden]`.
    pub q_proj: Linear,
    /// Per-head norm of q before rope.
    pub q_norm: RmsNorm,
    /// Own K/V, or `None` for a layer that reads an earlier layer's (KV sharing).
    pub kv: Option<KvProj>,
    /// `o_proj` `[hidden, n_heads * head_dim]`.
    pub o_proj: Linear,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of K/V heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f32,
    /// Keys visible to a row, for sliding layers.
    pub window: Option<usize>,
}

impl GemmaAttention {
    /// `proj(xs)` as `[T, heads, head_dim]` with the per-head norm, on the host.
    fn heads(&self, ys: &Tensor, heads: usize, norm: Option<&RmsNorm>) -> Result<Vec<f32>> {
        attention::host_heads(ys, heads, self.head_dim, norm)
    }

    /// Attends the rows `xs` of `batch`, writing their K/V into `slot` first when the layer
    /// has its own ([`KvSlot::Own`]); a [`KvSlot::Shared`] slot is only read.
    ///
    /// # Errors
    /// On shape mismatches, a position past the rope table, or an own slot without K/V
    /// projections.
    pub fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        batch: &AttnBatch,
        pool: &mut KvPool,
        slot: KvSlot,
    ) -> Result<Tensor> {
        let t = xs.dim(0)?;
        let d = self.head_dim;
        // PyTorch: query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        let mut q = self.heads(&self.q_proj.forward(xs)?, self.n_heads, Some(&self.q_norm))?;
        rope.apply(&mut q, self.n_heads, &batch.positions)?;
        let slot = match (slot, &self.kv) {
            (KvSlot::Own(slot), Some(kv)) => {
                let k_raw = kv.k_proj.forward(xs)?;
                let mut k = self.heads(&k_raw, self.kv_heads, Some(&kv.k_norm))?;
                rope.apply(&mut k, self.kv_heads, &batch.positions)?;
                let v_raw = match &kv.v_proj {
                    Some(v_proj) => v_proj.forward(xs)?,
                    None => k_raw,
                };
                let v = self.heads(&v_raw, self.kv_heads, kv.v_norm.as_ref())?;
                attention::write_rows(pool, slot, batch, &k, &v);
                slot
            }
            (KvSlot::Shared(slot), _) => slot,
            (KvSlot::Own(slot), None) => {
                return Err(Error::InvalidRequest {
                    op: "gemma attention",
                    reason: format!("slot {slot} is written by a layer without K/V projections"),
                })
            }
        };
        let shape = kernel::Shape {
            n_heads: self.n_heads,
            kv_heads: self.kv_heads,
            head_dim: d,
            scale: self.scale,
            window: self.window,
        };
        let out = kernel::attend(&q, &batch.spans, pool, slot, shape);
        let out = Tensor::from_vec(out, (t, self.n_heads * d), xs.device())?;
        self.o_proj.forward(&out)
    }
}

/// A Gemma norm `(1 + w) · x̂` of width `len` named `name`, from either checkpoint kind.
pub(crate) fn gemma_norm(
    weights: &mut dyn WeightSource,
    name: &str,
    len: usize,
    eps: f64,
    from: Checkpoint,
) -> Result<RmsNorm> {
    let w = weights.vector(name, len)?;
    match from {
        // llama.cpp stored 1 + w.
        Checkpoint::Gguf => RmsNorm::new(w, eps),
        Checkpoint::Hf => RmsNorm::plus_one(w, eps),
    }
}

/// `cap · tanh(logits / cap)`.
pub(crate) fn softcap(logits: Tensor, cap: Option<f64>) -> Result<Tensor> {
    match cap {
        // PyTorch: logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap
        Some(cap) => Ok(((logits / cap)?.tanh()? * cap)?),
        None => Ok(logits),
    }
}

/// One decoder layer (`Gemma3DecoderLayer`).
#[derive(Clone, Debug)]
struct Block {
    input_layernorm: RmsNorm,
    self_attn: GemmaAttention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
    kind: LayerType,
}

/// A Gemma 3 text model.
#[derive(Clone, Debug)]
pub struct Gemma3 {
    embed_tokens: Embedding,
    embed_scale: f64,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope_local: Rope,
    rope_global: Rope,
    final_logit_softcapping: Option<f64>,
    hidden: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Gemma3 {
    /// Builds the model from `weights` (a checkpoint or random).
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for Gemma hyper-parameters that are not supported,
    /// [`Error::Missing`] / [`Error::InvalidModel`] for absent or misshapen tensors.
    pub fn load(
        cfg: &ModelConfig,
        weights: &mut dyn WeightSource,
        from: Checkpoint,
    ) -> Result<Self> {
        let params = cfg.gemma3().map_err(|reason| Error::InvalidRequest {
            op: "load gemma3",
            reason,
        })?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (n_heads, kv_heads) = (cfg.num_attention_heads, cfg.kv_heads());
        let eps = cfg.rms_norm_eps;
        let bias = match cfg.attention_bias {
            true => Bias::Required,
            false => Bias::No,
        };
        let (embed_tokens, lm_head) =
            weights.embedding_and_head((cfg.vocab_size, h), cfg.tie_word_embeddings)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (l, &kind) in params.layer_types.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let norm = |w: &mut dyn WeightSource, name: &str, len| {
                gemma_norm(w, &format!("{p}.{name}.weight"), len, eps, from)
            };
            let self_attn = GemmaAttention {
                q_proj: weights.linear(
                    &format!("{p}.self_attn.q_proj"),
                    (n_heads * hd, h),
                    bias,
                )?,
                q_norm: norm(weights, "self_attn.q_norm", hd)?,
                kv: Some(KvProj {
                    k_proj: weights.linear(
                        &format!("{p}.self_attn.k_proj"),
                        (kv_heads * hd, h),
                        bias,
                    )?,
                    v_proj: Some(weights.linear(
                        &format!("{p}.self_attn.v_proj"),
                        (kv_heads * hd, h),
                        bias,
                    )?),
                    k_norm: norm(weights, "self_attn.k_norm", hd)?,
                    v_norm: None,
                }),
                o_proj: weights.linear(
                    &format!("{p}.self_attn.o_proj"),
                    (h, n_heads * hd),
                    bias,
                )?,
                n_heads,
                kv_heads,
                head_dim: hd,
                scale: params.attn_scale,
                window: match kind {
                    LayerType::SlidingAttention => Some(params.sliding_window),
                    LayerType::FullAttention => None,
                },
            };
            let i = cfg.intermediate_size;
            let mlp = Mlp {
                gate_proj: weights.linear(&format!("{p}.mlp.gate_proj"), (i, h), Bias::No)?,
                up_proj: weights.linear(&format!("{p}.mlp.up_proj"), (i, h), Bias::No)?,
                down_proj: weights.linear(&format!("{p}.mlp.down_proj"), (h, i), Bias::No)?,
            };
            layers.push(Block {
                input_layernorm: norm(weights, "input_layernorm", h)?,
                self_attn,
                post_attention_layernorm: norm(weights, "post_attention_layernorm", h)?,
                pre_feedforward_layernorm: norm(weights, "pre_feedforward_layernorm", h)?,
                mlp,
                post_feedforward_layernorm: norm(weights, "post_feedforward_layernorm", h)?,
                kind,
            });
            if (l + 1) % 8 == 0 {
                tracing::info!(layer = l + 1, of = cfg.num_hidden_layers, "loaded layers");
            }
        }
        let norm = gemma_norm(weights, "model.norm.weight", h, eps, from)?;
        // Neither llama.cpp's converter nor HF permutes Gemma's q/k: half-split everywhere.
        let rope = |theta| Rope::new(hd, cfg.max_position_embeddings, theta, RopeStyle::HalfSplit);
        Ok(Self {
            embed_tokens,
            // PyTorch: embed_scale = hidden_size**0.5 (a float32 buffer)
            embed_scale: (h as f64).sqrt() as f32 as f64,
            layers,
            norm,
            lm_head,
            rope_local: rope(params.rope_local_base)?,
            rope_global: rope(params.rope_global_base)?,
            final_logit_softcapping: params.final_logit_softcapping,
            hidden: h,
            kv_heads,
            head_dim: hd,
        })
    }
}

impl Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        "gemma3"
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn kv_layout(&self) -> KvLayout {
        // Sliding layers keep every position too; the kernel reads only their window.
        KvLayout::uniform(self.layers.len(), self.kv_heads, self.head_dim)
    }

    fn embedding(&self) -> &Embedding {
        &self.embed_tokens
    }

    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        Ok((self.embed_tokens.forward(ids)? * self.embed_scale)?)
    }

    fn layer(&self, l: usize, xs: &Tensor, batch: &AttnBatch, pool: &mut KvPool) -> Result<Tensor> {
        let b = &self.layers[l];
        let rope = match b.kind {
            LayerType::SlidingAttention => &self.rope_local,
            LayerType::FullAttention => &self.rope_global,
        };
        // PyTorch: h = x + post_attention_layernorm(self_attn(input_layernorm(x)))
        let attn = b.self_attn.forward(
            &b.input_layernorm.forward(xs)?,
            rope,
            batch,
            pool,
            KvSlot::Own(l),
        )?;
        let h = (xs + b.post_attention_layernorm.forward(&attn)?)?;
        // PyTorch: out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
        let mlp = b.mlp.forward_act(
            &b.pre_feedforward_layernorm.forward(&h)?,
            Activation::GeluTanh,
        )?;
        Ok((h + b.post_feedforward_layernorm.forward(&mlp)?)?)
    }

    fn final_norm(&self, xs: &Tensor) -> Result<Tensor> {
        self.norm.forward(xs)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        softcap(self.lm_head.forward(hidden)?, self.final_logit_softcapping)
    }
}

#[cfg(test)]
mod tests;
