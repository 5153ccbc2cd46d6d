//! [`Pace`]: how much a drafter may draft, from how it has kept its deadlines.
//!
//! - A miss halves the most drafts per row; a second miss in a row stops drafting.
//! - While stopped, one probe at a time (a one-draft request nobody waits for) tells whether
//!   the drafter answers in time again. A probe's reply is read at the next draft call, which
//!   can come long after it arrived (the controller may not draft for many steps), so it is
//!   judged by the checks in between: a reply that was *not* there at a check made after the
//!   probe's deadline was late; otherwise it may have arrived in time, and drafting resumes
//!   with one draft per row (a wrong guess costs one more miss, which stops it again).
//! - Every timely answer doubles the budget back up to the drafter's maximum; below the
//!   maximum the drafter is reported degraded.
//!
//! Times are passed in, so the rules are tested without clocks.

use std::time::{Duration, Instant};

/// A probe in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Probe {
    seq: u64,
    sent: Instant,
    deadline: Duration,
    /// A check found no reply after the deadline had passed: the reply is late.
    late: bool,
}

/// The drafting budget of one drafter (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pace {
    budget: usize,
    misses_in_row: u32,
    probe: Option<Probe>,
}

impl Pace {
    /// A drafter in good standing: `max` drafts per row.
    pub fn new(max: usize) -> Self {
        Pace {
            budget: max,
            misses_in_row: 0,
            probe: None,
        }
    }

    /// The most drafts per row now (0: stopped; only probes go out).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Whether a probe is in flight.
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// A waited-for request missed its deadline.
    pub fn missed(&mut self) {
        self.misses_in_row += 1;
        self.budget = match self.misses_in_row {
            1 => self.budget / 2,
            _ => 0,
        };
    }

    /// A waited-for request was answered in time.
    pub fn answered(&mut self, max: usize) {
        self.misses_in_row = 0;
        self.budget = (self.budget * 2).clamp(1, max.max(1));
    }

    /// A probe (request `seq`, sent at `sent`, due within `deadline`) went out.
    pub fn probe_sent(&mut self, seq: u64, sent: Instant, deadline: Duration) {
        self.probe = Some(Probe {
            seq,
            sent,
            deadline,
            late: false,
        });
    }

    /// Looked for the probe's reply at `now` and found none.
    pub fn no_reply(&mut self, now: Instant) {
        if let Some(p) = &mut self.probe {
            if now.saturating_duration_since(p.sent) > p.deadline {
                p.late = true;
            }
        }
    }

    /// The reply to request `seq` was read. Returns whether it was the probe's; when it was
    /// and it may have come in time, drafting resumes at one draft per row.
    pub fn reply(&mut self, seq: u64) -> bool {
        match self.probe {
            Some(p) if p.seq == seq => {
                self.probe = None;
                if !p.late {
                    self.budget = 1;
                    self.misses_in_row = 0;
                }
                true
            }
            _ => false,
        }
    }

    /// Whether the drafter drafts less than `max` (missed deadlines lately).
    pub fn degraded(&self, max: usize) -> bool {
        self.budget < max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_millis(40);

    #[test]
    fn two_misses_stop_drafting_and_a_timely_probe_resumes_it() {
        let mut p = Pace::new(4);
        assert!(!p.degraded(4));
        p.missed();
        assert_eq!(p.budget(), 2, "one miss halves the budget");
        assert!(p.degraded(4));
        p.missed();
        assert_eq!(p.budget(), 0, "a second miss in a row stops drafting");
        // A probe goes out; a check before its deadline finds nothing (not late yet).
        let t0 = Instant::now();
        p.probe_sent(7, t0, DEADLINE);
        assert!(p.probing());
        p.no_reply(t0 + DEADLINE / 2);
        assert!(!p.reply(6), "another request's reply is not the probe's");
        assert!(p.reply(7));
        assert!(!p.probing());
        assert_eq!(p.budget(), 1, "drafting resumes at one draft");
        p.answered(4);
        p.answered(4);
        assert_eq!(p.budget(), 4, "timely answers double back to the maximum");
        assert!(!p.degraded(4));
    }

    #[test]
    fn a_probe_missing_at_a_check_past_its_deadline_keeps_drafting_stopped() {
        let mut p = Pace::new(4);
        p.missed();
        p.missed();
        let t0 = Instant::now();
        p.probe_sent(1, t0, DEADLINE);
        p.no_reply(t0 + DEADLINE * 3);
        assert!(p.reply(1));
        assert_eq!(p.budget(), 0, "the reply was late");
        // The next probe answers in time: drafting resumes, and a miss stops it again.
        p.probe_sent(2, t0 + DEADLINE * 4, DEADLINE);
        assert!(p.reply(2));
        assert_eq!(p.budget(), 1);
        p.missed();
        assert_eq!(p.budget(), 0);
        assert!(p.degraded(4));
    }

    #[test]
    fn a_miss_between_answers_only_halves() {
        let mut p = Pace::new(8);
        p.missed();
        p.answered(8);
        assert_eq!(p.budget(), 8);
        p.missed();
        assert_eq!(p.budget(), 4, "misses count in a row only");
    }
}
