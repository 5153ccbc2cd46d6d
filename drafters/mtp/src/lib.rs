//! Specula's native MTP drafter: the multi-token-prediction module that DeepSeek-V3, GLM-4.5/5,
//! Qwen3-Next/Qwen3.5 and MiMo ship inside their checkpoints (and the heads Specula trains in
//! the DeepSeek layout), run as a drafter process over the target's verified hiddens.
//!
//! One MTP step fuses the target's post-final-norm hidden `h_p` with the embedding of the next
//! token `t_{p+1}`, runs one decoder block (its own KV cache) at position `p`, and predicts
//! `t_{p+2}` with the target's lm_head (DeepSeek: `shared_head.head` when present). After each
//! verify the cache rows of the verified window are rebuilt from the target's hiddens; deeper
//! drafts feed the block's output back as the next `h` (see [`model`] for each layout's rule).
//!
//! References read for the port (vLLM, `vllm-project/vllm`):
//! `vllm/model_executor/models/deepseek_mtp.py` @ 03356f8c, `qwen3_next_mtp.py` @ 055e47c2,
//! `mimo_mtp.py` @ 0bb55d60, and the proposer that drives them, `vllm/v1/spec_decode/eagle.py`
//! (`EagleProposer.propose`) @ f7eef1b6, whose positions this drafter follows.
//!
//! Modules: [`config`] (layout detection from `config.json` and tensor names, refusals),
//! [`model`] (fusion, block, norms, head, the per-layer KV cache), [`state`] (one session:
//! rebuild and recursion), [`weights`] (where the MTP tensors come from), [`drafter`] (the
//! SDK's `Drafter`) and [`feed`] (replaying a sequence into a drafter as the host does).

pub mod config;
pub mod drafter;
pub mod feed;
pub mod model;
pub mod state;
pub mod weights;

use std::path::PathBuf;

pub use config::{Layout, MtpConfig, Recycle};
pub use drafter::{MtpDrafter, Options};
pub use model::{LinearDType, Mtp};
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
    /// The `config.json` is malformed or describes what is not implemented.
    #[error("MTP config {}: {reason}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The MTP tensors are missing, misshapen, or of a block this drafter cannot run.
    #[error("MTP weights {}: {reason}", path.display())]
    Weights {
        /// The checkpoint.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No MTP module was found for this target.
    #[error(
        "no MTP weights for target {target}: none in its own checkpoint, none under {}; \
         pass --weights DIR",
        root.display()
    )]
    NoWeights {
        /// The target, described.
        target: String,
        /// Where shipped weights were looked for.
        root: PathBuf,
    },
    /// The weights do not fit the target.
    #[error("{0}")]
    Target(String),
    /// A bad command-line option.
    #[error("{0}")]
    Options(String),
    /// The draft vocabulary cannot be used.
    #[error(transparent)]
    Vocab(#[from] specula_models::drafter_support::draft_vocab::VocabError),
    /// A forward failed.
    #[error("MTP forward failed: {0}")]
    Forward(String),
}

/// A forward error, as text (candle's and the runtime's errors carry no path).
pub(crate) fn fwd(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}
