//! SentencePiece BPE tokenizers (Gemma, Llama 2) rebuilt from GGUF metadata.
//!
//! A GGUF with `tokenizer.ggml.model = llama` stores a SentencePiece BPE model as pieces,
//! scores and piece types, with no merges and no pre-tokenizer. SentencePiece encodes by
//! starting from characters and repeatedly merging the adjacent pair whose concatenation is a
//! normal piece of the highest score (`bpe_model.cc`); characters outside the vocabulary become
//! `<0xXX>` byte pieces. This module turns that into the `tokenizers` pipeline Hugging Face
//! publishes for these models (Gemma's `tokenizer.json`):
//!
//! ```text
//!   added tokens (control: special; user-defined "\n", "  ", "<table>": matched in raw text)
//!   → normalizer  Replace(" " → "▁")   [Prepend("▁") first when add_space_prefix]
//!   → BPE over the whole text, merges ranked by the merged piece's score, byte fallback
//!   → decoder     Replace("▁" → " "), ByteFallback, Fuse   [Strip one leading " "]
//! ```
//!
//! The merges are the ones `transformers`' `SentencePieceExtractor` derives (every split of a
//! normal piece into two normal pieces, ordered by score, then by the longer left part), but
//! only between normal pieces: SentencePiece never merges into or out of control, user-defined
//! or byte pieces. User-defined pieces are stored by llama.cpp's converter with spaces in
//! place of "▁" (`"  "`), so they are matched before the space is replaced, as llama.cpp does.
//! `scripts/reference/gemma_tokenizer.py` checks the ids against `sentencepiece` itself.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper};

use crate::{Error, Result};

/// SentencePiece's whitespace marker, U+2581.
const SPACE: &str = "\u{2581}";

/// GGUF token types (llama.cpp's `llama_token_type`; 5 is "unused", kept out of merges).
pub(super) const TYPE_NORMAL: i32 = 1;
pub(super) const TYPE_UNKNOWN: i32 = 2;
pub(super) const TYPE_CONTROL: i32 = 3;
pub(super) const TYPE_USER_DEFINED: i32 = 4;
pub(super) const TYPE_BYTE: i32 = 6;

/// The pieces of a SentencePiece model as GGUF stores them, in id order.
pub(super) struct Pieces<'a> {
    pub tokens: &'a [&'a str],
    pub scores: &'a [f32],
    pub types: &'a [i32],
    /// The id of `<unk>`, used for characters that have no byte piece either.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_space_prefix`: SentencePiece's `add_dummy_prefix` (Llama 2: true,
    /// Gemma: false).
    pub add_space_prefix: bool,
}

/// Builds the `tokenizers` pipeline of a SentencePiece BPE model.
pub(super) fn build(p: &Pieces<'_>) -> Result<tokenizers::Tokenizer> {
    let n = p.tokens.len();
    if p.scores.len() != n || p.types.len() != n {
        return Err(Error::Tokenizer(format!(
            "tokenizer.ggml.scores has {} and tokenizer.ggml.token_type {} entries for {n} tokens",
            p.scores.len(),
            p.types.len()
        )));
    }
    if let Some(bad) = p
        .types
        .iter()
        .find(|t| !(TYPE_NORMAL..=TYPE_BYTE).contains(*t))
    {
        return Err(Error::Tokenizer(format!(
            "tokenizer.ggml.token_type holds unknown type {bad}"
        )));
    }
    let vocab: tokenizers::models::bpe::Vocab = p
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.to_string(), id as u32))
        .collect();
    if vocab.len() != n {
        return Err(Error::Tokenizer(
            "tokenizer.ggml.tokens holds the same token twice".into(),
        ));
    }
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges(p))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = p.unk {
        let text = p.tokens.get(unk as usize).ok_or_else(|| {
            Error::Tokenizer(format!(
                "unknown token id {unk} is out of range (vocab size {n})"
            ))
        })?;
        bpe = bpe.unk_token(text.to_string());
    }
    let bpe = bpe.build().map_err(|e| {
        Error::Tokenizer(format!("cannot build BPE from SentencePiece pieces: {e}"))
    })?;

    let mut tok = tokenizers::Tokenizer::new(bpe);
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| Error::Tokenizer(format!("replace pattern: {e}")))
    };
    let mut norm: Vec<NormalizerWrapper> = Vec::new();
    let mut dec: Vec<DecoderWrapper> = vec![replace(SPACE, " ")?.into()];
    dec.extend([ByteFallback::new().into(), Fuse::new().into()]);
    if p.add_space_prefix {
        norm.push(Prepend::new(SPACE.into()).into());
        dec.push(Strip::new(' ', 1, 0).into());
    }
    norm.push(replace(" ", SPACE)?.into());
    tok.with_normalizer(Some(NormalizerSequence::new(norm)))
        .map_err(|e| Error::Tokenizer(format!("normalizer: {e}")))?;
    tok.with_decoder(Some(DecoderSequence::new(dec)));

    // Control and unknown tokens are special; user-defined ones are always matched, in raw text
    // and before the normalizer (their text has spaces, not "▁").
    let added: Vec<AddedToken> = p
        .tokens
        .iter()
        .zip(p.types)
        .filter(|(_, &ty)| matches!(ty, TYPE_CONTROL | TYPE_UNKNOWN | TYPE_USER_DEFINED))
        .map(|(t, &ty)| AddedToken::from(t.to_string(), ty != TYPE_USER_DEFINED).normalized(false))
        .collect();
    tok.add_tokens(added)
        .map_err(|e| Error::Tokenizer(format!("cannot add control tokens: {e}")))?;
    Ok(tok)
}

/// Every split of a normal piece into two normal pieces, the best-scored merged piece first.
///
/// Ties (two splits of one piece) go to the longer left part, then the longer right part, as
/// `transformers`' `generate_merges` orders them; SentencePiece cannot meet both splits of one
/// piece side by side in practice.
fn merges(p: &Pieces<'_>) -> Vec<(String, String)> {
    let normal: HashMap<&str, u32> = p
        .tokens
        .iter()
        .zip(p.types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == TYPE_NORMAL)
        .map(|(id, (t, _))| (*t, id as u32))
        .collect();
    let mut out: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, piece) in p.tokens.iter().enumerate() {
        if p.types[id] != TYPE_NORMAL {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if normal.contains_key(left) && normal.contains_key(right) {
                out.push((p.scores[id], left.len(), right.len(), left, right));
            }
        }
    }
    // A stable sort, so splits that tie on every key keep the vocabulary's order.
    out.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    out.into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// "▁" "a" "b" "c" "ab" "▁ab" "abc", one byte piece per byte of "é", a control and a
    /// user-defined token, scored so that "ab" merges before "bc" would.
    fn tiny(add_space_prefix: bool) -> tokenizers::Tokenizer {
        let tokens = [
            "<unk>", "<eos>", "\n\n", "▁", "a", "b", "c", "ab", "▁ab", "abc", "bc", "<0xC3>",
            "<0xA9>",
        ];
        let scores = [
            0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, 0.0, 0.0,
        ];
        let types = [2, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 6, 6];
        build(&Pieces {
            tokens: &tokens,
            scores: &scores,
            types: &types,
            unk: Some(0),
            add_space_prefix,
        })
        .unwrap()
    }

    fn ids(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        tok.encode_fast(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn merges_follow_scores_spaces_and_bytes() {
        let tok = tiny(false);
        // "abc": "ab" (-5) outranks "bc" (-8), then "abc".
        assert_eq!(ids(&tok, "abc"), [9]);
        // " ab": "▁" + "ab" → "▁ab"; "é" falls back to its two bytes; "\n\n" is user-defined.
        assert_eq!(ids(&tok, "c ab\n\né<eos>"), [6, 8, 2, 11, 12, 1]);
        // A character with no piece and no byte piece is <unk>.
        assert_eq!(ids(&tok, "z"), [0]);
        let text = "c ab\n\né<eos>";
        assert_eq!(tok.decode(&ids(&tok, text), false).unwrap(), text);
    }

    #[test]
    fn space_prefix_is_added_and_stripped() {
        let tok = tiny(true);
        assert_eq!(ids(&tok, "ab"), [8]);
        assert_eq!(tok.decode(&ids(&tok, "ab c"), false).unwrap(), "ab c");
    }

    #[test]
    fn merges_only_join_normal_pieces() {
        let tokens = ["a", "b", "<0x61>", "ab"];
        let m = merges(&Pieces {
            tokens: &tokens,
            scores: &[0.0, 0.0, 0.0, -1.0],
            types: &[1, 3, 6, 1],
            unk: None,
            add_space_prefix: false,
        });
        assert!(m.is_empty(), "{m:?}");
    }

    #[test]
    fn mismatched_lengths_and_types_are_errors() {
        let tokens = ["a", "b"];
        let err = |scores: &[f32], types: &[i32]| {
            build(&Pieces {
                tokens: &tokens,
                scores,
                types,
                unk: None,
                add_space_prefix: false,
            })
            .unwrap_err()
            .to_string()
        };
        assert!(err(&[0.0], &[1, 1]).contains("scores has 1"));
        assert!(err(&[0.0, 0.0], &[1, 9]).contains("unknown type 9"));
    }

    /// Gemma-3-270M's GGUF tokenizer against `sentencepiece` itself on tricky text
    /// (`scripts/reference/gemma_tokenizer.py` wrote the fixture, without BOS).
    #[test]
    fn gemma3_ids_match_sentencepiece() {
        use crate::tokenizer::{tests::load, Special};
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tokenizer/gemma3-270m.json"
        );
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(rows.len() > 30, "{path} has {} rows", rows.len());
        let tok = load("gemma3-270m");
        let bos = tok.bos_id().expect("Gemma has <bos>");
        assert!(tok.adds_bos());
        for row in rows {
            let text = row["text"].as_str().unwrap();
            let mut expected: Vec<u32> = serde_json::from_value(row["ids"].clone()).unwrap();
            if expected.first() != Some(&bos) {
                expected.insert(0, bos);
            }
            let got = tok.encode(text, Special::Parse).unwrap();
            assert_eq!(got, expected, "{text:?}");
            let with_bos = match text.starts_with("<bos>") {
                true => text.to_string(),
                false => format!("<bos>{text}"),
            };
            assert_eq!(tok.decode(&got).unwrap(), with_bos);
        }
    }

    #[test]
    fn gemma3_special_tokens() {
        use crate::tokenizer::{tests::load, Special};
        let tok = load("gemma3-270m");
        let id = |t: &str| tok.token_to_id(t).unwrap();
        assert_eq!(tok.vocab_size(), 262_144);
        assert_eq!(tok.bos_id(), Some(id("<bos>")));
        assert_eq!(tok.eos_ids(), [id("<eos>"), id("<end_of_turn>")]);
        // Plain text cannot open a turn, but user-defined pieces ("\n") still apply.
        let plain = tok.encode("<start_of_turn>\n", Special::Plain).unwrap();
        assert!(!plain.contains(&id("<start_of_turn>")), "{plain:?}");
        assert_eq!(plain.last(), Some(&id("\n")));
        assert_eq!(tok.decode(&plain[1..]).unwrap(), "<start_of_turn>\n");
    }

    /// A Hugging Face folder holding Gemma's tokenizer.json (the pipeline above, as Gemma
    /// publishes it) and tokenizer_config.json encodes and ends like the GGUF.
    #[test]
    fn gemma3_hf_dir_matches_gguf() {
        use crate::tokenizer::{tests::load, Special, Tokenizer};
        let gguf = load("gemma3-270m");
        let dir = std::env::temp_dir().join(format!("specula-gemma-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        gguf.inner.save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"add_bos_token": true, "bos_token": "<bos>", "eos_token": "<eos>"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [1, 106]}"#,
        )
        .unwrap();
        let hf = Tokenizer::from_hf_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let text = "<start_of_turn>user\n  café 12 🙂\t<end_of_turn>";
        assert_eq!(
            hf.encode(text, Special::Parse).unwrap(),
            gguf.encode(text, Special::Parse).unwrap()
        );
        assert_eq!(hf.eos_ids(), gguf.eos_ids());
        assert_eq!(hf.bos_id(), gguf.bos_id());
        assert_eq!(hf.fingerprint(), gguf.fingerprint());
    }
}
