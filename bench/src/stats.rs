//! From raw samples to the numbers in the table: medians with min–max over repetitions, and
//! speed-ups paired repetition by repetition against a baseline measured in the same run.
//!
//! A repetition's speed on a workload tag is `Σ tokens / Σ decode seconds` over its items (long
//! items weigh more, as in a real mix). Speed-ups are the median of per-repetition ratios: the
//! two configurations ran back to back in each repetition, so slow machine drift cancels.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::messages::Sample;

/// The tag under which all of a group's items are summarised together.
pub const ALL: &str = "all";

/// One measured generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Measured repetition (warm-ups are not recorded).
    pub rep: usize,
    /// Index into the group's items.
    pub item: usize,
    /// The measurements.
    pub sample: Sample,
}

/// Median and range of a set of numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The median (mean of the middle two for an even count).
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Spread> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// A configuration's numbers on one workload tag (or [`ALL`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TagSummary {
    /// Decode tokens/s over repetitions.
    pub tok_s: Spread,
    /// Speed-up against the configuration's own baseline.
    pub speedup: Option<Spread>,
    /// Speed-up against the group's first configuration (Specula plain).
    pub vs_first: Option<Spread>,
    /// Time to first token, ms, over all samples.
    pub ttft_ms: Spread,
    /// Accepted / drafted.
    pub acceptance: Option<f64>,
    /// Mean accepted drafts per drafting round (tau, bonus token excluded).
    pub tau: Option<f64>,
    /// Mean tokens committed per drafting round: tau plus the target's own (bonus) token.
    #[serde(default)]
    pub tau_bonus: Option<f64>,
    /// Bytes of taps written for the drafter per target forward of the decode.
    #[serde(default)]
    pub tap_bytes_per_round: Option<f64>,
    /// Target forwards per generated token (1 for plain decoding).
    pub forwards_per_token: Option<f64>,
    /// Mean wait for a draft per round, ms (the drafter's step latency, IPC included).
    pub draft_step_ms: Option<f64>,
    /// Greedy generations identical to the baseline's, out of those compared.
    pub same_output: Option<(usize, usize)>,
}

/// What [`summarize`] needs to know about each item.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ItemInfo<'a> {
    /// Its workload tag.
    pub tag: &'a str,
    /// Whether it decodes greedily under this configuration (outputs must then match).
    pub greedy: bool,
}

/// Per-repetition speed over the records `keep` selects: `Σ tokens / Σ decode_s`.
pub fn rep_speeds(records: &[Record], keep: impl Fn(&Record) -> bool) -> BTreeMap<usize, f64> {
    let mut sums: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for r in records.iter().filter(|r| keep(r)) {
        let e = sums.entry(r.rep).or_default();
        e.0 += r.sample.tokens as f64;
        e.1 += r.sample.decode_s;
    }
    sums.into_iter()
        .filter(|(_, (_, s))| *s > 0.0)
        .map(|(rep, (t, s))| (rep, t / s))
        .collect()
}

/// Ratios `a / b` for the repetitions both have.
pub fn paired_ratios(a: &BTreeMap<usize, f64>, b: &BTreeMap<usize, f64>) -> Vec<f64> {
    a.iter()
        .filter_map(|(rep, x)| b.get(rep).filter(|y| **y > 0.0).map(|y| x / y))
        .collect()
}

fn ratio(num: usize, den: usize) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// Summaries per tag (and [`ALL`]) of `records` against `baseline` and `first` (the group's
/// first configuration); `None` for a tag without records.
pub fn summarize(
    records: &[Record],
    baseline: &[Record],
    first: &[Record],
    items: &[ItemInfo<'_>],
) -> BTreeMap<String, TagSummary> {
    let mut tags: Vec<&str> = items.iter().map(|i| i.tag).collect();
    tags.sort_unstable();
    tags.dedup();
    tags.push(ALL);
    let mut out = BTreeMap::new();
    for tag in tags {
        let keep = |r: &Record| tag == ALL || items.get(r.item).is_some_and(|i| i.tag == tag);
        let mine: Vec<&Record> = records.iter().filter(|r| keep(r)).collect();
        let speeds = rep_speeds(records, keep);
        let Some(tok_s) = Spread::of(&speeds.values().copied().collect::<Vec<_>>()) else {
            continue;
        };
        let against =
            |other: &[Record]| Spread::of(&paired_ratios(&speeds, &rep_speeds(other, keep)));
        let ttft: Vec<f64> = mine.iter().map(|r| r.sample.ttft_s * 1e3).collect();
        let sum = |f: fn(&Sample) -> Option<usize>| -> Option<usize> {
            mine.iter().map(|r| f(&r.sample)).sum()
        };
        let drafted = sum(|s| s.drafted);
        let accepted = sum(|s| s.accepted);
        let rounds = sum(|s| s.rounds);
        let forwards = sum(|s| s.target_forwards);
        let tokens: usize = mine.iter().map(|r| r.sample.tokens).sum();
        let draft_s: Option<f64> = mine.iter().map(|r| r.sample.draft_s).sum();
        let tap_bytes = sum(|s| s.tap_bytes);
        let calls = forwards.filter(|_| draft_s.is_some());
        out.insert(
            tag.to_string(),
            TagSummary {
                tok_s,
                speedup: against(baseline),
                vs_first: against(first),
                ttft_ms: Spread::of(&ttft).unwrap_or(Spread {
                    median: 0.0,
                    min: 0.0,
                    max: 0.0,
                }),
                acceptance: accepted.zip(drafted).and_then(|(a, d)| ratio(a, d)),
                tau: accepted.zip(rounds).and_then(|(a, r)| ratio(a, r)),
                tau_bonus: accepted.zip(rounds).and_then(|(a, r)| ratio(a + r, r)),
                tap_bytes_per_round: tap_bytes.zip(forwards).and_then(|(b, f)| ratio(b, f)),
                forwards_per_token: forwards.and_then(|f| ratio(f, tokens)),
                draft_step_ms: draft_s
                    .zip(calls)
                    .filter(|(_, c)| *c > 0)
                    .map(|(s, c)| s * 1e3 / c as f64),
                same_output: same_output(&mine, baseline, items),
            },
        );
    }
    out
}

/// Greedy records whose ids equal the baseline's for the same repetition and item (engines that
/// report no ids, such as `llama-speculative`, are not compared).
fn same_output(
    mine: &[&Record],
    baseline: &[Record],
    items: &[ItemInfo<'_>],
) -> Option<(usize, usize)> {
    let mut compared = 0;
    let mut same = 0;
    for r in mine
        .iter()
        .filter(|r| items.get(r.item).is_some_and(|i| i.greedy))
    {
        let paired = baseline.iter().find(|b| b.rep == r.rep && b.item == r.item);
        if let Some(b) =
            paired.filter(|b| !(b.sample.token_ids.is_empty() || r.sample.token_ids.is_empty()))
        {
            compared += 1;
            same += usize::from(b.sample.token_ids == r.sample.token_ids);
        }
    }
    (compared > 0).then_some((same, compared))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rep: usize, item: usize, tokens: usize, decode_s: f64, ids: &[u32]) -> Record {
        Record {
            rep,
            item,
            sample: Sample {
                tokens,
                decode_s,
                ttft_s: 0.01 * (rep + 1) as f64,
                token_ids: ids.to_vec(),
                ..Sample::default()
            },
        }
    }

    #[test]
    fn spread_median_min_max() {
        assert_eq!(Spread::of(&[]), None);
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 10.0));
    }

    #[test]
    fn rep_speed_weighs_items_by_length() {
        let r = [
            rec(0, 0, 10, 1.0, &[]),
            rec(0, 1, 30, 1.0, &[]),
            rec(1, 0, 10, 2.0, &[]),
        ];
        let s = rep_speeds(&r, |_| true);
        assert_eq!(s[&0], 20.0);
        assert_eq!(s[&1], 5.0);
    }

    #[test]
    fn speedup_pairs_repetitions_of_the_same_run() {
        // The machine halves its speed in rep 1: paired ratios stay 2x, ratio of medians would not.
        let base = [rec(0, 0, 10, 1.0, &[1]), rec(1, 0, 10, 2.0, &[1])];
        let fast = [rec(0, 0, 10, 0.5, &[1]), rec(1, 0, 10, 1.0, &[2])];
        let items = [ItemInfo {
            tag: "t",
            greedy: true,
        }];
        let s = summarize(&fast, &base, &base, &items);
        let all = &s[ALL];
        let up = all.speedup.unwrap();
        assert_eq!((up.median, up.min, up.max), (2.0, 2.0, 2.0));
        assert_eq!(all.tok_s.median, 15.0);
        assert_eq!(all.same_output, Some((1, 2)));
        assert_eq!(s["t"].tok_s, all.tok_s);
        assert_eq!(all.acceptance, None);
        assert_eq!(all.ttft_ms.median, 15.0);
    }

    #[test]
    fn speculation_counters_and_tags() {
        let mut a = rec(0, 0, 8, 1.0, &[]);
        a.sample.drafted = Some(8);
        a.sample.accepted = Some(6);
        a.sample.rounds = Some(3);
        a.sample.target_forwards = Some(4);
        a.sample.draft_s = Some(0.004);
        a.sample.tap_bytes = Some(8 * 4608);
        let b = rec(0, 1, 8, 1.0, &[]);
        let items = [
            ItemInfo {
                tag: "x",
                greedy: false,
            },
            ItemInfo {
                tag: "y",
                greedy: true,
            },
        ];
        let s = summarize(&[a, b.clone()], &[b], &[], &items);
        let x = &s["x"];
        assert_eq!(x.acceptance, Some(0.75));
        assert_eq!(x.tau, Some(2.0));
        assert_eq!(x.tau_bonus, Some(3.0));
        assert_eq!(x.tap_bytes_per_round, Some(2.0 * 4608.0));
        assert_eq!(s["y"].tap_bytes_per_round, None, "no drafter taps");
        assert_eq!(x.forwards_per_token, Some(0.5));
        assert_eq!(x.draft_step_ms, Some(1.0));
        assert_eq!(x.speedup, None, "no baseline record for tag x");
        assert_eq!(x.same_output, None, "sampled items are not compared");
        assert_eq!(s["y"].speedup.unwrap().median, 1.0);
        assert_eq!(s["y"].acceptance, None);
        assert_eq!(s["y"].same_output, None, "no ids, nothing compared");
        assert_eq!(s[ALL].vs_first, None);
    }
}
