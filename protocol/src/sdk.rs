//! The drafter SDK: implement [`Drafter`], call [`serve`] from `main`.
//!
//! [`serve`] does the rest: it connects to the host named in [`crate::transport::BOOTSTRAP_ENV`],
//! negotiates the version, asks the drafter to accept the target, maps the shared-memory regions,
//! reads the taps, keeps the set of open sessions, caps every proposal at what was asked, and
//! returns when the host says `Shutdown` or goes away.
//!
//! ```no_run
//! use specula_protocol::sdk::{self, Drafter, DrafterInfo, OpenArgs, CommitArgs, Proposal};
//! use specula_protocol::wire::{Capabilities, SessionId};
//!
//! /// Proposes the last token again, `n` times.
//! struct Repeat(std::collections::HashMap<SessionId, u32>);
//!
//! impl Drafter for Repeat {
//!     fn info(&self) -> DrafterInfo {
//!         DrafterInfo::new("repeat", "0.1", Capabilities::tokens_only(4))
//!     }
//!     fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
//!         self.0.insert(session, *args.prompt.last().unwrap_or(&0));
//!     }
//!     fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
//!         let last = new_tokens.last().or(self.0.get(&session)).copied().unwrap_or(0);
//!         Proposal::tokens(vec![last; n])
//!     }
//!     fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
//!         if let Some(&id) = args.ids.last() { self.0.insert(session, id); }
//!     }
//!     fn close(&mut self, session: SessionId) { self.0.remove(&session); }
//! }
//!
//! fn main() -> std::process::ExitCode { sdk::serve(Repeat(Default::default())) }
//! ```

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;

use ipc_channel::ipc::IpcReceiver;
use ipc_channel::IpcError;
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::shm::{RegionId, ShmReader, TapViews, TensorView};
use crate::transport::{self, Sender, BOOTSTRAP_ENV};
use crate::version::{self, Version, PROTOCOL_VERSION};
use crate::wire::{
    Capabilities, Drafted, DraftedRow, DrafterMsg, HandshakeReply, Hello, HostMsg, Reply, Request,
    SamplingSpec, SessionId, TargetInfo,
};

/// What a drafter says about itself in its Hello.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterInfo {
    /// A short name for logs and metrics.
    pub name: String,
    /// The drafter's own version.
    pub version: String,
    /// What it can do and wants to see.
    pub capabilities: Capabilities,
    /// Protocol versions it speaks (per major, the newest minor).
    pub versions: Vec<Version>,
}

impl DrafterInfo {
    /// A drafter speaking this crate's [`PROTOCOL_VERSION`].
    pub fn new(name: &str, version: &str, capabilities: Capabilities) -> Self {
        DrafterInfo {
            name: name.to_string(),
            version: version.to_string(),
            capabilities,
            versions: vec![PROTOCOL_VERSION],
        }
    }
}

/// Target activations read from shared memory (copies: they stay valid).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Taps {
    /// Absolute position of the first row.
    pub pos: u64,
    /// Number of rows.
    pub rows: u32,
    /// One per requested tap layer: `rows × hidden`.
    pub layers: Vec<Vec<f32>>,
    /// Post-final-norm hidden, `rows × hidden`, when asked for.
    pub final_hidden: Option<Vec<f32>>,
    /// `(k, v)` per requested KV layer: `rows × kv_heads × head_dim` each.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

/// What [`Drafter::open`] gets.
#[derive(Debug)]
pub struct OpenArgs<'a> {
    /// The whole context; its last id is pending (not yet run by the target).
    pub prompt: &'a [u32],
    /// How the target samples.
    pub sampling: &'a SamplingSpec,
    /// Activations of the prompt, when asked for and intact.
    pub taps: Option<Taps>,
}

/// What [`Drafter::commit`] gets.
#[derive(Debug)]
pub struct CommitArgs<'a> {
    /// How many drafts were verified.
    pub drafted: usize,
    /// How many of them the target accepted.
    pub accepted: usize,
    /// Ids committed: the accepted drafts, then the target's own (pending) token.
    pub ids: &'a [u32],
    /// Activations of the verified rows, when asked for and intact.
    pub taps: Option<Taps>,
}

/// A drafter's answer to one draft request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    /// Proposed ids (the SDK keeps at most the `n` asked for).
    pub tokens: Vec<u32>,
    /// Probability rows, one per token, when the drafter sampled them.
    pub q: Option<Vec<Vec<f32>>>,
}

impl Proposal {
    /// No drafts this time.
    pub fn none() -> Self {
        Proposal::default()
    }

    /// Deterministic drafts (no `q`).
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Proposal { tokens, q: None }
    }
}

/// A drafter, as the SDK drives it. Calls for one session come in the order
/// `open, (draft, commit)*, close`; calls for sessions the host never opened never come.
pub trait Drafter {
    /// Name, version, capabilities, protocol versions: sent in the Hello.
    fn info(&self) -> DrafterInfo;
    /// Checks the target (e.g. the tokenizer fingerprint); `Err(reason)` ends the connection.
    ///
    /// # Errors
    /// A human-readable reason the drafter cannot serve this target.
    fn accept_target(&mut self, target: &TargetInfo) -> std::result::Result<(), String> {
        let _ = target;
        Ok(())
    }
    /// Starts a session.
    fn open(&mut self, session: SessionId, args: OpenArgs<'_>);
    /// Proposes up to `n` ids after appending `new_tokens` to the session's context.
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal;
    /// Learns what the target committed after the last draft.
    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>);
    /// Ends a session.
    fn close(&mut self, session: SessionId);
}

/// How a drafter's [`run`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The host sent `Shutdown`.
    Shutdown,
    /// The host went away (it exited or dropped the drafter).
    HostGone,
    /// The host refused the drafter.
    Refused {
        /// The host's reason.
        reason: String,
    },
    /// The drafter refused the target (or the version the host chose).
    Declined {
        /// The drafter's reason.
        reason: String,
    },
}

impl Outcome {
    /// The process exit status: 0 when the host ended things, 2 when it refused the drafter, 3
    /// when the drafter refused the target.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Outcome::Shutdown | Outcome::HostGone => ExitCode::SUCCESS,
            Outcome::Refused { .. } => ExitCode::from(2),
            Outcome::Declined { .. } => ExitCode::from(3),
        }
    }
}

/// Serves `drafter` to the host that started this process; returns the exit status for `main`.
/// Errors and refusals are printed to stderr.
pub fn serve<D: Drafter>(drafter: D) -> ExitCode {
    let Ok(name) = std::env::var(BOOTSTRAP_ENV) else {
        eprintln!(
            "this is a Specula drafter: the target host starts it ({BOOTSTRAP_ENV} is not set)"
        );
        return ExitCode::from(1);
    };
    match run(drafter, &name) {
        Ok(outcome) => {
            match &outcome {
                Outcome::Refused { reason } => eprintln!("the host refused this drafter: {reason}"),
                Outcome::Declined { reason } => {
                    eprintln!("this drafter refused the target: {reason}")
                }
                Outcome::Shutdown | Outcome::HostGone => {}
            }
            outcome.exit_code()
        }
        Err(e) => {
            eprintln!("drafter failed: {}", chain(&e));
            ExitCode::from(1)
        }
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Connects to the bootstrap `name`, does the handshake and serves requests until the host
/// ends the connection.
///
/// # Errors
/// Transport and protocol errors ([`Error`]); refusals are [`Outcome`]s, not errors.
pub fn run<D: Drafter>(mut drafter: D, bootstrap: &str) -> Result<Outcome> {
    let info = drafter.info();
    let hello = Hello {
        versions: info.versions.clone(),
        name: info.name.clone(),
        drafter_version: info.version.clone(),
        capabilities: info.capabilities.clone(),
    };
    let connected = transport::connect(bootstrap, &hello)?;
    let welcome = match connected.reply {
        HandshakeReply::Refused { reason } => return Ok(Outcome::Refused { reason }),
        HandshakeReply::Welcome(welcome) => welcome,
    };
    let to_host = Sender::new(connected.to_host, welcome.version);
    let spoken = version::negotiate(&info.versions, &[welcome.version]);
    let verdict = if spoken != Some(welcome.version) {
        Err(format!(
            "the host chose protocol {}, this drafter speaks {}",
            welcome.version,
            version::list(&info.versions)
        ))
    } else {
        drafter.accept_target(&welcome.target)
    };
    if let Err(reason) = verdict {
        // The host may already be gone; the reason is printed either way.
        let _ = to_host.send(DrafterMsg::Goodbye {
            reason: reason.clone(),
        });
        return Ok(Outcome::Declined { reason });
    }
    Server {
        drafter,
        max_draft_len: info.capabilities.max_draft_len as usize,
        to_host,
        regions: HashMap::new(),
        sessions: HashSet::new(),
    }
    .serve(&connected.from_host)
}

struct Server<D> {
    drafter: D,
    max_draft_len: usize,
    to_host: Sender<DrafterMsg>,
    regions: HashMap<RegionId, ShmReader>,
    sessions: HashSet<SessionId>,
}

impl<D: Drafter> Server<D> {
    fn serve(mut self, from_host: &IpcReceiver<HostMsg>) -> Result<Outcome> {
        loop {
            let msg = match from_host.recv() {
                Ok(msg) => msg,
                Err(IpcError::Disconnected) => return Ok(Outcome::HostGone),
                Err(source) => {
                    return Err(Error::Transport {
                        op: "receive a request",
                        source,
                    })
                }
            };
            let HostMsg::Request { seq, request } = msg else {
                return Err(Error::Violation {
                    reason: "a second handshake reply".to_string(),
                });
            };
            if let Request::Shutdown = request {
                return Ok(Outcome::Shutdown);
            }
            match self.handle(seq, request) {
                // The host went away while we answered: a normal end.
                Err(Error::Transport { .. }) => return Ok(Outcome::HostGone),
                other => other?,
            }
        }
    }

    fn handle(&mut self, seq: u64, request: Request) -> Result<()> {
        match request {
            Request::MapRegion(map) => {
                let reader = ShmReader::new(map.region, map.shm)?;
                self.regions.insert(map.region, reader);
            }
            Request::Open(open) => {
                if !self.sessions.insert(open.session) {
                    // A re-open replaces the session (e.g. the host resent its context).
                    self.drafter.close(open.session);
                }
                let taps = self.read_taps(open.prompt_taps.as_ref());
                let args = OpenArgs {
                    prompt: &open.prompt_ids,
                    sampling: &open.sampling,
                    taps,
                };
                self.drafter.open(open.session, args);
            }
            Request::Draft(draft) => {
                let rows = draft.rows.iter().map(|row| {
                    let n = (row.n as usize).min(self.max_draft_len);
                    let mut p = if self.sessions.contains(&row.session) {
                        self.drafter.draft(row.session, &row.new_tokens, n)
                    } else {
                        warn!(
                            session = row.session,
                            "draft for a session that is not open"
                        );
                        Proposal::none()
                    };
                    p.tokens.truncate(n);
                    if let Some(q) = &mut p.q {
                        q.truncate(p.tokens.len());
                    }
                    DraftedRow {
                        session: row.session,
                        tokens: p.tokens,
                        q: p.q,
                    }
                });
                let drafted = Drafted {
                    rows: rows.collect(),
                };
                self.to_host.send(DrafterMsg::Reply {
                    seq,
                    reply: Reply::Drafted(drafted),
                })?;
            }
            Request::Commit(commit) => {
                if self.sessions.contains(&commit.session) {
                    let taps = self.read_taps(commit.taps.as_ref());
                    let args = CommitArgs {
                        drafted: commit.drafted as usize,
                        accepted: commit.accepted as usize,
                        ids: &commit.accepted_ids,
                        taps,
                    };
                    self.drafter.commit(commit.session, args);
                }
            }
            Request::Close(close) => {
                if self.sessions.remove(&close.session) {
                    self.drafter.close(close.session);
                }
            }
            Request::Shutdown => unreachable!("invariant: handled by the caller"),
        }
        Ok(())
    }

    /// Reads every view; any torn or bad view drops the whole set (a partial set would misalign).
    fn read_taps(&self, views: Option<&TapViews>) -> Option<Taps> {
        let views = views?;
        let read = |v: &TensorView| {
            let reader = self.regions.get(&v.region).ok_or_else(|| Error::BadView {
                reason: format!("region {} was never mapped", v.region),
            })?;
            reader.read_f32(v)
        };
        let taps = (|| -> Result<Taps> {
            Ok(Taps {
                pos: views.pos,
                rows: views.rows,
                layers: views.layers.iter().map(read).collect::<Result<_>>()?,
                final_hidden: views.final_hidden.as_ref().map(read).transpose()?,
                kv: views
                    .kv
                    .iter()
                    .map(|kv| Ok((read(&kv.k)?, read(&kv.v)?)))
                    .collect::<Result<_>>()?,
            })
        })();
        match taps {
            Ok(taps) => Some(taps),
            Err(e) => {
                debug!(error = %e, "taps dropped");
                None
            }
        }
    }
}
