//! Drafter processes as the verify loop sees them: a [`DrafterClient`] is a
//! [`crate::proposer::Proposer`] whose drafts come from another process.
//!
//! - [`process`]: find the executable, spawn it, never leave an orphan.
//! - [`handshake`]: bootstrap, version negotiation, `Welcome`, shared-memory region, ping.
//! - [`supervisor`]: the [`DrafterState`] machine, respawn with exponential backoff.
//! - [`client`]: the `Proposer` implementation: deadlines, reply validation, taps, counters.
//! - [`pace`]: how much a drafter may draft from how it kept its deadlines (health).
//! - [`inprocess`]: an SDK drafter run inside the host, for benchmarks and tests.
//!
//! The protocol itself lives in `specula_protocol` (see `protocol/README.md`).

pub mod client;
pub mod handshake;
pub mod inprocess;
pub mod pace;
pub mod process;
pub mod supervisor;
pub(crate) mod validate;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

pub use client::DrafterClient;
pub use inprocess::InProcess;
pub use process::DrafterSpec;
pub use supervisor::DrafterState;

/// Why a drafter could not be started or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DrafterError {
    /// No file at the drafter path.
    #[error("drafter {} not found", path.display())]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The path is a folder or lacks an execute bit.
    #[error("drafter {} is not an executable file", path.display())]
    NotExecutable {
        /// The path.
        path: PathBuf,
    },
    /// The OS could not start it.
    #[error("cannot start drafter {}", path.display())]
    Spawn {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// It exited before completing the handshake.
    #[error("drafter {} exited during the handshake ({status}); its stderr:\n{stderr}", path.display())]
    ExitedDuringHandshake {
        /// The path.
        path: PathBuf,
        /// Its exit status.
        status: String,
        /// The last lines it wrote to stderr.
        stderr: String,
    },
    /// It did not complete the handshake in time.
    #[error("drafter {} did not complete the handshake within {after:?}", path.display())]
    HandshakeTimeout {
        /// The path.
        path: PathBuf,
        /// The deadline.
        after: Duration,
    },
    /// No protocol major version in common.
    #[error("drafter `{drafter}` speaks protocol {theirs}, this host speaks {host}: no common major version")]
    VersionMismatch {
        /// The drafter's name.
        drafter: String,
        /// Versions the host speaks.
        host: String,
        /// Versions the drafter speaks.
        theirs: String,
    },
    /// Its capabilities do not fit the target.
    #[error("drafter `{drafter}` has unusable capabilities: {reason}")]
    BadCapabilities {
        /// The drafter's name.
        drafter: String,
        /// What is wrong.
        reason: String,
    },
    /// It refused the target (e.g. another tokenizer).
    #[error("drafter `{drafter}` refused the target: {reason}")]
    Refused {
        /// The drafter's name.
        drafter: String,
        /// Its reason.
        reason: String,
    },
    /// The protocol layer failed.
    #[error("drafter protocol: cannot {op}")]
    Protocol {
        /// What was being done.
        op: &'static str,
        /// The protocol error.
        #[source]
        source: specula_protocol::Error,
    },
}

impl DrafterError {
    /// Whether the drafter started but could not agree with this host (old protocol, refused
    /// target, died or hung in the handshake). The host then serves without drafting; a path
    /// that names no runnable program is the user's error instead.
    pub fn is_handshake_failure(&self) -> bool {
        !matches!(
            self,
            DrafterError::NotFound { .. }
                | DrafterError::NotExecutable { .. }
                | DrafterError::Spawn { .. }
        )
    }
}

/// How long each side of a doorbell polls before it sleeps, unless configured: long enough to
/// catch a `Draft` that follows its `Commit`, and a quick drafter's reply, without a wake-up;
/// short enough not to hold a core through a target forward.
pub const DEFAULT_DOORBELL_SPIN: Duration = Duration::from_micros(50);

/// Parses a drafter transport as the benchmarks name it: `socket` (no doorbell; `None`),
/// `doorbell` (polling [`DEFAULT_DOORBELL_SPIN`]) or `doorbell:N` (polling N µs).
///
/// # Errors
/// Any other text, with what is accepted.
pub fn parse_transport(text: &str) -> Result<Option<Duration>, String> {
    match text.split_once(':') {
        _ if text == "socket" => Ok(None),
        _ if text == "doorbell" => Ok(Some(DEFAULT_DOORBELL_SPIN)),
        Some(("doorbell", us)) => us
            .parse()
            .map(|us| Some(Duration::from_micros(us)))
            .map_err(|_| format!("`{text}`: the doorbell's polling time is whole µs")),
        _ => Err(format!(
            "unknown transport `{text}` (socket, doorbell or doorbell:<µs>)"
        )),
    }
}

/// The name of a transport, as [`parse_transport`] reads it.
pub fn transport_name(spin: Option<Duration>) -> String {
    match spin {
        None => "socket".to_string(),
        Some(spin) => format!("doorbell:{}", spin.as_micros()),
    }
}

/// Deadlines and limits of a [`DrafterClient`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConfig {
    /// Spawn to ready.
    pub handshake_timeout: Duration,
    /// The longest a draft request may take (the engine's deadline, a few target steps, is
    /// usually shorter); a late reply is dropped and the round runs draft-less.
    pub draft_deadline: Duration,
    /// Bad replies in a row after which the drafter is restarted.
    pub max_bad_replies: u32,
    /// First respawn delay; doubles after each failed start.
    pub backoff_base: Duration,
    /// Longest respawn delay.
    pub backoff_max: Duration,
    /// Failed starts in a row after which the drafter is given up ([`DrafterState::Failed`]).
    pub max_failed_starts: u32,
    /// Size of the shared-memory ring for taps, when the drafter wants any.
    pub region_bytes: usize,
    /// How many round-trip latencies are kept for percentiles.
    pub rtt_samples: usize,
    /// The doorbell (protocol 1.3, drafters that offer it): session messages through
    /// shared-memory rings and a futex instead of the socket, each side polling its ring for
    /// this long before it sleeps. `None` keeps every drafter on the socket.
    pub doorbell_spin: Option<Duration>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            handshake_timeout: Duration::from_secs(10),
            draft_deadline: Duration::from_millis(200),
            max_bad_replies: 8,
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            max_failed_starts: 6,
            region_bytes: 64 << 20,
            rtt_samples: 1 << 16,
            doorbell_spin: Some(DEFAULT_DOORBELL_SPIN),
        }
    }
}

/// Counters of one drafter client.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrafterStats {
    /// Draft requests sent.
    pub requests: u64,
    /// Valid drafted tokens handed to the verify loop.
    pub drafted: u64,
    /// Drafted tokens the target accepted.
    pub accepted: u64,
    /// Replies discarded as invalid (bad ids, too many tokens, bad `q`, wrong session).
    pub discarded: u64,
    /// Requests whose reply missed the deadline.
    pub deadline_misses: u64,
    /// Late replies dropped because their sequence number was stale.
    pub late_replies: u64,
    /// Tap windows a protocol 1.0 peer has no message for (a round without drafts, or an
    /// `Open` too large for one message: only ≥ 1.1 peers get `Advance`).
    pub taps_undelivered: u64,
    /// `Open`s whose taps were split into `Open` + `Advance`s to fit the shared region.
    pub split_opens: u64,
    /// `Advance`s (rounds without drafts held back, then sent together) split the same way.
    pub split_advances: u64,
    /// Times the drafter process was (re)started after the first start.
    pub restarts: u64,
    /// Rounds reported to the drafter (`Commit`s and `Advance`s).
    pub rounds: u64,
    /// Bytes of K/V rows copied into taps for it (0 with donor views).
    pub kv_copied_bytes: u64,
    /// Bytes of donor block-table entries sent (`DonorTables`, views only).
    pub donor_table_bytes: u64,
    /// `MapDonors` sent (once per region and drafter process).
    pub donor_maps: u64,
    /// Recent Draft → Drafted round trips, in microseconds, oldest first.
    pub rtt_us: VecDeque<u32>,
}

impl DrafterStats {
    /// The K/V transfer counters, as [`crate::proposer::Proposer::transfer`] reports them.
    pub fn transfer(&self) -> crate::proposer::Transfer {
        crate::proposer::Transfer {
            rounds: self.rounds,
            kv_copied_bytes: self.kv_copied_bytes,
            donor_table_bytes: self.donor_table_bytes,
            donor_maps: self.donor_maps,
        }
    }

    /// The `p`-th percentile (`0.0..=1.0`) of the recorded round trips.
    pub fn rtt_percentile(&self, p: f64) -> Option<Duration> {
        if self.rtt_us.is_empty() {
            return None;
        }
        let mut sorted: Vec<u32> = self.rtt_us.iter().copied().collect();
        sorted.sort_unstable();
        let rank = ((sorted.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize;
        Some(Duration::from_micros(u64::from(sorted[rank])))
    }
}
