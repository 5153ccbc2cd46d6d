//! The draft vocabulary (EAGLE-3's `d2t` idea), shared by the drafters that compute logits
//! over the target's vocabulary (DFlash/DSpark, MTP): the drafter computes logits for only the
//! N ids a target answers with most often, so its lm_head reads N rows instead of the whole
//! vocabulary (SmolLM2: 8192 of 49152 rows cover 97.7 % of its self-distilled answer tokens).
//!
//! Exactness does not depend on the subset: greedy drafts are the subset's argmax (the target
//! verifies them like any others), and sampled drafts come with `q` rows that are the
//! distribution actually sampled from, zero outside the subset ([`DraftVocab::scatter`]), so
//! the host's rejection sampler still yields exactly the target's distribution.
//!
//! The list ships next to the drafter weights as `draft_vocab.json` (the weights folder, or the
//! target's folder above it, shared by every kind), made by `drafters/dflash/scripts/
//! draft_vocab.py` from the training answers:
//!
//! ```text
//! {"format": "specula-draft-vocab/1", "vocab_size": 49152, "ids": [198, 253, 28, ...], ...}
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use serde::Deserialize;

use crate::layers::linear::Weight;
use crate::layers::Linear;

/// The file name looked up next to the weights.
pub const FILE: &str = "draft_vocab.json";

/// Why a draft vocabulary cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VocabError {
    /// The list could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The list is malformed or made for another vocabulary.
    #[error("draft vocabulary {}: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// What was asked for (`--draft-vocab N`) is not there.
    #[error("{0}")]
    Unavailable(String),
}

/// Which draft vocabulary to run (`--draft-vocab`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VocabChoice {
    /// The whole target vocabulary (the references' numerics).
    #[default]
    Full,
    /// Every id of the shipped list when there is one, else the whole vocabulary.
    Shipped,
    /// The first N ids of the shipped list (which must exist and hold at least N).
    Top(usize),
}

impl std::str::FromStr for VocabChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "full" => Ok(VocabChoice::Full),
            "shipped" => Ok(VocabChoice::Shipped),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(VocabChoice::Top(n)),
                _ => Err(format!(
                    "--draft-vocab must be off, shipped or a positive count, got {s:?}"
                )),
            },
        }
    }
}

#[derive(Deserialize)]
struct File {
    format: String,
    vocab_size: usize,
    ids: Vec<u32>,
}

/// Where `draft_vocab.json` is for the weights in `dir`: the folder itself, else its parent.
fn locate(dir: &Path) -> Option<PathBuf> {
    [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join(FILE))
        .find(|p| p.is_file())
}

/// The draft ids to run for the weights in `dir` (`None`: the whole vocabulary).
///
/// # Errors
/// [`VocabError::Unavailable`] when N ids are asked for and no list holds them;
/// [`VocabError::Malformed`] for a malformed list (unknown format, another vocabulary size, ids
/// out of range or repeated); [`VocabError::Io`] when it cannot be read.
pub fn resolve(
    dir: &Path,
    choice: VocabChoice,
    vocab: usize,
) -> Result<Option<Vec<u32>>, VocabError> {
    let path = match (choice, locate(dir)) {
        (VocabChoice::Full, _) | (VocabChoice::Shipped, None) => return Ok(None),
        (VocabChoice::Top(n), None) => {
            return Err(VocabError::Unavailable(format!(
                "--draft-vocab {n}: no {FILE} in {} or its parent (use --draft-vocab off)",
                dir.display()
            )))
        }
        (_, Some(p)) => p,
    };
    let bad = |reason: String| VocabError::Malformed {
        path: path.clone(),
        reason,
    };
    let text = std::fs::read_to_string(&path).map_err(|source| VocabError::Io {
        path: path.clone(),
        source,
    })?;
    let file: File = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if file.format != "specula-draft-vocab/1" {
        return Err(bad(format!("unknown format {:?}", file.format)));
    }
    if file.vocab_size != vocab {
        return Err(bad(format!(
            "made for a vocabulary of {}, the target's is {vocab}",
            file.vocab_size
        )));
    }
    let mut seen = vec![false; vocab];
    for &id in &file.ids {
        match seen.get_mut(id as usize) {
            None => return Err(bad(format!("id {id} is outside the vocabulary"))),
            Some(true) => return Err(bad(format!("id {id} is listed twice"))),
            Some(s) => *s = true,
        }
    }
    let mut ids = file.ids;
    if let VocabChoice::Top(n) = choice {
        if n > ids.len() {
            return Err(VocabError::Unavailable(format!(
                "--draft-vocab {n}: {} lists only {} ids",
                path.display(),
                ids.len()
            )));
        }
        ids.truncate(n);
    }
    if ids.is_empty() {
        return Err(bad("the id list is empty".into()));
    }
    Ok(Some(ids))
}

/// The projection restricted to output rows `ids` (row `i` of the result is row `ids[i]`),
/// kept in the weight's own storage: packed quantized lanes are copied out bit for bit, never
/// dequantized. A bias-free projection on the CPU (the lm_heads and Markov heads this is used
/// for).
///
/// # Errors
/// For an id past the weight's rows or a weight off the CPU.
pub fn select_rows(linear: &Linear, ids: &[u32]) -> crate::Result<Linear> {
    match linear.weight() {
        Weight::Dense(w) => {
            let index = Tensor::new(ids, w.device())?;
            let sub = w.index_select(&index, 0)?;
            Linear::dense(sub, None)
        }
        Weight::Quantized(q) => Linear::from_qweight(Arc::new(q.select_rows(ids)?), None),
        Weight::Device(_) => Err(crate::Error::InvalidRequest {
            op: "draft vocabulary",
            reason: "a draft vocabulary needs the weights on the CPU".into(),
        }),
    }
}

/// A draft vocabulary in use: draft-head row → target id, and back to the whole vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftVocab {
    ids: Vec<u32>,
    vocab: usize,
}

impl DraftVocab {
    /// The draft ids `ids` (as [`resolve`] returns them) of a `vocab`-id target.
    ///
    /// # Errors
    /// [`VocabError::Unavailable`] for an empty list or an id outside the vocabulary.
    pub fn new(ids: Vec<u32>, vocab: usize) -> Result<Self, VocabError> {
        if ids.is_empty() {
            return Err(VocabError::Unavailable("an empty draft vocabulary".into()));
        }
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(VocabError::Unavailable(format!(
                "draft id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(DraftVocab { ids, vocab })
    }

    /// Draft ids, in draft-head row order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Rows of the draft head.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Never: a draft vocabulary holds at least one id.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The target id of draft-head row `row`.
    pub fn id(&self, row: u32) -> u32 {
        self.ids[row as usize]
    }

    /// A distribution over the draft head's rows as one over the whole vocabulary (zero
    /// outside the draft vocabulary): what the host's rejection sampler needs.
    pub fn scatter(&self, dist: &[f32]) -> Vec<f32> {
        let mut full = vec![0.0; self.vocab];
        for (&id, &p) in self.ids.iter().zip(dist) {
            full[id as usize] = p;
        }
        full
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::Device;
    use serde_json::json;

    use super::*;

    fn random(n: usize, k: usize) -> Tensor {
        let data: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        Tensor::from_vec(data, (n, k), &Device::Cpu).unwrap()
    }

    /// The restricted head's outputs are the full head's columns at `ids`, bit for bit, for a
    /// dense and a GGUF-block weight.
    #[test]
    fn selected_rows_compute_the_same_logits_as_the_full_head() {
        let w = random(96, 64);
        let xs = random(3, 64);
        let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap());
        let ids = [95u32, 0, 17, 40];
        for full in [
            Linear::dense(w.clone(), None).unwrap(),
            Linear::quantized(q, None).unwrap(),
        ] {
            let sub = select_rows(&full, &ids).unwrap();
            let all: Vec<Vec<f32>> = full.forward(&xs).unwrap().to_vec2().unwrap();
            let got: Vec<Vec<f32>> = sub.forward(&xs).unwrap().to_vec2().unwrap();
            for (r, row) in got.iter().enumerate() {
                let want: Vec<f32> = ids.iter().map(|&i| all[r][i as usize]).collect();
                assert_eq!(row, &want, "row {r}");
            }
        }
        let full = Linear::dense(w, None).unwrap();
        assert!(select_rows(&full, &[96]).is_err());
    }

    fn write(dir: &Path, value: serde_json::Value) {
        std::fs::write(dir.join(FILE), value.to_string()).unwrap();
    }

    #[test]
    fn the_list_is_found_next_to_or_above_the_weights_and_checked() {
        let root = tempfile::tempdir().unwrap();
        let weights = root.path().join("dflash");
        std::fs::create_dir_all(&weights).unwrap();
        // No list: shipped means the full vocabulary; a count is an error that says why.
        assert_eq!(resolve(&weights, VocabChoice::Shipped, 10).unwrap(), None);
        let e = resolve(&weights, VocabChoice::Top(4), 10).unwrap_err();
        assert!(e.to_string().contains("no draft_vocab.json"), "{e}");
        let ok = json!({"format": "specula-draft-vocab/1", "vocab_size": 10, "ids": [3, 1, 7]});
        write(root.path(), ok);
        let ids = resolve(&weights, VocabChoice::Shipped, 10).unwrap();
        assert_eq!(ids, Some(vec![3, 1, 7]));
        assert_eq!(
            resolve(&weights, VocabChoice::Top(2), 10).unwrap(),
            Some(vec![3, 1])
        );
        assert_eq!(resolve(&weights, VocabChoice::Full, 10).unwrap(), None);
        let e = resolve(&weights, VocabChoice::Top(4), 10).unwrap_err();
        assert!(e.to_string().contains("lists only 3 ids"), "{e}");
        let e = resolve(&weights, VocabChoice::Shipped, 12).unwrap_err();
        assert!(e.to_string().contains("vocabulary of 10"), "{e}");
        // The weights folder's own list wins, and bad lists are refused with the reason.
        for (ids, why) in [(json!([1, 1]), "twice"), (json!([10]), "outside")] {
            let bad = json!({"format": "specula-draft-vocab/1", "vocab_size": 10, "ids": ids});
            write(&weights, bad);
            let e = resolve(&weights, VocabChoice::Shipped, 10).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        write(
            &weights,
            json!({"format": "other", "vocab_size": 10, "ids": [1]}),
        );
        let e = resolve(&weights, VocabChoice::Shipped, 10).unwrap_err();
        assert!(e.to_string().contains("unknown format"), "{e}");
    }

    #[test]
    fn the_choice_parses_or_says_what_is_allowed() {
        assert_eq!("off".parse::<VocabChoice>(), Ok(VocabChoice::Full));
        assert_eq!("shipped".parse::<VocabChoice>(), Ok(VocabChoice::Shipped));
        assert_eq!("4096".parse::<VocabChoice>(), Ok(VocabChoice::Top(4096)));
        for bad in ["0", "-3", "many"] {
            let e = bad.parse::<VocabChoice>().unwrap_err();
            assert!(e.contains("--draft-vocab"), "{e}");
        }
    }

    #[test]
    fn draft_rows_map_back_to_target_ids_and_distributions_scatter() {
        let v = DraftVocab::new(vec![7, 2, 5], 8).unwrap();
        assert_eq!((v.len(), v.id(0), v.id(2)), (3, 7, 5));
        assert_eq!(
            v.scatter(&[0.5, 0.25, 0.25]),
            vec![0.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.5]
        );
        assert!(DraftVocab::new(vec![], 8).is_err());
        let e = DraftVocab::new(vec![8], 8).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
    }
}
