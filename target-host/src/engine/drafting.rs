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
//! - **Exactly once, in order**: `open` covers positions `0..len-1`; every later step sends
//!   each committed position once, by `commit` (a drafted round) or `advance` (a round without
//!   drafts).
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

/// One session's drafter record.
#[derive(Debug)]
struct Book {
    sampling: SamplingParams,
    /// Identity of the proposer the session is open on (`None`: never opened).
    opened_on: Option<(u64, u64)>,
    /// Taps of the context so far, when kept (their `wants` are the current ones).
    kept: Option<TapRows>,
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
                self.counters.reopened += 1;
            }
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
        if self.is_open(cur, session) {
            if let Some(p) = cur.proposer() {
                p.commit(session, verdict);
            }
        }
        self.extend(session, verdict.taps);
    }

    /// Tells the proposer of ids committed without drafts; keeps the taps.
    pub fn advance(
        &mut self,
        cur: &mut Current,
        session: SessionId,
        ids: &[u32],
        taps: Option<&TapRows>,
    ) {
        if self.is_open(cur, session) {
            if let Some(p) = cur.proposer() {
                p.advance(session, ids, taps);
            }
        }
        self.extend(session, taps);
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
