//! Rebuilding a tokenizer from GGUF metadata (`tokenizer.ggml.*`).
//!
//! `tokenizer.ggml.model` picks the family: `gpt2` is byte-level BPE (below), `llama` is
//! SentencePiece BPE (`sentencepiece.rs`: Gemma, Llama 2).
//!
//! For byte-level BPE the pre-tokenizer is only stored by name (`tokenizer.ggml.pre`). Each supported name maps to
//! the pipeline that the family's Hugging Face `tokenizer.json` declares; the regexes are the
//! ones llama.cpp uses for that name (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`), in their
//! original `tokenizer.json` form since `tokenizers`' Oniguruma regexes accept `(?i:...)`.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::SpecialIds;
use crate::{Error, Result};

use super::sentencepiece::{self, TYPE_CONTROL, TYPE_USER_DEFINED};

/// GPT-2's split, which `ByteLevel(use_regex = true)` applies itself.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's split: one digit per piece, letters with one leading non-letter.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: like Qwen2's but digits in groups of up to three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's fallback for BPE models converted without a pre-tokenizer name ("default").
const DEFAULT_REGEXES: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// The pipeline in front of the BPE model for one `tokenizer.ggml.pre` name.
struct PreSpec {
    /// Unicode NFC normalization first (Qwen2).
    nfc: bool,
    /// Split every digit into its own piece (SmolLM2, StarCoder).
    individual_digits: bool,
    /// Regex splits applied in order (each one `Isolated`); empty means GPT-2's split done by
    /// `ByteLevel` itself.
    regexes: &'static [&'static str],
    /// Look a whole piece up in the vocabulary before merging (Llama 3).
    ignore_merges: bool,
}

const KNOWN_PRE: &str =
    "gpt-2, mpt, olmo, jais, smollm, starcoder, refact, command-r, codeshell, exaone, minerva, \
     qwen2, llama-bpe, llama3, default";

fn pre_spec(name: &str) -> Result<PreSpec> {
    let spec = |nfc, individual_digits, regexes, ignore_merges| PreSpec {
        nfc,
        individual_digits,
        regexes,
        ignore_merges,
    };
    Ok(match name {
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" => spec(false, false, &[], false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            spec(false, true, &[], false)
        }
        "qwen2" => spec(true, false, &[QWEN2_REGEX], false),
        "llama-bpe" | "llama3" => spec(false, false, &[LLAMA3_REGEX], true),
        // Conversions older than the `pre` key say "default"; llama.cpp then uses this split.
        "default" => spec(false, false, DEFAULT_REGEXES, false),
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported pre-tokenizer tokenizer.ggml.pre = '{other}' (supported: {KNOWN_PRE})"
            )))
        }
    })
}

/// Builds the tokenizer, its vocabulary size and its special ids from GGUF metadata.
pub(super) fn build(content: &Content) -> Result<(tokenizers::Tokenizer, usize, SpecialIds)> {
    let meta = Meta(&content.metadata);
    let model = meta.string("tokenizer.ggml.model")?;
    match model {
        "gpt2" => build_bpe(&meta),
        "llama" => build_sentencepiece(&meta),
        other => Err(Error::Tokenizer(format!(
            "unsupported tokenizer model tokenizer.ggml.model = '{other}' (supported: gpt2, \
             the byte-level BPE of GPT-2, SmolLM, Qwen and Llama 3; llama, the SentencePiece \
             BPE of Gemma and Llama 2)"
        ))),
    }
}

/// `tokenizer.ggml.model = llama`: SentencePiece BPE from pieces, scores and types.
fn build_sentencepiece(meta: &Meta<'_>) -> Result<(tokenizers::Tokenizer, usize, SpecialIds)> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let scores = meta.floats("tokenizer.ggml.scores")?;
    let types = meta.ints("tokenizer.ggml.token_type")?;
    // SentencePiece has no pre-tokenizer: llama.cpp reads tokenizer.ggml.pre only for gpt2
    // vocabularies (converters write "default" here), and so does this builder.
    let tok = sentencepiece::build(&sentencepiece::Pieces {
        tokens: &tokens,
        scores: &scores,
        types: &types,
        unk: meta.opt_id("tokenizer.ggml.unknown_token_id")?,
        add_space_prefix: meta
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true),
    })?;
    Ok((tok, tokens.len(), special_ids(meta, &types)?))
}

/// `tokenizer.ggml.model = gpt2`: byte-level BPE with a named pre-tokenizer.
fn build_bpe(meta: &Meta<'_>) -> Result<(tokenizers::Tokenizer, usize, SpecialIds)> {
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let merges = meta
        .strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::Tokenizer(format!("merge '{m}' has no space separator")))
        })
        .collect::<Result<Vec<_>>>()?;
    let types = match meta.get("tokenizer.ggml.token_type") {
        Some(_) => meta.ints("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(Error::Tokenizer(format!(
            "tokenizer.ggml.token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let pre_name = match meta.get("tokenizer.ggml.pre") {
        Some(_) => meta.string("tokenizer.ggml.pre")?,
        None => "default",
    };
    let pre = pre_spec(pre_name)?;

    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.to_string(), id as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(Error::Tokenizer(
            "tokenizer.ggml.tokens holds the same token twice".into(),
        ));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("cannot build BPE from GGUF vocab/merges: {e}")))?;

    let mut tok = tokenizers::Tokenizer::new(bpe);
    if pre.nfc {
        tok.with_normalizer(Some(NFC))
            .map_err(|e| Error::Tokenizer(format!("normalizer: {e}")))?;
    }
    tok.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));
    tok.with_decoder(Some(ByteLevel::default()));

    // Control tokens are special added tokens; user-defined ones (Qwen's <tool_call>) are
    // matched in text too but are not special, as in the published tokenizer.json files.
    // Neither is normalized: NFC must not touch "<|im_start|>" matching.
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &ty)| ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED)
        .map(|(t, &ty)| AddedToken::from(t.to_string(), ty == TYPE_CONTROL).normalized(false))
        .collect();
    tok.add_tokens(added)
        .map_err(|e| Error::Tokenizer(format!("cannot add control tokens: {e}")))?;

    Ok((tok, tokens.len(), special_ids(meta, &types)?))
}

/// BOS, EOS/EOT and the control tokens, from the `tokenizer.ggml.*` ids and token types.
fn special_ids(meta: &Meta<'_>, types: &[i32]) -> Result<SpecialIds> {
    let control = types
        .iter()
        .enumerate()
        .filter(|(_, &ty)| ty == TYPE_CONTROL)
        .map(|(id, _)| id as u32)
        .collect();
    let mut declared_eos = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        declared_eos.extend(meta.opt_id(key)?);
    }
    Ok(SpecialIds {
        bos: meta.opt_id("tokenizer.ggml.bos_token_id")?,
        add_bos: meta
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false),
        declared_eos,
        control,
    })
}

fn pre_tokenizer(pre: &PreSpec) -> Result<PreTokenizerWrapper> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    if pre.individual_digits {
        steps.push(Digits::new(true).into());
    }
    for re in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {re}: {e}")))?;
        steps.push(split.into());
    }
    // Without its own regex split, ByteLevel applies GPT-2's.
    let use_regex = pre.regexes.is_empty();
    steps.push(ByteLevel::new(false, true, use_regex).into());
    Ok(Sequence::new(steps).into())
}

/// Typed access to GGUF metadata with errors that name the key.
struct Meta<'a>(&'a HashMap<String, Value>);

impl<'a> Meta<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key)
    }

    fn require(&self, key: &str) -> Result<&'a Value> {
        self.get(key)
            .ok_or_else(|| Error::Tokenizer(format!("GGUF metadata has no {key}")))
    }

    fn string(&self, key: &str) -> Result<&'a str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            other => Err(wrong_type(key, "a string", other)),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<&'a str>> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    other => Err(wrong_type(key, "an array of strings", other)),
                })
                .collect(),
            other => Err(wrong_type(key, "an array of strings", other)),
        }
    }

    fn ints(&self, key: &str) -> Result<Vec<i32>> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| {
                    as_i64(v)
                        .and_then(|i| i32::try_from(i).ok())
                        .ok_or_else(|| wrong_type(key, "an array of integers", v))
                })
                .collect(),
            other => Err(wrong_type(key, "an array of integers", other)),
        }
    }

    fn floats(&self, key: &str) -> Result<Vec<f32>> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match *v {
                    Value::F32(x) => Ok(x),
                    Value::F64(x) => Ok(x as f32),
                    _ => Err(wrong_type(key, "an array of floats", v)),
                })
                .collect(),
            other => Err(wrong_type(key, "an array of floats", other)),
        }
    }

    /// An optional token id; converters write them as u32 or i32 (-1 = none).
    fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match as_i64(v) {
            Some(-1) => Ok(None),
            Some(i) => u32::try_from(i)
                .map(Some)
                .map_err(|_| Error::Tokenizer(format!("{key} = {i} is not a token id"))),
            None => Err(wrong_type(key, "an integer", v)),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(key, "a bool", other)),
        }
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    Some(match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => i64::try_from(x).ok()?,
        Value::I64(x) => x,
        _ => return None,
    })
}

fn wrong_type(key: &str, expected: &str, got: &Value) -> Error {
    Error::Tokenizer(format!(
        "GGUF metadata {key} should be {expected}, got {:?}",
        got.value_type()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::VersionedMagic;

    /// A tiny byte-level vocabulary: "a", "b", "ab", one control token and "Ġ" (a space).
    fn content(model: &str, pre: Option<&str>) -> Content {
        let strings =
            |xs: &[&str]| Value::Array(xs.iter().map(|s| Value::String(s.to_string())).collect());
        let mut metadata = HashMap::from([
            (
                "tokenizer.ggml.model".to_string(),
                Value::String(model.into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                strings(&["a", "b", "ab", "<|end|>", "Ġ"]),
            ),
            ("tokenizer.ggml.merges".to_string(), strings(&["a b"])),
            (
                "tokenizer.ggml.token_type".to_string(),
                Value::Array([1, 1, 1, 3, 1].into_iter().map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(3)),
        ]);
        if let Some(pre) = pre {
            metadata.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        }
        Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    fn tokenizer_err(content: &Content) -> String {
        match super::super::Tokenizer::from_gguf(content) {
            Err(Error::Tokenizer(m)) => m,
            other => panic!("expected Error::Tokenizer, got {other:?}"),
        }
    }

    #[test]
    fn tiny_vocab_merges_and_ends() {
        let tok = super::super::Tokenizer::from_gguf(&content("gpt2", Some("gpt-2"))).unwrap();
        let ids = tok
            .encode("ab<|end|>", super::super::Special::Parse)
            .unwrap();
        assert_eq!(ids, [2, 3]);
        assert_eq!(tok.eos_ids(), [3]);
        assert_eq!(tok.decode(&ids).unwrap(), "ab<|end|>");
    }

    #[test]
    fn unknown_tokenizer_model_is_a_clear_error() {
        let msg = tokenizer_err(&content("bert", Some("gpt-2")));
        assert!(
            msg.contains("'bert'") && msg.contains("tokenizer.ggml.model"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_clear_error() {
        let msg = tokenizer_err(&content("gpt2", Some("klingon")));
        assert!(msg.contains("'klingon'") && msg.contains("qwen2"), "{msg}");
    }

    #[test]
    fn missing_and_mistyped_keys_name_the_key() {
        let mut c = content("gpt2", Some("gpt-2"));
        c.metadata.remove("tokenizer.ggml.merges");
        assert!(tokenizer_err(&c).contains("no tokenizer.ggml.merges"));

        let mut c = content("gpt2", Some("gpt-2"));
        c.metadata.insert(
            "tokenizer.ggml.eos_token_id".into(),
            Value::String("x".into()),
        );
        assert!(tokenizer_err(&c).contains("tokenizer.ggml.eos_token_id should be an integer"));

        let mut c = content("gpt2", Some("gpt-2"));
        c.metadata
            .insert("tokenizer.ggml.eos_token_id".into(), Value::U32(99));
        assert!(tokenizer_err(&c).contains("EOS token id 99 is out of range"));
    }

    #[test]
    fn every_known_pre_tokenizer_builds() {
        for name in KNOWN_PRE.split(", ") {
            let c = content("gpt2", Some(name));
            let tok = super::super::Tokenizer::from_gguf(&c)
                .unwrap_or_else(|e| panic!("pre-tokenizer {name}: {e}"));
            let ids = tok.encode("ab ba", super::super::Special::Parse).unwrap();
            assert_eq!(ids, [2, 4, 1, 0], "pre-tokenizer {name}");
        }
    }
}
