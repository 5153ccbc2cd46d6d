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

mod server;
pub mod shipped;

use std::process::ExitCode;

use crate::donor::DonorRows;
use crate::error::Result;
use crate::shm::TensorRef;
use crate::transport::{self, Sender, BOOTSTRAP_ENV};
use crate::version::{self, Version, PROTOCOL_VERSION};
use crate::wire::{
    Capabilities, DrafterMsg, HandshakeReply, Hello, SamplingSpec, SessionId, TargetInfo, Welcome,
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
    /// Whether [`Drafter::capabilities`] states the real capabilities once the target is known
    /// (then `capabilities` above are what a 1.0 host gets).
    pub late_capabilities: bool,
    /// Whether the `kv_layers` are wanted as K/V donor views (1.2; [`DraftAsk::donors`]) rather
    /// than as rows in the taps.
    pub kv_donor_views: bool,
    /// Whether the session messages may move onto a doorbell (1.3; the SDK does all of it): on
    /// by default, [`DrafterInfo::without_doorbell`] keeps the socket.
    pub doorbell: bool,
}

impl DrafterInfo {
    /// A drafter speaking this crate's [`PROTOCOL_VERSION`].
    pub fn new(name: &str, version: &str, capabilities: Capabilities) -> Self {
        DrafterInfo {
            name: name.to_string(),
            version: version.to_string(),
            capabilities,
            versions: vec![PROTOCOL_VERSION],
            late_capabilities: false,
            kv_donor_views: false,
            doorbell: true,
        }
    }

    /// The same, keeping every message on the socket (no doorbell, whatever the host offers).
    pub fn without_doorbell(self) -> Self {
        DrafterInfo {
            doorbell: false,
            ..self
        }
    }

    /// The same, asking for its `kv_layers` as donor views ([`DraftAsk::donors`]) where the host
    /// offers them (protocol ≥ 1.2); elsewhere they come as rows in the taps.
    pub fn with_kv_donor_views(self) -> Self {
        DrafterInfo {
            kv_donor_views: true,
            ..self
        }
    }

    /// The same, stating its capabilities once the target is known ([`Drafter::capabilities`]).
    pub fn with_late_capabilities(self) -> Self {
        DrafterInfo {
            late_capabilities: true,
            ..self
        }
    }
}

/// Target activations of a window of positions, borrowed from the shared-memory region (or,
/// in process, from the host's memory): read them in place, copy what you keep.
///
/// Row `i` of every tensor is the target's state at absolute position `pos + i`. Layer taps and
/// the final hidden are `rows × hidden_size`; K/V rows are `rows × kv_heads × head_dim`, K after
/// RoPE. See `protocol/README.md` for which positions each message carries.
#[derive(Debug, Clone)]
pub struct Taps<'a> {
    /// Absolute position of the first row.
    pub pos: u64,
    /// Number of rows.
    pub rows: u32,
    /// One per requested tap layer, in the order of `Capabilities::tap_layers`.
    pub layers: Vec<TensorRef<'a>>,
    /// Post-final-norm hidden, when asked for.
    pub final_hidden: Option<TensorRef<'a>>,
    /// `(k, v)` per requested KV layer, in the order of `Capabilities::kv_layers`.
    pub kv: Vec<(TensorRef<'a>, TensorRef<'a>)>,
}

impl<'a> Taps<'a> {
    /// Every tensor, in message order: layers, final hidden, then K and V of each KV layer.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorRef<'a>> {
        let kv = self.kv.iter().flat_map(|(k, v)| [k, v]);
        self.layers.iter().chain(&self.final_hidden).chain(kv)
    }

    /// Whether every tensor is still intact (call it after reading the bytes in place).
    ///
    /// # Errors
    /// [`crate::Error::Torn`] when the host overwrote one of them.
    pub fn check(&self) -> Result<()> {
        self.tensors().try_for_each(TensorRef::check)
    }

    /// Views of f32 tensors in this process's memory (an in-process host), each shaped
    /// `rows × rest`.
    pub fn from_f32(
        pos: u64,
        rows: u32,
        layers: &'a [Vec<f32>],
        final_hidden: Option<&'a [f32]>,
        kv: &'a [(Vec<f32>, Vec<f32>)],
    ) -> Self {
        let n = rows.max(1) as usize;
        let t = |data: &'a [f32]| TensorRef::from_f32(data, &[rows, (data.len() / n) as u32]);
        Taps {
            pos,
            rows,
            layers: layers.iter().map(|l| t(l)).collect(),
            final_hidden: final_hidden.map(t),
            kv: kv.iter().map(|(k, v)| (t(k), t(v))).collect(),
        }
    }

    /// Copies every tensor as f32.
    ///
    /// # Errors
    /// [`crate::Error::Torn`] when one was overwritten during the copy.
    pub fn to_owned(&self) -> Result<OwnedTaps> {
        Ok(OwnedTaps {
            pos: self.pos,
            rows: self.rows,
            layers: self
                .layers
                .iter()
                .map(TensorRef::to_f32)
                .collect::<Result<_>>()?,
            final_hidden: self
                .final_hidden
                .as_ref()
                .map(TensorRef::to_f32)
                .transpose()?,
            kv: self
                .kv
                .iter()
                .map(|(k, v)| Ok((k.to_f32()?, v.to_f32()?)))
                .collect::<Result<_>>()?,
        })
    }
}

/// Target activations copied out of shared memory as f32 (see [`Taps`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OwnedTaps {
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

impl OwnedTaps {
    /// Borrowed views of these copies.
    pub fn view(&self) -> Taps<'_> {
        Taps::from_f32(
            self.pos,
            self.rows,
            &self.layers,
            self.final_hidden.as_deref(),
            &self.kv,
        )
    }
}

/// What [`Drafter::open`] gets.
#[derive(Debug)]
pub struct OpenArgs<'a> {
    /// The whole context; its last id is pending (not yet run by the target).
    pub prompt: &'a [u32],
    /// How the target samples.
    pub sampling: &'a SamplingSpec,
    /// Activations of every prompt position but the pending one (`prompt.len() - 1` rows from
    /// position 0), when asked for and intact.
    pub taps: Option<Taps<'a>>,
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
    /// Activations of the verified rows `[pending, d1..d_accepted]` (`accepted + 1` rows from the
    /// position that was pending), when asked for and intact.
    pub taps: Option<Taps<'a>>,
}

/// What [`Drafter::advance`] gets: ids committed without a draft being verified.
#[derive(Debug)]
pub struct AdvanceArgs<'a> {
    /// The committed ids, oldest first; the last is pending now.
    pub ids: &'a [u32],
    /// Activations of the `ids.len()` rows that produced them (from the position that was
    /// pending before), when asked for and intact.
    pub taps: Option<Taps<'a>>,
}

/// What a drafter did with an [`Drafter::advance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advanced {
    /// The drafter appended the ids to its context itself.
    Taken,
    /// The SDK keeps the ids and passes them in the next [`Drafter::draft`]'s `new_tokens`, as
    /// a 1.0 host would (their taps are dropped).
    AsNewTokens,
}

/// One row of a batched draft request, as [`Drafter::draft_batch`] gets it.
#[derive(Debug, Clone, Copy)]
pub struct DraftAsk<'a> {
    /// The session (always an open one).
    pub session: SessionId,
    /// Ids committed that the drafter has not heard of (see [`Drafter::draft`]).
    pub new_tokens: &'a [u32],
    /// The most drafts wanted (already capped at `max_draft_len`).
    pub n: usize,
    /// The session's donor K/V, positions `0..len` (every committed id but the pending one), read
    /// in place from the host's KV pool, when the drafter asked for donor views and the host
    /// mapped them (protocol ≥ 1.2). Call [`DonorRows::check`] after reading.
    pub donors: Option<DonorRows<'a>>,
}

/// A drafter's answer to one draft request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    /// Proposed ids (the SDK keeps at most the `n` asked for).
    pub tokens: Vec<u32>,
    /// Probability rows, one per token, when the drafter sampled them.
    pub q: Option<Vec<Vec<f32>>>,
    /// Per token, the estimated probability (`0..=1`) that the target accepts it given that the
    /// earlier ones were accepted, when the drafter has such an estimate. Sent to hosts at ≥ 1.1.
    pub confidence: Option<Vec<f32>>,
}

impl Proposal {
    /// No drafts this time.
    pub fn none() -> Self {
        Proposal::default()
    }

    /// Deterministic drafts (no `q`).
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Proposal {
            tokens,
            ..Proposal::default()
        }
    }

    /// Keeps at most `n` tokens, with their `q` rows and confidences.
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        let n = self.tokens.len();
        if let Some(q) = &mut self.q {
            q.truncate(n);
        }
        if let Some(c) = &mut self.confidence {
            c.truncate(n);
        }
    }
}

/// A drafter, as the SDK drives it. Calls for one session come in the order
/// `open, (draft, commit | advance)*, close`; calls for sessions the host never opened never come.
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
    /// The capabilities to serve `target` with, for a drafter whose [`DrafterInfo`] set
    /// `late_capabilities` (called after [`Drafter::accept_target`]). Default: the Hello's.
    fn capabilities(&mut self, target: &TargetInfo) -> Capabilities {
        let _ = target;
        self.info().capabilities
    }
    /// Starts a session.
    fn open(&mut self, session: SessionId, args: OpenArgs<'_>);
    /// Proposes up to `n` ids after appending `new_tokens` to the session's context.
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal;
    /// Proposes for several sessions at once (one forward for all rows, in a batching drafter);
    /// returns one proposal per ask, in order. Default: [`Drafter::draft`] per row.
    fn draft_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Proposal> {
        asks.iter()
            .map(|a| self.draft(a.session, a.new_tokens, a.n))
            .collect()
    }
    /// Learns what the target committed after the last draft.
    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>);
    /// Learns ids committed without a verified draft (protocol ≥ 1.1). Default:
    /// [`Advanced::AsNewTokens`], so a drafter that ignores taps needs nothing here.
    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        let _ = (session, args);
        Advanced::AsNewTokens
    }
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
        late_capabilities: info.late_capabilities,
        kv_donor_views: info.kv_donor_views,
        doorbell: info.doorbell,
    };
    let connected = transport::connect(bootstrap, &hello)?;
    let welcome = match connected.reply {
        HandshakeReply::Refused { reason } => return Ok(Outcome::Refused { reason }),
        HandshakeReply::Welcome(welcome) => welcome,
    };
    let to_host = Sender::new(connected.to_host, welcome.version);
    let verdict = accept(&mut drafter, &info, &welcome);
    let caps = match verdict {
        Ok(caps) => caps,
        Err(reason) => {
            // The host may already be gone; the reason is printed either way.
            let _ = to_host.send(DrafterMsg::Goodbye {
                reason: reason.clone(),
            });
            return Ok(Outcome::Declined { reason });
        }
    };
    if info.late_capabilities && welcome.version >= LATE_CAPABILITIES {
        to_host.send(DrafterMsg::Capabilities(caps.clone()))?;
    }
    server::Server::new(drafter, caps.max_draft_len as usize, to_host).serve(&connected.from_host)
}

/// The version that brought `DrafterMsg::Capabilities`.
const LATE_CAPABILITIES: Version = Version { major: 1, minor: 1 };

/// Checks the version and the target; returns the capabilities to serve with.
fn accept<D: Drafter>(
    drafter: &mut D,
    info: &DrafterInfo,
    welcome: &Welcome,
) -> std::result::Result<Capabilities, String> {
    let spoken = version::negotiate(&info.versions, &[welcome.version]);
    if spoken != Some(welcome.version) {
        return Err(format!(
            "the host chose protocol {}, this drafter speaks {}",
            welcome.version,
            version::list(&info.versions)
        ));
    }
    drafter.accept_target(&welcome.target)?;
    if !info.late_capabilities {
        return Ok(info.capabilities.clone());
    }
    let caps = drafter.capabilities(&welcome.target);
    if welcome.version < LATE_CAPABILITIES && caps != info.capabilities {
        return Err(format!(
            "this drafter states its capabilities once it knows the target, which needs \
             protocol {LATE_CAPABILITIES}; the host speaks {}",
            welcome.version
        ));
    }
    Ok(caps)
}
