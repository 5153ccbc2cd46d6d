//! Per-token confidences for drafts that have no confidence head (DFlash; DSpark without
//! one): the draft distribution's own probability of the drafted id, calibrated online against
//! what the target accepted.
//!
//! The host cuts a draft where the product of its confidences says the rest will be rejected
//! anyway, and verifies nothing when even the first is unlikely: a round that would not pay
//! then costs the draft only, not the verify of k + 1 rows. A drafter's raw top-1 probability
//! is a good ranking of its drafts but not a probability of acceptance (a small drafter is
//! over-confident), so each draft's feature — `softmax(logits)[id]` greedy, `q[id]` sampled —
//! falls in one of [`BINS`] bins, and the confidence is that bin's acceptance rate so far,
//! shrunk toward the feature itself ([`PRIOR_WEIGHT`] pseudo-trials). The counts are per
//! session and start empty at each `Open` (a request's drafts never depend on the requests
//! before it: a re-`Open` after a fault starts where a clean run starts), and forget slowly
//! ([`FORGET`] per judged draft, [`IDLE_FADE`] per round), so they follow a change within the
//! text and a bin whose drafts the host always cuts is tried again.
//!
//! What a judged round says: drafts `0..accepted` were accepted; draft `accepted`, when
//! `accepted < drafted`, was rejected; the drafts after it were never judged and say nothing.

/// Bins over the feature's range 0..=1.
pub const BINS: usize = 10;

/// Weight, in judged drafts, of the raw feature as a bin's prior.
pub const PRIOR_WEIGHT: f64 = 4.0;

/// Per judged draft, a bin's counts are multiplied by this: the last few hundred drafts count.
pub const FORGET: f64 = 0.995;

/// Per verified round, every bin's counts are multiplied by this.
pub const IDLE_FADE: f64 = 0.999;

/// One session's acceptance counts per feature bin.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Per bin: (accepted, judged), exponentially forgotten.
    bins: [(f64, f64); BINS],
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            bins: [(0.0, 0.0); BINS],
        }
    }
}

fn bin(feature: f32) -> usize {
    // NaN and negatives land in bin 0; 1.0 in the last.
    ((feature.max(0.0) * BINS as f32) as usize).min(BINS - 1)
}

impl Calibration {
    /// The estimated probability that a draft with this feature is accepted, once reached.
    pub fn confidence(&self, feature: f32) -> f32 {
        // NaN (a broken row) counts as no confidence at all.
        let feature = if feature.is_nan() { 0.0 } else { feature };
        let prior = f64::from(feature.clamp(0.0, 1.0));
        let (accepted, judged) = self.bins[bin(feature)];
        let c = (accepted + PRIOR_WEIGHT * prior) / (judged + PRIOR_WEIGHT);
        c.clamp(0.0, 1.0) as f32
    }

    /// Folds in one verified round: `features` of the drafts proposed (in order), `drafted` of
    /// them verified, `accepted` of those accepted.
    pub fn observe(&mut self, features: &[f32], drafted: usize, accepted: usize) {
        // Every round, every bin fades a little: a bin whose drafts are always cut (so never
        // judged) drifts back to its prior and is tried again.
        for (a, n) in &mut self.bins {
            *a *= IDLE_FADE;
            *n *= IDLE_FADE;
        }
        let drafted = drafted.min(features.len());
        let accepted = accepted.min(drafted);
        for &f in &features[..accepted] {
            self.judge(f, true);
        }
        if accepted < drafted {
            self.judge(features[accepted], false);
        }
    }

    fn judge(&mut self, feature: f32, accepted: bool) {
        let (a, n) = &mut self.bins[bin(feature)];
        *a = *a * FORGET + f64::from(u8::from(accepted));
        *n = *n * FORGET + 1.0;
    }
}

/// `softmax(row)[at]`: the probability the distribution of these logits gives id `at`, to a
/// few parts in 10⁴ (a feature for [`Calibration`]'s bins: [`exp_le0`] keeps the sum over a
/// draft vocabulary of 16k ids a small part of the round).
pub fn probability_of(row: &[f32], at: usize) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    let sum: f32 = row.iter().map(|&z| exp_le0(z - max)).sum();
    row.get(at).map_or(0.0, |&z| exp_le0(z - max) / sum)
}

/// `eˣ` for `x ≤ 0` (relative error below 2·10⁻⁴; 0 below −87): `2^i · 2^f` with `i` the
/// truncated integer part of `x·log₂e` and `2^f = e^(f·ln 2)`, `f ∈ (−1, 0]`, by a degree-6
/// Taylor polynomial.
/// Branch-free, so the sum over a row vectorises.
pub fn exp_le0(x: f32) -> f32 {
    let t = x.max(-87.0) * std::f32::consts::LOG2_E;
    let i = t as i32;
    let f = (t - i as f32) * std::f32::consts::LN_2;
    let p = 1.0
        + f * (1.0
            + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f / 720.0)))));
    let scale = f32::from_bits(((i + 127) as u32) << 23);
    let y = scale * p;
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn before_any_round_the_confidence_is_the_feature() {
        let c = Calibration::default();
        assert_eq!(c.confidence(0.25), 0.25);
        assert_eq!(c.confidence(1.0), 1.0);
        assert_eq!(c.confidence(f32::NAN), 0.0);
    }

    #[test]
    fn an_over_confident_drafter_is_corrected_by_what_was_accepted() {
        let mut c = Calibration::default();
        // Drafts at 0.95 are accepted one time in five; drafts at 0.35 never.
        for round in 0..200 {
            let accepted = usize::from(round % 5 == 0);
            c.observe(&[0.95, 0.35, 0.35], 3, accepted);
        }
        let high = c.confidence(0.95);
        assert!((high - 0.2).abs() < 0.05, "{high}");
        // Only the first rejected draft was judged: the 0.35 drafts after it were reached
        // only when the first was accepted (40 times), and were then always rejected.
        assert!(c.confidence(0.35) < 0.05, "{}", c.confidence(0.35));
        // A bin never judged keeps its prior.
        assert_eq!(c.confidence(0.75), 0.75);
    }

    #[test]
    fn unjudged_drafts_say_nothing() {
        let mut c = Calibration::default();
        // The host verified 1 of 3 drafts (it cut the rest) and rejected it.
        c.observe(&[0.55, 0.15, 0.85], 1, 0);
        assert!(c.confidence(0.55) < 0.55);
        assert_eq!(c.confidence(0.15), 0.15);
        assert_eq!(c.confidence(0.85), 0.85);
        // All verified drafts accepted: none rejected.
        let mut all = Calibration::default();
        all.observe(&[0.55, 0.55], 2, 2);
        assert!(all.confidence(0.55) > 0.55);
        // A reply that counts more than it had is clamped, never a panic.
        all.observe(&[0.55], 5, 7);
    }

    #[test]
    fn exp_le0_is_exp_within_its_bound() {
        for i in 0..=10_000 {
            let x = -87.0 * i as f32 / 10_000.0;
            let (got, want) = (exp_le0(x), x.exp());
            assert!((got - want).abs() <= 2e-4 * want, "{x}: {got} vs {want}");
        }
        assert_eq!(exp_le0(0.0), 1.0);
        assert_eq!(exp_le0(-1000.0), 0.0);
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn the_probability_of_an_id_is_its_softmax() {
        let p = probability_of(&[0.0, 0.0f32.ln_1p(), 2.0f32.ln()], 2);
        assert!((p - 0.5).abs() < 1e-4, "{p}");
        assert_eq!(probability_of(&[1.0, 2.0], 5), 0.0);
        assert_eq!(probability_of(&[f32::NEG_INFINITY; 3], 0), 0.0);
    }
}
