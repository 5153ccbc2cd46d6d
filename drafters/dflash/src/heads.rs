//! DSpark's heads: the Markov correction of the block logits and the confidence head. A port of
//! DeepSpec `deepspec/modeling/dspark/markov_head.py` (`VanillaMarkov`, `GatedMarkovHead`,
//! `RNNHead`) and `Qwen3DSparkModel.predict_confidence_step` (`AcceptRatePredictor`).
//!
//! ```text
//! prev_0 = anchor; state_0 = 0 (rnn)
//! for k in 0..ℓ:  z_k = U_k + bias_k(prev_k, h_k [, state])     U = lm_head(h)
//!                 x_k = sample(z_k);  c_k = σ(proj([h_k; W1[prev_k]]))   (or proj(h_k))
//!                 prev_{k+1} = x_k
//! ```

use candle_core::{Device, Tensor};
use specula_models::layers::Linear;

use crate::config::{ConfidenceInput, DSparkHeads, MarkovHead};
use crate::tensors::Tensors;
use crate::Error;

fn err(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}

/// The Markov head's weights.
struct Markov {
    kind: MarkovHead,
    rank: usize,
    /// `markov_w1` `[vocab, rank]`.
    w1: Tensor,
    /// `markov_w2` `[vocab, rank]` (a Linear rank → vocab), or its draft-vocabulary rows.
    w2: Linear,
    /// `gate_proj` (gated) or `joint_proj` (rnn).
    proj: Option<Linear>,
}

/// DSpark's Markov and confidence heads.
pub struct Heads {
    markov: Option<Markov>,
    confidence: Option<(ConfidenceInput, Linear)>,
}

/// What the heads make of one block.
#[derive(Debug, Clone)]
pub struct HeadsOutput {
    /// The corrected logits `z_k`, `[B, vocab]`.
    pub logits: Tensor,
    /// The drafted ids `x_k`.
    pub tokens: Vec<u32>,
    /// `σ(c_k)` per slot, with a confidence head.
    pub confidence: Option<Vec<f32>>,
}

impl Heads {
    /// Loads the heads the config names; with a draft vocabulary `d2t` the Markov bias is
    /// computed for its ids only (the columns of the restricted lm_head it is added to).
    ///
    /// # Errors
    /// [`Error::Weights`] for a missing or misshapen tensor.
    pub fn load(
        heads: &DSparkHeads,
        t: &Tensors,
        hidden: usize,
        vocab: usize,
        d2t: Option<&[u32]>,
    ) -> Result<Self, Error> {
        let markov = match heads.markov {
            None => None,
            Some((rank, kind)) => Some(Markov {
                kind,
                rank,
                w1: t.get("markov_head.markov_w1.weight", &[vocab, rank])?,
                w2: {
                    let w2 = t.linear("markov_head.markov_w2", vocab, rank, false)?;
                    match d2t {
                        Some(ids) => crate::vocab::select_rows(&w2, ids)?,
                        None => w2,
                    }
                },
                proj: match kind {
                    MarkovHead::Vanilla => None,
                    MarkovHead::Gated => {
                        Some(t.linear("markov_head.gate_proj", rank, hidden + rank, true)?)
                    }
                    MarkovHead::Rnn => Some(t.linear(
                        "markov_head.joint_proj",
                        3 * rank,
                        2 * rank + hidden,
                        true,
                    )?),
                },
            }),
        };
        let confidence = match heads.confidence {
            None => None,
            Some(input) => {
                let width = match input {
                    ConfidenceInput::Hidden => hidden,
                    ConfidenceInput::HiddenAndMarkov => {
                        hidden + markov.as_ref().map_or(0, |m| m.rank)
                    }
                };
                Some((input, t.linear("confidence_head.proj", 1, width, true)?))
            }
        };
        Ok(Heads { markov, confidence })
    }

    /// These heads with their weights in f32 on `device` (the device path; loaded from f32
    /// linears).
    ///
    /// # Errors
    /// [`Error::Forward`] when a projection is quantized or the device refuses the weights.
    pub fn to_device(&self, device: &Device) -> Result<Heads, Error> {
        let mv = |l: &Linear| -> Result<Linear, Error> {
            let (w, b) = crate::device::dense(l, device)?;
            Linear::dense(w, b).map_err(err)
        };
        let markov = match &self.markov {
            None => None,
            Some(m) => Some(Markov {
                kind: m.kind,
                rank: m.rank,
                w1: m.w1.to_device(device).map_err(err)?,
                w2: mv(&m.w2)?,
                proj: m.proj.as_ref().map(mv).transpose()?,
            }),
        };
        let confidence = match &self.confidence {
            None => None,
            Some((input, l)) => Some((*input, mv(l)?)),
        };
        Ok(Heads { markov, confidence })
    }

    /// Whether there is a confidence head.
    pub fn has_confidence(&self) -> bool {
        self.confidence.is_some()
    }

    /// Where a confidence cut at `cut_below` ends the block of hiddens `h` `[B, hidden]`, when
    /// that is known before any draft: a confidence head that reads the hidden state alone
    /// (its input has no Markov embedding of the previous draft). Then only the rows before
    /// the cut need lm_head logits. `None`: no cut, or one that depends on the drafts.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch.
    pub fn cut_before_drafting(&self, h: &Tensor, cut_below: f32) -> Result<Option<usize>, Error> {
        let Some((ConfidenceInput::Hidden, proj)) = &self.confidence else {
            return Ok(None);
        };
        if cut_below <= 0.0 {
            return Ok(None);
        }
        // One multi-row call: bit-identical to `run`'s row-by-row confidences.
        let c = candle_nn::ops::sigmoid(&proj.forward(h).map_err(err)?).map_err(err)?;
        let c: Vec<f32> = c.flatten_all().and_then(|c| c.to_vec1()).map_err(err)?;
        Ok(Some(
            c.iter().position(|&c| c < cut_below).unwrap_or(c.len()),
        ))
    }

    /// Runs the heads over the block, slot by slot: `h` `[B, hidden]` normed hiddens, `base(k)`
    /// the `[1, vocab]` logits of slot `k` (asked for only for slots that are drafted), `anchor`
    /// the token before slot 0; `pick` chooses each slot's id from its corrected logits row
    /// (argmax, or a sample), so the chain follows the drafts. With `cut_below > 0` and a
    /// confidence head, drafting stops before the first slot whose confidence is below it
    /// (DeepSpec `_confident_prefix_length`), so its logits are never used.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch.
    pub fn run(
        &self,
        h: &Tensor,
        base: &dyn Fn(usize) -> Result<Tensor, Error>,
        anchor: u32,
        cut_below: f32,
        vocab: usize,
        pick: &mut dyn FnMut(&Tensor) -> Result<u32, Error>,
    ) -> Result<HeadsOutput, Error> {
        let (b, _) = h.dims2().map_err(err)?;
        let device = h.device().clone();
        let mut prev = anchor;
        let mut state: Option<Tensor> = None;
        let (mut rows, mut tokens, mut conf) = (Vec::new(), Vec::new(), Vec::new());
        for k in 0..b {
            let h_k = h.narrow(0, k, 1).map_err(err)?;
            let prev_emb = match &self.markov {
                None => None,
                Some(m) => Some(m.w1.narrow(0, prev as usize, 1).map_err(err)?),
            };
            if let Some((input, proj)) = &self.confidence {
                let features = match (input, &prev_emb) {
                    (ConfidenceInput::HiddenAndMarkov, Some(e)) => {
                        Tensor::cat(&[&h_k, e], 1).map_err(err)?
                    }
                    _ => h_k.clone(),
                };
                let logit = proj.forward(&features).map_err(err)?;
                let c = candle_nn::ops::sigmoid(&logit).map_err(err)?;
                let c = c
                    .flatten_all()
                    .and_then(|c| c.to_vec1::<f32>())
                    .map_err(err)?[0];
                if cut_below > 0.0 && c < cut_below {
                    break;
                }
                conf.push(c);
            }
            let base_k = base(k)?;
            let z = match (&self.markov, &prev_emb) {
                (Some(m), Some(e)) => {
                    let bias = m.step_bias(e, &h_k, &mut state, &device)?;
                    (base_k + bias).map_err(err)?
                }
                _ => base_k,
            };
            let id = pick(&z)?;
            tokens.push(id);
            rows.push(z);
            prev = id;
        }
        let logits = match rows.is_empty() {
            true => Tensor::zeros((0, vocab), candle_core::DType::F32, &device).map_err(err)?,
            false => Tensor::cat(&rows, 0).map_err(err)?,
        };
        Ok(HeadsOutput {
            logits,
            tokens,
            confidence: self.confidence.as_ref().map(|_| conf),
        })
    }
}

impl Markov {
    /// The logit bias of one step given `e = W1[prev]` `[1, rank]` and `h_k` `[1, hidden]`.
    fn step_bias(
        &self,
        e: &Tensor,
        h_k: &Tensor,
        state: &mut Option<Tensor>,
        device: &Device,
    ) -> Result<Tensor, Error> {
        match self.kind {
            // PyTorch: self.markov_w2(self.markov_w1(token_ids))
            MarkovHead::Vanilla => self.w2.forward(e).map_err(err),
            // PyTorch: self.project_bias(sigmoid(gate_proj(cat[h, e])) * e)
            MarkovHead::Gated => {
                let gate_in = Tensor::cat(&[h_k, e], 1).map_err(err)?;
                let gate = self.proj().forward(&gate_in).map_err(err)?;
                let gated = (candle_nn::ops::sigmoid(&gate).map_err(err)? * e).map_err(err)?;
                self.w2.forward(&gated).map_err(err)
            }
            // PyTorch: gate, cand, out = joint_proj(cat[s, e, h]).chunk(3)
            //          s' = σ(gate) s + (1 − σ(gate)) tanh(cand); bias = w2(tanh(out))
            MarkovHead::Rnn => {
                let s = match state.take() {
                    Some(s) => s,
                    None => Tensor::zeros((1, self.rank), candle_core::DType::F32, device)
                        .map_err(err)?,
                };
                let z = Tensor::cat(&[&s, e, h_k], 1).map_err(err)?;
                let p = self.proj().forward(&z).map_err(err)?;
                let r = self.rank;
                let gate =
                    candle_nn::ops::sigmoid(&p.narrow(1, 0, r).map_err(err)?).map_err(err)?;
                let cand = p.narrow(1, r, r).and_then(|c| c.tanh()).map_err(err)?;
                let out = p.narrow(1, 2 * r, r).and_then(|o| o.tanh()).map_err(err)?;
                let keep = (&gate * &s).map_err(err)?;
                let new = ((1.0 - &gate).map_err(err)? * cand).map_err(err)?;
                *state = Some((keep + new).map_err(err)?);
                self.w2.forward(&out).map_err(err)
            }
        }
    }

    fn proj(&self) -> &Linear {
        self.proj
            .as_ref()
            .expect("invariant: gated and rnn heads load their projection")
    }
}
