//! Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, and the logit
//! processors — repetition, presence and frequency penalties, logit bias.
//!
//! The speculative verify loop needs more than a token: it needs the whole target distribution
//! `p` to run Leviathan-style rejection sampling against a drafter's `q`. [`Sampler::distribution`]
//! returns exactly the distribution that [`Sampler::sample`] draws from, so plain decoding and
//! speculative decoding share one definition of "the target's distribution". The processors
//! read the history they are given (the context before the row), so a verify row sees exactly
//! the history plain decoding would have had at that position, and speculation stays lossless.
//!
//! Processor order follows vLLM: repetition penalty, then presence/frequency penalties (over
//! the *generated* tokens only, as OpenAI and vLLM count them), then logit bias, then
//! temperature and the filters.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How to pick the next token. The defaults decode greedily.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (`None` or `0`: off).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability sums to at least `top_p` (`1.0`: off).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top token's (`0.0`: off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already in the context (`1.0`: off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (OpenAI's range -2..=2;
    /// `0.0`: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (-2..=2; `0.0`: off).
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids (-100..=100 each), as OpenAI's `logit_bias`.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the random stream; `None` picks one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Whether these parameters always pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == Some(1)
    }

    /// Whether a logit processor (penalty, bias) changes the logits before the choice: then the
    /// raw argmax of the model is not the answer, even when greedy.
    pub fn processes_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    /// Checks the ranges of every field.
    ///
    /// # Errors
    /// [`Error::Sampling`] naming the first parameter out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason: &str| {
            Err(Error::Sampling {
                name,
                reason: reason.to_string(),
            })
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad("repetition_penalty", "must be a finite number > 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", "must be in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", "must be in [-2, 2]");
        }
        if self
            .logit_bias
            .iter()
            .any(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad("logit_bias", "biases must be in [-100, 100]");
        }
        Ok(())
    }
}

/// A probability distribution over the vocabulary, as the sampler would draw from it.
#[derive(Debug, Clone, PartialEq)]
pub enum Distribution {
    /// All mass on one token (greedy decoding).
    OneHot(u32),
    /// Dense probabilities, one per vocabulary id, summing to 1.
    Dense(Vec<f32>),
}

impl Distribution {
    /// Probability of `token`.
    pub fn prob(&self, token: u32) -> f32 {
        match self {
            Distribution::OneHot(t) => f32::from(u8::from(*t == token)),
            Distribution::Dense(p) => p.get(token as usize).copied().unwrap_or(0.0),
        }
    }

    /// The dense row of `vocab` probabilities.
    pub fn to_dense(&self, vocab: usize) -> Vec<f32> {
        match self {
            Distribution::Dense(p) => p.clone(),
            Distribution::OneHot(t) => {
                let mut p = vec![0.0; vocab];
                if let Some(slot) = p.get_mut(*t as usize) {
                    *slot = 1.0;
                }
                p
            }
        }
    }
}

/// Draws tokens according to [`SamplingParams`], with its own seeded random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Length of the prompt at the head of every history: presence and frequency penalties
    /// count only the tokens after it.
    prompt_len: usize,
}

impl Sampler {
    /// A sampler seeded from `params.seed` (or the OS when it is `None`), for histories that
    /// hold no prompt (every token in them was generated).
    pub fn new(params: SamplingParams) -> Self {
        Sampler::for_prompt(params, 0)
    }

    /// A sampler whose histories start with a prompt of `prompt_len` tokens.
    pub fn for_prompt(params: SamplingParams, prompt_len: usize) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            prompt_len,
        }
    }

    /// The parameters this sampler follows.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The distribution the next token is drawn from, given raw `logits` and the ids already in
    /// the context (`history`, for the repetition penalty).
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Distribution {
        let p = &self.params;
        let mut logits = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            apply_repetition_penalty(&mut logits, history, p.repetition_penalty);
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let generated = history.get(self.prompt_len..).unwrap_or(&[]);
            apply_presence_frequency(&mut logits, generated, p);
        }
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.is_greedy() {
            return Distribution::OneHot(argmax(&logits));
        }
        Distribution::Dense(filtered_softmax(&logits, p))
    }

    /// Draws the next token.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let dist = self.distribution(logits, history);
        self.draw(&dist)
    }

    /// Draws a token from `dist`.
    pub fn draw(&mut self, dist: &Distribution) -> u32 {
        match dist {
            Distribution::OneHot(t) => *t,
            Distribution::Dense(p) => self.draw_from(p),
        }
    }

    /// Draws an index from the (not necessarily normalised) non-negative weights `w`.
    pub fn draw_from(&mut self, w: &[f32]) -> u32 {
        let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
        let mut r = self.rng.random::<f64>() * total;
        let mut last_nonzero = 0;
        for (i, &x) in w.iter().enumerate() {
            if x > 0.0 {
                last_nonzero = i;
                r -= f64::from(x);
                if r < 0.0 {
                    return i as u32;
                }
            }
        }
        // Rounding left a sliver of mass: it belongs to the last token that had any.
        last_nonzero as u32
    }

    /// A uniform draw in `[0, 1)` from this sampler's stream (for accept/reject decisions).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }
}

/// Index of the largest logit; the lowest index wins a tie, so greedy decoding is deterministic.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `log_softmax` of raw logits, in f64 for accuracy of small probabilities.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let log_sum = sum.ln() as f32;
    logits.iter().map(|&x| x - max - log_sum).collect()
}

fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; logits.len()];
    for &t in history {
        let Some(slot) = seen.get_mut(t as usize) else {
            continue;
        };
        if !*slot {
            *slot = true;
            let l = &mut logits[t as usize];
            // As in HF's RepetitionPenaltyLogitsProcessor.
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// `logit -= count * frequency_penalty + (count > 0) * presence_penalty` over the generated
/// tokens (OpenAI's formula).
fn apply_presence_frequency(logits: &mut [f32], generated: &[u32], p: &SamplingParams) {
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, c) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// Softmax at `temperature`, then top-k, top-p and min-p filtering, renormalised.
fn filtered_softmax(logits: &[f32], p: &SamplingParams) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits
        .iter()
        .map(|&x| ((x - max) / p.temperature).exp())
        .collect();
    normalise(&mut probs);

    let top_k = p.top_k.filter(|&k| k > 0 && k < probs.len());
    if top_k.is_some() || p.top_p < 1.0 {
        // Sort only the candidates: ids by descending probability.
        let mut order: Vec<u32> = (0..probs.len() as u32).collect();
        let by_prob = |a: &u32, b: &u32| probs[*b as usize].total_cmp(&probs[*a as usize]);
        let keep = top_k.unwrap_or(order.len());
        if keep < order.len() {
            order.select_nth_unstable_by(keep - 1, by_prob);
            order.truncate(keep);
        }
        order.sort_unstable_by(by_prob);
        let mut kept = order.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &t) in order.iter().enumerate() {
                cum += probs[t as usize];
                if cum >= p.top_p {
                    kept = i + 1;
                    break;
                }
            }
        }
        let mut filtered = vec![0.0; probs.len()];
        for &t in &order[..kept] {
            filtered[t as usize] = probs[t as usize];
        }
        probs = filtered;
    }
    if p.min_p > 0.0 {
        let top = probs.iter().copied().fold(0.0, f32::max);
        let floor = top * p.min_p;
        for x in probs.iter_mut() {
            if *x < floor {
                *x = 0.0;
            }
        }
    }
    normalise(&mut probs);
    probs
}

fn normalise(p: &mut [f32]) {
    let sum: f32 = p.iter().sum();
    if sum > 0.0 {
        p.iter_mut().for_each(|x| *x /= sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(7),
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let s = Sampler::new(params(0.0));
        assert_eq!(
            s.distribution(&[1.0, 3.0, 3.0, 2.0], &[]),
            Distribution::OneHot(1)
        );
    }

    #[test]
    fn temperature_one_is_softmax() {
        let s = Sampler::new(params(1.0));
        let Distribution::Dense(p) = s.distribution(&[0.0, (2.0f32).ln()], &[]) else {
            panic!("temperature 1 gives a dense distribution");
        };
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_top_p_min_p_filter() {
        let logits = [(0.5f32).ln(), (0.3f32).ln(), (0.15f32).ln(), (0.05f32).ln()];
        let dense = |p: SamplingParams| match Sampler::new(p).distribution(&logits, &[]) {
            Distribution::Dense(p) => p,
            Distribution::OneHot(_) => panic!("expected dense"),
        };
        let k2 = dense(SamplingParams {
            top_k: Some(2),
            ..params(1.0)
        });
        assert!((k2[0] - 0.625).abs() < 1e-5 && k2[2] == 0.0 && k2[3] == 0.0);
        let p08 = dense(SamplingParams {
            top_p: 0.8,
            ..params(1.0)
        });
        assert!(p08[0] > 0.0 && p08[1] > 0.0 && p08[2] == 0.0);
        let m = dense(SamplingParams {
            min_p: 0.2,
            ..params(1.0)
        });
        assert!(m[2] > 0.0 && m[3] == 0.0);
    }

    #[test]
    fn repetition_penalty_changes_greedy_choice() {
        let s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        });
        assert_eq!(s.distribution(&[3.0, 2.0], &[0]), Distribution::OneHot(1));
    }

    #[test]
    fn presence_frequency_count_generated_tokens_only() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 1.0,
            ..params(0.0)
        };
        // Token 0 leads by 2.0; generated twice it loses 2 * 1.0 + 0.5 = 2.5.
        let logits = [3.0, 1.0, 0.5];
        let s = Sampler::for_prompt(p.clone(), 2);
        assert_eq!(
            s.distribution(&logits, &[0, 0]),
            Distribution::OneHot(0),
            "prompt only"
        );
        assert_eq!(
            s.distribution(&logits, &[0, 0, 0]),
            Distribution::OneHot(0),
            "2.5 - 1.5 > 1"
        );
        assert_eq!(
            s.distribution(&logits, &[9, 9, 0, 0]),
            Distribution::OneHot(1)
        );
        let dense = Sampler::for_prompt(
            SamplingParams {
                temperature: 1.0,
                ..p
            },
            0,
        );
        let Distribution::Dense(d) = dense.distribution(&logits, &[0]) else {
            panic!("dense");
        };
        let want = log_softmax(&[3.0 - 1.5, 1.0, 0.5]);
        assert!((d[0].ln() - want[0]).abs() < 1e-5, "{d:?}");
    }

    #[test]
    fn logit_bias_moves_the_choice_and_is_range_checked() {
        let s = Sampler::new(SamplingParams {
            logit_bias: vec![(2, 10.0), (99, 5.0)],
            ..params(0.0)
        });
        assert_eq!(
            s.distribution(&[3.0, 2.0, 1.0], &[]),
            Distribution::OneHot(2)
        );
        assert!(s.params().processes_logits());
        assert!(!params(0.0).processes_logits());
        for (bad, name) in [
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..params(0.0)
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..params(0.0)
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(0, 101.0)],
                    ..params(0.0)
                },
                "logit_bias",
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(
                matches!(&e, Error::Sampling { name: n, .. } if *n == name),
                "{e}"
            );
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let mut s = Sampler::new(params(1.0));
        let w = [0.1, 0.0, 0.6, 0.3];
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[s.draw_from(&w) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (i, &c) in counts.iter().enumerate() {
            let f = c as f32 / 20_000.0;
            assert!((f - w[i]).abs() < 0.02, "token {i}: {f} vs {}", w[i]);
        }
    }

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(params(0.9));
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn invalid_params_are_named() {
        let err = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("top_p"), "{err}");
    }
}
