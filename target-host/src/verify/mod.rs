//! Deciding which drafts the target accepts.
//!
//! One target forward over `[pending, d1..dk]` gives `k + 1` logit rows: row `i` is the target's
//! view of the token after `d_i` (row 0: after `pending`). Greedy decoding accepts the longest
//! prefix of drafts equal to the target's argmax and then takes the target's own token (the
//! "bonus") from the first row not matched. Sampling uses Leviathan et al.'s rejection rule
//! (arXiv 2211.17192, Algorithm 1; vLLM `rejection_sampler.py`): accept `d_i` with probability
//! `min(1, p(d_i) / q(d_i))`, otherwise draw from `norm(max(0, p - q))` and stop. Either way the
//! committed tokens have exactly the target's distribution, whatever the drafter proposed.

use specula_models::sampling::{Distribution, Sampler};

use crate::grammar::{Constraint, GrammarError};

/// The outcome of verifying one round of drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acceptance {
    /// How many drafts were accepted (a prefix of them).
    pub accepted: usize,
    /// The token the target chose after the accepted prefix: the bonus token when every draft
    /// was accepted, the correction otherwise.
    pub next: u32,
}

/// Verifies `drafts` against the target's logit rows (`rows.len() == drafts.len() + 1`).
///
/// `q` holds the drafter's probability row for each draft when it sampled them; `None` means the
/// drafts were picked deterministically (one-hot `q`). `history` is the context before the
/// verified window, used by the repetition penalty; it is extended with accepted drafts here.
///
/// With a `grammar`, row `i` is masked by the grammar's state after the context and
/// `d1..d(i-1)` before anything else (penalties, temperature, filters): the grammar advances
/// through each accepted draft, the correction or bonus token is drawn under its row's mask,
/// and the grammar is rolled back to where it started (committing advances it for real).
/// Drafts the grammar forbids have probability 0 and are rejected; [`Constraint::check_draft`]
/// cuts them before the forward so they cost no row.
///
/// # Errors
/// The grammar's matcher failing (it never does on tokens its own masks allowed).
pub fn verify(
    sampler: &mut Sampler,
    rows: &[Vec<f32>],
    drafts: &[u32],
    q: Option<&[Vec<f32>]>,
    history: &mut Vec<u32>,
    mut grammar: Option<&mut Constraint>,
) -> Result<Acceptance, GrammarError> {
    debug_assert_eq!(
        rows.len(),
        drafts.len() + 1,
        "one logit row per draft plus one"
    );
    let base = history.len();
    let mut out = None;
    for (i, &d) in drafts.iter().enumerate() {
        let p = distribution(sampler, &rows[i], history, grammar.as_deref_mut())?;
        match accept_one(sampler, &p, d, q.map(|q| q[i].as_slice())) {
            Ok(()) => {
                history.push(d);
                if let Some(g) = grammar.as_deref_mut() {
                    g.advance(d)?;
                }
            }
            Err(next) => {
                out = Some(Acceptance { accepted: i, next });
                break;
            }
        }
    }
    let acceptance = match out {
        Some(a) => a,
        None => {
            let p = distribution(
                sampler,
                &rows[drafts.len()],
                history,
                grammar.as_deref_mut(),
            )?;
            Acceptance {
                accepted: drafts.len(),
                next: sampler.draw(&p),
            }
        }
    };
    history.truncate(base);
    if let Some(g) = grammar {
        g.rollback(acceptance.accepted)?;
    }
    Ok(acceptance)
}

/// The sampler's distribution of `row`, masked by the grammar's current state first.
fn distribution(
    sampler: &Sampler,
    row: &[f32],
    history: &[u32],
    grammar: Option<&mut Constraint>,
) -> Result<Distribution, GrammarError> {
    let Some(g) = grammar else {
        return Ok(sampler.distribution(row, history));
    };
    let mut masked = row.to_vec();
    g.allowed()?.apply(&mut masked);
    Ok(sampler.distribution(&masked, history))
}

/// Greedy verification from each row's argmax alone (`argmax.len() == drafts.len() + 1`):
/// what [`verify`] decides for a greedy sampler without repetition penalty, when only the
/// argmax ids were copied back from the device.
pub fn verify_greedy(argmax: &[u32], drafts: &[u32]) -> Acceptance {
    debug_assert_eq!(
        argmax.len(),
        drafts.len() + 1,
        "one argmax per draft plus one"
    );
    let accepted = drafts
        .iter()
        .zip(argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Acceptance {
        accepted,
        next: argmax[accepted],
    }
}

/// Accepts draft `d` under target distribution `p` and draft row `q`, or returns the
/// replacement token drawn from the residual distribution.
fn accept_one(
    sampler: &mut Sampler,
    p: &Distribution,
    d: u32,
    q: Option<&[f32]>,
) -> Result<(), u32> {
    let qd = q.map_or(1.0, |q| q.get(d as usize).copied().unwrap_or(0.0));
    let pd = p.prob(d);
    match p {
        // A deterministic target accepts exactly its own choice, whatever q says.
        Distribution::OneHot(t) => {
            if *t == d {
                Ok(())
            } else {
                Err(*t)
            }
        }
        Distribution::Dense(pv) => {
            if pd >= qd || sampler.uniform() * qd < pd {
                return Ok(());
            }
            // Residual: max(0, p - q), with q one-hot at d when the drafter sent none.
            let residual: Vec<f32> = match q {
                Some(q) => pv.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect(),
                None => {
                    let mut r = pv.clone();
                    r[d as usize] = 0.0;
                    r
                }
            };
            if residual.iter().all(|&x| x <= 0.0) {
                // p == q up to rounding: the rejection had probability ~0; draw from p itself.
                return Err(sampler.draw(p));
            }
            Err(sampler.draw_from(&residual))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_models::sampling::SamplingParams;

    fn sampler(temperature: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            seed: Some(seed),
            ..SamplingParams::default()
        })
    }

    fn row(best: usize, vocab: usize) -> Vec<f32> {
        (0..vocab)
            .map(|i| if i == best { 5.0 } else { 0.0 })
            .collect()
    }

    #[test]
    fn greedy_accepts_the_matching_prefix_and_corrects() {
        let rows = vec![row(3, 8), row(4, 8), row(7, 8), row(1, 8)];
        let mut s = sampler(0.0, 0);
        let mut hist = vec![];
        let a = verify(&mut s, &rows, &[3, 4, 5], None, &mut hist, None).unwrap();
        assert_eq!(
            a,
            Acceptance {
                accepted: 2,
                next: 7
            }
        );
        let a = verify(&mut s, &rows, &[3, 4, 7], None, &mut hist, None).unwrap();
        assert_eq!(
            a,
            Acceptance {
                accepted: 3,
                next: 1
            }
        );
        let a = verify(&mut s, &rows, &[0, 4, 7], None, &mut hist, None).unwrap();
        assert_eq!(
            a,
            Acceptance {
                accepted: 0,
                next: 3
            }
        );
        assert!(hist.is_empty(), "history is restored");
    }

    /// The argmax-only path decides exactly what the row path decides for greedy sampling.
    #[test]
    fn greedy_ids_agree_with_greedy_rows() {
        let mut s = sampler(0.0, 0);
        let mut rng = sampler(1.0, 5);
        for case in 0..200 {
            let vocab = 6;
            let k = case % 5;
            let rows: Vec<Vec<f32>> = (0..=k)
                .map(|_| (0..vocab).map(|_| rng.uniform()).collect())
                .collect();
            let argmax: Vec<u32> = rows
                .iter()
                .map(|r| specula_models::sampling::argmax(r))
                .collect();
            // Drafts that follow the target for a while, then (maybe) diverge.
            let drafts: Vec<u32> = (0..k)
                .map(|i| match i < case % 3 {
                    true => argmax[i],
                    false => (rng.uniform() * vocab as f32) as u32 % vocab as u32,
                })
                .collect();
            let want = verify(&mut s, &rows, &drafts, None, &mut vec![], None).unwrap();
            assert_eq!(verify_greedy(&argmax, &drafts), want, "case {case}");
        }
    }

    /// The first committed token of a round has the target's distribution, for a drafter that
    /// proposes a fixed bad token deterministically and for one that samples from a wrong `q`.
    #[test]
    fn rejection_sampling_preserves_the_target_distribution() {
        let logits = vec![1.0f32, 0.2, -0.5, 0.7, 0.0];
        let target = match sampler(1.0, 0).distribution(&logits, &[]) {
            Distribution::Dense(p) => p,
            Distribution::OneHot(_) => unreachable!("temperature 1 is dense"),
        };
        let q_bad = vec![0.05f32, 0.05, 0.7, 0.1, 0.1];
        let n = 40_000;
        for q in [None, Some(q_bad.clone())] {
            let mut s = sampler(1.0, 11);
            let mut drafter = sampler(1.0, 12);
            let mut counts = [0usize; 5];
            for _ in 0..n {
                let d = match &q {
                    Some(q) => drafter.draw_from(q),
                    None => 2,
                };
                let rows = vec![logits.clone(), logits.clone()];
                let qs = q.as_ref().map(|q| vec![q.clone()]);
                let a = verify(&mut s, &rows, &[d], qs.as_deref(), &mut vec![], None).unwrap();
                let first = if a.accepted == 1 { d } else { a.next };
                counts[first as usize] += 1;
            }
            for (i, &c) in counts.iter().enumerate() {
                let f = c as f32 / n as f32;
                assert!(
                    (f - target[i]).abs() < 0.012,
                    "q={q:?} token {i}: {f} vs {}",
                    target[i]
                );
            }
        }
    }

    /// Under a grammar, the first committed token has exactly the masked target distribution,
    /// whether the drafter proposes a forbidden token, an allowed one, or samples from a wrong
    /// `q`; the grammar's state is the same after every round.
    #[test]
    fn rejection_sampling_under_a_mask_gives_the_masked_distribution() {
        use crate::grammar::{tests::vocab, Constraint};
        let vocab = vocab();
        let mut g = Constraint::json_object(&vocab);
        let m0 = g.allowed().unwrap().clone();
        let n_vocab = vocab.len();
        let allowed: Vec<u32> = (0..n_vocab as u32)
            .filter(|&t| m0.allows(t))
            .take(3)
            .collect();
        let forbidden: Vec<u32> = (0..n_vocab as u32)
            .filter(|&t| !m0.allows(t))
            .take(2)
            .collect();
        let mut logits = vec![-1e4f32; n_vocab];
        for (&t, l) in allowed.iter().zip([1.0, 0.2, -0.5]) {
            logits[t as usize] = l;
        }
        for &t in &forbidden {
            logits[t as usize] = 3.0; // the most likely tokens, were there no grammar
        }
        let z: f32 = [1.0f32, 0.2, -0.5].iter().map(|x| x.exp()).sum();
        let target: Vec<f32> = [1.0f32, 0.2, -0.5].iter().map(|x| x.exp() / z).collect();
        let mut q = vec![0.0f32; n_vocab];
        q[forbidden[0] as usize] = 0.5;
        q[allowed[2] as usize] = 0.4;
        q[allowed[0] as usize] = 0.1;
        let n = 6000;
        for case in 0..3 {
            let mut s = sampler(1.0, 21 + case);
            let mut drafter = sampler(1.0, 40 + case);
            let mut counts = [0usize; 3];
            for _ in 0..n {
                let (d, qs) = match case {
                    0 => (forbidden[1], None),
                    1 => (allowed[1], None),
                    _ => (drafter.draw_from(&q), Some(vec![q.clone()])),
                };
                let rows = vec![logits.clone(), logits.clone()];
                let a = verify(
                    &mut s,
                    &rows,
                    &[d],
                    qs.as_deref(),
                    &mut vec![],
                    Some(&mut g),
                )
                .unwrap();
                let first = if a.accepted == 1 { d } else { a.next };
                let at = allowed.iter().position(|&t| t == first);
                counts[at.unwrap_or_else(|| panic!("case {case}: {first} is outside the mask"))] +=
                    1;
                assert_eq!(g.allowed().unwrap(), &m0, "state restored");
            }
            for (i, &c) in counts.iter().enumerate() {
                let f = c as f32 / n as f32;
                assert!(
                    (f - target[i]).abs() < 0.02,
                    "case {case} token {i}: {f} vs {}",
                    target[i]
                );
            }
        }
    }
}
