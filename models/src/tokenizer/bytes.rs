//! The bytes each token id stands for, for consumers that work on bytes rather than text
//! (the grammar engine builds its token trie from them).
//!
//! A vocabulary entry is not its text: byte-level BPE (GPT-2, SmolLM2, Qwen) spells every byte
//! as a printable character (`Ġ` is a space, `Ċ` a newline), and SentencePiece writes `▁` for
//! a space and `<0xE2>` for a lone byte of a character it has no piece for. A token that holds
//! part of a UTF-8 character has no text of its own at all, so decoding one id at a time
//! cannot recover it; this module undoes the spelling directly. Concatenating the bytes of a
//! sequence of ids gives `decode(ids)` (tested on SmolLM2 and Qwen), except that SentencePiece
//! decoding drops the one space that starts a text.

use tokenizers::DecoderWrapper;

use super::Tokenizer;

/// One vocabulary entry as bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPiece {
    /// What the token decodes to (a control token: its text, e.g. `<|im_end|>`).
    pub bytes: Vec<u8>,
    /// A control token: it ends or frames turns rather than standing for text.
    pub special: bool,
}

/// How a vocabulary spells bytes.
enum Spelling {
    /// GPT-2's byte-to-character table.
    ByteLevel(Box<[Option<u8>; CHAR_SLOTS]>),
    /// SentencePiece: `▁` is a space, `<0xAB>` is the byte 0xAB.
    SentencePiece,
}

/// GPT-2 maps the 256 bytes to characters below U+0144.
const CHAR_SLOTS: usize = 0x144;

impl Tokenizer {
    /// The bytes of every token id, in id order (`vocab_size` entries; an id without a
    /// vocabulary entry has no bytes).
    pub fn token_pieces(&self) -> Vec<TokenPiece> {
        let spelling = spelling(self.inner.get_decoder());
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return TokenPiece {
                        bytes: t.content.as_bytes().to_vec(),
                        special: t.special,
                    };
                }
                let bytes = self
                    .inner
                    .id_to_token(id)
                    .map(|piece| unspell(&spelling, &piece))
                    .unwrap_or_default();
                TokenPiece {
                    bytes,
                    special: false,
                }
            })
            .collect()
    }

    /// The bytes of one token id, as [`Tokenizer::token_pieces`] gives them (computed once, on
    /// first use): exact also for a token that holds part of a UTF-8 character, which has no
    /// text of its own (logprobs' `bytes`). Empty for an id past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let pieces = self.pieces.get_or_init(|| self.token_pieces().into());
        pieces.get(id as usize).map_or(&[], |p| &p.bytes)
    }
}

fn spelling(decoder: Option<&DecoderWrapper>) -> Spelling {
    let byte_level = match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(s)) => s
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    };
    match byte_level {
        true => Spelling::ByteLevel(Box::new(byte_level_table())),
        false => Spelling::SentencePiece,
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: printable Latin-1 bytes stand for themselves, the
/// others take the characters from U+0100 on, in byte order.
fn byte_level_table() -> [Option<u8>; CHAR_SLOTS] {
    let mut table = [None; CHAR_SLOTS];
    let mut next = 0x100usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
}

fn unspell(spelling: &Spelling, piece: &str) -> Vec<u8> {
    match spelling {
        Spelling::ByteLevel(table) => {
            let mut out = Vec::with_capacity(piece.len());
            for c in piece.chars() {
                match table.get(c as usize).copied().flatten() {
                    Some(b) => out.push(b),
                    // Not a byte-level character (an entry the table never produced): as text.
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            out
        }
        Spelling::SentencePiece => match byte_fallback(piece) {
            Some(b) => vec![b],
            None => piece.replace('\u{2581}', " ").into_bytes(),
        },
    }
}

/// `<0xAB>` → 0xAB.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::load;
    use crate::tokenizer::Special;

    /// Every token whose bytes are whole characters decodes alone to exactly those bytes, and
    /// the bytes of encoded texts (partial characters, emoji, CJK, code) concatenate to their
    /// decoding.
    fn round_trips(name: &str) {
        let tok = load(name);
        let pieces = tok.token_pieces();
        assert_eq!(pieces.len(), tok.vocab_size());
        for id in (0..pieces.len()).step_by(97) {
            assert_eq!(
                tok.token_bytes(id as u32),
                pieces[id].bytes,
                "{name} id {id}"
            );
        }
        assert!(tok.token_bytes(pieces.len() as u32).is_empty());
        let mut checked = 0;
        for (id, p) in pieces.iter().enumerate() {
            let Ok(text) = std::str::from_utf8(&p.bytes) else {
                continue; // part of a character: covered by the texts below
            };
            assert_eq!(tok.decode(&[id as u32]).unwrap(), text, "{name} id {id}");
            checked += 1;
        }
        assert!(checked > tok.vocab_size() * 9 / 10, "{name}: {checked}");
        let texts = [
            "{\"name\": \"Ada\", \"age\": 36, \"tags\": [\"a\", \"b\"]}",
            "🙂👍🏽🇫🇷 日本語のテキスト 中文 café",
            "def f(x):\n    return x  # hi\n\n\tprintln!(\"{}\", 1);\n",
            "<|im_start|>user\nhi<|im_end|>",
        ];
        for text in texts {
            let ids = tok.encode(text, Special::Parse).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| pieces[id as usize].bytes.clone())
                .collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text, "{name}");
        }
        let im_end = tok.token_to_id("<|im_end|>").unwrap() as usize;
        assert!(pieces[im_end].special);
        assert_eq!(pieces[im_end].bytes, b"<|im_end|>");
        // A lone byte of a multi-byte character exists as a token of its own.
        assert!(pieces.iter().any(|p| p.bytes == [0xE2]), "{name}");
    }

    #[test]
    fn token_bytes_round_trip_smollm2() {
        round_trips("smollm2-135m");
    }

    #[test]
    fn token_bytes_round_trip_qwen() {
        round_trips("qwen2.5-coder-0.5b");
    }

    /// SentencePiece with byte fallback (Gemma 3): `▁` is a space, `<0xAB>` a byte; decoding
    /// drops the one space that starts a text, so single tokens compare without it.
    #[test]
    fn token_bytes_round_trip_gemma3() {
        let tok = load("gemma3-270m");
        let pieces = tok.token_pieces();
        let mut checked = 0;
        for (id, p) in pieces.iter().enumerate().filter(|(_, p)| !p.special) {
            let Ok(text) = std::str::from_utf8(&p.bytes) else {
                continue;
            };
            // Decoding may drop the space a text starts with (added tokens skip that Strip).
            let got = tok.decode(&[id as u32]).unwrap();
            let stripped = text.strip_prefix(' ').unwrap_or(text);
            assert!(
                got == text || got == stripped,
                "id {id}: {got:?} vs {text:?}"
            );
            checked += 1;
        }
        assert!(checked > tok.vocab_size() * 9 / 10, "{checked}");
        assert!(
            pieces.iter().any(|p| p.bytes == [0xE2]),
            "byte-fallback pieces"
        );
        for text in ["🙂👍🏽 日本語のテキスト café", "def f(x):\n    return x\n"] {
            let ids = tok.encode(text, Special::Plain).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .filter(|&&id| Some(id) != tok.bos_id())
                .flat_map(|&id| pieces[id as usize].bytes.clone())
                .collect();
            let decoded = tok.decode(&ids[usize::from(tok.adds_bos())..]).unwrap();
            let got = String::from_utf8(bytes).unwrap();
            assert_eq!(got.strip_prefix(' ').unwrap_or(&got), decoded);
        }
    }

    #[test]
    fn byte_fallback_pieces() {
        assert_eq!(byte_fallback("<0xE2>"), Some(0xE2));
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0xE>"), None);
        assert_eq!(byte_fallback("<0xZZ>"), None);
        assert_eq!(
            unspell(&Spelling::SentencePiece, "\u{2581}hello"),
            b" hello"
        );
        let t = byte_level_table();
        assert_eq!(t['Ġ' as usize], Some(b' '));
        assert_eq!(t['Ċ' as usize], Some(b'\n'));
        assert_eq!(t['a' as usize], Some(b'a'));
        assert_eq!(
            t[' ' as usize], None,
            "a raw space is not a byte-level character"
        );
    }
}
