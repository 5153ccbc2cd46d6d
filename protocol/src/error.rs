//! The protocol crate's error type.

use crate::version::Version;

/// A protocol failure: transport, handshake, version or shared-memory error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The ipc channel failed (the peer is gone, or a message did not decode).
    #[error("cannot {op}: ipc channel failed")]
    Transport {
        /// What was being done.
        op: &'static str,
        /// The channel's error.
        #[source]
        source: ipc_channel::IpcError,
    },
    /// An OS call failed.
    #[error("cannot {op}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A handshake payload (JSON) did not encode or decode.
    #[error("handshake payload `{what}` is not valid")]
    Handshake {
        /// Which payload.
        what: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The peers share no major version.
    #[error("no common protocol version: host speaks {host}, drafter speaks {drafter}")]
    VersionMismatch {
        /// Versions the host speaks.
        host: String,
        /// Versions the drafter speaks.
        drafter: String,
    },
    /// A message newer than the negotiated version was about to be sent.
    #[error("message `{message}` needs protocol {since} but {negotiated} was negotiated")]
    TooNew {
        /// The message kind.
        message: &'static str,
        /// The version that introduced it.
        since: Version,
        /// The version the peers agreed on.
        negotiated: Version,
    },
    /// The peer broke the protocol (unexpected message, unknown region, ...).
    #[error("protocol violation: {reason}")]
    Violation {
        /// What was wrong.
        reason: String,
    },
    /// A tensor view does not fit its region, or names the wrong region or dtype.
    #[error("bad tensor view: {reason}")]
    BadView {
        /// What was wrong.
        reason: String,
    },
    /// The tensor was overwritten while (or before) it was read: the reader must drop it.
    #[error("tensor at epoch {epoch} was overwritten (region valid from {valid_from})")]
    Torn {
        /// The view's epoch.
        epoch: u64,
        /// The oldest epoch still intact.
        valid_from: u64,
    },
    /// A tensor does not fit in the region at all.
    #[error("tensor of {bytes} bytes does not fit in a region of {capacity} bytes")]
    TooLarge {
        /// Size of the tensor.
        bytes: usize,
        /// Data capacity of the region.
        capacity: usize,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
