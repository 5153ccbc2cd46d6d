//! Driving a drafter the way `target-host` does, from one sequence and the target's final-norm
//! hiddens of its rows, without the host: the twin check, the GGUF tests and the acceptance
//! and round-cost examples all replay a sequence through [`HostFeed`].
//!
//! The host's order: `Open` with the context up to the pending id and the hiddens of every row
//! before it; after each verify, `Commit` of the ids that follow the old pending one with the
//! hiddens of the rows that produced them (starting at the old pending row).

use std::path::Path;

use specula_models::config::ModelConfig;
use specula_protocol::sdk::{CommitArgs, Drafter, OpenArgs, Taps};
use specula_protocol::wire::{SamplingSpec, SessionId, TargetInfo};

/// The [`TargetInfo`] a host sends for the target `config` loaded from `path`, with a context
/// of `context_len` positions (no tokenizer fingerprint: the drafter is given its weights).
pub fn target_info(config: &ModelConfig, path: &Path, context_len: usize) -> TargetInfo {
    TargetInfo {
        architecture: config.model_type.clone(),
        vocab_size: config.vocab_size as u32,
        hidden_size: config.hidden_size as u32,
        num_layers: config.num_hidden_layers as u32,
        num_kv_heads: config.kv_heads() as u32,
        head_dim: config.head_dim() as u32,
        weights_path: path.display().to_string(),
        context_len: context_len as u32,
        ..TargetInfo::default()
    }
}

/// One sequence and the final-norm hidden of each of its rows (`hidden` values a row).
pub struct HostFeed<'a> {
    /// The ids.
    pub seq: &'a [u32],
    /// Row-major hiddens, at least one row per id that is not pending.
    pub hiddens: &'a [f32],
    /// Values per hidden row.
    pub hidden: usize,
}

impl HostFeed<'_> {
    fn rows(&self, from: usize, to: usize) -> &[f32] {
        &self.hiddens[from * self.hidden..to * self.hidden]
    }

    /// `Open` of `session` on `seq[..=pending]` (greedy), with the hiddens of rows
    /// `0..pending`.
    pub fn open(&self, d: &mut impl Drafter, session: SessionId, pending: usize) {
        d.open(
            session,
            OpenArgs {
                prompt: &self.seq[..=pending],
                sampling: &SamplingSpec::greedy(),
                taps: Some(Taps::from_f32(
                    0,
                    pending as u32,
                    &[],
                    Some(self.rows(0, pending)),
                    &[],
                )),
            },
        );
    }

    /// `Commit` after a verify at the pending row `pos`: ids `seq[pos + 1..=pos + n]` with the
    /// hiddens of rows `pos..pos + n` (`n - 1` accepted drafts and the target's own id).
    pub fn commit(&self, d: &mut impl Drafter, session: SessionId, pos: usize, n: usize) {
        d.commit(
            session,
            CommitArgs {
                drafted: n - 1,
                accepted: n - 1,
                ids: &self.seq[pos + 1..pos + 1 + n],
                taps: Some(Taps::from_f32(
                    pos as u64,
                    n as u32,
                    &[],
                    Some(self.rows(pos, pos + n)),
                    &[],
                )),
            },
        );
    }
}
