//! The draft vocabulary (EAGLE-3's `d2t` idea): the drafter computes logits for only the N ids
//! a target answers with most often. The list, its checks and the head restriction are shared
//! with the MTP drafter in [`specula_models::drafter_support::draft_vocab`]; this module puts
//! them in this crate's [`Error`].

use std::path::Path;

use specula_models::drafter_support::draft_vocab::{self as shared, VocabError};
use specula_models::layers::Linear;

pub use shared::{VocabChoice, FILE};

use crate::Error;

/// The draft ids to run for the weights in `dir` (`None`: the whole vocabulary): as
/// [`shared::resolve`].
///
/// # Errors
/// [`Error::Options`] when N ids are asked for and no list holds them; [`Error::Config`] for
/// a malformed list; [`Error::Io`] when it cannot be read.
pub fn resolve(dir: &Path, choice: VocabChoice, vocab: usize) -> Result<Option<Vec<u32>>, Error> {
    shared::resolve(dir, choice, vocab).map_err(|e| match e {
        VocabError::Io { path, source } => Error::Io { path, source },
        VocabError::Malformed { path, reason } => Error::Config { path, reason },
        other => Error::Options(other.to_string()),
    })
}

/// The projection restricted to output rows `ids`: as [`shared::select_rows`].
///
/// # Errors
/// [`Error::Forward`] for an id past the weight's rows or a weight off the CPU.
pub fn select_rows(linear: &Linear, ids: &[u32]) -> Result<Linear, Error> {
    shared::select_rows(linear, ids).map_err(|e| Error::Forward(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared errors keep this crate's kinds (the CLI and the tests match on them).
    #[test]
    fn shared_errors_map_to_this_crates_kinds() {
        let root = tempfile::tempdir().unwrap();
        let e = resolve(root.path(), VocabChoice::Top(4), 10).unwrap_err();
        assert!(matches!(e, Error::Options(_)), "{e}");
        std::fs::write(root.path().join(FILE), "{}").unwrap();
        let e = resolve(root.path(), VocabChoice::Shipped, 10).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
    }
}
