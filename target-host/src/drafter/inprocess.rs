//! Any SDK [`Drafter`] run inside the host, as a [`Proposer`]: the same drafting logic as its
//! process, without the process boundary (for benchmarks that isolate the IPC cost, and tests).

use std::collections::HashMap;

use specula_models::sampling::SamplingParams;
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk as SdkAsk, Drafter, OpenArgs, Taps,
};

use super::client::sampling_spec;
use crate::proposer::{Draft, DraftBatch, Proposer, SessionId, TapRows, Verdict, Wants};

/// An in-process drafter. Like the SDK, it caps every draft at `n` and at the drafter's
/// `max_draft_len`; unlike a process, it cannot crash independently or miss a deadline.
///
/// Ids committed without drafts ([`Proposer::advance`]) reach the drafter's `advance` with their
/// taps, as a protocol 1.1 peer gets them; one that answers [`Advanced::AsNewTokens`] hears
/// them as the `new_tokens` of its next draft.
#[derive(Debug)]
pub struct InProcess<D> {
    drafter: D,
    name: String,
    max_draft_len: usize,
    wants: Wants,
    unheard: HashMap<SessionId, Vec<u32>>,
}

impl<D: Drafter> InProcess<D> {
    /// Wraps `drafter` (it is not asked to accept a target: there is no handshake).
    pub fn new(drafter: D) -> Self {
        let info = drafter.info();
        let caps = info.capabilities;
        InProcess {
            drafter,
            name: info.name,
            max_draft_len: caps.max_draft_len as usize,
            wants: Wants::from(&caps),
            unheard: HashMap::new(),
        }
    }
}

/// Borrows the host's tap rows as SDK views (no copy).
fn taps(rows: &TapRows) -> Taps<'_> {
    Taps::from_f32(
        rows.pos as u64,
        rows.rows as u32,
        &rows.layers,
        rows.final_hidden.as_deref(),
        &rows.kv,
    )
}

impl<D: Drafter + Send> Proposer for InProcess<D> {
    fn name(&self) -> &str {
        &self.name
    }

    fn wants(&self) -> Wants {
        self.wants.clone()
    }

    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        prompt_taps: Option<&TapRows>,
    ) {
        let sampling = sampling_spec(sampling);
        let args = OpenArgs {
            prompt: context,
            sampling: &sampling,
            taps: prompt_taps.map(taps),
        };
        if self.unheard.insert(session, Vec::new()).is_some() {
            // A re-open replaces the session, as the SDK's serve loop does.
            self.drafter.close(session);
        }
        self.drafter.open(session, args);
    }

    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        // Sessions never opened get no row, as the SDK's serve loop does.
        let unheard: Vec<Option<Vec<u32>>> = batch
            .asks
            .iter()
            .map(|a| self.unheard.get_mut(&a.session).map(std::mem::take))
            .collect();
        let asks: Vec<SdkAsk<'_>> = batch
            .asks
            .iter()
            .zip(&unheard)
            .filter_map(|(a, new)| {
                new.as_deref().map(|new_tokens| SdkAsk {
                    session: a.session,
                    new_tokens,
                    n: a.n.min(self.max_draft_len),
                    // In process the drafter gets K/V rows in its taps, not pool views.
                    donors: None,
                })
            })
            .collect();
        let mut proposals = self.drafter.draft_batch(&asks).into_iter();
        let mut asks = asks.iter();
        unheard
            .iter()
            .map(|new| {
                let (Some(_), Some(ask)) = (new, asks.next()) else {
                    return Draft::default();
                };
                let mut p = proposals.next().unwrap_or_default();
                p.truncate(ask.n);
                Draft {
                    tokens: p.tokens,
                    q: p.q,
                    confidence: p.confidence,
                }
            })
            .collect()
    }

    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        if !self.unheard.contains_key(&session) {
            return;
        }
        let args = CommitArgs {
            drafted: verdict.drafted,
            accepted: verdict.accepted,
            ids: verdict.committed,
            taps: verdict.taps.map(taps),
        };
        self.drafter.commit(session, args);
    }

    fn advance(&mut self, session: SessionId, ids: &[u32], taps_rows: Option<&TapRows>) {
        if !self.unheard.contains_key(&session) {
            return;
        }
        let args = AdvanceArgs {
            ids,
            taps: taps_rows.map(taps),
        };
        if self.drafter.advance(session, args) == Advanced::AsNewTokens {
            if let Some(unheard) = self.unheard.get_mut(&session) {
                unheard.extend_from_slice(ids);
            }
        }
    }

    fn close(&mut self, session: SessionId) {
        if self.unheard.remove(&session).is_some() {
            self.drafter.close(session);
        }
    }
}
