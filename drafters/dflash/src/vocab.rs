//! The draft vocabulary (EAGLE-3's `d2t` idea): the drafter computes logits for only the N ids
//! a target answers with most often, so its lm_head reads N rows instead of the whole
//! vocabulary (SmolLM2: 8192 of 49152 rows cover 97.7 % of its self-distilled answer tokens).
//!
//! Exactness does not depend on the subset: greedy drafts are the subset's argmax (the target
//! verifies them like any others), and sampled drafts come with `q` rows that are the
//! distribution actually sampled from, zero outside the subset, so the host's rejection sampler
//! still yields exactly the target's distribution.
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
use specula_models::layers::linear::Weight;
use specula_models::layers::Linear;

use crate::Error;

/// The file name looked up next to the weights.
pub const FILE: &str = "draft_vocab.json";

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
/// [`Error::Options`] when N ids are asked for and no list holds them; [`Error::Config`] for
/// a malformed list (unknown format, another vocabulary size, ids out of range or repeated).
pub fn resolve(dir: &Path, choice: VocabChoice, vocab: usize) -> Result<Option<Vec<u32>>, Error> {
    let path = match (choice, locate(dir)) {
        (VocabChoice::Full, _) | (VocabChoice::Shipped, None) => return Ok(None),
        (VocabChoice::Top(n), None) => {
            return Err(Error::Options(format!(
                "--draft-vocab {n}: no {FILE} in {} or its parent (use --draft-vocab off)",
                dir.display()
            )))
        }
        (_, Some(p)) => p,
    };
    let bad = |reason: String| Error::Config {
        path: path.clone(),
        reason,
    };
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
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
            return Err(Error::Options(format!(
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

fn err(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}

/// The projection restricted to output rows `ids` (row `i` of the result is row `ids[i]`),
/// kept in the weight's own storage: GGUF blocks are copied row by row, never dequantized.
/// A bias-free projection on the CPU (the lm_heads and Markov heads this is used for).
///
/// # Errors
/// [`Error::Forward`] for an id past the weight's rows or a weight off the CPU.
pub fn select_rows(linear: &Linear, ids: &[u32]) -> Result<Linear, Error> {
    match linear.weight() {
        Weight::Dense(w) => {
            let index = Tensor::new(ids, w.device()).map_err(err)?;
            let sub = w.index_select(&index, 0).map_err(err)?;
            Linear::dense(sub, None).map_err(err)
        }
        Weight::Quantized(q) => {
            let sub = q.select_rows(ids).map_err(err)?;
            Ok(Linear::from_qweight(Arc::new(sub), None).map_err(err)?)
        }
        Weight::Device(_) => Err(err("a draft vocabulary needs the weights on the CPU")),
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
}
