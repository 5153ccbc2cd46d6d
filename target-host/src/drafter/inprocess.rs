//! Any SDK [`Drafter`] run inside the host, as a [`Proposer`]: the same drafting logic as its
//! process, without the process boundary (for benchmarks that isolate the IPC cost, and tests).

use specula_models::sampling::SamplingParams;
use specula_protocol::sdk::{CommitArgs, Drafter, OpenArgs, Taps};

use super::client::sampling_spec;
use crate::proposer::{Draft, Proposer, SessionId, TapRows, Verdict, Wants};

/// An in-process drafter. Like the SDK, it caps every draft at `n` and at the drafter's
/// `max_draft_len`; unlike a process, it cannot crash independently or miss a deadline.
#[derive(Debug)]
pub struct InProcess<D> {
    drafter: D,
    name: String,
    max_draft_len: usize,
    wants: Wants,
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
            wants: Wants {
                tap_layers: caps.tap_layers.iter().map(|&l| l as usize).collect(),
                final_hidden: caps.final_hidden,
                kv_layers: caps.kv_layers.iter().map(|&l| l as usize).collect(),
            },
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
        prompt: &[u32],
        sampling: &SamplingParams,
        prompt_taps: Option<&TapRows>,
    ) {
        let sampling = sampling_spec(sampling);
        let args = OpenArgs {
            prompt,
            sampling: &sampling,
            taps: prompt_taps.map(taps),
        };
        self.drafter.open(session, args);
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft {
        let n = n.min(self.max_draft_len);
        let mut p = self.drafter.draft(session, new_tokens, n);
        p.truncate(n);
        Draft {
            tokens: p.tokens,
            q: p.q,
        }
    }

    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        let args = CommitArgs {
            drafted: verdict.drafted,
            accepted: verdict.accepted,
            ids: verdict.committed,
            taps: verdict.taps.map(taps),
        };
        self.drafter.commit(session, args);
    }

    fn close(&mut self, session: SessionId) {
        self.drafter.close(session);
    }
}
