//! The target's vocabulary as llguidance sees it: a token trie over each id's bytes, the EOS
//! ids, and a tokenizer for the bytes a grammar forces. Built once per tokenizer and shared by
//! every grammar compiled for it.

use std::sync::{Arc, Mutex};

use llguidance::ParserFactory;
use specula_models::tokenizer::{Special, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// A tokenizer's vocabulary, ready to compile grammars against.
pub struct Vocab {
    pub(super) factory: ParserFactory,
    pub(super) eos: Vec<u32>,
}

impl Vocab {
    /// The vocabulary of `tok`, built on first use and cached by the tokenizer's fingerprint
    /// (building the trie and its token slices takes a while for a large vocabulary).
    ///
    /// # Errors
    /// The tokenizer declares no EOS token (a grammar could never end), or llguidance refuses
    /// the vocabulary.
    pub fn of(tok: &Tokenizer) -> anyhow::Result<Arc<Vocab>> {
        static CACHE: Mutex<Vec<(String, Arc<Vocab>)>> = Mutex::new(Vec::new());
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, v)) = cache.iter().find(|(f, _)| f == tok.fingerprint()) {
            return Ok(v.clone());
        }
        let v = Arc::new(Vocab::new(tok)?);
        cache.push((tok.fingerprint().to_string(), v.clone()));
        Ok(v)
    }

    /// Builds the vocabulary of `tok` (uncached; see [`Vocab::of`]).
    ///
    /// # Errors
    /// As [`Vocab::of`].
    pub fn new(tok: &Tokenizer) -> anyhow::Result<Vocab> {
        let eos = tok.eos_ids().to_vec();
        let Some(&first) = eos.first() else {
            anyhow::bail!("the tokenizer has no end-of-sequence token: grammars need one");
        };
        let words: Vec<Vec<u8>> = tok
            .token_pieces()
            .into_iter()
            .map(|p| match p.special {
                // llguidance's convention: special tokens start with 0xFF, which no text has.
                true => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &p.bytes].concat(),
                false => p.bytes,
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: first,
            tok_bos: tok.bos_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(Env {
            trie,
            tok: tok.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Vocab { factory, eos })
    }

    /// Number of token ids (the length of every mask).
    pub fn len(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Whether the vocabulary is empty (never, for a real tokenizer).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// llguidance's view of our tokenizer.
struct Env {
    trie: TokTrie,
    tok: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Forced text is tokenized as the model's tokenizer would (canonically), bytes that are
    /// not whole characters greedily by the trie; never with a BOS, never parsing special-token
    /// text.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            let mut ids = self
                .tok
                .encode(text, Special::Plain)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()));
            if self.tok.adds_bos() && ids.first() == self.tok.bos_id().as_ref() {
                ids.remove(0);
            }
            ids
        })
    }
}
