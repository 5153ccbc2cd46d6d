//! Specula's DFlash and DSpark drafters, one process: a block drafter fed by the target's hidden
//! taps proposes a whole block per forward.
//!
//! - DFlash: z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036),
//!   reference `dflash==0.1.0` (`dflash/model.py`).
//! - DSpark: DeepSeek-AI × PKU, "Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
//!   Generation" (arXiv 2607.05147), reference deepseek-ai/DeepSpec (`deepspec/modeling/dspark`,
//!   `deepspec/eval/dspark/draft_ops.py`).
//!
//! Modules: [`calibration`] (confidences for drafts without a confidence head), [`config`] (the references' `config.json`), [`tensors`] (the drafter's own file),
//! [`model`] (the shared backbone and its context cache), [`heads`] (DSpark's Markov and
//! confidence heads), [`sampling`], [`vocab`] (the draft vocabulary), [`weights`] (finding the
//! weights for a target) and [`drafter`] (sessions and the SDK's `Drafter`).

pub mod calibration;
pub mod config;
pub mod device;
pub mod drafter;
pub mod heads;
pub mod model;
pub mod sampling;
pub mod tensors;
pub mod vocab;
pub mod weights;

use std::path::PathBuf;

pub use device::DeviceChoice;
pub use drafter::{Block, DFlash, Options};
pub use tensors::LinearDType;
pub use vocab::VocabChoice;
pub use weights::WeightsSource;

/// Why the drafter cannot load or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The drafter's `config.json` is malformed or asks for what is not implemented.
    #[error("drafter config {}: {reason}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The drafter's tensors are missing or misshapen.
    #[error("drafter weights {}: {reason}", path.display())]
    Weights {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No weights are shipped for this target.
    #[error("no {kind} weights for target {target} under {}; pass --weights DIR", root.display())]
    NoWeights {
        /// `dflash` or `dspark`.
        kind: String,
        /// The target, described.
        target: String,
        /// Where it looked.
        root: PathBuf,
    },
    /// The weights do not fit the target.
    #[error("{0}")]
    Target(String),
    /// A bad command-line option.
    #[error("{0}")]
    Options(String),
    /// A forward failed.
    #[error("drafter forward failed: {0}")]
    Forward(String),
}
