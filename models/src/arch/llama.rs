//! The llama block, with the switches of qwen2 (q/k/v biases) and qwen3 (q/k norms). Follows
//! HF `modeling_llama.py` / candle-transformers `models/llama.rs`, over the shared
//! [`crate::layers`] and the packed batch (see [`crate::arch::Architecture`]).

use candle_core::Tensor;

use crate::arch::{Architecture, Checkpoint};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_pool::{KvLayout, KvPool};
use crate::layers::attention::{AttnBatch, KvSlot};
use crate::layers::{Attention, Embedding, Linear, Mlp, RmsNorm, Rope, RopeStyle};
use crate::loader::WeightSource;
use crate::weights::Bias;

/// What distinguishes one llama-family architecture from another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switches {
    /// The canonical name (`llama`, `qwen2`, `qwen3`).
    pub name: &'static str,
    /// Rope layout of q/k in GGUF files of this architecture (HF files are always
    /// [`RopeStyle::HalfSplit`]).
    pub gguf_rope: RopeStyle,
    /// q/k/v projections always have biases (qwen2).
    pub qkv_bias: bool,
    /// q and k have per-head RMS norms (qwen3).
    pub qk_norm: bool,
}

impl Switches {
    /// The switches of GGUF `general.architecture` / HF `model_type` `name`, if a llama.
    pub fn of(name: &str) -> Option<Self> {
        let s = |name, gguf_rope, qkv_bias, qk_norm| Switches {
            name,
            gguf_rope,
            qkv_bias,
            qk_norm,
        };
        match name {
            // llama.cpp's converter permutes llama q/k rows (mistral converts as llama).
            "llama" | "mistral" => Some(s("llama", RopeStyle::Interleaved, false, false)),
            "qwen2" => Some(s("qwen2", RopeStyle::HalfSplit, true, false)),
            "qwen3" => Some(s("qwen3", RopeStyle::HalfSplit, false, true)),
            _ => None,
        }
    }
}

/// One decoder layer (`LlamaDecoderLayer`).
#[derive(Clone, Debug)]
struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// A llama-family model.
#[derive(Clone, Debug)]
pub struct Llama {
    name: &'static str,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    hidden: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Llama {
    /// Builds the model from `weights` (a checkpoint or random).
    ///
    /// # Errors
    /// [`crate::Error::Missing`] / [`crate::Error::InvalidModel`] for absent or misshapen tensors.
    pub fn load(
        cfg: &ModelConfig,
        spec: Switches,
        weights: &mut dyn WeightSource,
        from: Checkpoint,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (n_heads, kv_heads) = (cfg.num_attention_heads, cfg.kv_heads());
        let eps = cfg.rms_norm_eps;
        let qkv_bias = match spec.qkv_bias || cfg.attention_bias {
            true => Bias::Required,
            false => Bias::No,
        };
        let (embed_tokens, lm_head) =
            weights.embedding_and_head((cfg.vocab_size, h), cfg.tie_word_embeddings)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let qk_norm = |w: &mut dyn WeightSource, which: &str| -> Result<Option<RmsNorm>> {
                match spec.qk_norm || cfg.qk_norm {
                    true => Ok(Some(RmsNorm::new(
                        w.vector(&format!("{p}.self_attn.{which}.weight"), hd)?,
                        eps,
                    )?)),
                    false => Ok(None),
                }
            };
            let self_attn = Attention {
                q_proj: weights.linear(
                    &format!("{p}.self_attn.q_proj"),
                    (n_heads * hd, h),
                    qkv_bias,
                )?,
                k_proj: weights.linear(
                    &format!("{p}.self_attn.k_proj"),
                    (kv_heads * hd, h),
                    qkv_bias,
                )?,
                v_proj: weights.linear(
                    &format!("{p}.self_attn.v_proj"),
                    (kv_heads * hd, h),
                    qkv_bias,
                )?,
                o_proj: weights.linear(
                    &format!("{p}.self_attn.o_proj"),
                    (h, n_heads * hd),
                    Bias::IfPresent,
                )?,
                q_norm: qk_norm(weights, "q_norm")?,
                k_norm: qk_norm(weights, "k_norm")?,
                n_heads,
                kv_heads,
                head_dim: hd,
            };
            let i = cfg.intermediate_size;
            let mlp = Mlp {
                gate_proj: weights.linear(&format!("{p}.mlp.gate_proj"), (i, h), Bias::No)?,
                up_proj: weights.linear(&format!("{p}.mlp.up_proj"), (i, h), Bias::No)?,
                down_proj: weights.linear(&format!("{p}.mlp.down_proj"), (h, i), Bias::No)?,
            };
            layers.push(Block {
                input_layernorm: RmsNorm::new(
                    weights.vector(&format!("{p}.input_layernorm.weight"), h)?,
                    eps,
                )?,
                self_attn,
                post_attention_layernorm: RmsNorm::new(
                    weights.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                    eps,
                )?,
                mlp,
            });
            if (l + 1) % 8 == 0 {
                tracing::info!(layer = l + 1, of = cfg.num_hidden_layers, "loaded layers");
            }
        }
        let norm = RmsNorm::new(weights.vector("model.norm.weight", h)?, eps)?;
        let rope = match from {
            Checkpoint::Gguf => spec.gguf_rope,
            Checkpoint::Hf => RopeStyle::HalfSplit,
        };
        let rope = Rope::new(hd, cfg.max_position_embeddings, cfg.rope_theta, rope)?;
        Ok(Self {
            name: spec.name,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            hidden: h,
            kv_heads,
            head_dim: hd,
        })
    }
}

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        self.name
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout::uniform(self.layers.len(), self.kv_heads, self.head_dim)
    }

    fn embedding(&self) -> &Embedding {
        &self.embed_tokens
    }

    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.embed_tokens.forward(ids)
    }

    fn layer(&self, l: usize, xs: &Tensor, batch: &AttnBatch, pool: &mut KvPool) -> Result<Tensor> {
        let block = &self.layers[l];
        // PyTorch: h = x + attn(norm(x)); out = h + mlp(norm(h))
        let attn = block.self_attn.forward(
            &block.input_layernorm.forward(xs)?,
            &self.rope,
            batch,
            pool,
            KvSlot::Own(l),
            None,
        )?;
        let h = (xs + attn)?;
        let mlp = block
            .mlp
            .forward(&block.post_attention_layernorm.forward(&h)?)?;
        Ok((h + mlp)?)
    }

    fn final_norm(&self, xs: &Tensor) -> Result<Tensor> {
        self.norm.forward(xs)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }
}
