//! Gemma 4 (text): HF `modeling_gemma4.py` (`Gemma4ForCausalLM`) over the shared layers, the
//! Gemma attention of [`super::gemma3`] and the packed batch.
//!
//! What it adds to Gemma 3:
//!
//! ```text
//!  norms are plain w · x̂ (not 1 + w); v gets a weightless norm; scores are not scaled (1.0)
//!  global layers: their own head_dim / K/V heads, proportional RoPE (only the first
//!    partial_rotary_factor of the pairs rotate), and with attention_k_eq_v V = K before k_norm
//!  KV sharing: the last num_kv_shared_layers layers compute no K/V and read the pool slot of
//!    the last earlier layer of their type (their MLP is twice as wide with use_double_wide_mlp)
//!  per-layer embeddings (PLE), when hidden_size_per_layer_input > 0, for layer l:
//!    ple_l = (norm(embeds · W_lᵀ · H^-½) + E_l[ids] · √P) · 2^-½
//!    x     = x + post_per_layer_input_norm(proj_l(gelu(gate_l(x)) · ple_l))
//!  every layer ends with x · layer_scalar; logits = cap · tanh(logits / cap) when set
//! ```
//!
//! The pool holds one slot per layer with its own K/V ([`Gemma4::kv_layout`]); sliding layers
//! keep every position and the kernel reads only their window. Mixture-of-experts blocks
//! (26B-A4B) are refused at load.

use candle_core::Tensor;

use crate::arch::gemma3::{softcap, GemmaAttention, KvProj};
use crate::arch::{Architecture, Checkpoint};
use crate::config::{Gemma4Layer, KvSource, LayerType, ModelConfig};
use crate::error::{Error, Result};
use crate::kv_pool::{KvLayout, KvPool, SlotShape};
use crate::layers::attention::{AttnBatch, KvSlot};
use crate::layers::linear::Weight;
use crate::layers::mlp::Activation;
use crate::layers::{Embedding, Linear, Mlp, RmsNorm, Rope, RopeStyle};
use crate::loader::WeightSource;
use crate::weights::Bias;

/// The per-layer embedding parts of one layer.
#[derive(Clone, Debug)]
struct LayerPle {
    /// `E_l`: columns `l·P..(l+1)·P` of `embed_tokens_per_layer`, `[per_layer_vocab, P]`.
    table: Tensor,
    /// `W_l`: rows `l·P..(l+1)·P` of `per_layer_model_projection`, `[P, H]`.
    projection: Linear,
    /// `per_layer_input_gate` `[P, H]`.
    gate: Linear,
    /// `per_layer_projection` `[H, P]`.
    proj: Linear,
    /// `post_per_layer_input_norm` over H.
    post_norm: RmsNorm,
}

/// One decoder layer (`Gemma4TextDecoderLayer`).
#[derive(Clone, Debug)]
struct Block {
    input_layernorm: RmsNorm,
    self_attn: GemmaAttention,
    slot: KvSlot,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
    ple: Option<LayerPle>,
    layer_scalar: f64,
    kind: LayerType,
}

/// A Gemma 4 text model.
#[derive(Clone, Debug)]
pub struct Gemma4 {
    embed_tokens: Embedding,
    embed_scale: f64,
    /// `per_layer_projection_norm` over P, shared by every layer (when PLE is on).
    ple_norm: Option<RmsNorm>,
    ple_scale: f64,
    layers: Vec<Block>,
    slots: Vec<SlotShape>,
    norm: RmsNorm,
    lm_head: Linear,
    rope_local: Rope,
    rope_global: Rope,
    final_logit_softcapping: Option<f64>,
    hidden: usize,
}

/// A dense f32 copy of a projection's weight (PLE slices need rows of it; Gemma 4 loads from
/// safetensors, so its weights are dense).
fn dense(linear: &Linear, what: &str) -> Result<Tensor> {
    match linear.weight() {
        Weight::Dense(t) => Ok(t.to_dtype(candle_core::DType::F32)?),
        _ => Err(Error::InvalidRequest {
            op: "load gemma4",
            reason: format!("{what} must be a dense tensor"),
        }),
    }
}

/// `(h as f32).sqrt()` as HF's float32 `embed_scale` buffers hold it.
fn scale_f32(x: usize) -> f64 {
    (x as f64).sqrt() as f32 as f64
}

impl Gemma4 {
    /// Builds the model from `weights` (an HF checkpoint or random weights in its layout).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a GGUF (not supported yet) or hyper-parameters that are
    /// not supported; [`Error::Missing`] / [`Error::InvalidModel`] for absent or misshapen
    /// tensors.
    pub fn load(
        cfg: &ModelConfig,
        weights: &mut dyn WeightSource,
        from: Checkpoint,
    ) -> Result<Self> {
        let bad = |reason: String| Error::InvalidRequest {
            op: "load gemma4",
            reason,
        };
        if from == Checkpoint::Gguf {
            return Err(bad(
                "Gemma 4 loads from HF safetensors only (no GGUF names yet)".into(),
            ));
        }
        let params = cfg.gemma4().map_err(bad)?;
        let (h, eps, n_heads) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.num_attention_heads);
        let device = weights.device().clone();
        let (embed_tokens, lm_head) =
            weights.embedding_and_head((cfg.vocab_size, h), cfg.tie_word_embeddings)?;
        let p_dim = params.per_layer_input;
        let n = cfg.num_hidden_layers;
        let (ple_table, ple_projection, ple_norm) = match p_dim {
            0 => (None, None, None),
            _ => {
                let table = weights.linear(
                    "model.embed_tokens_per_layer",
                    (params.per_layer_vocab, n * p_dim),
                    Bias::No,
                )?;
                let projection =
                    weights.linear("model.per_layer_model_projection", (n * p_dim, h), Bias::No)?;
                let norm = RmsNorm::new(
                    weights.vector("model.per_layer_projection_norm.weight", p_dim)?,
                    eps,
                )?;
                (
                    Some(dense(&table, "model.embed_tokens_per_layer")?),
                    Some(dense(&projection, "model.per_layer_model_projection")?),
                    Some(norm),
                )
            }
        };
        let mut slots = Vec::new();
        let mut slot_of = Vec::with_capacity(n);
        let mut layers = Vec::with_capacity(n);
        for (l, shape) in params.layers.iter().enumerate() {
            let Gemma4Layer {
                kind,
                head_dim: hd,
                kv_heads,
                kv,
                k_eq_v,
                intermediate_size: i,
            } = *shape;
            let pre = format!("model.layers.{l}");
            let norm = |w: &mut dyn WeightSource, name: &str, len| -> Result<RmsNorm> {
                RmsNorm::new(w.vector(&format!("{pre}.{name}.weight"), len)?, eps)
            };
            let linear = |w: &mut dyn WeightSource, name: &str, dims| {
                w.linear(&format!("{pre}.{name}"), dims, Bias::No)
            };
            let (slot, kv_proj) = match kv {
                KvSource::Own => {
                    slot_of.push(Some(slots.len()));
                    slots.push(SlotShape {
                        kv_heads,
                        head_dim: hd,
                    });
                    let proj = KvProj {
                        k_proj: linear(weights, "self_attn.k_proj", (kv_heads * hd, h))?,
                        v_proj: match k_eq_v {
                            true => None,
                            false => Some(linear(weights, "self_attn.v_proj", (kv_heads * hd, h))?),
                        },
                        k_norm: norm(weights, "self_attn.k_norm", hd)?,
                        v_norm: Some(RmsNorm::unit(hd, eps, &device)?),
                    };
                    (KvSlot::Own(slots.len() - 1), Some(proj))
                }
                KvSource::SharedFrom(donor) => {
                    slot_of.push(None);
                    let slot = slot_of[donor].expect("invariant: a donor layer owns a slot");
                    (KvSlot::Shared(slot), None)
                }
                KvSource::Target => {
                    return Err(bad(format!(
                        "layer {l} reads a target's K/V: an assistant, not a target model"
                    )))
                }
            };
            let self_attn = GemmaAttention {
                q_proj: linear(weights, "self_attn.q_proj", (n_heads * hd, h))?,
                q_norm: norm(weights, "self_attn.q_norm", hd)?,
                kv: kv_proj,
                o_proj: linear(weights, "self_attn.o_proj", (h, n_heads * hd))?,
                n_heads,
                kv_heads,
                head_dim: hd,
                scale: 1.0,
                window: match kind {
                    LayerType::SlidingAttention => Some(params.sliding_window),
                    LayerType::FullAttention => None,
                },
            };
            let ple = match (&ple_table, &ple_projection) {
                (Some(table), Some(projection)) => Some(LayerPle {
                    table: table.narrow(1, l * p_dim, p_dim)?.contiguous()?,
                    projection: Linear::dense(
                        projection.narrow(0, l * p_dim, p_dim)?.contiguous()?,
                        None,
                    )?,
                    gate: linear(weights, "per_layer_input_gate", (p_dim, h))?,
                    proj: linear(weights, "per_layer_projection", (h, p_dim))?,
                    post_norm: norm(weights, "post_per_layer_input_norm", h)?,
                }),
                _ => None,
            };
            let layer_scalar = weights
                .vector(&format!("{pre}.layer_scalar"), 1)?
                .to_vec1::<f32>()?[0] as f64;
            layers.push(Block {
                input_layernorm: norm(weights, "input_layernorm", h)?,
                self_attn,
                slot,
                post_attention_layernorm: norm(weights, "post_attention_layernorm", h)?,
                pre_feedforward_layernorm: norm(weights, "pre_feedforward_layernorm", h)?,
                mlp: Mlp {
                    gate_proj: linear(weights, "mlp.gate_proj", (i, h))?,
                    up_proj: linear(weights, "mlp.up_proj", (i, h))?,
                    down_proj: linear(weights, "mlp.down_proj", (h, i))?,
                },
                post_feedforward_layernorm: norm(weights, "post_feedforward_layernorm", h)?,
                ple,
                layer_scalar,
                kind,
            });
        }
        let norm = RmsNorm::new(weights.vector("model.norm.weight", h)?, eps)?;
        let head_dim_of = |kind| {
            params
                .layers
                .iter()
                .find(|l| l.kind == kind)
                .map_or(cfg.head_dim(), |l| l.head_dim)
        };
        let max_pos = cfg.max_position_embeddings;
        let local = head_dim_of(LayerType::SlidingAttention);
        let global = head_dim_of(LayerType::FullAttention);
        Ok(Self {
            embed_tokens,
            embed_scale: scale_f32(h),
            ple_norm,
            ple_scale: scale_f32(p_dim.max(1)),
            layers,
            slots,
            norm,
            lm_head,
            rope_local: Rope::new(local, max_pos, params.rope_local_base, RopeStyle::HalfSplit)?,
            rope_global: Rope::proportional(
                global,
                max_pos,
                params.rope_global_base,
                params.rope_global_partial_factor,
                RopeStyle::HalfSplit,
            )?,
            final_logit_softcapping: params.final_logit_softcapping,
            hidden: h,
        })
    }

    /// `ple_l` for the rows of `ids` (see the module docs).
    fn per_layer_input(&self, ple: &LayerPle, ids: &[u32]) -> Result<Tensor> {
        let norm = self
            .ple_norm
            .as_ref()
            .expect("invariant: layers have PLE parts only with the PLE norm");
        let embeds = self.embed(ids)?;
        // PyTorch: per_layer_model_projection(inputs_embeds) * hidden_size**-0.5, then the norm
        let proj = (ple.projection.forward(&embeds)? * (self.hidden as f64).powf(-0.5))?;
        let proj = norm.forward(&proj)?;
        let index = Tensor::new(ids, ple.table.device())?;
        let tok = (ple.table.index_select(&index, 0)? * self.ple_scale)?;
        // PyTorch: (per_layer_projection + per_layer_inputs) * 2**-0.5
        Ok(((proj + tok)? * 2f64.powf(-0.5))?)
    }
}

impl Architecture for Gemma4 {
    fn name(&self) -> &'static str {
        "gemma4"
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            slots: self.slots.clone(),
        }
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
        let attn =
            b.self_attn
                .forward(&b.input_layernorm.forward(xs)?, rope, batch, pool, b.slot)?;
        let h = (xs + b.post_attention_layernorm.forward(&attn)?)?;
        let mlp = b.mlp.forward_act(
            &b.pre_feedforward_layernorm.forward(&h)?,
            Activation::GeluTanh,
        )?;
        let mut out = (h + b.post_feedforward_layernorm.forward(&mlp)?)?;
        if let Some(ple) = &b.ple {
            // PyTorch: h = act(per_layer_input_gate(x)) * per_layer_input; x + norm(proj(h))
            let gate = ple.gate.forward(&out)?.gelu()?;
            let gated = (gate * self.per_layer_input(ple, &batch.ids)?)?;
            out = (&out + ple.post_norm.forward(&ple.proj.forward(&gated)?)?)?;
        }
        Ok((out * b.layer_scalar)?)
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
