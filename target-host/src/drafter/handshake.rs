//! Spawning a drafter and shaking hands with it, under a deadline.
//!
//! ```text
//! host                                   drafter
//! spawn (env SPECULA_BOOTSTRAP=name)
//!          ◀── Connect { Hello, sender }
//! negotiate: no shared major → Refused { both versions }, error
//! Welcome { version, TargetInfo } ──▶    accept_target? no → Goodbye { reason }
//!          ◀── Capabilities (≥ 1.1, when the Hello set late_capabilities; replace the Hello's)
//! MapRegion (when it wants taps) ──▶
//! MapDoorbell (≥ 1.3, when offered) ──▶  from here on: the rings (see below)
//! Draft { rows: [] } (seq 0)     ──▶     (an empty draft is a ping)
//!          ◀── Drafted { seq 0 }         ready
//! ```
//!
//! With a doorbell ([`specula_protocol::doorbell`]) every later request is a frame in the
//! host → drafter ring, except those that carry a file descriptor or do not fit a frame: they
//! take the socket, announced by an empty frame. Replies come in the other ring; the socket
//! still carries a `Goodbye` and tells when the drafter is gone.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use ipc_channel::ipc::{IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};
use specula_protocol::doorbell::{decode, encode, Doorbell, Frame};
use specula_protocol::shm::ShmWriter;
use specula_protocol::transport::{check, Accepted, Bootstrap, Sender};
use specula_protocol::version::{self, Version, PROTOCOL_VERSION};
use specula_protocol::wire::{
    Capabilities, Draft, DrafterMsg, HandshakeReply, Hello, HostMsg, MapDoorbell, MapRegion,
    Request, Seq, TargetInfo, Welcome,
};
use tracing::info;

use super::process::{ChildGuard, DrafterSpec};
use super::{ClientConfig, DrafterError};

/// A drafter that completed the handshake.
#[derive(Debug)]
pub struct Connection {
    /// The process (killed when the connection is dropped).
    pub child: ChildGuard,
    /// What the drafter said about itself.
    pub hello: Hello,
    /// Host → drafter, checked against the negotiated version.
    pub tx: Sender<HostMsg>,
    /// Drafter → host.
    pub rx: IpcReceiver<DrafterMsg>,
    /// Where taps are written, when the drafter wants any.
    pub region: Option<ShmWriter>,
    /// The next request's sequence number.
    pub next_seq: Seq,
    /// The doorbell the session messages travel through, once mapped (1.3).
    bell: Option<Doorbell>,
    /// Whether dropping asks the drafter to shut down before killing it.
    polite: bool,
}

/// The version that brought the doorbell.
const DOORBELL: Version = Version { major: 1, minor: 3 };

/// Bytes of each doorbell ring: thousands of small messages; a sampled reply (q rows) or a long
/// prompt that does not fit half of it takes the socket.
const RING_BYTES: usize = 1 << 20;

/// How long a request waits for room in a full ring (a drafter that stopped reading) before the
/// send fails and the drafter is restarted.
const RING_FULL: Duration = Duration::from_millis(200);

/// How often a host waiting on the ring looks at the socket (a `Goodbye`, a dead drafter).
const SOCKET_LOOK: Duration = Duration::from_millis(2);

impl Connection {
    /// Sends a request and returns its sequence number.
    ///
    /// # Errors
    /// [`DrafterError::Protocol`] when the drafter is gone (or the message is too new for it).
    pub fn send(&mut self, request: Request) -> Result<Seq, DrafterError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let err = |source| DrafterError::Protocol {
            op: "send a request",
            source,
        };
        let msg = HostMsg::Request { seq, request };
        let Some(bell) = &self.bell else {
            self.tx.send(msg).map_err(err)?;
            return Ok(seq);
        };
        check(&msg, self.tx.version()).map_err(err)?;
        let frame = match &msg {
            HostMsg::Request { request, .. } if request.carries_fd() => None,
            _ => Some(encode(&msg).map_err(err)?),
        };
        match frame.filter(|f| f.len() <= bell.max_frame()) {
            Some(frame) => bell.send(&frame, RING_FULL).map_err(err)?,
            None => {
                self.tx.send(msg).map_err(err)?;
                bell.send(&[], RING_FULL).map_err(err)?;
            }
        }
        Ok(seq)
    }

    /// Whether the session messages travel through a doorbell.
    pub fn has_doorbell(&self) -> bool {
        self.bell.is_some()
    }

    /// Waits up to `left` for the drafter's next message (the doorbell's ring, else the socket).
    ///
    /// # Errors
    /// `Empty` when nothing came in time; an `IpcError` when the drafter is gone or broke the
    /// ring.
    pub fn try_recv_timeout(&self, left: Duration) -> Result<DrafterMsg, TryRecvError> {
        let Some(bell) = &self.bell else {
            return match left.is_zero() {
                true => self.rx.try_recv(),
                false => self.rx.try_recv_timeout(left),
            };
        };
        let broken = |reason: String| {
            let io = std::io::Error::new(std::io::ErrorKind::InvalidData, reason);
            TryRecvError::IpcError(IpcError::Io(io))
        };
        let until = Instant::now() + left;
        loop {
            let slice = until.saturating_duration_since(Instant::now());
            match bell.recv(slice.min(SOCKET_LOOK)) {
                Ok(Some(Frame::Message(bytes))) => {
                    return decode(&bytes).map_err(|e| broken(e.to_string()))
                }
                // Sent before its frame: already there.
                Ok(Some(Frame::OnSocket)) => {
                    return self.rx.try_recv_timeout(left.max(SOCKET_LOOK))
                }
                Ok(None) => {}
                Err(e) => return Err(broken(e.to_string())),
            }
            match self.rx.try_recv() {
                Err(TryRecvError::Empty) if Instant::now() < until => {}
                other => return other,
            }
        }
    }

    /// Moves the session messages onto a doorbell whose sides poll for `spin` before sleeping.
    fn map_doorbell(&mut self, spin: Duration) -> Result<(), DrafterError> {
        let err = |source| DrafterError::Protocol {
            op: "map the doorbell",
            source,
        };
        let bell = Doorbell::host(RING_BYTES, spin).map_err(err)?;
        let map = MapDoorbell {
            shm: bell.handle(),
            spin_us: spin.as_micros().min(u32::MAX as u128) as u32,
        };
        self.send(Request::MapDoorbell(map))?;
        self.bell = Some(bell);
        Ok(())
    }
}

impl Connection {
    /// Drops the connection and kills the drafter at once (it is misbehaving or stuck: waiting
    /// for a polite shutdown would stall the verify loop).
    pub fn abandon(mut self) {
        self.polite = false;
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Ask politely first; the ChildGuard kills whatever is left.
        if self.polite && self.send(Request::Shutdown).is_ok() {
            self.child.wait_for(Duration::from_millis(100));
        }
    }
}

/// Spawns the drafter and shakes hands within `config.handshake_timeout`.
///
/// # Errors
/// Every way a drafter can fail to start, each with its own [`DrafterError`] variant.
pub fn connect(
    spec: &DrafterSpec,
    target: &TargetInfo,
    config: &ClientConfig,
) -> Result<Connection, DrafterError> {
    let path = spec.resolve()?;
    let until = Instant::now() + config.handshake_timeout;
    let bootstrap = Bootstrap::new().map_err(|source| DrafterError::Protocol {
        op: "create the bootstrap socket",
        source,
    })?;
    let name = bootstrap.name().to_string();
    let mut child = ChildGuard::spawn(&path, &spec.args, &name)?;
    let accepted = accept(bootstrap, &name, &mut child, until, config)?;
    let hello = accepted.hello.clone();
    let Some(version) = version::negotiate(&[PROTOCOL_VERSION], &hello.versions) else {
        let err = DrafterError::VersionMismatch {
            drafter: hello.name.clone(),
            host: PROTOCOL_VERSION.to_string(),
            theirs: version::list(&hello.versions),
        };
        refuse(&accepted, &err);
        return Err(err);
    };
    // A drafter with late capabilities may announce placeholders in its Hello; its real ones are
    // checked when they come.
    let early = match hello.late_capabilities && version >= LATE_CAPABILITIES {
        true => Ok(()),
        false => check_capabilities(&hello.capabilities, target),
    };
    if let Err(reason) = early {
        let err = DrafterError::BadCapabilities {
            drafter: hello.name.clone(),
            reason,
        };
        refuse(&accepted, &err);
        return Err(err);
    }
    let welcome = HandshakeReply::Welcome(Welcome {
        version,
        target: target.clone(),
    });
    accepted
        .reply(&welcome)
        .map_err(|source| DrafterError::Protocol {
            op: "send Welcome",
            source,
        })?;
    let mut hello = hello;
    if hello.late_capabilities && version >= LATE_CAPABILITIES {
        let caps = late_capabilities(&accepted, &mut child, &hello.name, until, config)?;
        check_capabilities(&caps, target).map_err(|reason| DrafterError::BadCapabilities {
            drafter: hello.name.clone(),
            reason,
        })?;
        hello.capabilities = caps;
    }
    let region = match hello.capabilities.wants_activations() {
        true => Some(ShmWriter::new(0, config.region_bytes).map_err(|source| {
            DrafterError::Protocol {
                op: "create the shared-memory region",
                source,
            }
        })?),
        false => None,
    };
    let mut conn = Connection {
        child,
        hello,
        tx: Sender::new(accepted.to_drafter, version),
        rx: accepted.from_drafter,
        region,
        next_seq: 0,
        bell: None,
        polite: true,
    };
    if let Some(region) = &conn.region {
        let map = MapRegion {
            region: region.id(),
            shm: region.handle(),
        };
        if let Err(e) = conn.send(Request::MapRegion(map)) {
            return Err(goodbye_or(&conn, e));
        }
    }
    if let Some(spin) = config.doorbell_spin {
        if conn.hello.doorbell && version >= DOORBELL {
            if let Err(e) = conn.map_doorbell(spin) {
                return Err(goodbye_or(&conn, e));
            }
        }
    }
    // Through the doorbell, when there is one: it works before the drafter counts as ready.
    ping(&mut conn, until, config)?;
    info!(
        drafter = %conn.hello.name,
        pid = conn.child.pid(),
        %version,
        doorbell = conn.has_doorbell(),
        max_draft_len = conn.hello.capabilities.max_draft_len,
        prefill = ?conn.hello.capabilities.prefill,
        "drafter ready"
    );
    Ok(conn)
}

fn refuse(accepted: &Accepted, err: &DrafterError) {
    let reply = HandshakeReply::Refused {
        reason: err.to_string(),
    };
    // The drafter may be gone already; the error is reported to our caller either way.
    let _ = accepted.reply(&reply);
}

/// The version that brought `DrafterMsg::Capabilities`.
const LATE_CAPABILITIES: Version = Version { major: 1, minor: 1 };

/// Waits (until the handshake deadline) for the capabilities a drafter states after `Welcome`.
fn late_capabilities(
    accepted: &Accepted,
    child: &mut ChildGuard,
    name: &str,
    until: Instant,
    config: &ClientConfig,
) -> Result<Capabilities, DrafterError> {
    let left = until.saturating_duration_since(Instant::now());
    match accepted.from_drafter.try_recv_timeout(left) {
        Ok(DrafterMsg::Capabilities(caps)) => Ok(caps),
        Ok(DrafterMsg::Goodbye { reason }) => Err(DrafterError::Refused {
            drafter: name.to_string(),
            reason,
        }),
        Ok(DrafterMsg::Reply { seq, .. }) => Err(DrafterError::BadCapabilities {
            drafter: name.to_string(),
            reason: format!("a reply (seq {seq}) before its capabilities"),
        }),
        Err(TryRecvError::Empty) => Err(DrafterError::HandshakeTimeout {
            path: child.path().to_path_buf(),
            after: config.handshake_timeout,
        }),
        Err(TryRecvError::IpcError(_)) => {
            let status = child.wait_for(Duration::from_millis(200));
            let status = status.map_or("still running".to_string(), |s| s.to_string());
            Err(exited(child, status))
        }
    }
}

fn check_capabilities(caps: &Capabilities, target: &TargetInfo) -> Result<(), String> {
    if caps.max_draft_len == 0 {
        return Err("max_draft_len is 0".to_string());
    }
    let layers = caps.tap_layers.iter().chain(&caps.kv_layers);
    if let Some(l) = layers.into_iter().find(|&&l| l >= target.num_layers) {
        return Err(format!(
            "asks for layer {l}, the target has {} layers",
            target.num_layers
        ));
    }
    Ok(())
}

/// Accepts the drafter's connection on a helper thread, watching the child and the deadline.
fn accept(
    bootstrap: Bootstrap,
    name: &str,
    child: &mut ChildGuard,
    until: Instant,
    config: &ClientConfig,
) -> Result<Accepted, DrafterError> {
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("drafter-accept".to_string())
        .spawn(move || {
            let _ = done_tx.send(bootstrap.accept());
        })
        .map_err(|source| DrafterError::Spawn {
            path: child.path().to_path_buf(),
            source,
        })?;
    // Unblocks the helper if it still waits for a connection: connect, then hang up. (If the
    // child connected and went silent, killing the child unblocks it.)
    let fail = |err: DrafterError| {
        let _ = IpcSender::<()>::connect(name.to_string());
        Err(err)
    };
    loop {
        match done_rx.recv_timeout(Duration::from_millis(5)) {
            Ok(Ok(accepted)) => return Ok(accepted),
            Ok(Err(source)) => {
                let status = child.wait_for(Duration::from_millis(200));
                return match status {
                    Some(status) => Err(exited(child, status.to_string())),
                    None => Err(DrafterError::Protocol {
                        op: "accept the drafter's Hello",
                        source,
                    }),
                };
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                unreachable!("invariant: the accept thread always sends")
            }
        }
        if let Some(status) = child.try_wait() {
            // It may have connected just before exiting: give the helper one last look.
            if let Ok(Ok(accepted)) = done_rx.recv_timeout(Duration::from_millis(20)) {
                return Ok(accepted);
            }
            let err = exited(child, status.to_string());
            return fail(err);
        }
        if Instant::now() >= until {
            let err = DrafterError::HandshakeTimeout {
                path: child.path().to_path_buf(),
                after: config.handshake_timeout,
            };
            return fail(err);
        }
    }
}

fn exited(child: &mut ChildGuard, status: String) -> DrafterError {
    DrafterError::ExitedDuringHandshake {
        path: child.path().to_path_buf(),
        status,
        stderr: child.stderr_tail(),
    }
}

/// A send failed because the drafter is gone: its `Goodbye`, when it said one before leaving,
/// explains why better than the broken channel does.
fn goodbye_or(conn: &Connection, err: DrafterError) -> DrafterError {
    match conn.rx.try_recv_timeout(Duration::from_millis(100)) {
        Ok(DrafterMsg::Goodbye { reason }) => DrafterError::Refused {
            drafter: conn.hello.name.clone(),
            reason,
        },
        _ => err,
    }
}

/// Sends an empty draft and waits for its reply: the drafter accepted the target and serves.
fn ping(conn: &mut Connection, until: Instant, config: &ClientConfig) -> Result<(), DrafterError> {
    let seq = match conn.send(Request::Draft(Draft { rows: Vec::new() })) {
        Ok(seq) => seq,
        Err(e) => return Err(goodbye_or(conn, e)),
    };
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match conn.try_recv_timeout(left) {
            Ok(DrafterMsg::Reply { seq: got, .. }) if got == seq => return Ok(()),
            Ok(DrafterMsg::Reply { .. }) => continue,
            Ok(DrafterMsg::Goodbye { reason }) => {
                return Err(DrafterError::Refused {
                    drafter: conn.hello.name.clone(),
                    reason,
                })
            }
            Ok(DrafterMsg::Capabilities(_)) => {
                return Err(DrafterError::BadCapabilities {
                    drafter: conn.hello.name.clone(),
                    reason: "capabilities sent without late_capabilities in its Hello".into(),
                })
            }
            Err(TryRecvError::Empty) => {
                return Err(DrafterError::HandshakeTimeout {
                    path: conn.child.path().to_path_buf(),
                    after: config.handshake_timeout,
                })
            }
            Err(TryRecvError::IpcError(_)) => {
                let status = conn.child.wait_for(Duration::from_millis(200));
                let status = status.map_or("still running".to_string(), |s| s.to_string());
                return Err(exited(&mut conn.child, status));
            }
        }
    }
}
