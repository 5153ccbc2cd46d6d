//! Any SDK [`Drafter`] run inside the host, as a [`Proposer`]: the same drafting logic as its
//! process, without the process boundary (for benchmarks that isolate the IPC cost, and tests).
//!
//! A drafter that asks for K/V donor views reads the KV pool's donor region in place here too
//! (mapped into this process a second time, as the SDK maps it), unless it was wrapped with
//! [`InProcess::with_copies`], which hands it copied K/V rows as an older host would.

use std::collections::HashMap;

use specula_models::sampling::SamplingParams;
use specula_protocol::donor::{DonorBlock, DonorReader};
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk as SdkAsk, Drafter, OpenArgs, Taps,
};

use super::client::sampling_spec;
use crate::proposer::{Draft, DraftBatch, Proposer, SessionId, TapRows, Transfer, Verdict, Wants};

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
    /// The donor region, mapped (views only).
    donors: Option<DonorReader>,
    /// Per session, its donor block table and readable length (views only).
    tables: HashMap<SessionId, (Vec<DonorBlock>, usize)>,
    transfer: Transfer,
}

impl<D: Drafter> InProcess<D> {
    /// Wraps `drafter` (it is not asked to accept a target: there is no handshake). A drafter
    /// that asks for donor views reads the pool's K/V in place.
    pub fn new(drafter: D) -> Self {
        let views = drafter.info().kv_donor_views;
        Self::build(drafter, views)
    }

    /// Wraps `drafter`, handing it K/V rows copied into its taps even if it asks for views.
    pub fn with_copies(drafter: D) -> Self {
        Self::build(drafter, false)
    }

    fn build(drafter: D, views: bool) -> Self {
        let info = drafter.info();
        let caps = info.capabilities;
        let wants = Wants {
            kv_views: views && !caps.kv_layers.is_empty(),
            ..Wants::from(&caps)
        };
        InProcess {
            drafter,
            name: info.name,
            max_draft_len: caps.max_draft_len as usize,
            wants,
            unheard: HashMap::new(),
            donors: None,
            tables: HashMap::new(),
            transfer: Transfer::default(),
        }
    }

    /// Counts what `taps` carry and takes `session`'s donor table from them.
    fn take_donors(&mut self, session: SessionId, taps: Option<&TapRows>) {
        let Some(taps) = taps else {
            return;
        };
        self.transfer.kv_copied_bytes += taps.kv_bytes();
        let Some(d) = taps.donor.as_ref().filter(|_| self.wants.kv_views) else {
            return;
        };
        if self
            .donors
            .as_ref()
            .is_none_or(|r| r.region() != d.region.id)
        {
            let r = &d.region;
            match DonorReader::new(r.id, r.shm.clone(), r.layout.clone()) {
                Ok(reader) => {
                    self.donors = Some(reader);
                    self.transfer.donor_maps += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "donor region not mapped");
                    return;
                }
            }
        }
        self.transfer.donor_table_bytes += 12 * d.table.len() as u64;
        self.tables
            .insert(session, (d.table.clone(), taps.pos + taps.rows));
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
        self.tables.remove(&session);
        self.drafter.open(session, args);
        self.take_donors(session, prompt_taps);
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
                    donors: self.donors.as_ref().and_then(|r| {
                        let (table, len) = self.tables.get(&a.session)?;
                        r.rows(table, *len).ok()
                    }),
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
        self.transfer.rounds += 1;
        self.take_donors(session, verdict.taps);
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
        self.transfer.rounds += 1;
        self.take_donors(session, taps_rows);
    }

    fn close(&mut self, session: SessionId) {
        if self.unheard.remove(&session).is_some() {
            self.drafter.close(session);
        }
        self.tables.remove(&session);
    }

    fn transfer(&self) -> Transfer {
        self.transfer
    }
}
