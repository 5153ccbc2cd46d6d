//! [`Model`]: the contract the target host and the drafters code against — forward a chunk of
//! tokens over a [`KvCache`], get logits for the last `k` positions and hidden-state taps.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::arch::llama::{Llama, RowSpec};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;

/// A hidden state a caller can tap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TapId {
    /// Output of decoder layer `l` (HF `hidden_states[l + 1]`).
    Layer(usize),
    /// Output of the final norm (what `lm_head` sees).
    FinalNorm,
}

/// What a forward should return.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardRequest {
    /// Logits for the last `last_k` positions of the call (0 skips `lm_head`).
    pub last_k: usize,
    /// Hidden states to return.
    pub taps: Vec<TapId>,
    /// Taps over all positions of the call instead of the last `last_k`.
    pub taps_all_positions: bool,
}

impl Default for ForwardRequest {
    /// Next-token logits, no taps.
    fn default() -> Self {
        Self {
            last_k: 1,
            taps: Vec::new(),
            taps_all_positions: false,
        }
    }
}

/// Result of a forward.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `[last_k, vocab]` f32.
    pub logits: Tensor,
    /// One `[rows, hidden]` f32 tensor per requested tap, in request order (`rows` is
    /// `last_k`, or all positions with `taps_all_positions`).
    pub taps: Vec<(TapId, Tensor)>,
}

/// A loaded model, ready to run.
#[derive(Clone, Debug)]
pub struct Model {
    net: Llama,
    config: ModelConfig,
    weights_path: PathBuf,
    prefill_chunk: usize,
    device: Device,
}

impl Model {
    /// Assembles a model from its parts (used by [`crate::loader`]).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `prefill_chunk` is 0.
    pub fn from_parts(
        net: Llama,
        config: ModelConfig,
        weights_path: &Path,
        prefill_chunk: usize,
        device: &Device,
    ) -> Result<Self> {
        if prefill_chunk == 0 {
            return Err(Error::InvalidRequest {
                op: "load",
                reason: "prefill_chunk must be at least 1".into(),
            });
        }
        Ok(Self {
            net,
            config,
            weights_path: weights_path.to_path_buf(),
            prefill_chunk,
            device: device.clone(),
        })
    }

    /// The device the weights, the cache and the logits live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// An empty cache sized for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.config.num_hidden_layers,
            self.config.kv_heads(),
            self.config.head_dim(),
            self.context_len(),
            DType::F32,
            &self.device,
        )
    }

    /// Maximum number of positions (prompt + generated).
    pub fn context_len(&self) -> usize {
        self.config.max_position_embeddings
    }

    /// The GGUF file or HF directory the weights came from.
    pub fn weights_path(&self) -> &Path {
        &self.weights_path
    }

    /// Projects final-norm hidden states (a [`TapId::FinalNorm`] tap, `[rows, hidden]`) to
    /// logits `[rows, vocab]`.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.net.lm_head(hidden)
    }

    fn check(&self, tokens: &[u32], cache: &KvCache, req: &ForwardRequest) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidRequest {
                op: "forward",
                reason,
            })
        };
        if tokens.is_empty() {
            return bad("no tokens".into());
        }
        if req.last_k > tokens.len() {
            return bad(format!(
                "last_k {} exceeds the {} tokens of the call",
                req.last_k,
                tokens.len()
            ));
        }
        if let Some(TapId::Layer(l)) = req
            .taps
            .iter()
            .find(|t| matches!(t, TapId::Layer(l) if *l >= self.net.num_layers()))
        {
            return bad(format!(
                "tap Layer({l}) but the model has {} layers",
                self.net.num_layers()
            ));
        }
        if cache.num_layers() != self.net.num_layers() {
            return bad(format!(
                "cache has {} layers, the model {}",
                cache.num_layers(),
                self.net.num_layers()
            ));
        }
        let got = cache.len() + tokens.len();
        if got > self.context_len() {
            return Err(Error::ContextOverflow {
                got,
                max: self.context_len(),
            });
        }
        Ok(())
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their K/V to `cache`.
    ///
    /// On error the cache is rolled back to its length before the call.
    ///
    /// # Errors
    /// [`Error::ContextOverflow`] if `cache.len() + tokens.len() > context_len()`,
    /// [`Error::InvalidRequest`] for empty `tokens`, `last_k > tokens.len()`, an unknown tap
    /// layer or an out-of-vocabulary token.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
    ) -> Result<ForwardOutput> {
        self.run_chunks(tokens, cache, req, tokens.len())
    }

    /// Same as [`Model::forward`], in chunks of `prefill_chunk` tokens (bounding the size of
    /// the attention scores); returns the logits of the last `req.last_k` positions and taps
    /// as `forward` would.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn prefill(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
    ) -> Result<ForwardOutput> {
        self.run_chunks(tokens, cache, req, self.prefill_chunk)
    }

    fn run_chunks(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
        chunk: usize,
    ) -> Result<ForwardOutput> {
        self.check(tokens, cache, req)?;
        let start = cache.len();
        let out = self.run_chunks_unchecked(tokens, cache, req, chunk);
        if out.is_err() {
            cache.truncate(start)?;
        }
        out
    }

    fn run_chunks_unchecked(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        req: &ForwardRequest,
        chunk: usize,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        // Rows (of the whole call) that get logits / taps.
        let logits_from = n - req.last_k;
        let taps_from = match req.taps_all_positions {
            true => 0,
            false => logits_from,
        };
        let mut logits = Vec::new();
        let mut taps: Vec<Vec<Tensor>> = vec![Vec::new(); req.taps.len()];
        for (c, part) in tokens.chunks(chunk).enumerate() {
            let offset = c * chunk;
            let rows = RowSpec {
                logits_from: logits_from.saturating_sub(offset),
                taps: &req.taps,
                taps_from: taps_from.saturating_sub(offset),
            };
            let out = self.net.forward_chunk(part, cache, rows)?;
            logits.extend(out.logits);
            for (acc, t) in taps.iter_mut().zip(out.taps) {
                acc.extend(t);
            }
        }
        let logits = match logits.len() {
            0 => Tensor::zeros((0, self.config.vocab_size), DType::F32, &self.device)?,
            _ => Tensor::cat(&logits, 0)?,
        };
        let hidden = self.config.hidden_size;
        let taps = req
            .taps
            .iter()
            .zip(taps)
            .map(|(id, parts)| {
                let t = match parts.len() {
                    0 => Tensor::zeros((0, hidden), DType::F32, &self.device)?,
                    _ => Tensor::cat(&parts, 0)?,
                };
                Ok((*id, t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput { logits, taps })
    }
}

#[cfg(test)]
mod tests;
