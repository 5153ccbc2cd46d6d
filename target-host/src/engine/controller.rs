//! The cost-aware speculation controller: every step, each running sequence's draft length k
//! (0 included) is chosen to maximise committed tokens per second of the whole batch.
//!
//! - **Cost**: [`CostTable`] maps the rows of one target forward to its time, profiled at
//!   start-up and kept current by every step (an EMA per size bucket, interpolated between
//!   buckets, made non-decreasing). Drafting costs its measured latency (IPC and the drafter's
//!   own step), measured per drafter and per longest row asked ([`DraftCost`]: the median of
//!   the last few calls, so one slow call — a cold start, a missed deadline — does not shut a
//!   good drafter off), whenever any sequence drafts.
//! - **Acceptance**: each sequence keeps an exponentially forgotten count of judged draft slots
//!   ([`Acceptance`]): a round of k drafts with a accepted is a accepts and, when a < k, one
//!   rejection (the first rejection ends the round: a truncated geometric). Its estimate is
//!   shrunk toward the drafter-wide rate, so a new sequence starts from what the drafter has
//!   shown, and it drifts back toward that prior while the sequence does not draft, so a
//!   sequence that once did badly is probed again later. Apart from that, it counts how often
//!   an ask came back with any draft at all (the *hit rate*): an empty reply (prompt lookup
//!   finding no match) costs the call's latency but no verify row, so it is not a rejection.
//!   Counting it as one made the controller stop asking between the echo runs of a code edit
//!   and miss the next run (1.25× plain where a fixed k 2 gave 1.48×).
//! - **Allocation** (TETRIS, arXiv 2502.15197, over SmartSpec's goodput, arXiv 2406.14066):
//!   the next draft slot goes to the sequence whose next draft is most likely accepted
//!   (α_i^(k_i+1)); for every total m of slots the batch's goodput is
//!   `Σ_i E_i(k_i) / (cost(rows + Σ_i h_i·k_i) + draft_latency·[m > 0])`,
//!   `E_i(k) = 1 + h_i·Σ_{j=1..k} α_i^j` with h_i the hit rate, and the best m wins. m = 0 is
//!   plain decoding, so speculation is chosen only when it is expected to pay.
//! - **Hysteresis**: the last total is kept unless another beats it by [`HYSTERESIS`], so the
//!   choice does not flap at a threshold (vLLM #49548's collapse).
//! - **Exploration**: while drafting does not pay, what is known of it stops changing, so
//!   after [`EXPLORE_MIN`] steps without drafts one sequence drafts one token anyway; each
//!   probe that changes nothing doubles the wait (up to [`EXPLORE_MAX`] steps), which bounds
//!   its cost to a fraction of a percent, and a drafter that became fast or accurate (or a
//!   stalled one that answers in time again) is found.
//!
//! Whatever k is chosen, every committed token comes from the target's verification, so the
//! controller changes speed only.

/// How much better (relative goodput) a new total draft count must be to replace the last.
pub const HYSTERESIS: f64 = 0.05;

/// Steps without drafts before the first exploration draft.
pub const EXPLORE_MIN: usize = 16;

/// The longest wait, in steps, between exploration drafts.
pub const EXPLORE_MAX: usize = 1024;

/// Draft calls remembered per longest row asked.
const DRAFT_SAMPLES: usize = 5;

/// Forgetting factor of a sequence's acceptance counts, per judged round.
const FORGET: f64 = 0.9;

/// Weight, in judged slots, of the drafter-wide prior in a sequence's estimate.
const PRIOR_WEIGHT: f64 = 2.0;

/// Per step without drafting, a sequence's own counts fade by this factor (back to the prior).
const IDLE_FADE: f64 = 0.97;

/// Forward time as a function of the rows in the forward.
///
/// Buckets keep the shape they were profiled (or guessed) with until a step of their size is
/// measured; a scale learned from every measurement carries the buckets not measured yet, so
/// a table profiled on an idle machine (or guessed) follows the real one.
#[derive(Debug, Clone)]
pub struct CostTable {
    /// Rows ascending.
    buckets: Vec<Bucket>,
    /// Measured over shape-predicted time (EMA); `None` before any measurement.
    scale: Option<f64>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    rows: usize,
    /// The profiled (or guessed) time.
    shape: f64,
    /// The measured time (EMA), once a step of this size ran.
    measured: Option<f64>,
}

/// Piecewise-linear interpolation over `(rows, ms)` points, linear past the ends, never
/// decreasing in `rows`.
fn interpolate(points: &[(usize, f64)], rows: usize) -> f64 {
    let rows = rows.max(1);
    let i = points.partition_point(|&(r, _)| r < rows);
    let raw = if i == 0 {
        points[0].1 * rows as f64 / points[0].0 as f64
    } else if i == points.len() {
        let (r, c) = points[points.len() - 1];
        c * rows as f64 / r as f64
    } else {
        let ((r0, c0), (r1, c1)) = (points[i - 1], points[i]);
        c0 + (rows - r0) as f64 / (r1 - r0) as f64 * (c1 - c0)
    };
    let floor = points[..i].iter().map(|p| p.1).fold(0.0, f64::max);
    raw.max(floor)
}

impl CostTable {
    /// A table from measured `(rows, ms)` points (at least one).
    pub fn new(mut points: Vec<(usize, f64)>) -> Self {
        points.retain(|p| p.0 > 0 && p.1.is_finite() && p.1 > 0.0);
        points.sort_by_key(|p| p.0);
        points.dedup_by_key(|p| p.0);
        assert!(!points.is_empty(), "invariant: the cost table has a point");
        CostTable {
            buckets: points
                .into_iter()
                .map(|(rows, shape)| Bucket {
                    rows,
                    shape,
                    measured: None,
                })
                .collect(),
            scale: None,
        }
    }

    fn shape(&self, rows: usize) -> f64 {
        let points: Vec<(usize, f64)> = self.buckets.iter().map(|b| (b.rows, b.shape)).collect();
        interpolate(&points, rows)
    }

    /// Estimated milliseconds of a forward of `rows` rows (non-decreasing in `rows`).
    pub fn cost(&self, rows: usize) -> f64 {
        let scale = self.scale.unwrap_or(1.0);
        let points: Vec<(usize, f64)> = self
            .buckets
            .iter()
            .map(|b| (b.rows, b.measured.unwrap_or(b.shape * scale)))
            .collect();
        interpolate(&points, rows)
    }

    /// Estimated milliseconds of a forward of `rows` plus an expected `extra` rows (a
    /// fraction interpolates between the whole numbers around it).
    pub fn cost_between(&self, rows: usize, extra: f64) -> f64 {
        let whole = extra.floor();
        let lo = self.cost(rows + whole as usize);
        let hi = self.cost(rows + whole as usize + 1);
        lo + (extra - whole) * (hi - lo)
    }

    /// Folds a measured step (`rows`, `ms`) into the table.
    pub fn observe(&mut self, rows: usize, ms: f64) {
        if rows == 0 || !ms.is_finite() || ms <= 0.0 {
            return;
        }
        let ratio = ms / self.shape(rows).max(1e-9);
        self.scale = Some(self.scale.map_or(ratio, |s| 0.8 * s + 0.2 * ratio));
        let bucket = rows.next_power_of_two();
        // The sample scaled to the bucket's size along the shape.
        let scaled = ms * self.shape(bucket) / self.shape(rows).max(1e-9);
        let i = self.buckets.partition_point(|b| b.rows < bucket);
        if self.buckets.get(i).is_none_or(|b| b.rows != bucket) {
            let shape = self.shape(bucket);
            self.buckets.insert(
                i,
                Bucket {
                    rows: bucket,
                    shape,
                    measured: None,
                },
            );
        }
        let b = &mut self.buckets[i];
        b.measured = Some(b.measured.map_or(scaled, |m| 0.8 * m + 0.2 * scaled));
    }
}

/// Draft latency (ms) as a function of the longest row asked, from the last
/// [`DRAFT_SAMPLES`] calls at each length.
#[derive(Debug, Clone, Default)]
pub struct DraftCost {
    /// Index k - 1: the recent calls whose longest row asked k drafts.
    by_k: Vec<std::collections::VecDeque<f64>>,
}

impl DraftCost {
    /// Folds in a call whose longest row asked `k` drafts and took `ms`.
    pub fn observe(&mut self, k: usize, ms: f64) {
        if k == 0 || !ms.is_finite() || ms < 0.0 {
            return;
        }
        if self.by_k.len() < k {
            self.by_k.resize_with(k, Default::default);
        }
        let ring = &mut self.by_k[k - 1];
        if ring.len() == DRAFT_SAMPLES {
            ring.pop_front();
        }
        ring.push_back(ms);
    }

    fn median(ring: &std::collections::VecDeque<f64>) -> Option<f64> {
        let mut v: Vec<f64> = ring.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }

    /// Estimated ms of a call whose longest row asks `k` drafts (0 for k = 0): the largest
    /// median measured at `k` or below, else the nearest measured above, else 0 (nothing
    /// measured yet: the first draft finds out).
    pub fn estimate(&self, k: usize) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let medians: Vec<Option<f64>> = self.by_k.iter().map(Self::median).collect();
        let below = medians.iter().take(k).flatten().copied().reduce(f64::max);
        let above = || medians.iter().skip(k).flatten().copied().next();
        below.or_else(above).unwrap_or(0.0)
    }

    /// Whether any call was measured.
    pub fn is_measured(&self) -> bool {
        self.by_k.iter().any(|r| !r.is_empty())
    }
}

/// A sequence's record of how its drafts fared.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Acceptance {
    accepts: f64,
    trials: f64,
    /// Asks (forgotten like the trials) and those answered with a non-empty draft.
    asks: f64,
    replies: f64,
    /// The most drafts its next round may get ([`Acceptance::reach`]; 0 reads as 1).
    ramp: usize,
}

impl Acceptance {
    /// Folds in one verified round: `asked` slots asked for, `drafted` came back, `accepted`
    /// of them accepted. An empty reply is a miss of the hit rate, not a rejected slot.
    pub fn observe(&mut self, asked: usize, drafted: usize, accepted: usize) {
        if asked == 0 {
            return;
        }
        self.asks = self.asks * FORGET + 1.0;
        if drafted == 0 {
            self.replies *= FORGET;
            return;
        }
        self.replies = self.replies * FORGET + 1.0;
        self.accepts = self.accepts * FORGET + accepted as f64;
        let rejected = usize::from(accepted < drafted);
        self.trials = self.trials * FORGET + (accepted + rejected) as f64;
        self.ramp = match rejected {
            0 => self.reach().max(drafted) * 2,
            _ => accepted + 1,
        };
    }

    /// The most drafts the sequence's next round may get (slow start): one before any of its
    /// own rounds was judged, whatever the prior says, so a prior learned on other prompts
    /// costs a new sequence at most one verify row a round until its own drafts are judged;
    /// doubled by each round whose drafts were all accepted; one more than the accepted run
    /// after a rejection. The acceptance estimate still decides whether drafting pays at all.
    pub fn reach(&self) -> usize {
        self.ramp.max(1)
    }

    /// A step in which the sequence did not draft: its own evidence fades.
    pub fn idle(&mut self) {
        self.accepts *= IDLE_FADE;
        self.trials *= IDLE_FADE;
        self.asks *= IDLE_FADE;
        self.replies *= IDLE_FADE;
    }

    /// Per-slot acceptance of drafted tokens, shrunk toward `prior`.
    pub fn alpha(&self, prior: f64) -> f64 {
        ((self.accepts + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)).clamp(0.0, 0.999)
    }

    /// Share of asks answered with a draft, shrunk toward `prior`.
    pub fn hit(&self, prior: f64) -> f64 {
        ((self.replies + PRIOR_WEIGHT * prior) / (self.asks + PRIOR_WEIGHT)).clamp(0.0, 1.0)
    }
}

/// One sequence's part in an allocation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Per-slot acceptance estimate of drafted tokens.
    pub alpha: f64,
    /// Chance that an ask comes back with a draft at all.
    pub hit: f64,
    /// Most drafts it may get (its request's maximum, its budget, the context room).
    pub max: usize,
}

/// The controller's state between steps.
#[derive(Debug, Clone)]
pub struct Controller {
    /// Forward cost.
    pub cost: CostTable,
    /// Drafter-wide acceptance (the prior of every sequence).
    pub global: Acceptance,
    /// Measured draft latency of the current drafter.
    pub draft: DraftCost,
    last_total: usize,
    /// Steps in a row without drafts while some sequence could draft.
    idle_steps: usize,
    /// Idle steps before the next exploration draft.
    explore_every: usize,
}

impl Controller {
    /// A controller over a profiled cost table.
    pub fn new(cost: CostTable) -> Self {
        Controller {
            cost,
            global: Acceptance::default(),
            draft: DraftCost::default(),
            last_total: 0,
            idle_steps: 0,
            explore_every: EXPLORE_MIN,
        }
    }

    /// The drafter-wide prior acceptance: optimistic before any evidence, so a new drafter
    /// is tried (and its acceptance learned) before the cost model can rule it out.
    pub fn prior(&self) -> f64 {
        self.global.alpha(0.8)
    }

    /// The drafter-wide prior hit rate (every ask answered, before any evidence).
    pub fn prior_hit(&self) -> f64 {
        self.global.hit(1.0)
    }

    /// Folds in a measured draft call whose longest row asked `k` drafts.
    pub fn observe_draft(&mut self, k: usize, ms: f64) {
        self.draft.observe(k, ms);
    }

    /// A new drafter (hot swap): what was learned about the old one no longer holds.
    pub fn reset_drafter(&mut self) {
        self.global = Acceptance::default();
        self.draft = DraftCost::default();
        self.last_total = 0;
        self.idle_steps = 0;
        self.explore_every = EXPLORE_MIN;
    }

    /// Each candidate's k for a step that already runs `rows` rows, with at most `room` draft
    /// rows in all. See the module docs.
    pub fn allocate(&mut self, rows: usize, room: usize, cands: &[Candidate]) -> Vec<usize> {
        let mut k = vec![0usize; cands.len()];
        // Slots in the order the greedy allocation hands them out.
        let mut order = Vec::new();
        let mut next: Vec<f64> = cands.iter().map(|c| c.alpha).collect();
        let cap: usize = cands.iter().map(|c| c.max).sum::<usize>().min(room);
        let mut probe = k.clone();
        for _ in 0..cap {
            let best = (0..cands.len())
                .filter(|&i| probe[i] < cands[i].max)
                .max_by(|&a, &b| next[a].total_cmp(&next[b]));
            let Some(i) = best else { break };
            order.push(i);
            probe[i] += 1;
            next[i] *= cands[i].alpha;
        }
        let base_tokens = cands.len() as f64;
        let mut gain = base_tokens;
        // Expected verify rows the handed slots add: an empty reply adds none.
        let mut extra = 0.0;
        let mut weight: Vec<f64> = cands.iter().map(|c| c.alpha).collect();
        let mut goodput = vec![base_tokens / self.cost.cost(rows)];
        let (mut given, mut longest) = (vec![0usize; cands.len()], 0);
        for &i in &order {
            gain += cands[i].hit * weight[i];
            extra += cands[i].hit;
            weight[i] *= cands[i].alpha;
            given[i] += 1;
            longest = longest.max(given[i]);
            let cost = self.cost.cost_between(rows, extra) + self.draft.estimate(longest);
            goodput.push(gain / cost);
        }
        let best = (0..goodput.len())
            .max_by(|&a, &b| goodput[a].total_cmp(&goodput[b]))
            .unwrap_or(0);
        let keep = self.last_total.min(goodput.len() - 1);
        let total = match goodput[best] > goodput[keep] * (1.0 + HYSTERESIS) {
            true => best,
            false => keep,
        };
        self.last_total = total;
        let total = match (total, order.is_empty()) {
            (0, false) => self.explore(),
            (0, true) => 0,
            _ => {
                self.idle_steps = 0;
                self.explore_every = EXPLORE_MIN;
                total
            }
        };
        for &i in &order[..total] {
            k[i] += 1;
        }
        k
    }

    /// A step in which drafting does not pay: 1 (one exploration draft) once enough such steps
    /// went by, else 0. The hysteresis keeps its choice of none.
    fn explore(&mut self) -> usize {
        self.idle_steps += 1;
        if self.idle_steps < self.explore_every {
            return 0;
        }
        self.idle_steps = 0;
        self.explore_every = (self.explore_every * 2).min(EXPLORE_MAX);
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU-like table: 8 verify rows cost ~3.7 decode steps (the measurement).
    fn cpu() -> CostTable {
        CostTable::new(vec![(1, 10.0), (2, 14.0), (4, 22.0), (8, 37.0), (16, 70.0)])
    }

    /// A memory-bound table: extra rows are nearly free.
    fn gpu() -> CostTable {
        CostTable::new(vec![(1, 10.0), (8, 10.5), (64, 14.0)])
    }

    #[test]
    fn the_cost_table_interpolates_and_never_decreases() {
        let t = cpu();
        assert_eq!(t.cost(1), 10.0);
        assert_eq!(t.cost(3), 18.0);
        assert_eq!(t.cost(32), 140.0);
        let mut last = 0.0;
        for rows in 1..40 {
            assert!(t.cost(rows) >= last);
            last = t.cost(rows);
        }
        let mut t = cpu();
        t.observe(8, 57.0);
        assert!(
            (t.cost(8) - 57.0).abs() < 1e-9,
            "the first measurement replaces the guess"
        );
        t.observe(8, 37.0);
        assert!(
            (t.cost(8) - 53.0).abs() < 1e-9,
            "then an EMA moves 20% toward 37"
        );
        // A machine 4x faster than profiled: unmeasured sizes follow.
        let mut t = cpu();
        for _ in 0..40 {
            t.observe(1, 2.5);
        }
        assert!((t.cost(1) - 2.5).abs() < 0.1);
        assert!((t.cost(16) - 70.0 / 4.0).abs() < 1.0, "{}", t.cost(16));
    }

    #[test]
    fn acceptance_counts_a_truncated_geometric() {
        let mut a = Acceptance::default();
        // α = 0.5: accept, reject.
        for _ in 0..50 {
            a.observe(4, 4, 1);
        }
        assert!((a.alpha(0.5) - 0.5).abs() < 0.01);
        let mut b = Acceptance::default();
        for _ in 0..50 {
            b.observe(4, 4, 4);
        }
        assert!(b.alpha(0.5) > 0.95);
        let mut c = Acceptance::default();
        for _ in 0..50 {
            c.observe(4, 0, 0);
        }
        assert!(c.hit(1.0) < 0.2, "empty replies are misses");
        assert!(
            (c.alpha(0.5) - 0.5).abs() < 1e-9,
            "empty replies judge no drafted token"
        );
        for _ in 0..50 {
            c.observe(4, 2, 1);
        }
        assert!((c.alpha(0.5) - 0.5).abs() < 0.01 && c.hit(1.0) > 0.95);
        for _ in 0..50 {
            c.observe(4, 0, 0);
        }
        assert_eq!(c.reach(), 2, "an empty reply judges nothing");
        for _ in 0..300 {
            c.idle();
        }
        assert!(
            (c.alpha(0.9) - 0.9).abs() < 0.01 && (c.hit(1.0) - 1.0).abs() < 0.01,
            "idle sequences return to the prior"
        );
    }

    #[test]
    fn a_new_sequence_drafts_one_until_its_own_rounds_earn_more() {
        let mut a = Acceptance::default();
        assert_eq!(
            a.reach(),
            1,
            "a new sequence: one draft, whatever the prior"
        );
        a.observe(1, 1, 1);
        assert_eq!(a.reach(), 2);
        a.observe(2, 2, 2);
        assert_eq!(a.reach(), 4, "every fully accepted round doubles it");
        a.observe(4, 4, 1);
        assert_eq!(a.reach(), 2, "a rejection: one more than the accepted run");
        a.observe(2, 2, 0);
        assert_eq!(a.reach(), 1);
        a.observe(1, 0, 0);
        assert_eq!(a.reach(), 1, "an empty reply judges nothing");
        a.idle();
        assert_eq!(a.reach(), 1);
        // A drafter that sent fewer than asked, all accepted: twice what it showed.
        a.observe(8, 3, 3);
        assert_eq!(a.reach(), 6);
    }

    fn cands(alphas: &[f64], max: usize) -> Vec<Candidate> {
        alphas
            .iter()
            .map(|&alpha| Candidate {
                alpha,
                hit: 1.0,
                max,
            })
            .collect()
    }

    #[test]
    fn poor_acceptance_on_a_compute_bound_target_drafts_nothing() {
        let mut c = Controller::new(cpu());
        assert_eq!(c.allocate(1, 16, &cands(&[0.3], 8)), vec![0]);
    }

    #[test]
    fn high_acceptance_drafts_and_cheap_verification_drafts_more() {
        let mut c = Controller::new(cpu());
        let k_cpu = c.allocate(1, 16, &cands(&[0.95], 8))[0];
        assert!(k_cpu > 0, "α = 0.95 pays even on a CPU");
        let mut g = Controller::new(gpu());
        let k_gpu = g.allocate(1, 16, &cands(&[0.95], 8))[0];
        assert!(k_gpu >= k_cpu, "gpu {k_gpu} cpu {k_cpu}");
        assert_eq!(
            g.allocate(1, 4, &cands(&[0.95], 8))[0],
            4,
            "bounded by room"
        );
    }

    #[test]
    fn slots_go_to_the_sequences_most_likely_to_accept() {
        let mut c = Controller::new(gpu());
        let k = c.allocate(3, 64, &cands(&[0.9, 0.2, 0.7], 6));
        assert!(k[0] >= k[2] && k[2] >= k[1], "{k:?}");
        assert!(k[0] > 0);
    }

    #[test]
    fn a_slow_drafter_drafts_nothing_and_a_fast_accurate_one_drafts() {
        // A learned drafter on this CPU: 25 ms a call against a 10 ms decode step.
        let mut slow = Controller::new(cpu());
        for k in 1..=4 {
            slow.observe_draft(k, 25.0);
        }
        assert_eq!(slow.allocate(1, 16, &cands(&[0.9], 4)), vec![0]);
        // ngram: well under a millisecond; accurate drafts pay even on a CPU.
        let mut fast = Controller::new(cpu());
        for k in 1..=4 {
            fast.observe_draft(k, 0.3);
        }
        let k = fast.allocate(1, 16, &cands(&[0.9], 4))[0];
        assert!(k > 0, "fast and accurate: {k}");
        // The same drafter, slower: fewer drafts, never more.
        let mut mid = Controller::new(cpu());
        for k in 1..=4 {
            mid.observe_draft(k, 6.0);
        }
        let km = mid.allocate(1, 16, &cands(&[0.9], 4))[0];
        assert!(km <= k, "mid {km} fast {k}");
    }

    #[test]
    fn draft_cost_is_per_length_and_one_slow_call_does_not_count() {
        let mut d = DraftCost::default();
        assert_eq!(
            d.estimate(3),
            0.0,
            "nothing measured: free, so the first draft finds out"
        );
        assert!(!d.is_measured());
        for ms in [2.0, 2.2, 300.0, 1.8, 2.1] {
            d.observe(1, ms);
        }
        assert_eq!(d.estimate(1), 2.1, "the median ignores the cold start");
        d.observe(4, 8.0);
        assert_eq!(d.estimate(4), 8.0);
        assert_eq!(d.estimate(2), 2.1, "unmeasured: the largest measured below");
        assert_eq!(d.estimate(6), 8.0);
        assert_eq!(d.estimate(0), 0.0);
        let mut only_long = DraftCost::default();
        only_long.observe(4, 8.0);
        assert_eq!(
            only_long.estimate(1),
            8.0,
            "only longer measured: the nearest above"
        );
        // A two-model drafter (latency per drafted token): shorter rows get chosen.
        let mut c = Controller::new(gpu());
        for k in 1..=8 {
            c.observe_draft(k, 3.0 * k as f64);
        }
        let k = c.allocate(1, 16, &cands(&[0.8], 8))[0];
        assert!(k > 0 && k < 8, "{k}");
    }

    #[test]
    fn exploration_drafts_once_in_a_while_and_backs_off() {
        let mut c = Controller::new(cpu());
        for k in 1..=4 {
            c.observe_draft(k, 25.0);
        }
        let one = cands(&[0.9], 4);
        let mut explored = Vec::new();
        for step in 1..=16 * 7 {
            if c.allocate(1, 16, &one) == vec![1] {
                explored.push(step);
            }
        }
        // After 16 idle steps, then 32, then 64: the wait doubles.
        assert_eq!(explored, vec![16, 48, 112]);
        // Drafting pays again (the drafter is fast now): chosen at once, and the wait resets.
        for k in 1..=4 {
            for _ in 0..DRAFT_SAMPLES {
                c.observe_draft(k, 0.3);
            }
        }
        assert!(c.allocate(1, 16, &one)[0] > 0);
        for k in 1..=4 {
            for _ in 0..DRAFT_SAMPLES {
                c.observe_draft(k, 25.0);
            }
        }
        let first = (1..=EXPLORE_MAX)
            .find(|_| c.allocate(1, 16, &one) == vec![1])
            .expect("explores");
        assert_eq!(first, EXPLORE_MIN, "the back-off restarted");
        // Nothing to explore: no candidate may draft.
        let mut idle = Controller::new(cpu());
        for _ in 0..100 {
            assert_eq!(idle.allocate(1, 16, &cands(&[0.9], 0)), vec![0]);
        }
    }

    #[test]
    fn empty_replies_cost_only_the_call_so_a_fast_drafter_keeps_asking() {
        // Prompt lookup in a code edit: most asks find no match, but a match is an echo run.
        let rare = [Candidate {
            alpha: 0.9,
            hit: 0.2,
            max: 4,
        }];
        let mut fast = Controller::new(cpu());
        for k in 1..=4 {
            fast.observe_draft(k, 0.1);
        }
        assert!(fast.allocate(1, 16, &rare)[0] > 0, "cheap asks pay off");
        // The same hit rate from a drafter whose every call costs a decode step: not worth it.
        let mut slow = Controller::new(cpu());
        for k in 1..=4 {
            slow.observe_draft(k, 10.0);
        }
        assert_eq!(slow.allocate(1, 16, &rare), vec![0]);
        // Expected rows interpolate: a fraction of a row costs a fraction of its price.
        let t = cpu();
        assert!((t.cost_between(1, 0.5) - 12.0).abs() < 1e-9);
        assert_eq!(t.cost_between(2, 0.0), t.cost(2));
    }

    #[test]
    fn hysteresis_keeps_the_last_choice_near_a_tie() {
        // On the CPU table one draft at α = 0.42 beats none by 1.4%: not enough to switch.
        let mut c = Controller::new(cpu());
        assert_eq!(c.allocate(1, 16, &cands(&[0.42], 8)), vec![0]);
        // At α = 0.5 it wins by 7%: switch.
        assert_eq!(c.allocate(1, 16, &cands(&[0.5], 8)), vec![1]);
        // Back just below the tie: keep drafting one, where a fresh controller drafts none.
        assert_eq!(c.allocate(1, 16, &cands(&[0.39], 8)), vec![1]);
        assert_eq!(
            Controller::new(cpu()).allocate(1, 16, &cands(&[0.39], 8)),
            vec![0]
        );
        // Far below: switch back.
        assert_eq!(c.allocate(1, 16, &cands(&[0.1], 8)), vec![0]);
    }
}
