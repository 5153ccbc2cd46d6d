//! Admission and the per-step token budget.
//!
//! - **Admission**: a request reserves its worst case, `min(prompt + max_tokens, context)`
//!   positions of the KV pool, when it starts running, so a running sequence never runs out of
//!   blocks mid-generation and nothing has to be preempted. What does not fit (pool or
//!   `max_running`) waits in a bounded FIFO queue; when that is full too the request is refused
//!   (HTTP 429 with `Retry-After`). A request that could never fit is refused outright.
//! - **Budget**: every step runs at most `batch_tokens` target rows. Running sequences come
//!   first (one row each, plus the drafts the controller gives them), prefill chunks share
//!   what is left oldest first, so a long prompt is cut into chunks and never stalls the
//!   streams already running (Sarathi-style chunked prefill, vLLM's scheduler order).

use std::collections::VecDeque;

/// The limits the scheduler enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sequences running at once.
    pub max_running: usize,
    /// Requests waiting for a slot; one more is refused.
    pub max_waiting: usize,
    /// Target rows per step.
    pub batch_tokens: usize,
    /// KV positions all running sequences may hold together.
    pub pool_tokens: usize,
}

/// Why a request was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The queue is full; try again later.
    #[error("the server is busy: {running} requests running and {waiting} waiting")]
    Busy {
        /// Running sequences.
        running: usize,
        /// Waiting requests.
        waiting: usize,
    },
    /// The request needs more KV positions than the whole pool holds.
    #[error(
        "the request needs {need} KV positions (prompt + max_tokens) but the pool holds \
         {pool}: shorten the prompt or lower max_tokens"
    )]
    TooLarge {
        /// Positions it needs.
        need: usize,
        /// Positions in the pool.
        pool: usize,
    },
    /// The engine is not running.
    #[error("the engine has stopped")]
    Stopped,
}

/// The waiting queue and the pool reservations of running sequences.
#[derive(Debug)]
pub struct Scheduler<T> {
    limits: Limits,
    waiting: VecDeque<(T, usize)>,
    running: usize,
    reserved: usize,
}

impl<T> Scheduler<T> {
    /// An empty scheduler under `limits`.
    pub fn new(limits: Limits) -> Self {
        Scheduler {
            limits,
            waiting: VecDeque::new(),
            running: 0,
            reserved: 0,
        }
    }

    /// The limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Queues `item`, which will need `need` KV positions.
    ///
    /// # Errors
    /// [`Refusal::TooLarge`] when `need` exceeds the pool, [`Refusal::Busy`] when the queue is
    /// full; the item comes back with it.
    pub fn offer(&mut self, item: T, need: usize) -> Result<(), (T, Refusal)> {
        if need > self.limits.pool_tokens {
            let pool = self.limits.pool_tokens;
            return Err((item, Refusal::TooLarge { need, pool }));
        }
        if self.waiting.len() >= self.limits.max_waiting && !self.fits(need) {
            let (running, waiting) = (self.running, self.waiting.len());
            return Err((item, Refusal::Busy { running, waiting }));
        }
        self.waiting.push_back((item, need));
        Ok(())
    }

    fn fits(&self, need: usize) -> bool {
        self.running < self.limits.max_running
            && self.reserved + need <= self.limits.pool_tokens
            && self.waiting.is_empty()
    }

    /// Takes the waiting requests that can start now, in arrival order (strict FIFO: a large
    /// request at the head is not overtaken, so it cannot starve).
    pub fn admit(&mut self) -> Vec<(T, usize)> {
        let mut out = Vec::new();
        while let Some(&(_, need)) = self.waiting.front() {
            if self.running >= self.limits.max_running
                || self.reserved + need > self.limits.pool_tokens
            {
                break;
            }
            let entry = self.waiting.pop_front().expect("invariant: front exists");
            self.running += 1;
            self.reserved += need;
            out.push(entry);
        }
        out
    }

    /// A running sequence that reserved `need` positions ended.
    pub fn release(&mut self, need: usize) {
        debug_assert!(self.running > 0 && self.reserved >= need);
        self.running -= 1;
        self.reserved -= need;
    }

    /// Removes waiting requests for which `gone` holds (their consumer went away), returning
    /// them.
    pub fn drop_waiting(&mut self, mut gone: impl FnMut(&T) -> bool) -> Vec<T> {
        let (out, keep): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|(t, _)| gone(t));
        self.waiting = keep.into();
        out.into_iter().map(|(t, _)| t).collect()
    }

    /// Running sequences.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Waiting requests.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// KV positions reserved by running sequences.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Splits one step's budget: `decode_rows` rows of running sequences (always scheduled),
    /// then `drafts` asked by the controller (cut to what is left), then prefill chunks for
    /// sequences wanting `prefill[i]` more rows, oldest first. Returns the drafts granted and
    /// each prefill chunk (0: not this step).
    pub fn plan(&self, decode_rows: usize, drafts: usize, prefill: &[usize]) -> Plan {
        let mut left = self.limits.batch_tokens.saturating_sub(decode_rows);
        let drafts = drafts.min(left);
        left -= drafts;
        let chunks = prefill
            .iter()
            .map(|&want| {
                let take = want.min(left);
                left -= take;
                take
            })
            .collect();
        Plan { drafts, chunks }
    }

    /// Rows left for prefill after `decode_rows`, before any drafts: what the controller should
    /// expect prefill to take this step.
    pub fn prefill_room(&self, decode_rows: usize, prefill: &[usize]) -> usize {
        let left = self.limits.batch_tokens.saturating_sub(decode_rows);
        prefill.iter().sum::<usize>().min(left)
    }
}

/// One step's split of the budget (see [`Scheduler::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Draft rows granted in total.
    pub drafts: usize,
    /// Rows of each prefilling sequence this step, in the order asked.
    pub chunks: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_running: 2,
            max_waiting: 2,
            batch_tokens: 16,
            pool_tokens: 100,
        }
    }

    #[test]
    fn admission_respects_running_pool_and_queue_limits() {
        let mut s = Scheduler::new(limits());
        assert_eq!(
            s.offer("huge", 101),
            Err((
                "huge",
                Refusal::TooLarge {
                    need: 101,
                    pool: 100
                }
            ))
        );
        s.offer("a", 60).unwrap();
        s.offer("b", 30).unwrap();
        let first: Vec<_> = s.admit().into_iter().map(|(t, _)| t).collect();
        assert_eq!(first, ["a", "b"]);
        s.offer("c", 20).unwrap();
        s.offer("d", 5).unwrap();
        // The queue (2) is full and "e" could not start now either (max_running = 2).
        assert!(matches!(s.offer("e", 1), Err(("e", Refusal::Busy { .. }))));
        assert!(s.admit().is_empty(), "max_running = 2");
        assert_eq!((s.running(), s.waiting(), s.reserved()), (2, 2, 90));
        s.release(60);
        // "c" needs 20 and 30 + 20 fits; "d" would fit the pool but max_running stops it.
        let next: Vec<_> = s.admit().into_iter().map(|(t, _)| t).collect();
        assert_eq!(next, ["c"]);
        s.release(30);
        s.release(20);
        assert_eq!(s.admit().len(), 1);
        assert_eq!(s.reserved(), 5);
    }

    #[test]
    fn the_head_of_the_queue_is_not_overtaken() {
        let mut s = Scheduler::new(limits());
        s.offer("big", 90).unwrap();
        assert_eq!(s.admit().len(), 1);
        s.offer("big2", 50).unwrap();
        s.offer("small", 5).unwrap();
        // "small" would fit beside "big", but "big2" is first in line.
        assert!(s.admit().is_empty());
        s.release(90);
        assert_eq!(s.admit().len(), 2);
    }

    #[test]
    fn the_budget_serves_decode_then_drafts_then_prefill_oldest_first() {
        let s: Scheduler<()> = Scheduler::new(limits());
        assert_eq!(
            s.plan(3, 4, &[5, 10]),
            Plan {
                drafts: 4,
                chunks: vec![5, 4]
            }
        );
        assert_eq!(
            s.plan(3, 20, &[5]),
            Plan {
                drafts: 13,
                chunks: vec![0]
            }
        );
        assert_eq!(s.prefill_room(3, &[5, 10]), 13);
    }

    #[test]
    fn cancelled_waiting_requests_leave_the_queue() {
        let mut s = Scheduler::new(limits());
        s.offer(1, 1).unwrap();
        s.offer(2, 1).unwrap();
        assert_eq!(s.drop_waiting(|&t| t == 1), vec![1]);
        assert_eq!(s.waiting(), 1);
    }
}
