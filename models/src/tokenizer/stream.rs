//! Incremental detokenization for streaming output.
//!
//! Byte-level BPE splits characters across tokens: 🙂 is four bytes and may arrive as two or
//! more ids, and decoding the first alone gives U+FFFD. The decoder holds text back until it
//! forms whole characters. It also re-decodes the last emitted tokens together with the new
//! ones, so decoders that treat a sequence's first token specially still space words right.
//! This is the scheme of Hugging Face's `DecodeStream` (text-generation-inference's
//! `decode_token`).

use super::Tokenizer;
use crate::{Error, Result};

/// Turns generated ids into text pieces that never end in half a UTF-8 character.
///
/// ```text
///   ids:  [ emitted context | pending ]
///           ^0              ^read
/// ```
/// After a piece is emitted, the pending ids become the context of the next step.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    read: usize,
}

impl<'t> StreamDecoder<'t> {
    /// A decoder with nothing decoded yet.
    pub fn new(tok: &'t Tokenizer) -> StreamDecoder<'t> {
        StreamDecoder {
            tok,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Adds one id; returns the new text once it ends on a whole character, else `None`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when `id` is out of range, or when adding it rewrote text that was
    /// already emitted (byte-level tokenizers never do).
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let emitted = self.tok.decode(&self.ids[..self.read])?;
        let text = match self.tok.decode(&self.ids) {
            Ok(text) => text,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        if text.len() <= emitted.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = text.strip_prefix(emitted.as_str()) else {
            return Err(Error::Tokenizer(format!(
                "stream decoding: adding token {id} rewrote already emitted text {emitted:?}"
            )));
        };
        let new = new.to_string();
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(Some(new))
    }

    /// Returns whatever is still held back and resets the decoder. `None` when nothing is
    /// pending. An incomplete character at the end (generation stopped inside it) is dropped,
    /// not shown as U+FFFD: the text ends at the last whole character, the same text a stream
    /// shows.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when decoding fails (it cannot for ids `step` accepted).
    pub fn flush(&mut self) -> Result<Option<String>> {
        if self.read == self.ids.len() {
            self.ids.clear();
            self.read = 0;
            return Ok(None);
        }
        let emitted = self.tok.decode(&self.ids[..self.read])?;
        let text = self.tok.decode(&self.ids)?;
        self.ids.clear();
        self.read = 0;
        let rest = text.strip_prefix(emitted.as_str()).unwrap_or(&text);
        let rest = rest.trim_end_matches('\u{FFFD}');
        Ok((!rest.is_empty()).then(|| rest.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{tests::load, Special};

    /// Feeds ids one at a time; returns the pieces (flush included).
    fn pieces(tok: &super::Tokenizer, ids: &[u32]) -> Vec<String> {
        let mut dec = tok.stream_decoder();
        let mut out: Vec<String> = ids.iter().filter_map(|&id| dec.step(id).unwrap()).collect();
        out.extend(dec.flush().unwrap());
        out
    }

    #[test]
    fn emoji_split_across_ids_is_held_back() {
        for model in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
            let tok = load(model);
            // Rare characters (a hieroglyph, a Gothic letter) have no token of their own in
            // either vocabulary, so their bytes arrive spread over several ids.
            let text = "ok 🙂👍🏽 𓀀𐍈 日本語 done";
            let ids = tok.encode(text, Special::Parse).unwrap();
            // The emoji really is split: some single id decodes to a broken character.
            assert!(
                ids.iter()
                    .any(|&id| tok.decode(&[id]).unwrap().contains('\u{FFFD}')),
                "{model}: no emoji split across ids in {ids:?}"
            );
            let out = pieces(tok, &ids);
            assert!(
                out.iter().all(|p| !p.contains('\u{FFFD}')),
                "{model}: {out:?}"
            );
            assert_eq!(out.concat(), text, "{model}");
        }
    }

    #[test]
    fn flush_drops_an_unfinished_character() {
        let tok = load("smollm2-135m");
        let ids = tok.encode("a🙂", Special::Parse).unwrap();
        let mut dec = tok.stream_decoder();
        let mut out = String::new();
        // Stop one id short: the emoji is incomplete.
        for &id in &ids[..ids.len() - 1] {
            out.extend(dec.step(id).unwrap());
        }
        assert_eq!(out, "a");
        assert_eq!(dec.flush().unwrap(), None, "no U+FFFD for the cut emoji");
        // Held-back whole characters still come out.
        let mut dec = tok.stream_decoder();
        for &id in &ids {
            out.extend(dec.step(id).unwrap());
        }
        out.extend(dec.flush().unwrap());
        assert_eq!(out, "aa🙂");
        assert_eq!(dec.flush().unwrap(), None);
    }

    #[test]
    fn out_of_range_id_is_an_error_and_leaves_the_stream_usable() {
        let tok = load("smollm2-135m");
        let mut dec = tok.stream_decoder();
        assert!(dec.step(u32::MAX).is_err());
        let hi = tok.encode("hi", Special::Parse).unwrap();
        let out: String = hi.iter().filter_map(|&id| dec.step(id).unwrap()).collect();
        assert_eq!(out, "hi");
    }
}
