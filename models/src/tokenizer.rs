//! Tokenizers rebuilt from GGUF metadata or read from a Hugging Face `tokenizer.json`.
//!
//! A GGUF file carries its tokenizer as metadata (`tokenizer.ggml.*`): the vocabulary, the BPE
//! merges, token types and a pre-tokenizer *name*. [`Tokenizer::from_gguf`] turns that back into
//! a `tokenizers` pipeline with the structure the model family publishes in its
//! `tokenizer.json` (`tokenizer/gguf.rs` holds the table of pre-tokenizer names, taken from
//! llama.cpp's `src/llama-vocab.cpp`). The ids must match the reference tokenizer exactly: a target and a
//! drafter that tokenize differently would still be correct, but would never agree.
//!
//! Decoding skips nothing: control tokens such as `<|im_end|>` come back as their text.
//! [`StreamDecoder`] turns a stream of ids into text without ever emitting half a UTF-8
//! character.

mod bytes;
mod gguf;
mod hf;
mod sentencepiece;
mod stream;

use std::path::Path;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

pub use bytes::TokenPiece;
pub use stream::StreamDecoder;

use crate::{Error, Result};

/// Whether special (control) tokens written in the text are recognised while encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// `"<|im_start|>"` in the text becomes the `<|im_start|>` token, as Hugging Face does by
    /// default. Use this for prompts rendered from a chat template.
    Parse,
    /// Special tokens in the text are encoded as ordinary text. Use this for untrusted text that
    /// must not be able to open or close a chat turn.
    Plain,
}

/// A tokenizer with the model's special token ids.
///
/// # Invariants
/// Every id in `eos_ids` and `bos` is below `vocab_size`; `eos_ids` has no duplicates and starts
/// with the model's primary EOS token when it declares one.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy of `inner` that treats special tokens as text, built on first use of
    /// [`Special::Plain`] (most callers never need it, and the Qwen vocabulary is large).
    plain: OnceLock<tokenizers::Tokenizer>,
    /// Every id's bytes ([`Tokenizer::token_bytes`]), built on first use.
    pieces: OnceLock<std::sync::Arc<[bytes::TokenPiece]>>,
    vocab_size: usize,
    bos: Option<u32>,
    add_bos: bool,
    eos_ids: Vec<u32>,
    fingerprint: String,
}

/// Texts of end-of-generation tokens, as llama.cpp's `llama-vocab.cpp` scans for them: a model
/// may stop on any of these, not only on its declared EOS (Qwen chat ends turns with
/// `<|im_end|>` but its base models end documents with `<|endoftext|>`).
const END_TOKEN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "</s>",
];

/// What a tokenizer source says about its special tokens.
struct SpecialIds {
    bos: Option<u32>,
    add_bos: bool,
    /// Declared end tokens (EOS, EOT, ...), primary first.
    declared_eos: Vec<u32>,
    /// Ids of control tokens: only these may be picked up by the [`END_TOKEN_TEXTS`] scan.
    control: Vec<u32>,
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's metadata.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when a `tokenizer.ggml.*` key is missing or has the wrong type, when
    /// the tokenizer model (`tokenizer.ggml.model`) or pre-tokenizer (`tokenizer.ggml.pre`) is
    /// not supported, or when a special token id is out of range.
    pub fn from_gguf(content: &candle_core::quantized::gguf_file::Content) -> Result<Tokenizer> {
        let (inner, vocab_size, ids) = gguf::build(content)?;
        Tokenizer::assemble(inner, vocab_size, ids)
    }

    /// Reads the metadata of the GGUF file at `path` (not its tensors) and builds its tokenizer.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::InvalidModel`] when the file cannot be read as GGUF, else as
    /// [`Tokenizer::from_gguf`].
    pub fn from_gguf_file(path: &Path) -> Result<Tokenizer> {
        Tokenizer::from_gguf(&read_gguf_metadata(path)?)
    }

    /// Reads `tokenizer.json` from a Hugging Face model folder, with the BOS/EOS tokens of
    /// `tokenizer_config.json` and `generation_config.json` when they are present.
    ///
    /// # Errors
    /// [`Error::Io`] when `tokenizer.json` cannot be read, [`Error::Tokenizer`] when a file is
    /// not valid or names a special token that is not in the vocabulary.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let (inner, vocab_size, ids) = hf::build(dir)?;
        Tokenizer::assemble(inner, vocab_size, ids)
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        vocab_size: usize,
        ids: SpecialIds,
    ) -> Result<Tokenizer> {
        let in_range = |id: u32, what: &str| {
            if (id as usize) < vocab_size {
                Ok(id)
            } else {
                Err(Error::Tokenizer(format!(
                    "{what} token id {id} is out of range (vocab size {vocab_size})"
                )))
            }
        };
        let bos = ids.bos.map(|id| in_range(id, "BOS")).transpose()?;
        if ids.add_bos && bos.is_none() {
            return Err(Error::Tokenizer(
                "the tokenizer asks for a BOS token but does not name one".into(),
            ));
        }
        let mut eos_ids = Vec::new();
        for id in ids.declared_eos {
            let id = in_range(id, "EOS")?;
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        for &id in &ids.control {
            let is_end = inner
                .id_to_token(id)
                .is_some_and(|t| END_TOKEN_TEXTS.contains(&t.as_str()));
            if is_end && !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let fingerprint = fingerprint(&inner, vocab_size, bos, ids.add_bos, &eos_ids);
        Ok(Tokenizer {
            inner,
            plain: OnceLock::new(),
            pieces: OnceLock::new(),
            vocab_size,
            bos,
            add_bos: ids.add_bos,
            eos_ids,
            fingerprint,
        })
    }

    /// Encodes `text`, prepending BOS when the model asks for it (`add_bos_token`) and the text
    /// does not already start with it (a chat template that writes `bos_token` must not end up
    /// with two).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the underlying tokenizer fails (it does not for valid UTF-8
    /// with the byte-level models Specula builds).
    pub fn encode(&self, text: &str, special: Special) -> Result<Vec<u32>> {
        self.encode_segments(&[(text, special)])
    }

    /// Encodes text made of segments with their own special-token rule, as one prompt: a chat
    /// prompt whose template text is [`Special::Parse`]d while the special-token text a user
    /// wrote inside a message stays [`Special::Plain`]. BOS is handled as in
    /// [`Tokenizer::encode`], once, for the whole prompt.
    ///
    /// # Errors
    /// As [`Tokenizer::encode`].
    pub fn encode_segments(&self, segments: &[(&str, Special)]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for &(text, special) in segments.iter().filter(|(t, _)| !t.is_empty()) {
            let tok = match special {
                Special::Parse => &self.inner,
                Special::Plain => self.plain.get_or_init(|| {
                    let mut plain = self.inner.clone();
                    plain.set_encode_special_tokens(true);
                    plain
                }),
            };
            let enc = tok
                .encode_fast(text, false)
                .map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
            ids.extend_from_slice(enc.get_ids());
        }
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Texts of the special (control) tokens that [`Special::Parse`] turns into their ids,
    /// longest first (so a scan finds `<|im_start|>` before a shorter token it contains).
    pub fn special_token_texts(&self) -> Vec<String> {
        let mut texts: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        texts.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        texts.dedup();
        texts
    }

    /// Decodes `ids` to text. Nothing is skipped: control tokens come back as their text, and
    /// bytes that do not form valid UTF-8 become U+FFFD.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when an id is not below [`Tokenizer::vocab_size`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is out of range (vocab size {})",
                self.vocab_size
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(format!("decode failed: {e}")))
    }

    /// A decoder for a stream of generated ids; see [`StreamDecoder`].
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// Number of token ids, including control tokens and unused padding entries (for GGUF
    /// models this equals the rows of the embedding matrix).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// All ids that end generation: the declared EOS first, then EOT and the other end tokens
    /// the vocabulary holds (for SmolLM2 and Qwen2.5: `<|im_end|>` and `<|endoftext|>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token, when the model has one (whether or not [`Tokenizer::encode`] adds it).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`Tokenizer::encode`] prepends the BOS token.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of a token given its vocabulary text (byte-level form, e.g. `"Ġthe"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary text of a token id (byte-level form, e.g. `"Ġthe"`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// SHA-256 (hex) of the vocabulary in id order and the special token ids.
    ///
    /// Identical tokenizers give identical fingerprints, so the drafter handshake can refuse a
    /// drafter whose ids would mean different text. Merges and the pre-tokenizer are not
    /// hashed: two vocabularies that agree id for id come from the same tokenizer in practice.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The inner tokenizer's Debug prints the whole vocabulary.
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("add_bos", &self.add_bos)
            .field("eos_ids", &self.eos_ids)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// Reads a GGUF file's header and metadata; tensor data is left on disk.
pub(crate) fn read_gguf_metadata(
    path: &Path,
) -> Result<candle_core::quantized::gguf_file::Content> {
    use std::io::Read;
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    // candle parses value by value and asks the reader for its position before each string;
    // on a File that is two syscalls per string, seconds for Qwen's 300k vocabulary strings and
    // merges. So parse an in-memory prefix, doubling it until the metadata fits.
    let mut prefix = Vec::new();
    let mut want = 8 << 20;
    loop {
        let have = prefix.len() as u64;
        (&mut file)
            .take(want - have)
            .read_to_end(&mut prefix)
            .map_err(io)?;
        let parsed =
            candle_core::quantized::gguf_file::Content::read(&mut std::io::Cursor::new(&prefix));
        match parsed {
            Ok(content) => return Ok(content),
            Err(_) if (prefix.len() as u64) < file_len => want *= 2,
            Err(e) => {
                return Err(Error::InvalidModel {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })
            }
        }
    }
}

fn fingerprint(
    inner: &tokenizers::Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    add_bos: bool,
    eos_ids: &[u32],
) -> String {
    let mut h = Sha256::new();
    h.update(b"specula-tokenizer-v1");
    for id in 0..vocab_size as u32 {
        // Length-prefixed so that ["ab", "c"] and ["a", "bc"] differ; a hole hashes as u32::MAX.
        match inner.id_to_token(id) {
            Some(t) => {
                h.update((t.len() as u32).to_le_bytes());
                h.update(t.as_bytes());
            }
            None => h.update(u32::MAX.to_le_bytes()),
        }
    }
    h.update(bos.map_or(u32::MAX, |b| b).to_le_bytes());
    h.update([u8::from(add_bos)]);
    h.update((eos_ids.len() as u32).to_le_bytes());
    for id in eos_ids {
        h.update(id.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    pub(crate) use crate::testing::real_model;

    pub(crate) fn gguf_content(name: &str) -> candle_core::quantized::gguf_file::Content {
        read_gguf_metadata(&real_model(name)).expect("read GGUF metadata")
    }

    /// The tokenizer of a real model, built once per test binary (Qwen's takes a while).
    pub(crate) fn load(name: &str) -> &'static Tokenizer {
        static CACHE: Mutex<Vec<(String, &'static Tokenizer)>> = Mutex::new(Vec::new());
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, tok)) = cache.iter().find(|(n, _)| n == name) {
            return tok;
        }
        let tok = Tokenizer::from_gguf(&gguf_content(name)).expect("tokenizer from GGUF");
        let tok: &'static Tokenizer = Box::leak(Box::new(tok));
        cache.push((name.to_string(), tok));
        tok
    }

    const TRICKY: &[&str] = &[
        "12345 3.14159 1,000,000",
        "a  b   c\n\n\n\t\tx",
        "trailing spaces   ",
        "🙂👍🏽🇫🇷",
        "日本語のテキスト 中文",
        "def f(x):\n    return x  # hi\n\nfn main() {\n\tprintln!(\"{}\", 1);\n}\n",
        "<|im_start|>user\nhi<|im_end|>",
        "don't I'll we've DON'T",
        "",
    ];

    #[test]
    fn round_trip_smollm2() {
        let tok = load("smollm2-135m");
        for text in TRICKY.iter().chain(["café cafe\u{301}"].iter()) {
            let ids = tok.encode(text, Special::Parse).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), *text, "{text:?}");
        }
    }

    #[test]
    fn round_trip_qwen_normalizes_to_nfc() {
        let tok = load("qwen2.5-coder-0.5b");
        for text in TRICKY {
            let ids = tok.encode(text, Special::Parse).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), *text, "{text:?}");
        }
        // Qwen2 applies NFC first: the decomposed é comes back composed, with the same ids.
        let nfd = tok.encode("cafe\u{301}", Special::Parse).unwrap();
        assert_eq!(nfd, tok.encode("café", Special::Parse).unwrap());
        assert_eq!(tok.decode(&nfd).unwrap(), "café");
    }

    #[test]
    fn special_tokens_parse_or_plain() {
        let tok = load("smollm2-135m");
        let im_start = tok.token_to_id("<|im_start|>").unwrap();
        let parsed = tok.encode("<|im_start|>user", Special::Parse).unwrap();
        assert_eq!(parsed[0], im_start);
        let plain = tok.encode("<|im_start|>user", Special::Plain).unwrap();
        assert!(!plain.contains(&im_start), "{plain:?}");
        assert!(plain.len() > parsed.len());
        assert_eq!(tok.decode(&plain).unwrap(), "<|im_start|>user");
        assert!(tok
            .special_token_texts()
            .iter()
            .any(|t| t == "<|im_start|>"));
        let mixed = tok
            .encode_segments(&[
                ("<|im_start|>", Special::Parse),
                ("<|im_end|>", Special::Plain),
            ])
            .unwrap();
        assert_eq!(mixed[0], im_start);
        assert!(!mixed.contains(&tok.token_to_id("<|im_end|>").unwrap()));
        assert_eq!(tok.decode(&mixed).unwrap(), "<|im_start|><|im_end|>");
    }

    #[test]
    fn special_ids_from_metadata() {
        let smol = load("smollm2-135m");
        let id = |t: &Tokenizer, s: &str| t.token_to_id(s).unwrap();
        assert_eq!(
            smol.eos_ids(),
            [id(smol, "<|im_end|>"), id(smol, "<|endoftext|>")]
        );
        assert_eq!(smol.bos_id(), Some(id(smol, "<|im_start|>")));
        assert!(!smol.adds_bos());
        assert_eq!(smol.vocab_size(), 49152);

        let qwen = load("qwen2.5-coder-0.5b");
        assert_eq!(qwen.eos_ids(), [151645, 151643]);
        assert_eq!(qwen.id_to_token(151645).as_deref(), Some("<|im_end|>"));
        assert_eq!(qwen.vocab_size(), 151936);
        // No BOS for Qwen: the GGUF names one but says not to add it, as Hugging Face does.
        assert_eq!(qwen.encode("hi", Special::Parse).unwrap().len(), 1);
    }

    #[test]
    fn fingerprints_match_across_same_family_only() {
        let a = load("qwen2.5-coder-0.5b");
        let b = load("qwen2.5-coder-1.5b");
        let s = load("smollm2-135m");
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), s.fingerprint());
        assert_eq!(a.fingerprint().len(), 64);
    }

    #[test]
    fn from_gguf_file_errors_name_the_file() {
        let missing = Path::new("/nonexistent/model.gguf");
        assert!(matches!(
            Tokenizer::from_gguf_file(missing),
            Err(Error::Io { .. })
        ));
        let not_gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let err = Tokenizer::from_gguf_file(&not_gguf).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidModel { path, .. } if path == &not_gguf),
            "{err}"
        );
    }

    #[test]
    fn decode_rejects_out_of_range_ids() {
        let tok = load("smollm2-135m");
        let err = tok.decode(&[1, 49152]).unwrap_err();
        assert!(
            matches!(&err, Error::Tokenizer(m) if m.contains("49152")),
            "{err}"
        );
    }
}
