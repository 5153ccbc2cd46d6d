//! What the drafter is told and given, per session: the engine's one record of it.
//!
//! - **Identity**: the slot's identity (its epoch and the proposer's incarnation,
//!   [`Current::identity`]) is read at every step; after a hot swap or a respawn of the drafter
//!   process the proposer's [`Wants`] are read again (its taps are the ones collected from then
//!   on) and every session is opened again on it, with the whole context so far and its taps,
//!   before its next draft. The drafter client forgets its sessions on a respawn: the engine
//!   is the one that re-opens them, since only it holds their taps.
//! - **Re-sync taps**: while a session speculates, the engine keeps the taps of its whole
//!   context (bounded by [`TAP_BUDGET_BYTES`] per session) so a re-`Open` carries them; when
//!   they were not kept (over budget, or collected for another drafter's wants) the step
//!   re-forwards the context on a scratch sequence to make them ([`Resync`]).
//! - **Exactly once, in order**: `open` covers positions `0..len-1`; every later position
//!   reaches the drafter once, by `commit` (a drafted round) or `advance` (rounds without
//!   drafts), before the session's next draft.
//! - **Told when needed**: the ids (and taps) of rounds without drafts are held back
//!   ([`Unsent`]) and sent as one `advance` right before the session's next draft. A session
//!   the controller keeps from drafting costs the drafter nothing: a learned drafter runs its
//!   layers over every row it hears of, and on a CPU that work takes cores from the target's
//!   forward (MTP under the controller ran chat at 0.80–0.88× plain, drafting almost never).
//!   When the drafter drafts again, it hears the held rows in one batched `advance`, whose
//!   cost lands in the draft latency the controller measures. What is held stays bounded
//!   ([`UNSENT_BUDGET_BYTES`], [`UNSENT_MAX_IDS`]): past that it is sent at once.
//! - **Prefix cache and drafter state** (the choice, and why): the host keeps what a drafter
//!   needs, and no protocol message asks drafters to checkpoint. A token-only drafter (ngram,
//!   two-model) is re-opened with the ids of the whole context and rebuilds its own state from
//!   them — the two-model drafter's LRU of draft-model caches is that drafter's side of the
//!   prefix cache. A tap drafter needs every position's taps, which the host has at the moment
//!   it commits them and keeps per session (above) for re-syncs, and per cached block in
//!   [`super::tap_cache`], so that a sequence feeding a tap drafter adopts cached blocks too
//!   and its `Open` carries their taps. A `Checkpoint`/`Resume` protocol would make every
//!   drafter implement storage and eviction for a saving only where the drafter's own state
//!   is costly to rebuild.

use std::collections::HashMap;

use specula_models::sampling::SamplingParams;
use tracing::{debug, warn};

use crate::proposer::{Current, Draft, DraftAsk, DraftBatch, SessionId, TapRows, Verdict, Wants};

/// Taps kept per session for re-sync, at most.
pub const TAP_BUDGET_BYTES: usize = 32 << 20;

/// Taps of rounds without drafts held back per session, at most (then sent).
pub const UNSENT_BUDGET_BYTES: usize = 4 << 20;

/// Ids of rounds without drafts held back per session, at most (then sent).
pub const UNSENT_MAX_IDS: usize = 1024;

/// Committed ids (with their taps) the proposer has not heard of yet.
#[derive(Debug, Default)]
struct Unsent {
    ids: Vec<u32>,
    taps: Option<TapRows>,
}

impl Unsent {
    /// Holds `ids` (and `taps`) back; false when they do not fit (the caller sends them).
    fn hold(&mut self, ids: &[u32], taps: Option<&TapRows>) -> bool {
        let held = self.taps.as_ref().map_or(0, TapRows::bytes);
        let adds = taps.map_or(0, TapRows::bytes);
        // Rows with and without taps never mix in one message.
        let same_kind = self.ids.is_empty() || self.taps.is_some() == taps.is_some();
        let fits = self.ids.len() + ids.len() <= UNSENT_MAX_IDS
            && held + adds <= UNSENT_BUDGET_BYTES
            && same_kind;
        if fits {
            self.ids.extend_from_slice(ids);
            if let Some(t) = taps {
                self.taps.get_or_insert_with(TapRows::default).extend(t);
            }
        }
        fits
    }

    fn take(&mut self) -> Option<(Vec<u32>, Option<TapRows>)> {
        match self.ids.is_empty() {
            true => None,
            false => Some((std::mem::take(&mut self.ids), self.taps.take())),
        }
    }
}

/// One session's drafter record.
#[derive(Debug)]
struct Book {
    sampling: SamplingParams,
    /// Identity of the proposer the session is open on (`None`: never opened).
    opened_on: Option<(u64, u64)>,
    /// Taps of the context so far, when kept (their `wants` are the current ones).
    kept: Option<TapRows>,
    /// Rounds without drafts not yet told to the proposer it is open on.
    unsent: Unsent,
}

/// A session that must be (re)opened with taps the engine does not hold: the step re-forwards
/// `context[..len-1]` and calls [`Drafting::resync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resync {
    /// The session.
    pub session: SessionId,
}

/// Counters of what the drafters were told.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftingCounters {
    /// Sessions (re)opened after a hot swap or a respawn.
    pub reopened: u64,
    /// Contexts re-forwarded to rebuild their taps.
    pub reforwards: u64,
    /// Sessions whose kept taps went over the budget (then re-forwarded if needed).
    pub taps_over_budget: u64,
    /// Re-forwards that failed (those sequences run plain).
    pub resync_failed: u64,
}

/// The per-session drafter records and the proposer's wants.
#[derive(Debug, Default)]
pub struct Drafting {
    identity: Option<(u64, u64)>,
    wants: Wants,
    books: HashMap<SessionId, Book>,
    /// Counters.
    pub counters: DraftingCounters,
}

impl Drafting {
    /// Reads the slot's identity; after a change (a swap or a respawn) re-reads the wants.
    /// Returns whether the proposer was swapped (not only respawned).
    pub fn refresh(&mut self, cur: &mut Current) -> bool {
        let identity = cur.identity();
        if self.identity == Some(identity) {
            return false;
        }
        let swapped = self.identity.is_none_or(|(epoch, _)| epoch != identity.0);
        self.identity = Some(identity);
        let wants = cur.proposer().map(|p| p.wants()).unwrap_or_default();
        if wants != self.wants {
            // Kept taps were collected for the old drafter's layers.
            for book in self.books.values_mut() {
                book.kept = None;
            }
        }
        self.wants = wants;
        swapped
    }

    /// What the current proposer wants tapped.
    pub fn wants(&self) -> &Wants {
        &self.wants
    }

    /// Whether `session` speculates (has a record).
    pub fn has(&self, session: SessionId) -> bool {
        self.books.contains_key(&session)
    }

    /// Opens `session` on the current proposer: `context` (its last id pending) with `taps` of
    /// positions `0..context.len() - 1`.
    pub fn open(
        &mut self,
        cur: &mut Current,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<TapRows>,
    ) {
        let mut book = Book {
            sampling: sampling.clone(),
            opened_on: None,
            kept: None,
            unsent: Unsent::default(),
        };
        if let Some(p) = cur.proposer() {
            p.open(session, context, sampling, taps.as_ref());
            // Read after the call: a respawn it completed is the life the session is open on.
            book.opened_on = Some(cur.identity());
        }
        book.kept = self.keep(taps);
        self.books.insert(session, book);
    }

    fn keep(&mut self, taps: Option<TapRows>) -> Option<TapRows> {
        let taps = taps?;
        if taps.bytes() > TAP_BUDGET_BYTES {
            self.counters.taps_over_budget += 1;
            return None;
        }
        Some(taps)
    }

    /// Sessions among `sessions` that are not open on the current proposer and whose taps the
    /// engine does not hold: the step re-forwards them before drafting.
    pub fn needs_reforward(&self, cur: &Current, sessions: &[SessionId]) -> Vec<Resync> {
        if !cur.is_some() || self.wants.is_empty() {
            return Vec::new();
        }
        sessions
            .iter()
            .filter_map(|&s| {
                let book = self.books.get(&s)?;
                (book.opened_on != Some(cur.identity()) && book.kept.is_none())
                    .then_some(Resync { session: s })
            })
            .collect()
    }

    /// Hands `session` the taps a re-forward made (positions `0..len-1` of its context).
    pub fn resync(&mut self, session: SessionId, taps: TapRows) {
        self.counters.reforwards += 1;
        let kept = self.keep(Some(taps));
        if let Some(book) = self.books.get_mut(&session) {
            book.kept = kept;
        }
    }

    /// Drafts for `asks` (each session's context given by `context`), re-opening sessions that
    /// are not open on the current proposer first. One proposer call for the whole batch.
    pub fn draft<'c>(
        &mut self,
        cur: &mut Current,
        asks: &[DraftAsk],
        deadline: std::time::Duration,
        vocab: usize,
        context: impl Fn(SessionId) -> &'c [u32],
    ) -> Vec<Draft> {
        if !cur.is_some() {
            return vec![Draft::default(); asks.len()];
        }
        for ask in asks {
            let Some(book) = self.books.get_mut(&ask.session) else {
                continue;
            };
            if book.opened_on != Some(cur.identity()) {
                // A new drafter, or a new life of it: it learns the whole context, with the
                // taps of every position but the pending one.
                let ctx = context(ask.session);
                let taps = book.kept.as_ref().filter(|t| t.rows + 1 == ctx.len());
                if taps.is_none() && !self.wants.is_empty() {
                    warn!(session = ask.session, "re-opened without taps");
                }
                if let Some(p) = cur.proposer() {
                    p.open(ask.session, ctx, &book.sampling, taps);
                }
                book.opened_on = Some(cur.identity());
                // The open told it everything held back.
                book.unsent = Unsent::default();
                self.counters.reopened += 1;
            }
        }
        for ask in asks {
            self.flush(cur, ask.session);
        }
        let Some(p) = cur.proposer() else {
            return vec![Draft::default(); asks.len()];
        };
        let drafts = p.draft(&DraftBatch { asks, deadline });
        if drafts.len() != asks.len() {
            warn!(
                got = drafts.len(),
                asked = asks.len(),
                "proposer answered another number of rows; drafts dropped"
            );
            return vec![Draft::default(); asks.len()];
        }
        drafts
            .into_iter()
            .zip(asks)
            .map(|(d, ask)| sanitize(d, ask.n, vocab))
            .collect()
    }

    /// Tells the proposer how `session`'s drafts fared; keeps the taps.
    pub fn commit(&mut self, cur: &mut Current, session: SessionId, verdict: &Verdict<'_>) {
        // Drafting flushed what was held: nothing is, unless the drafter changed since.
        self.flush(cur, session);
        if self.is_open(cur, session) {
            if let Some(p) = cur.proposer() {
                p.commit(session, verdict);
            }
        }
        self.extend(session, verdict.taps);
    }

    /// Records ids committed without drafts (and keeps the taps); the proposer hears of
    /// them before the session's next draft (see the module docs).
    pub fn advance(
        &mut self,
        cur: &mut Current,
        session: SessionId,
        ids: &[u32],
        taps: Option<&TapRows>,
    ) {
        if self.is_open(cur, session) {
            let held = self
                .books
                .get_mut(&session)
                .is_some_and(|b| b.unsent.hold(ids, taps));
            if !held {
                self.flush(cur, session);
                if let Some(p) = cur.proposer() {
                    p.advance(session, ids, taps);
                }
            }
        }
        self.extend(session, taps);
    }

    /// Sends what `session` held back, in one `advance` (dropped when the session is not open
    /// on the current proposer: its re-open carries the whole context).
    fn flush(&mut self, cur: &mut Current, session: SessionId) {
        let open = self.is_open(cur, session);
        let Some((ids, taps)) = self.books.get_mut(&session).and_then(|b| b.unsent.take()) else {
            return;
        };
        if let (true, Some(p)) = (open, cur.proposer()) {
            p.advance(session, &ids, taps.as_ref());
        }
    }

    /// Ids held back from the proposer for `session` (see the module docs).
    pub fn unsent(&self, session: SessionId) -> usize {
        self.books.get(&session).map_or(0, |b| b.unsent.ids.len())
    }

    fn is_open(&self, cur: &Current, session: SessionId) -> bool {
        self.books
            .get(&session)
            .is_some_and(|b| b.opened_on == Some(cur.identity()))
    }

    fn extend(&mut self, session: SessionId, taps: Option<&TapRows>) {
        let Some(book) = self.books.get_mut(&session) else {
            return;
        };
        match (&mut book.kept, taps) {
            (Some(kept), Some(t)) if kept.pos + kept.rows == t.pos => {
                kept.extend(t);
                if kept.bytes() > TAP_BUDGET_BYTES {
                    debug!(session, "kept taps over budget; a re-sync will re-forward");
                    self.counters.taps_over_budget += 1;
                    book.kept = None;
                }
            }
            // Taps missing or out of order (a swap, a budget overflow): re-sync re-forwards.
            _ => book.kept = None,
        }
    }

    /// The taps kept of `session`'s context (positions `0..len-1`), when kept.
    pub fn kept(&self, session: SessionId) -> Option<&TapRows> {
        self.books.get(&session)?.kept.as_ref()
    }

    /// Ends `session`.
    pub fn close(&mut self, cur: &mut Current, session: SessionId) {
        if self.is_open(cur, session) {
            if let Some(p) = cur.proposer() {
                p.close(session);
            }
        }
        self.books.remove(&session);
    }
}

/// Last line of defence: whatever a proposer returns, the engine only verifies in-vocabulary
/// drafts, at most `n`, with well-formed `q` rows (or none); anything else costs the round.
fn sanitize(mut draft: Draft, n: usize, vocab: usize) -> Draft {
    match crate::drafter::validate::check(&draft.tokens, draft.q.as_deref(), n, vocab as u32) {
        Ok(()) => {
            if draft.confidence.as_ref().is_some_and(|c| {
                c.len() != draft.tokens.len() || c.iter().any(|x| !(0.0..=1.0).contains(x))
            }) {
                // A bad confidence row is advice only: drop it, keep the drafts.
                draft.confidence = None;
            }
            draft
        }
        Err(why) => {
            warn!(%why, "draft discarded");
            Draft::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::proposer::{Proposer, ProposerSlot};

    /// Logs every call as `open S N`, `advance S ID,ID,.. ROWS`, `draft S`, `commit S N`,
    /// `close S`.
    struct Log(Arc<Mutex<Vec<String>>>, Wants);

    impl Proposer for Log {
        fn name(&self) -> &str {
            "log"
        }
        fn wants(&self) -> Wants {
            self.1.clone()
        }
        fn open(&mut self, s: SessionId, ctx: &[u32], _: &SamplingParams, _: Option<&TapRows>) {
            self.0
                .lock()
                .unwrap()
                .push(format!("open {s} {}", ctx.len()));
        }
        fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
            let mut log = self.0.lock().unwrap();
            for a in batch.asks {
                log.push(format!("draft {}", a.session));
            }
            vec![Draft::default(); batch.asks.len()]
        }
        fn commit(&mut self, s: SessionId, v: &Verdict<'_>) {
            self.0
                .lock()
                .unwrap()
                .push(format!("commit {s} {}", v.committed.len()));
        }
        fn advance(&mut self, s: SessionId, ids: &[u32], taps: Option<&TapRows>) {
            let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
            let rows = taps.map_or(0, |t| t.rows);
            let line = format!("advance {s} {} {rows}", ids.join(","));
            self.0.lock().unwrap().push(line);
        }
        fn close(&mut self, s: SessionId) {
            self.0.lock().unwrap().push(format!("close {s}"));
        }
    }

    fn setup(wants: Wants) -> (ProposerSlot, Drafting, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let slot = ProposerSlot::new(Some(Box::new(Log(log.clone(), wants))));
        let mut d = Drafting::default();
        d.refresh(&mut slot.lock());
        (slot, d, log)
    }

    fn taps(pos: usize, rows: usize, floats: usize) -> TapRows {
        TapRows {
            pos,
            rows,
            layers: vec![vec![0.5; rows * floats]],
            ..TapRows::default()
        }
    }

    fn open(d: &mut Drafting, slot: &ProposerSlot, session: SessionId, ctx: &[u32]) {
        d.open(
            &mut slot.lock(),
            session,
            ctx,
            &SamplingParams::default(),
            None,
        );
    }

    fn ask(d: &mut Drafting, slot: &ProposerSlot, session: SessionId) {
        let asks = [DraftAsk { session, n: 2 }];
        let ctx = [1u32, 2, 3];
        d.draft(&mut slot.lock(), &asks, Duration::from_secs(1), 100, |_| {
            &ctx[..]
        });
    }

    #[test]
    fn rounds_without_drafts_reach_the_drafter_in_one_advance_before_its_next_draft() {
        let (slot, mut d, log) = setup(Wants::default());
        open(&mut d, &slot, 1, &[1, 2, 3]);
        for id in [4, 5, 6] {
            d.advance(&mut slot.lock(), 1, &[id], None);
        }
        assert_eq!(
            *log.lock().unwrap(),
            ["open 1 3"],
            "a dormant session costs nothing"
        );
        assert_eq!(d.unsent(1), 3);
        ask(&mut d, &slot, 1);
        d.commit(
            &mut slot.lock(),
            1,
            &Verdict {
                drafted: 0,
                accepted: 0,
                committed: &[7],
                taps: None,
            },
        );
        d.advance(&mut slot.lock(), 1, &[8], None);
        d.close(&mut slot.lock(), 1);
        assert_eq!(
            *log.lock().unwrap(),
            [
                "open 1 3",
                "advance 1 4,5,6 0",
                "draft 1",
                "commit 1 1",
                "close 1"
            ],
            "held ids go first, once, in order; what follows the last draft is never needed"
        );
    }

    #[test]
    fn held_taps_travel_together_and_stay_bounded() {
        let wants = Wants {
            tap_layers: vec![0],
            ..Wants::default()
        };
        let (slot, mut d, log) = setup(wants);
        d.open(
            &mut slot.lock(),
            1,
            &[1, 2],
            &SamplingParams::default(),
            Some(taps(0, 1, 4)),
        );
        d.advance(&mut slot.lock(), 1, &[3], Some(&taps(1, 1, 4)));
        d.advance(&mut slot.lock(), 1, &[4], Some(&taps(2, 1, 4)));
        ask(&mut d, &slot, 1);
        assert_eq!(
            log.lock().unwrap()[1],
            "advance 1 3,4 2",
            "taps of both rows"
        );
        // Rows too big to hold go at once, after what was held.
        let floats = UNSENT_BUDGET_BYTES / 4 / 2 + 1;
        d.advance(&mut slot.lock(), 1, &[5], Some(&taps(3, 1, floats)));
        assert_eq!(d.unsent(1), 1);
        d.advance(&mut slot.lock(), 1, &[6], Some(&taps(4, 1, floats)));
        assert_eq!(d.unsent(1), 0);
        let log = log.lock().unwrap();
        assert_eq!(log[log.len() - 2..], ["advance 1 5 1", "advance 1 6 1"]);
        // So do ids past their bound.
        let (slot, mut d, log) = setup(Wants::default());
        open(&mut d, &slot, 2, &[1]);
        for id in 0..=UNSENT_MAX_IDS as u32 {
            d.advance(&mut slot.lock(), 2, &[id], None);
        }
        assert_eq!(log.lock().unwrap().len(), 3, "open, the held ids, the last");
        assert_eq!(d.unsent(2), 0);
    }

    #[test]
    fn a_reopen_replaces_what_was_held() {
        let (slot, mut d, log) = setup(Wants::default());
        open(&mut d, &slot, 1, &[1, 2, 3]);
        d.advance(&mut slot.lock(), 1, &[4], None);
        // A new drafter: the session opens on it with the whole context at its next draft.
        let log2 = Arc::new(Mutex::new(Vec::new()));
        drop(slot.replace(Some(Box::new(Log(log2.clone(), Wants::default())))));
        d.refresh(&mut slot.lock());
        d.advance(&mut slot.lock(), 1, &[5], None);
        ask(&mut d, &slot, 1);
        assert_eq!(*log.lock().unwrap(), ["open 1 3"]);
        assert_eq!(*log2.lock().unwrap(), ["open 1 3", "draft 1"]);
        assert_eq!(d.unsent(1), 0);
    }
}
