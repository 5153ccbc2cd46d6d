//! [`DrafterClient`]: a drafter process behind the [`Proposer`] trait.
//!
//! Every call is synchronous and bounded: `draft` waits for the reply until
//! [`ClientConfig::draft_deadline`] and returns an empty draft when it misses it; a reply that
//! comes later carries a stale sequence number and is dropped. The client mirrors every session's
//! context, so a respawned drafter gets its sessions re-opened with their full context.

use std::collections::HashMap;
use std::time::Instant;

use ipc_channel::TryRecvError;
use specula_models::sampling::SamplingParams;
use specula_protocol::shm::{KvView, ShmWriter, TapViews};
use specula_protocol::wire::{
    Capabilities, Close, Commit, Draft as DraftRequest, DraftRow, DrafterMsg, Open, Request,
    SamplingSpec, TargetInfo,
};
use tracing::{debug, warn};

use super::handshake::Connection;
use super::supervisor::Supervisor;
use super::validate::validate;
use super::{ClientConfig, DrafterError, DrafterSpec, DrafterState, DrafterStats};
use crate::proposer::{Draft, Proposer, SessionId, TapRows, Verdict, Wants};

/// What the client remembers of a session, to re-open it on a fresh drafter.
#[derive(Debug)]
struct Mirror {
    context: Vec<u32>,
    sampling: SamplingSpec,
    step: u64,
}

/// A drafter process, supervised, as a [`Proposer`].
#[derive(Debug)]
pub struct DrafterClient {
    sup: Supervisor,
    target: TargetInfo,
    config: ClientConfig,
    name: String,
    caps: Capabilities,
    sessions: HashMap<SessionId, Mirror>,
    stats: DrafterStats,
    bad_in_row: u32,
}

/// The protocol's form of the sampling parameters.
pub(super) fn sampling_spec(p: &SamplingParams) -> SamplingSpec {
    SamplingSpec {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.map(|k| k.min(u32::MAX as usize) as u32),
        min_p: p.min_p,
        seed: p.seed,
    }
}

impl DrafterClient {
    /// Spawns the drafter and waits until it is ready.
    ///
    /// # Errors
    /// Every way a drafter can fail to start ([`DrafterError`]): missing or non-executable path,
    /// exit or timeout during the handshake, no common protocol version, refused target.
    pub fn start(
        spec: DrafterSpec,
        target: TargetInfo,
        config: ClientConfig,
    ) -> Result<Self, DrafterError> {
        let mut sup = Supervisor::start(spec, target.clone(), config.clone())?;
        let conn = sup
            .connection()
            .expect("invariant: a started supervisor is ready");
        let (name, caps) = (conn.hello.name.clone(), conn.hello.capabilities.clone());
        Ok(DrafterClient {
            sup,
            target,
            config,
            name,
            caps,
            sessions: HashMap::new(),
            stats: DrafterStats::default(),
            bad_in_row: 0,
        })
    }

    /// Where the drafter is in its lifecycle.
    pub fn state(&self) -> DrafterState {
        self.sup.state()
    }

    /// The counters so far.
    pub fn stats(&self) -> DrafterStats {
        DrafterStats {
            restarts: self.sup.restarts(),
            ..self.stats.clone()
        }
    }

    /// The drafter's capabilities, as it announced them.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// The drafter's process id, when one is running and ready.
    pub fn pid(&mut self) -> Option<u32> {
        self.sup.connection().map(|c| c.child.pid())
    }

    /// Moves a pending respawn along (also done by every `Proposer` call); returns the state.
    pub fn poll(&mut self) -> DrafterState {
        if self.sup.poll() {
            self.reopen_all();
        }
        self.sup.state()
    }

    fn reopen_all(&mut self) {
        let Some(conn) = self.sup.connection() else {
            return;
        };
        // Taps of the old prompt are gone; the drafter gets ids only and catches up from there.
        let result = self.sessions.iter().try_for_each(|(&session, m)| {
            let open = Open {
                session,
                prompt_ids: m.context.clone(),
                sampling: m.sampling.clone(),
                prompt_taps: None,
            };
            conn.send(Request::Open(open)).map(drop)
        });
        if let Err(e) = result {
            self.sup.restart(&e.to_string());
        }
    }

    /// Sends a one-way request; a failure means the drafter is gone.
    fn send(&mut self, make: impl FnOnce(&mut Connection, &TargetInfo) -> Request) {
        let Some(conn) = self.sup.connection() else {
            return;
        };
        let request = make(conn, &self.target);
        if let Err(e) = conn.send(request) {
            self.sup.restart(&e.to_string());
        }
    }

    fn discard(&mut self, reason: &str) {
        self.stats.discarded += 1;
        self.bad_in_row += 1;
        debug!(drafter = %self.name, reason, "draft discarded");
        if self.bad_in_row >= self.config.max_bad_replies {
            self.bad_in_row = 0;
            self.sup.restart(&format!(
                "{} bad replies in a row, the last: {reason}",
                self.config.max_bad_replies
            ));
        }
    }

    fn record_rtt(&mut self, since: Instant) {
        let us = since.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        if self.stats.rtt_us.len() >= self.config.rtt_samples {
            self.stats.rtt_us.pop_front();
        }
        self.stats.rtt_us.push_back(us);
    }
}

/// Writes a window of activations into the region; `None` (logged) when it does not fit.
fn write_taps(region: &mut ShmWriter, taps: &TapRows, target: &TargetInfo) -> Option<TapViews> {
    let rows = u32::try_from(taps.rows).ok().filter(|&r| r > 0)?;
    let mut write = |data: &[f32], inner: &[u32]| {
        let want: usize = inner.iter().map(|&d| d as usize).product::<usize>() * rows as usize;
        let shape: Vec<u32> = match data.len() == want {
            true => std::iter::once(rows).chain(inner.iter().copied()).collect(),
            false => vec![rows, (data.len() / rows as usize) as u32],
        };
        region.write_f32(data, &shape)
    };
    let hidden = [target.hidden_size];
    let head = [target.num_kv_heads, target.head_dim];
    let views = (|| -> specula_protocol::Result<TapViews> {
        Ok(TapViews {
            pos: taps.pos as u64,
            rows,
            layers: taps
                .layers
                .iter()
                .map(|l| write(l, &hidden))
                .collect::<Result<_, _>>()?,
            final_hidden: taps
                .final_hidden
                .as_deref()
                .map(|h| write(h, &hidden))
                .transpose()?,
            kv: taps
                .kv
                .iter()
                .map(|(k, v)| {
                    Ok(KvView {
                        k: write(k, &head)?,
                        v: write(v, &head)?,
                    })
                })
                .collect::<specula_protocol::Result<_>>()?,
        })
    })();
    views
        .map_err(|e| warn!(error = %e, "taps not delivered"))
        .ok()
}

impl Proposer for DrafterClient {
    fn name(&self) -> &str {
        &self.name
    }

    fn wants(&self) -> Wants {
        Wants {
            tap_layers: self.caps.tap_layers.iter().map(|&l| l as usize).collect(),
            final_hidden: self.caps.final_hidden,
            kv_layers: self.caps.kv_layers.iter().map(|&l| l as usize).collect(),
        }
    }

    fn open(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        sampling: &SamplingParams,
        prompt_taps: Option<&TapRows>,
    ) {
        self.poll();
        let sampling = sampling_spec(sampling);
        let mirror = Mirror {
            context: prompt.to_vec(),
            sampling: sampling.clone(),
            step: 0,
        };
        self.sessions.insert(session, mirror);
        self.send(|conn, target| {
            let prompt_taps = match (&mut conn.region, prompt_taps) {
                (Some(region), Some(taps)) => write_taps(region, taps, target),
                _ => None,
            };
            Request::Open(Open {
                session,
                prompt_ids: prompt.to_vec(),
                sampling,
                prompt_taps,
            })
        });
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft {
        self.poll();
        let Some(mirror) = self.sessions.get_mut(&session) else {
            warn!(session, "draft for a session that is not open");
            return Draft::default();
        };
        mirror.context.extend_from_slice(new_tokens);
        let n = n.min(self.caps.max_draft_len as usize);
        let step = mirror.step;
        mirror.step += 1;
        let Some(conn) = self.sup.connection().filter(|_| n > 0) else {
            return Draft::default();
        };
        let row = DraftRow {
            session,
            new_tokens: new_tokens.to_vec(),
            n: n as u32,
            step,
        };
        let sent_at = Instant::now();
        let seq = match conn.send(Request::Draft(DraftRequest { rows: vec![row] })) {
            Ok(seq) => seq,
            Err(e) => {
                self.sup.restart(&e.to_string());
                return Draft::default();
            }
        };
        self.stats.requests += 1;
        let deadline = sent_at + self.config.draft_deadline;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(conn) = self.sup.connection() else {
                return Draft::default();
            };
            match conn.rx.try_recv_timeout(left) {
                Ok(DrafterMsg::Reply { seq: got, reply }) if got == seq => {
                    self.record_rtt(sent_at);
                    let proposed = reply.into_proposed();
                    return match validate(proposed, session, n, self.target.vocab_size) {
                        Ok(draft) => {
                            self.bad_in_row = 0;
                            self.stats.drafted += draft.tokens.len() as u64;
                            draft
                        }
                        Err(reason) => {
                            self.discard(&reason);
                            Draft::default()
                        }
                    };
                }
                Ok(DrafterMsg::Reply { .. }) => self.stats.late_replies += 1,
                Ok(DrafterMsg::Goodbye { reason }) => {
                    self.sup
                        .restart(&format!("the drafter said goodbye: {reason}"));
                    return Draft::default();
                }
                Ok(DrafterMsg::Capabilities(_)) => {
                    self.sup
                        .restart("the drafter sent capabilities after the handshake");
                    return Draft::default();
                }
                Err(TryRecvError::Empty) => {
                    self.stats.deadline_misses += 1;
                    return Draft::default();
                }
                Err(TryRecvError::IpcError(e)) => {
                    self.sup
                        .restart(&format!("the drafter's channel failed: {e}"));
                    return Draft::default();
                }
            }
        }
    }

    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        let Some(mirror) = self.sessions.get_mut(&session) else {
            return;
        };
        mirror.context.extend_from_slice(verdict.committed);
        self.stats.accepted += verdict.accepted as u64;
        self.send(|conn, target| {
            let taps = match (&mut conn.region, verdict.taps) {
                (Some(region), Some(taps)) => write_taps(region, taps, target),
                _ => None,
            };
            Request::Commit(Commit {
                session,
                drafted: verdict.drafted as u32,
                accepted: verdict.accepted as u32,
                accepted_ids: verdict.committed.to_vec(),
                taps,
            })
        });
    }

    fn close(&mut self, session: SessionId) {
        if self.sessions.remove(&session).is_some() {
            self.send(|_, _| Request::Close(Close { session }));
        }
    }
}

impl Drop for DrafterClient {
    fn drop(&mut self) {
        self.sup.stop();
    }
}
