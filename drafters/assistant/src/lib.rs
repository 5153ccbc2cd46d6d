//! The Gemma 4 assistant: a drafter with no K/V projections of its own, each of whose layers
//! attends over the target's K/V (transformers `Gemma4AssistantForCausalLM`,
//! `modeling_gemma4_assistant.py`; design notes: drafter-architectures.md §4).
//!
//! ```text
//!  x = pre_projection(cat[embed_target(tok) · √Hb, h])        h: target final-norm hidden
//!  per layer (sliding or full, plain w · x̂ norms, scale 1.0):
//!    q = rope(q_norm(q_proj(input_norm(x))), P)
//!    a = softmax(q Kᵀ) V  over the donor K/V of its type    sliding: the last window + 1 keys
//!    x = x + post_attn_norm(o_proj(a));  x = x + post_ffw_norm(mlp(pre_ffw_norm(x)))
//!    x = x · layer_scalar
//!  y = norm(x);  logits = lm_head(y), or centroid-masked (use_ordered_embeddings)
//!  next h = post_projection(y)
//! ```
//!
//! The donor of a draft layer is the target's last layer of the same type that owns K/V
//! ([`specula_models::config::Gemma4Params::donor_slot`]); its K are already normed and roped.
//!
//! **Positions** follow one named reference, transformers' `Gemma4AssistantCandidateGenerator`:
//! every draft step of a round uses the position `P` of the last committed token (the pending
//! one), and the donor K/V are those of positions `0..P` (the host has not run the pending token
//! yet). The drafter process that receives the donor rows over the protocol is [`drafter`].
//!
//! **Non-Gemma donors** (a llama target such as SmolLM2): every layer is `full_attention` and reads
//! the target's last layer. The checkpoint keeps Hugging Face's half-split head layout; when the
//! target's K are roped interleaved (GGUF llama files, whose converter permuted q/k rows) the
//! loader permutes each q head the same way ([`LoadFor::interleaved_k`]), so q · k is unchanged. A
//! checkpoint without `model.embed_tokens.weight` borrows the target's lm_head
//! ([`LoadFor::target_head`]). See `ASSISTANT-FORMAT.md` in the repository root.

use std::path::{Path, PathBuf};

pub mod drafter;

use candle_core::{DType, Device, Tensor};
use specula_models::config::{Gemma4Layer, LayerType, ModelConfig};
use specula_models::layers::mlp::Activation;
use specula_models::layers::{Linear, Mlp, RmsNorm, Rope, RopeStyle};
use specula_protocol::donor::DonorRows;

/// What can go wrong loading or running the assistant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint or its config is not a Gemma 4 assistant this crate runs.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Inputs of the wrong shape (donor K/V, hidden state, position).
    #[error("assistant step: {0}")]
    Input(String),
    /// The models crate failed.
    #[error(transparent)]
    Models(#[from] specula_models::Error),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// The K/V rows of one donor layer: `[rows, kv_heads, head_dim]` row-major, as the host's
/// [`specula_models::KvCache::rows`] and the protocol's `kv_layers` views give them.
#[derive(Clone, Debug)]
pub struct DonorKv<'a> {
    /// Keys (normed and roped by the target).
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Number of positions.
    pub rows: usize,
}

/// Where a draft layer reads its donor's K/V.
#[derive(Clone, Debug)]
pub enum Donor<'a> {
    /// Row-major copies (the rows a 1.1 host sends in its taps, kept by the drafter).
    Rows(DonorKv<'a>),
    /// The host's KV-pool blocks in place (protocol 1.2 donor views): layer `layer` of `rows`.
    Blocks {
        /// The session's donor rows.
        rows: DonorRows<'a>,
        /// Index of the layer in the donor layout.
        layer: usize,
    },
}

impl Donor<'_> {
    fn rows(&self) -> usize {
        match self {
            Donor::Rows(kv) => kv.rows,
            Donor::Blocks { rows, .. } => rows.len(),
        }
    }

    /// `q · k_r` for rows `first..rows` of K/V head `g`.
    fn scores(&self, g: usize, hd: usize, w: usize, q: &[f32], first: usize) -> Vec<f32> {
        match self {
            Donor::Rows(kv) => (first..kv.rows)
                .map(|r| {
                    let k = &kv.k[r * w + g * hd..r * w + (g + 1) * hd];
                    q.iter().zip(k).map(|(a, b)| a * b).sum()
                })
                .collect(),
            Donor::Blocks { rows, layer } => {
                let bs = specula_protocol::donor::DONOR_BLOCK_SIZE as usize;
                (first..rows.len())
                    .map(|r| {
                        let kt = rows.k_block(*layer, r / bs, g);
                        let off = r % bs;
                        (0..hd).map(|d| q[d] * kt[d * bs + off]).sum()
                    })
                    .collect()
            }
        }
    }

    /// `out += Σ_r p_r · v_r` over rows `first..` of K/V head `g`.
    fn mix(&self, g: usize, hd: usize, w: usize, p: &[f32], first: usize, out: &mut [f32]) {
        let bs = specula_protocol::donor::DONOR_BLOCK_SIZE as usize;
        for (r, &p) in (first..).zip(p) {
            let v = match self {
                Donor::Rows(kv) => &kv.v[r * w + g * hd..r * w + (g + 1) * hd],
                Donor::Blocks { rows, layer } => {
                    &rows.v_block(*layer, r / bs, g)[(r % bs) * hd..(r % bs + 1) * hd]
                }
            };
            for (o, v) in out.iter_mut().zip(v) {
                *o += p * v;
            }
        }
    }
}

/// How to fit a checkpoint to the target it drafts for.
#[derive(Clone, Debug, Default)]
pub struct LoadFor {
    /// The target's K are roped interleaved (`RopeLayout::Interleaved`): permute each q head
    /// from the checkpoint's half-split layout to match.
    pub interleaved_k: bool,
    /// The target's lm_head, used when the checkpoint has no `model.embed_tokens.weight`.
    pub target_head: Option<Linear>,
}

/// The assistant's vocabulary projection.
#[derive(Clone, Debug)]
enum Head {
    /// Its own tied embedding `[vocab, hidden]` (the Gemma 4 assistants).
    Own(Tensor),
    /// The target's lm_head (a checkpoint trained on it, e.g. for SmolLM2).
    Target(Linear),
}

/// The row order that turns a half-split head of width `d` into the interleaved one:
/// new row `2i + half` is old row `half · d/2 + i` (llama.cpp's `permute` of q/k).
fn interleave_rows(d: usize) -> Vec<u32> {
    (0..d).map(|j| ((j % 2) * (d / 2) + j / 2) as u32).collect()
}

/// What one draft step returns.
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// Logits over the vocabulary.
    pub logits: Vec<f32>,
    /// `post_projection(y)`: the `h` of the next step (backbone width).
    pub projected: Tensor,
}

/// Centroid masking (`Gemma4AssistantMaskedEmbedder`): only the tokens of the top-k centroids
/// get logits; every other token gets `min(selected) - 1`.
#[derive(Clone, Debug)]
struct Centroids {
    centroids: Linear,
    /// `token_ordering` as `[num_centroids][vocab / num_centroids]`.
    ordering: Vec<u32>,
    num_centroids: usize,
    top_k: usize,
}

#[derive(Clone, Debug)]
struct Block {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    q_norm: RmsNorm,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: f64,
    shape: Gemma4Layer,
}

/// A loaded assistant.
#[derive(Debug)]
pub struct Assistant {
    pre_projection: Linear,
    post_projection: Linear,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Head,
    centroids: Option<Centroids>,
    rope_local: Rope,
    rope_global: Rope,
    window: usize,
    n_heads: usize,
    backbone: usize,
    vocab: usize,
}

/// The tensors of a safetensors file by name.
struct Tensors {
    map: std::collections::HashMap<String, Tensor>,
    path: PathBuf,
}

impl Tensors {
    fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor `name` of shape `dims`, as f32 (checkpoints may be bf16 or f16).
    fn take(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let t = self.map.get(name).ok_or_else(|| Error::Invalid {
            path: self.path.clone(),
            reason: format!("no tensor {name}"),
        })?;
        if t.dims() != dims {
            return Err(Error::Invalid {
                path: self.path.clone(),
                reason: format!("{name} has shape {:?}, expected {dims:?}", t.dims()),
            });
        }
        match t.dtype() {
            DType::I64 | DType::U32 | DType::U8 => Ok(t.clone()),
            _ => Ok(t.to_dtype(DType::F32)?),
        }
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        let w = self.take(&format!("{name}.weight"), &[out, inp])?;
        Ok(Linear::dense(w.to_dtype(DType::F32)?, None)?)
    }

    fn norm(&self, name: &str, len: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm::new(
            self.take(&format!("{name}.weight"), &[len])?,
            eps,
        )?)
    }
}

impl Assistant {
    /// Loads `config.json` + `model.safetensors` from `dir` (the layout transformers saves), for
    /// a Gemma target (half-split K, own lm_head).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Invalid`] for missing or malformed files, a config that is not
    /// an assistant's, or tensors of the wrong shape.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_for(dir, &LoadFor::default())
    }

    /// Loads a checkpoint fitted to its target (see [`LoadFor`]).
    ///
    /// # Errors
    /// As [`Assistant::load`], and when the checkpoint has no lm_head and none is given, or
    /// the given one does not fit.
    pub fn load_for(dir: &Path, fit: &LoadFor) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let invalid = |reason: String| Error::Invalid {
            path: cfg_path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
            path: cfg_path.clone(),
            source,
        })?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if raw["model_type"] != "gemma4_assistant" {
            return Err(invalid(format!(
                "model_type is {}, expected \"gemma4_assistant\"",
                raw["model_type"]
            )));
        }
        let text_cfg = ModelConfig::from_hf_value(&raw["text_config"], &cfg_path)?;
        let params = text_cfg.gemma4_assistant().map_err(invalid)?;
        let backbone = raw["backbone_hidden_size"]
            .as_u64()
            .ok_or_else(|| invalid("no backbone_hidden_size".into()))?
            as usize;
        let st_path = dir.join("model.safetensors");
        let bad = |reason: String| Error::Invalid {
            path: st_path.clone(),
            reason,
        };
        let map = candle_core::safetensors::load(&st_path, &Device::Cpu)
            .map_err(|e| bad(e.to_string()))?;
        let tensors = Tensors {
            map: specula_models::int8::dequantize_map(map).map_err(|e| bad(e.to_string()))?,
            path: st_path.clone(),
        };
        let (h, eps, heads) = (
            text_cfg.hidden_size,
            text_cfg.rms_norm_eps,
            text_cfg.num_attention_heads,
        );
        let mut layers = Vec::with_capacity(params.layers.len());
        for (l, &shape) in params.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let (hd, i) = (shape.head_dim, shape.intermediate_size);
            let scalar = tensors.take(&format!("{p}.layer_scalar"), &[1])?;
            let q_name = format!("{p}.self_attn.q_proj.weight");
            let mut q_w = tensors.take(&q_name, &[heads * hd, h])?;
            let mut q_norm = tensors.take(&format!("{p}.self_attn.q_norm.weight"), &[hd])?;
            if fit.interleaved_k {
                let order = interleave_rows(hd);
                let rows: Vec<u32> = (0..heads)
                    .flat_map(|head| order.iter().map(move |&j| (head * hd) as u32 + j))
                    .collect();
                let idx = Tensor::new(rows.as_slice(), &Device::Cpu)?;
                q_w = q_w.index_select(&idx, 0)?;
                q_norm = q_norm.index_select(&Tensor::new(order.as_slice(), &Device::Cpu)?, 0)?;
            }
            layers.push(Block {
                input_layernorm: tensors.norm(&format!("{p}.input_layernorm"), h, eps)?,
                q_proj: Linear::dense(q_w, None)?,
                q_norm: RmsNorm::new(q_norm, eps)?,
                o_proj: tensors.linear(&format!("{p}.self_attn.o_proj"), h, heads * hd)?,
                post_attention_layernorm: tensors.norm(
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    eps,
                )?,
                pre_feedforward_layernorm: tensors.norm(
                    &format!("{p}.pre_feedforward_layernorm"),
                    h,
                    eps,
                )?,
                mlp: Mlp {
                    gate_proj: tensors.linear(&format!("{p}.mlp.gate_proj"), i, h)?,
                    up_proj: tensors.linear(&format!("{p}.mlp.up_proj"), i, h)?,
                    down_proj: tensors.linear(&format!("{p}.mlp.down_proj"), h, i)?,
                },
                post_feedforward_layernorm: tensors.norm(
                    &format!("{p}.post_feedforward_layernorm"),
                    h,
                    eps,
                )?,
                layer_scalar: scalar.to_dtype(DType::F32)?.to_vec1::<f32>()?[0] as f64,
                shape,
            });
        }
        let vocab = text_cfg.vocab_size;
        let centroids = match raw["use_ordered_embeddings"].as_bool() == Some(true) {
            false => None,
            true => {
                let n = raw["num_centroids"].as_u64().unwrap_or(2048) as usize;
                let top_k = raw["centroid_intermediate_top_k"].as_u64().unwrap_or(32) as usize;
                if n == 0 || !vocab.is_multiple_of(n) || top_k == 0 || top_k > n {
                    return Err(invalid(format!(
                        "{n} centroids (top {top_k}) do not divide the vocabulary of {vocab}"
                    )));
                }
                let ordering = tensors.take("masked_embedding.token_ordering", &[vocab])?;
                let ordering: Vec<u32> = ordering
                    .to_dtype(DType::I64)?
                    .to_vec1::<i64>()?
                    .into_iter()
                    .map(|t| u32::try_from(t).ok().filter(|&t| (t as usize) < vocab))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        invalid("token_ordering holds an id outside the vocabulary".into())
                    })?;
                Some(Centroids {
                    centroids: tensors.linear("masked_embedding.centroids", n, h)?,
                    ordering,
                    num_centroids: n,
                    top_k,
                })
            }
        };
        let head_dim_of = |kind| {
            params
                .layers
                .iter()
                .find(|l| l.kind == kind)
                .map_or(text_cfg.head_dim(), |l| l.head_dim)
        };
        let max_pos = text_cfg.max_position_embeddings;
        let style = match fit.interleaved_k {
            true => RopeStyle::Interleaved,
            false => RopeStyle::HalfSplit,
        };
        let lm_head = match (tensors.has("model.embed_tokens.weight"), &fit.target_head) {
            (true, _) => Head::Own(tensors.take("model.embed_tokens.weight", &[vocab, h])?),
            (false, Some(head)) if h == backbone && centroids.is_none() => {
                Head::Target(head.clone())
            }
            (false, _) => {
                return Err(Error::Invalid {
                    path: st_path,
                    reason: format!(
                        "no model.embed_tokens.weight, and the target's lm_head cannot stand in \
                         (it needs hidden_size {h} = backbone_hidden_size {backbone} and no \
                         centroid masking)"
                    ),
                })
            }
        };
        if fit.interleaved_k && params.rope_global_partial_factor != 1.0 {
            return Err(invalid(
                "partial rotary factors are not supported for an interleaved-RoPE target".into(),
            ));
        }
        Ok(Self {
            pre_projection: tensors.linear("pre_projection", h, 2 * backbone)?,
            post_projection: tensors.linear("post_projection", backbone, h)?,
            layers,
            norm: tensors.norm("model.norm", h, eps)?,
            lm_head,
            centroids,
            rope_local: Rope::new(
                head_dim_of(LayerType::SlidingAttention),
                max_pos,
                params.rope_local_base,
                style,
            )?,
            rope_global: Rope::proportional(
                head_dim_of(LayerType::FullAttention),
                max_pos,
                params.rope_global_base,
                params.rope_global_partial_factor,
                style,
            )?,
            window: params.sliding_window,
            n_heads: heads,
            backbone,
            vocab,
        })
    }

    /// The backbone (target) hidden width.
    pub fn backbone(&self) -> usize {
        self.backbone
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Per layer, its kind and the `(kv_heads, head_dim)` it reads from its donor.
    pub fn layer_shapes(&self) -> Vec<(LayerType, (usize, usize))> {
        self.layers
            .iter()
            .map(|b| (b.shape.kind, (b.shape.kv_heads, b.shape.head_dim)))
            .collect()
    }

    /// The layer kinds, in order (each reads the donor of its kind).
    pub fn layer_kinds(&self) -> Vec<LayerType> {
        self.layers.iter().map(|b| b.shape.kind).collect()
    }

    /// One draft step: `embed` = the target's scaled embedding of the last token and `hidden`
    /// = the target's final-norm hidden state (or the previous step's
    /// [`StepOutput::projected`]), both `[backbone]`; `pos` = the pending position `P`;
    /// `donor(kind)` = the target's K/V rows `0..P` of that kind's donor layer.
    ///
    /// # Errors
    /// [`Error::Input`] for inputs of the wrong shape or a missing donor.
    pub fn step<'a>(
        &self,
        embed: &Tensor,
        hidden: &Tensor,
        pos: usize,
        donor: impl Fn(LayerType) -> Option<Donor<'a>>,
    ) -> Result<StepOutput> {
        for (what, t) in [("embedding", embed), ("hidden state", hidden)] {
            if t.elem_count() != self.backbone {
                return Err(Error::Input(format!(
                    "{what} has {} values, the backbone {}",
                    t.elem_count(),
                    self.backbone
                )));
            }
        }
        let input = Tensor::cat(
            &[
                embed.reshape((1, self.backbone))?,
                hidden.reshape((1, self.backbone))?,
            ],
            1,
        )?;
        let mut x = self.pre_projection.forward(&input)?;
        for b in &self.layers {
            let kv = donor(b.shape.kind).ok_or_else(|| {
                Error::Input(format!("no donor K/V for a {:?} layer", b.shape.kind))
            })?;
            let attn = self.attend(b, &b.input_layernorm.forward(&x)?, pos, &kv)?;
            x = (x + b
                .post_attention_layernorm
                .forward(&b.o_proj.forward(&attn)?)?)?;
            let mlp = b.mlp.forward_act(
                &b.pre_feedforward_layernorm.forward(&x)?,
                Activation::GeluTanh,
            )?;
            x = ((x + b.post_feedforward_layernorm.forward(&mlp)?)? * b.layer_scalar)?;
        }
        let y = self.norm.forward(&x)?;
        let logits = match (&self.centroids, &self.lm_head) {
            (None, Head::Own(w)) => y.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?,
            (None, Head::Target(head)) => head.forward(&y)?.flatten_all()?.to_vec1::<f32>()?,
            (Some(c), Head::Own(w)) => self.masked_logits(c, w, &y)?,
            (Some(_), Head::Target(_)) => unreachable!("invariant: refused at load"),
        };
        Ok(StepOutput {
            logits,
            projected: self.post_projection.forward(&y)?.flatten_all()?,
        })
    }

    /// q-only attention of one row over the donor K/V, scale 1.0; sliding layers see the last
    /// `window + 1` donor positions (transformers' flipped, inclusive bidirectional mask).
    fn attend(&self, b: &Block, xs: &Tensor, pos: usize, kv: &Donor<'_>) -> Result<Tensor> {
        let (hd, kvh) = (b.shape.head_dim, b.shape.kv_heads);
        let w = kvh * hd;
        match kv {
            Donor::Rows(kv) if kv.k.len() != kv.rows * w || kv.v.len() != kv.rows * w => {
                return Err(Error::Input(format!(
                    "donor K/V of {} and {} values for {} rows of {kvh} heads of {hd}",
                    kv.k.len(),
                    kv.v.len(),
                    kv.rows
                )));
            }
            Donor::Blocks { rows, layer } => {
                let l = &rows.layers()[*layer];
                if (l.kv_heads as usize, l.head_dim as usize) != (kvh, hd) {
                    return Err(Error::Input(format!(
                        "donor layer {} has {} heads of {}, this layer reads {kvh} of {hd}",
                        l.layer, l.kv_heads, l.head_dim
                    )));
                }
            }
            Donor::Rows(_) => {}
        }
        if kv.rows() == 0 {
            return Err(Error::Input("no donor rows".into()));
        }
        let q = b.q_proj.forward(xs)?.reshape((self.n_heads, hd))?;
        let mut q = b.q_norm.forward(&q)?.flatten_all()?.to_vec1::<f32>()?;
        let rope = match b.shape.kind {
            LayerType::SlidingAttention => &self.rope_local,
            LayerType::FullAttention => &self.rope_global,
        };
        rope.apply(&mut q, self.n_heads, &[pos])?;
        // transformers' bidirectional sliding overlay is inclusive (|q - kv| <= window), flipped
        // onto the donor's last positions: window + 1 keys.
        let first = match b.shape.kind {
            LayerType::SlidingAttention => kv.rows().saturating_sub(self.window + 1),
            LayerType::FullAttention => 0,
        };
        let groups = self.n_heads / kvh;
        let mut out = vec![0f32; self.n_heads * hd];
        for head in 0..self.n_heads {
            let g = head / groups;
            let qh = &q[head * hd..(head + 1) * hd];
            let scores = kv.scores(g, hd, w, qh, first);
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let p: Vec<f32> = exps.iter().map(|e| e / sum).collect();
            kv.mix(g, hd, w, &p, first, &mut out[head * hd..(head + 1) * hd]);
        }
        Ok(Tensor::from_vec(out, (1, self.n_heads * hd), xs.device())?)
    }

    fn masked_logits(&self, c: &Centroids, lm_head: &Tensor, y: &Tensor) -> Result<Vec<f32>> {
        let scores = c.centroids.forward(y)?.flatten_all()?.to_vec1::<f32>()?;
        let mut order: Vec<usize> = (0..c.num_centroids).collect();
        // PyTorch: torch.topk(centroid_logits, k) (ties: the lower index first)
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let per = c.ordering.len() / c.num_centroids;
        let ids: Vec<u32> = order[..c.top_k]
            .iter()
            .flat_map(|&k| c.ordering[k * per..(k + 1) * per].iter().copied())
            .collect();
        let rows = lm_head.index_select(&Tensor::new(ids.as_slice(), y.device())?, 0)?;
        let selected = y.matmul(&rows.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let mask = selected.iter().copied().fold(f32::INFINITY, f32::min) - 1.0;
        let mut logits = vec![mask; c.ordering.len()];
        for (&id, &s) in ids.iter().zip(&selected) {
            logits[id as usize] = s;
        }
        Ok(logits)
    }
}

#[cfg(test)]
mod tests;
