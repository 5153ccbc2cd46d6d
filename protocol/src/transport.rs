//! Bootstrap over `ipc-channel` and the version-checked sender.
//!
//! ```text
//! host                                       drafter (child process)
//! IpcOneShotServer::<Connect>::new() ─name─▶ env SPECULA_BOOTSTRAP
//!                                            channel::<HostMsg>() = (to_drafter, from_host)
//!        ◀── Connect { hello (JSON), to_drafter } ── IpcSender::<Connect>::connect(name)
//! accept(): the bootstrap connection becomes the drafter → host channel of DrafterMsg
//! ```

use ipc_channel::ipc::{self, IpcOneShotServer, IpcReceiver, IpcSender};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::version::Version;
use crate::wire::{Connect, DrafterMsg, HandshakeReply, Hello, HostMsg, Since};

/// The environment variable through which the host hands the bootstrap name to a drafter.
pub const BOOTSTRAP_ENV: &str = "SPECULA_BOOTSTRAP";

/// A sender that refuses to send a message newer than the negotiated version.
#[derive(Debug)]
pub struct Sender<T: Serialize> {
    tx: IpcSender<T>,
    version: Version,
}

impl<T: Serialize + Since> Sender<T> {
    /// Wraps a raw sender; `version` is the negotiated one.
    pub fn new(tx: IpcSender<T>, version: Version) -> Self {
        Sender { tx, version }
    }

    /// The negotiated version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Sends `msg` when the peer understands it.
    ///
    /// # Errors
    /// [`Error::TooNew`] when `msg` came after the negotiated version (nothing is sent);
    /// [`Error::Transport`] when the peer is gone.
    pub fn send(&self, msg: T) -> Result<()> {
        check(&msg, self.version)?;
        self.tx.send(msg).map_err(|source| Error::Transport {
            op: "send a message",
            source,
        })
    }
}

/// Checks that a peer at `negotiated` can decode `msg`.
///
/// # Errors
/// [`Error::TooNew`] when `msg` needs a newer minor, or another major, than `negotiated`.
pub fn check(msg: &impl Since, negotiated: Version) -> Result<()> {
    let since = msg.since();
    if since.major != negotiated.major || since.minor > negotiated.minor {
        return Err(Error::TooNew {
            message: msg.kind(),
            since,
            negotiated,
        });
    }
    Ok(())
}

fn to_json(what: &'static str, value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|source| Error::Handshake { what, source })
}

fn from_json<T: serde::de::DeserializeOwned>(what: &'static str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|source| Error::Handshake { what, source })
}

/// The host's end of a bootstrap: create, hand `name()` to the child, then [`Bootstrap::accept`].
pub struct Bootstrap {
    server: IpcOneShotServer<Connect>,
    name: String,
}

impl Bootstrap {
    /// Creates the one-shot server (a Unix socket in a fresh temporary folder).
    ///
    /// # Errors
    /// [`Error::Io`] when the socket cannot be created.
    pub fn new() -> Result<Self> {
        let (server, name) = IpcOneShotServer::new().map_err(|source| Error::Io {
            op: "create the bootstrap socket",
            source,
        })?;
        Ok(Bootstrap { server, name })
    }

    /// The name a drafter connects to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits (without deadline) for the drafter's [`Connect`]; returns its [`Hello`], the channel
    /// to it and the channel from it. Run it on a helper thread to impose a deadline; connecting to
    /// [`Bootstrap::name`] and disconnecting unblocks it.
    ///
    /// # Errors
    /// [`Error::Transport`] when the drafter hung up; [`Error::Handshake`] on a bad Hello.
    pub fn accept(self) -> Result<Accepted> {
        let (rx, connect) = self.server.accept().map_err(|source| Error::Transport {
            op: "accept the drafter's connection",
            source,
        })?;
        let hello = from_json("Hello", &connect.hello)?;
        Ok(Accepted {
            hello,
            to_drafter: connect.to_drafter,
            // The bootstrap connection carries every later drafter → host message.
            from_drafter: rx.to_opaque().to(),
        })
    }
}

/// A drafter that connected, before the handshake reply.
#[derive(Debug)]
pub struct Accepted {
    /// What the drafter said.
    pub hello: Hello,
    /// Host → drafter.
    pub to_drafter: IpcSender<HostMsg>,
    /// Drafter → host.
    pub from_drafter: IpcReceiver<DrafterMsg>,
}

impl Accepted {
    /// Sends the handshake reply (the one message every version can read).
    ///
    /// # Errors
    /// [`Error::Transport`] when the drafter is gone.
    pub fn reply(&self, reply: &HandshakeReply) -> Result<()> {
        let json = to_json("HandshakeReply", reply)?;
        self.to_drafter
            .send(HostMsg::Handshake(json))
            .map_err(|source| Error::Transport {
                op: "send the handshake reply",
                source,
            })
    }
}

/// The drafter's end after connecting: the raw channels and the host's handshake reply.
#[derive(Debug)]
pub struct Connected {
    /// The host's reply to the Hello.
    pub reply: HandshakeReply,
    /// Drafter → host (raw: wrap it in a [`Sender`] once the version is known).
    pub to_host: IpcSender<DrafterMsg>,
    /// Host → drafter.
    pub from_host: IpcReceiver<HostMsg>,
}

/// Connects to the host's bootstrap `name`, sends `hello` and waits for the handshake reply.
///
/// # Errors
/// [`Error::Io`] when the host's socket is not there; [`Error::Transport`] when the host hung up;
/// [`Error::Violation`] when the first message is not the handshake reply.
pub fn connect(name: &str, hello: &Hello) -> Result<Connected> {
    let (to_drafter, from_host) = ipc::channel::<HostMsg>().map_err(|source| Error::Io {
        op: "create the host → drafter channel",
        source,
    })?;
    let bootstrap =
        IpcSender::<Connect>::connect(name.to_string()).map_err(|source| Error::Io {
            op: "connect to the host's bootstrap socket",
            source,
        })?;
    let connect = Connect {
        hello: to_json("Hello", hello)?,
        to_drafter,
    };
    bootstrap.send(connect).map_err(|source| Error::Transport {
        op: "send Hello",
        source,
    })?;
    let to_host: IpcSender<DrafterMsg> = bootstrap.to_opaque().to();
    let first = from_host.recv().map_err(|source| Error::Transport {
        op: "receive the handshake reply",
        source,
    })?;
    let HostMsg::Handshake(json) = first else {
        return Err(Error::Violation {
            reason: format!("expected the handshake reply, got {first:?}"),
        });
    };
    Ok(Connected {
        reply: from_json("HandshakeReply", &json)?,
        to_host,
        from_host,
    })
}
