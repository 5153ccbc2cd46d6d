//! Specula's drafter protocol: wire types, version negotiation, shared-memory tensor views and the
//! drafter SDK.
//!
//! # Design: draft, then commit
//!
//! Every drafter is its own process. The target host owns the truth (target model, KV cache,
//! sampler); a drafter only ever *suggests* tokens, so a drafter can change speed, never output.
//! Per session the host sends `Open` (the prompt), then repeats `Draft` → `Drafted` (the only
//! request with a reply) and `Commit` (what the target accepted, plus the target's own token), and
//! ends with `Close`. Large tensors (hidden-state taps, K/V rows) never travel on the channel: the
//! host writes them into a shared-memory region ([`shm`]) and the messages carry [`shm::TensorView`]s.
//!
//! The design follows speculative decoding as in Leviathan et al. (2023,
//! <https://arxiv.org/abs/2211.17192>) and prompt-lookup decoding as in vLLM's `ngram` proposer.
//!
//! # Modules
//! - [`version`]: [`Version`], [`PROTOCOL_VERSION`] and negotiation.
//! - [`wire`]: every message that crosses the process boundary.
//! - [`shm`]: the host-written, drafter-read shared-memory ring of tensors.
//! - [`donor`]: K/V donor views (1.2): the host's KV pool blocks, mapped read-only.
//! - [`doorbell`]: session messages through shared-memory rings and a futex (1.3).
//! - [`transport`]: bootstrap over `ipc-channel` and the version-checked sender.
//! - [`sdk`]: the [`sdk::Drafter`] trait and [`sdk::serve`], which is all a third-party drafter needs.
//!
//! See `protocol/README.md` for the state machine, the versioning rules and a sequence diagram.
#![deny(missing_docs)]

pub mod donor;
pub mod doorbell;
pub mod error;
pub mod sdk;
pub mod shm;
pub mod transport;
pub mod version;
pub mod wire;

pub use error::{Error, Result};
pub use version::{Version, PROTOCOL_VERSION};
