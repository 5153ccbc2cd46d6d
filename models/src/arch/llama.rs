//! The llama block, with the switches of qwen2 (q/k/v biases) and qwen3 (q/k norms). Follows
//! HF `modeling_llama.py` / candle-transformers `models/llama.rs`, but shares
//! [`crate::layers`] and runs over the one [`KvCache`].

use candle_core::{Device, Tensor};

use crate::arch::ArchSpec;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::layers::attention::causal_mask;
use crate::layers::{Attention, Embedding, Linear, Mlp, RmsNorm, Rope, RopeStyle};
use crate::loader::WeightSource;
use crate::model::TapId;
use crate::weights::Bias;

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
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    device: Device,
}

/// Which rows of a chunk a caller wants back.
#[derive(Clone, Copy, Debug)]
pub struct RowSpec<'a> {
    /// Logits for rows `logits_from..seq` (none when `logits_from >= seq`).
    pub logits_from: usize,
    /// Taps to record.
    pub taps: &'a [TapId],
    /// Taps for rows `taps_from..seq`.
    pub taps_from: usize,
}

/// Logits and taps of one chunk; taps are in the order of [`RowSpec::taps`].
#[derive(Debug)]
pub struct ChunkOutput {
    /// `[seq - logits_from, vocab]` f32, or `None` when no row was asked.
    pub logits: Option<Tensor>,
    /// `[seq - taps_from, hidden]` f32 per requested tap (`None` when no row was asked).
    pub taps: Vec<Option<Tensor>>,
}

impl Llama {
    /// Builds the model from `weights` (a checkpoint or random), rotating q/k in the `rope`
    /// layout.
    ///
    /// # Errors
    /// [`crate::Error::Missing`] / [`crate::Error::InvalidModel`] for absent or misshapen tensors.
    pub fn load(
        cfg: &ModelConfig,
        spec: &ArchSpec,
        weights: &mut dyn WeightSource,
        rope: RopeStyle,
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
        let device = weights.device().clone();
        let rope = Rope::new(
            hd,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            rope,
            &device,
        )?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            device,
        })
    }

    /// Projects final-norm hidden states `[rows, hidden]` to logits `[rows, vocab]`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their K/V to `cache`.
    ///
    /// # Errors
    /// On an out-of-vocabulary token, a full cache or a tensor failure.
    pub fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        rows: RowSpec<'_>,
    ) -> Result<ChunkOutput> {
        let seq = tokens.len();
        let tap_rows = |xs: &Tensor| -> Result<Option<Tensor>> {
            match rows.taps_from < seq {
                true => Ok(Some(xs.narrow(0, rows.taps_from, seq - rows.taps_from)?)),
                false => Ok(None),
            }
        };
        let mut taps = vec![None; rows.taps.len()];
        let mut record = |id: TapId, xs: &Tensor| -> Result<()> {
            for (slot, _) in taps.iter_mut().zip(rows.taps).filter(|(_, t)| **t == id) {
                *slot = tap_rows(xs)?;
            }
            Ok(())
        };
        let mask = causal_mask(cache.len(), seq, &self.device)?;
        let mut xs = self.embed_tokens.forward(tokens)?;
        for (l, block) in self.layers.iter().enumerate() {
            // PyTorch: h = x + attn(norm(x)); out = h + mlp(norm(h))
            let attn = block.self_attn.forward(
                &block.input_layernorm.forward(&xs)?,
                &self.rope,
                mask.as_ref(),
                cache,
                l,
            )?;
            let h = (xs + attn)?;
            let mlp = block
                .mlp
                .forward(&block.post_attention_layernorm.forward(&h)?)?;
            xs = (h + mlp)?;
            record(TapId::Layer(l), &xs)?;
        }
        let xs = self.norm.forward(&xs)?;
        record(TapId::FinalNorm, &xs)?;
        let logits = match rows.logits_from < seq {
            true => {
                Some(self.lm_head(&xs.narrow(0, rows.logits_from, seq - rows.logits_from)?)?)
            }
            false => None,
        };
        Ok(ChunkOutput { logits, taps })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}
