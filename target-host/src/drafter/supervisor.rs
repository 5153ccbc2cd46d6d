//! The drafter's lifecycle: a [`DrafterState`] machine that owns the connection and respawns a
//! crashed or misbehaving drafter with exponential backoff, on a helper thread, while the verify
//! loop goes on without drafts.
//!
//! ```text
//!            start ok                 crash / restart
//! Starting ─────────▶ Ready ─────────────────────────▶ Backoff
//!    │  ▲                                               │
//!    │  └──────────────── delay elapsed ────────────────┘
//!    │ failed start: Backoff (delay doubles), or Failed after `max_failed_starts`
//!    ▼
//! Failed            any state ── stop ──▶ Stopped
//! ```

use std::sync::mpsc;
use std::time::Instant;

use specula_protocol::wire::TargetInfo;
use tracing::{error, info, warn};

use super::handshake::{self, Connection};
use super::{ClientConfig, DrafterError, DrafterSpec};

/// Where a drafter is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterState {
    /// A process is being spawned and shaken hands with.
    Starting,
    /// Connected; requests go to it.
    Ready,
    /// It died or misbehaved; a respawn is scheduled.
    Backoff,
    /// It failed to start too many times in a row; no more attempts.
    Failed,
    /// Stopped on purpose.
    Stopped,
}

impl DrafterState {
    fn allows(self, to: DrafterState) -> bool {
        use DrafterState::*;
        matches!(
            (self, to),
            (Starting, Ready | Backoff | Failed)
                | (Ready, Backoff)
                | (Backoff, Starting)
                | (_, Stopped)
        )
    }
}

type StartResult = Result<Connection, DrafterError>;

/// Owns a drafter's connection and lifecycle.
#[derive(Debug)]
pub struct Supervisor {
    spec: DrafterSpec,
    target: TargetInfo,
    config: ClientConfig,
    state: DrafterState,
    conn: Option<Connection>,
    failed_starts: u32,
    retry_at: Instant,
    starting: Option<mpsc::Receiver<StartResult>>,
    restarts: u64,
}

impl Supervisor {
    /// Starts the drafter and waits for it (the first start reports its errors to the caller).
    ///
    /// # Errors
    /// Whatever [`handshake::connect`] reports.
    pub fn start(
        spec: DrafterSpec,
        target: TargetInfo,
        config: ClientConfig,
    ) -> Result<Self, DrafterError> {
        let conn = handshake::connect(&spec, &target, &config)?;
        Ok(Supervisor {
            spec,
            target,
            config,
            state: DrafterState::Ready,
            conn: Some(conn),
            failed_starts: 0,
            retry_at: Instant::now(),
            starting: None,
            restarts: 0,
        })
    }

    /// The current state.
    pub fn state(&self) -> DrafterState {
        self.state
    }

    /// Successful starts after the first one.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// The connection, when [`DrafterState::Ready`].
    pub fn connection(&mut self) -> Option<&mut Connection> {
        self.conn
            .as_mut()
            .filter(|_| self.state == DrafterState::Ready)
    }

    fn go(&mut self, to: DrafterState) {
        assert!(
            self.state.allows(to),
            "invariant: drafter state {:?} → {to:?} is not a transition",
            self.state
        );
        self.state = to;
    }

    /// Moves a respawn along; returns `true` when a fresh drafter just became ready (its
    /// sessions must be re-opened).
    pub fn poll(&mut self) -> bool {
        match self.state {
            DrafterState::Backoff if Instant::now() >= self.retry_at => {
                self.go(DrafterState::Starting);
                let (tx, rx) = mpsc::channel();
                let (spec, target, config) =
                    (self.spec.clone(), self.target.clone(), self.config.clone());
                // If the supervisor is gone when the start ends, the send fails and the
                // connection is dropped, which kills the process.
                let spawned = std::thread::Builder::new()
                    .name("drafter-respawn".to_string())
                    .spawn(move || {
                        let _ = tx.send(handshake::connect(&spec, &target, &config));
                    });
                match spawned {
                    Ok(_) => self.starting = Some(rx),
                    Err(e) => self.start_failed(&e.to_string()),
                }
                false
            }
            DrafterState::Starting => {
                let Some(rx) = &self.starting else {
                    return false;
                };
                match rx.try_recv() {
                    Ok(Ok(conn)) => {
                        info!(drafter = %conn.hello.name, pid = conn.child.pid(), "drafter restarted");
                        self.starting = None;
                        self.conn = Some(conn);
                        self.failed_starts = 0;
                        self.restarts += 1;
                        self.go(DrafterState::Ready);
                        true
                    }
                    Ok(Err(e)) => {
                        self.starting = None;
                        self.start_failed(&e.to_string());
                        false
                    }
                    Err(mpsc::TryRecvError::Empty) => false,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.starting = None;
                        self.start_failed("the respawn thread died");
                        false
                    }
                }
            }
            _ => false,
        }
    }

    fn start_failed(&mut self, reason: &str) {
        self.failed_starts += 1;
        if self.failed_starts >= self.config.max_failed_starts {
            error!(spec = ?self.spec, reason, "drafter failed to start {} times; giving up", self.failed_starts);
            self.go(DrafterState::Failed);
        } else {
            warn!(spec = ?self.spec, reason, "drafter failed to start");
            self.schedule();
            self.go(DrafterState::Backoff);
        }
    }

    fn schedule(&mut self) {
        let factor = 1u32 << self.failed_starts.min(16);
        let delay = (self.config.backoff_base * factor).min(self.config.backoff_max);
        self.retry_at = Instant::now() + delay;
    }

    /// The drafter died or keeps misbehaving: drop (kill) it and schedule a respawn.
    pub fn restart(&mut self, reason: &str) {
        if self.state != DrafterState::Ready {
            return;
        }
        warn!(spec = ?self.spec, reason, "drafter lost; respawning");
        if let Some(conn) = self.conn.take() {
            conn.abandon();
        }
        self.schedule();
        self.go(DrafterState::Backoff);
    }

    /// Stops the drafter for good.
    pub fn stop(&mut self) {
        self.conn = None;
        self.starting = None;
        self.go(DrafterState::Stopped);
    }
}
