//! Runs an SDK [`Drafter`] inside the host process, behind the same [`Proposer`] interface as
//! a drafter process. Used to measure what the process boundary costs (same drafter logic, no
//! IPC) and by tests; users run drafters as processes.

use specula_models::sampling::SamplingParams;
use specula_protocol::sdk::{CommitArgs, Drafter, OpenArgs, Taps};
use specula_protocol::wire::SamplingSpec;

use crate::proposer::{Draft, Proposer, SessionId, TapRows, Verdict, Wants};

/// An SDK drafter called directly, without a process or a channel in between.
pub struct InProcess<D> {
    drafter: D,
    name: String,
    wants: Wants,
}

impl<D: Drafter> InProcess<D> {
    /// Wraps `drafter`; what it wants to see comes from its capabilities.
    pub fn new(drafter: D) -> Self {
        let info = drafter.info();
        let caps = &info.capabilities;
        let wants = Wants {
            tap_layers: caps.tap_layers.iter().map(|&l| l as usize).collect(),
            final_hidden: caps.final_hidden,
            kv_layers: caps.kv_layers.iter().map(|&l| l as usize).collect(),
        };
        InProcess {
            drafter,
            name: format!("{} (in-process)", info.name),
            wants,
        }
    }
}

/// The protocol's view of sampling parameters.
pub fn sampling_spec(p: &SamplingParams) -> SamplingSpec {
    SamplingSpec {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.map(|k| k as u32),
        min_p: p.min_p,
        seed: p.seed,
    }
}

/// The SDK's view of tapped activations.
pub fn sdk_taps(t: &TapRows) -> Taps {
    Taps {
        pos: t.pos as u64,
        rows: t.rows as u32,
        layers: t.layers.clone(),
        final_hidden: t.final_hidden.clone(),
        kv: t.kv.clone(),
    }
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
        self.drafter.open(
            session,
            OpenArgs {
                prompt,
                sampling: &sampling,
                taps: prompt_taps.map(sdk_taps),
            },
        );
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft {
        let p = self.drafter.draft(session, new_tokens, n);
        Draft {
            tokens: p.tokens,
            q: p.q,
        }
    }

    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.drafter.commit(
            session,
            CommitArgs {
                drafted: verdict.drafted,
                accepted: verdict.accepted,
                ids: verdict.committed,
                taps: verdict.taps.map(sdk_taps),
            },
        );
    }

    fn close(&mut self, session: SessionId) {
        self.drafter.close(session);
    }
}
