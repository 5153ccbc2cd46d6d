//! Adaptive draft length: the host picks each round's k from what the request has observed so
//! far, so a drafter that is often wrong (or slow) costs less and one that is right drafts more.
//!
//! The rule is Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
//! (<https://arxiv.org/abs/2211.17192>, §3.5): with a per-token acceptance rate α and a draft
//! token costing c target forwards, a round of k drafts commits
//!
//! ```text
//!   E[tokens](k) = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)
//! ```
//!
//! tokens for a cost of `1 + c·k` target forwards, and the best k maximizes their ratio. Both
//! numbers come from the request's own [`GenerationStats`]:
//!
//! - α solves `Σ_{i=1..k̄} α^i = accepted / rounds` with `k̄ = drafted / rounds` (a round's accepted
//!   count is a truncated geometric: the first rejection ends it). `accepted / drafted` would
//!   read low, since drafts after the first rejection are never judged;
//! - c is `(draft_ms / drafted) / (forward_ms / target_forwards)`: the wait for one draft token
//!   (IPC and the drafter's own forwards) over one target forward as measured.
//!
//! The first round, before anything is observed, drafts the maximum. k stays in `[1, max]`:
//! adaptivity never turns speculation off. It reads only counters the decode loop keeps anyway,
//! so it needs no state of its own. Since every committed token still comes from the target's
//! verify step, the choice of k changes speed only, never output.
//!
//! Not modelled: a verify window of k+1 tokens costs more than one token on a CPU, so the rule
//! is optimistic about long drafts when verification is compute-bound.

use crate::generation::{GenerationStats, Speculation};

impl Speculation {
    /// Drafts to ask for in the next round given the request's counters so far (before the
    /// budget and context clamps): 0 when off, the fixed k when on, [`adaptive_k`] when adaptive.
    pub fn draft_len(&self, stats: &GenerationStats) -> usize {
        match *self {
            Speculation::Off => 0,
            Speculation::On { num_draft_tokens } => num_draft_tokens,
            Speculation::Adaptive { max_draft_tokens } => adaptive_k(max_draft_tokens, stats),
        }
    }
}

/// The k in `1..=max` that maximizes expected committed tokens per unit of time, estimated
/// from `stats` (see the module docs); `max` (at least 1) before the first round.
pub fn adaptive_k(max: usize, stats: &GenerationStats) -> usize {
    let max = max.max(1);
    if stats.rounds == 0 || stats.drafted == 0 || stats.target_forwards == 0 {
        return max;
    }
    let alpha = acceptance_per_token(stats);
    let cost = draft_cost(stats);
    best_k(alpha, cost, max)
}

/// The k in `1..=max` that maximizes `E[tokens](k) / (1 + cost·k)`; the shortest on ties.
pub fn best_k(alpha: f64, cost: f64, max: usize) -> usize {
    let speed = |k: usize| expected_tokens(alpha, k) / (1.0 + cost * k as f64);
    (1..=max.max(1))
        .fold((1, f64::MIN), |(best, s_best), k| {
            let s = speed(k);
            // A strict margin: a longer draft must be really better to be chosen.
            if s > s_best * (1.0 + 1e-9) {
                (k, s)
            } else {
                (best, s_best)
            }
        })
        .0
}

/// `1 + α + … + α^k`: tokens one round commits on average (accepted drafts plus the target's).
pub fn expected_tokens(alpha: f64, k: usize) -> f64 {
    (0..=k).map(|i| alpha.powi(i as i32)).sum()
}

/// Per-token acceptance α from the request's counters: the root in `[0, 1]` of
/// `Σ_{i=1..k̄} α^i = accepted / rounds` with real-valued `k̄ = drafted / rounds`.
pub fn acceptance_per_token(stats: &GenerationStats) -> f64 {
    if stats.rounds == 0 || stats.drafted == 0 {
        return 0.0;
    }
    let k_bar = stats.drafted as f64 / stats.rounds as f64;
    let mean = stats.accepted as f64 / stats.rounds as f64;
    if mean >= k_bar {
        return 1.0;
    }
    // Σ_{i=1..k̄} α^i for real k̄, as (α − α^(k̄+1)) / (1 − α); increasing in α on [0, 1).
    let accepted_at = |a: f64| (a - a.powf(k_bar + 1.0)) / (1.0 - a);
    let (mut lo, mut hi) = (0.0_f64, 1.0_f64);
    for _ in 0..50 {
        let mid = 0.5 * (lo + hi);
        if accepted_at(mid) < mean {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Cost of one draft token in target forwards, as measured; 0 when nothing was timed.
pub fn draft_cost(stats: &GenerationStats) -> f64 {
    if stats.drafted == 0 || stats.target_forwards == 0 || stats.forward_ms <= 0.0 {
        return 0.0;
    }
    let per_draft = stats.draft_ms / stats.drafted as f64;
    let per_forward = stats.forward_ms / stats.target_forwards as f64;
    (per_draft / per_forward).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(rounds: usize, drafted: usize, accepted: usize, draft_ms: f64) -> GenerationStats {
        GenerationStats {
            rounds,
            drafted,
            accepted,
            target_forwards: rounds,
            forward_ms: 100.0 * rounds as f64,
            draft_ms,
            ..GenerationStats::default()
        }
    }

    #[test]
    fn the_first_round_drafts_the_maximum() {
        assert_eq!(adaptive_k(5, &GenerationStats::default()), 5);
        assert_eq!(adaptive_k(0, &GenerationStats::default()), 1, "never 0");
    }

    #[test]
    fn acceptance_inverts_the_truncated_geometric_mean() {
        // α = 0.5, k = 4: a round accepts 0.5 + 0.25 + 0.125 + 0.0625 = 0.9375 on average.
        let s = stats(16, 64, 15, 0.0);
        assert!((acceptance_per_token(&s) - 0.5).abs() < 1e-6);
        assert_eq!(acceptance_per_token(&stats(4, 16, 16, 0.0)), 1.0);
        assert!(acceptance_per_token(&stats(4, 16, 0, 0.0)) < 1e-9);
        // The naive rate (15/64 = 0.23) reads low.
        assert!(acceptance_per_token(&s) > 15.0 / 64.0 * 2.0);
    }

    #[test]
    fn free_drafts_that_are_always_accepted_draft_the_maximum() {
        assert_eq!(adaptive_k(6, &stats(10, 40, 40, 0.0)), 6);
    }

    #[test]
    fn drafts_that_are_never_accepted_draft_one() {
        assert_eq!(adaptive_k(6, &stats(10, 40, 0, 400.0)), 1);
    }

    #[test]
    fn the_best_k_follows_the_paper() {
        // The closed form, worked by hand: α = 0.8, c = 0.05 peaks at k = 8 (3.09 tokens per
        // unit of time); α = 0.6, c = 0.1 at k = 3 (1.67).
        assert_eq!(best_k(0.8, 0.05, 12), 8);
        assert_eq!(best_k(0.6, 0.1, 12), 3);
        // An expensive drafter lowers k even at high acceptance.
        assert!(best_k(0.8, 0.5, 12) < best_k(0.8, 0.05, 12));
        assert_eq!(best_k(0.9, 0.0, 4), 4, "bounded by max");
    }

    #[test]
    fn a_slow_drafter_drafts_less_than_a_fast_one_at_the_same_acceptance() {
        // α ≈ 0.7 at k = 4; drafts cost 5 ms vs 60 ms against 100 ms target forwards.
        let fast = adaptive_k(6, &stats(20, 80, 37, 5.0 * 80.0));
        let slow = adaptive_k(6, &stats(20, 80, 37, 60.0 * 80.0));
        assert!(fast > slow, "fast {fast} slow {slow}");
        assert!(slow >= 1);
    }

    #[test]
    fn draft_len_follows_the_speculation() {
        let s = stats(10, 40, 0, 400.0);
        assert_eq!(Speculation::Off.draft_len(&s), 0);
        let on = Speculation::On {
            num_draft_tokens: 4,
        };
        assert_eq!(on.draft_len(&s), 4, "fixed k ignores the counters");
        let adaptive = Speculation::Adaptive {
            max_draft_tokens: 4,
        };
        assert_eq!(adaptive.draft_len(&s), 1);
    }
}
