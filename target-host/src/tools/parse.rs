//! Parsing `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks out of generated text,
//! fed in pieces as the model writes it ([`CallParser`]).
//!
//! The same parser serves a stream and a whole reply (fed at once), so both give the same
//! content and calls. Rules:
//! - text that may be the start of `<tool_call>` (`<`, `<tool_`) is held back until the next
//!   piece settles it, so a stream never shows half a tag;
//! - a call is only released when its block is closed and its JSON is an object with a `name`
//!   among the request's tools and an object of `arguments` (no other keys); anything else —
//!   malformed JSON, an unknown function, a block still open at the end — is text, verbatim;
//! - whitespace between the text and a call, and after a call, is dropped (it is layout, not
//!   content: Qwen2.5 writes `\n` between calls);
//! - a reply that is nothing but one call object, without the tags, is that call: small
//!   models (Qwen2.5-Coder-0.5B, greedy) answer a tool request with the bare
//!   `{"name": "get_weather", "arguments": {…}}`, as llama.cpp's Hermes parser also accepts. A
//!   reply is held back while it may still be such an object (it starts `{"name": "` and a
//!   prefix of a listed name) and released as text at the end when it is not one.
//!
//! A call's arguments are released whole once the block closes, not token by token: a stream
//! must never start a call that the closing JSON then proves malformed.

use serde_json::{Map, Value};

/// Opens a call block.
pub const OPEN: &str = "<tool_call>";
/// Closes it.
pub const CLOSE: &str = "</tool_call>";

/// A call parsed from the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    /// The function called (one of the request's tools).
    pub name: String,
    /// Its arguments (a JSON object, keys in the model's order).
    pub arguments: Map<String, Value>,
}

impl ParsedCall {
    /// The arguments as a JSON string, as OpenAI sends them.
    pub fn arguments_json(&self) -> String {
        serde_json::to_string(&self.arguments).expect("invariant: a JSON map serializes")
    }
}

/// What the parser releases.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Content text.
    Text(String),
    /// A complete call.
    Call(ParsedCall),
}

/// How the generation ended, for a block still open at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The text ended on its own (EOS, a user stop string, `max_tokens`): an open block is
    /// text.
    Plain,
    /// Generation stopped at `</tool_call>` (the stop string that keeps a reply to one call):
    /// the open block is closed.
    AtClose,
}

/// Splits generated text into content and calls; see the module docs.
#[derive(Debug, Clone)]
pub struct CallParser {
    names: Vec<String>,
    /// Text received and not yet released (a possible tag prefix, or an open block's body).
    buf: String,
    /// Inside `<tool_call>`, before its close.
    in_call: bool,
    /// Trailing whitespace of released text, held in case a call follows.
    pending_ws: String,
    /// The last thing released was a call (leading whitespace of what follows is dropped).
    after_call: bool,
    /// Nothing is released yet and the reply may still be a bare call object.
    bare: bool,
}

impl CallParser {
    /// A parser for calls of the functions `names`.
    pub fn new(names: Vec<String>) -> CallParser {
        CallParser {
            names,
            buf: String::new(),
            in_call: false,
            pending_ws: String::new(),
            after_call: false,
            bare: true,
        }
    }

    /// Feeds the next piece of generated text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if self.bare {
            match bare_call_prefix(&self.buf, &self.names) {
                true => return out,
                false => self.bare = false,
            }
        }
        loop {
            if self.in_call {
                let Some(at) = self.buf.find(CLOSE) else {
                    break;
                };
                let body: String = self.buf.drain(..at).collect();
                self.buf.drain(..CLOSE.len());
                self.in_call = false;
                self.block(&body, true, &mut out);
            } else if let Some(at) = self.buf.find(OPEN) {
                let before: String = self.buf.drain(..at).collect();
                self.buf.drain(..OPEN.len());
                self.text(&before, &mut out);
                self.in_call = true;
            } else {
                let keep = partial_suffix(&self.buf, OPEN);
                let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.text(&ready, &mut out);
                break;
            }
        }
        out
    }

    /// Releases everything left at the end of generation.
    pub fn finish(&mut self, end: End) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.bare) {
            if let Some(call) = self.call(&rest) {
                return vec![Piece::Call(call)];
            }
            // Not a call after all: the held text is parsed as any other.
            let mut out = self.push(&rest);
            out.extend(self.finish(end));
            return out;
        }
        let mut out = Vec::new();
        if std::mem::take(&mut self.in_call) {
            self.block(&rest, end == End::AtClose, &mut out);
        } else {
            self.text(&rest, &mut out);
        }
        if !self.pending_ws.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.pending_ws)));
        }
        out
    }

    /// A block's body: a call when it is one (and `closed`), else its text verbatim.
    fn block(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        match closed.then(|| self.call(body)).flatten() {
            Some(call) => {
                self.pending_ws.clear();
                self.after_call = true;
                out.push(Piece::Call(call));
            }
            None => {
                let close = if closed { CLOSE } else { "" };
                self.text(&format!("{OPEN}{body}{close}"), out);
            }
        }
    }

    fn call(&self, body: &str) -> Option<ParsedCall> {
        let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(body.trim()) else {
            return None;
        };
        if o.len() != 2 {
            return None;
        }
        let name = match o.remove("name") {
            Some(Value::String(n)) if self.names.contains(&n) => n,
            _ => return None,
        };
        let arguments = match o.remove("arguments") {
            Some(Value::Object(a)) => a,
            // Some fine-tunes write the arguments as a JSON string, as OpenAI's wire does.
            Some(Value::String(s)) => match serde_json::from_str(&s) {
                Ok(Value::Object(a)) => a,
                _ => return None,
            },
            _ => return None,
        };
        Some(ParsedCall { name, arguments })
    }

    /// Releases `s` as content, holding its trailing whitespace back.
    fn text(&mut self, s: &str, out: &mut Vec<Piece>) {
        let mut s = s;
        if self.after_call {
            s = s.trim_start();
            if s.is_empty() {
                return;
            }
            self.after_call = false;
        }
        let body = s.trim_end();
        if !body.is_empty() {
            let mut t = std::mem::take(&mut self.pending_ws);
            t.push_str(body);
            out.push(Piece::Text(t));
        }
        self.pending_ws.push_str(&s[body.len()..]);
    }
}

/// Whether `s` may still be the start of a bare call object `{"name": "<listed name>", …`.
fn bare_call_prefix(s: &str, names: &[String]) -> bool {
    let mut rest = s.trim_start();
    // `{`, `"name"`, `:` and the name's opening quote, with JSON whitespace between.
    for lit in ["{", "\"name\"", ":", "\""] {
        rest = rest.trim_start();
        if rest.is_empty() || lit.starts_with(rest) {
            return true;
        }
        match rest.strip_prefix(lit) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    match rest.find('"') {
        // The whole name is there: it must be listed (the rest is checked at the end).
        Some(end) => names.iter().any(|n| *n == rest[..end]),
        None => names.iter().any(|n| n.starts_with(rest)),
    }
}

/// Length of the longest proper prefix of `tag` that `s` ends with.
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| s.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// The content text and the calls of `pieces`, in order.
pub fn split(pieces: Vec<Piece>) -> (String, Vec<ParsedCall>) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => text.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (text, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parser() -> CallParser {
        CallParser::new(vec!["get_weather".into(), "get_time".into()])
    }

    fn whole(text: &str, end: End) -> (String, Vec<ParsedCall>) {
        let mut p = parser();
        let mut pieces = p.push(text);
        pieces.extend(p.finish(end));
        split(pieces)
    }

    fn call(name: &str, args: Value) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: args.as_object().unwrap().clone(),
        }
    }

    const TWO: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>";

    #[test]
    fn several_calls_and_their_text() {
        let (text, calls) = whole(TWO, End::Plain);
        assert_eq!(text, "Let me check.");
        assert_eq!(
            calls,
            vec![
                call("get_weather", json!({"city": "Paris", "unit": "c"})),
                call("get_time", json!({"zone": "CET"})),
            ]
        );
        // The model's key order is kept (OpenAI clients see the arguments as written).
        assert_eq!(calls[0].arguments_json(), r#"{"city":"Paris","unit":"c"}"#);
    }

    #[test]
    fn text_without_calls_is_untouched() {
        for t in [
            "",
            "plain",
            "  a < b and c <tool but not a tag\n\n",
            "x <tool_cal",
            "<",
        ] {
            assert_eq!(whole(t, End::Plain), (t.to_string(), vec![]), "{t:?}");
        }
    }

    #[test]
    fn malformed_calls_are_text() {
        for t in [
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": }}</tool_call>",
            "<tool_call>{\"name\": \"launch_missiles\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\"}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}, \"x\": 1}</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
            "ok <tool_call>{\"name\": \"get_weather\", \"arguments\": {}}",
        ] {
            assert_eq!(whole(t, End::Plain), (t.to_string(), vec![]), "{t}");
        }
        // A good call after a bad one still parses.
        let t = "<tool_call>oops</tool_call> then <tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"UTC\\\"}\"}</tool_call>";
        let (text, calls) = whole(t, End::Plain);
        assert_eq!(text, "<tool_call>oops</tool_call> then");
        assert_eq!(calls, vec![call("get_time", json!({"zone": "UTC"}))]);
    }

    #[test]
    fn a_block_cut_by_the_close_stop_is_a_call() {
        let t = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n";
        assert_eq!(whole(t, End::Plain).1, vec![]);
        assert_eq!(
            whole(t, End::AtClose),
            (String::new(), vec![call("get_time", json!({}))])
        );
    }

    #[test]
    fn a_bare_call_object_is_a_call() {
        let t = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
        assert_eq!(
            whole(t, End::Plain),
            (
                String::new(),
                vec![call("get_weather", json!({"city": "Paris"}))]
            )
        );
        // Streamed: held back to the end, then the call.
        let mut p = parser();
        for piece in [
            "{\"",
            "name",
            "\":",
            " \"",
            "get",
            "_weather",
            "\", \"arguments\": {}}",
        ] {
            assert_eq!(p.push(piece), vec![], "{piece}");
        }
        assert_eq!(
            p.finish(End::Plain),
            vec![Piece::Call(call("get_weather", json!({})))]
        );
        // Not a call: other JSON, another name, or text after the object.
        for t in [
            "{\"a\": 1}",
            "{\"name\": \"get_weatherman\", \"arguments\": {}}",
            "{\"name\": \"get_time\", \"arguments\": {}} and more",
            "{\"name\": \"Bob\"}",
            "{",
        ] {
            assert_eq!(whole(t, End::Plain), (t.to_string(), vec![]), "{t}");
        }
        // Other JSON is released as soon as it cannot be a call.
        let mut p = parser();
        assert_eq!(p.push("{\"na"), vec![]);
        assert_eq!(
            p.push("mes\": 1"),
            vec![Piece::Text("{\"names\": 1".into())]
        );
    }

    #[test]
    fn partial_tags_are_held_back() {
        let mut p = parser();
        assert_eq!(p.push("Hi <tool"), vec![Piece::Text("Hi".into())]);
        assert_eq!(p.push("_c"), vec![]);
        assert_eq!(p.push("all>{\"name\": \"get_time\", "), vec![]);
        assert_eq!(p.push("\"arguments\": {}}</tool_"), vec![]);
        assert_eq!(
            p.push("call>"),
            vec![Piece::Call(call("get_time", json!({})))]
        );
        assert_eq!(p.push("\n\n"), vec![]);
        assert_eq!(p.push("Done <"), vec![Piece::Text("Done".into())]);
        assert_eq!(p.push("b"), vec![Piece::Text(" <b".into())]);
        assert_eq!(p.finish(End::Plain), vec![]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// However the text is cut into stream pieces, the parser releases the same content and
        /// calls as for the whole text, and never shows a piece of a tag that became a call.
        #[test]
        fn any_split_gives_the_whole_result(cuts in proptest::collection::vec(0usize..200, 0..12),
                                           which in 0usize..4) {
            let text = [
                TWO,
                "a<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>b<tool_call>bad",
                "<<tool_call>{\"name\": \"get_time\", \"arguments\": {\"é\": \"ü\"}}</tool_call></tool_call>",
                "x < y <tool_call> {} </tool_call> ",
            ][which];
            let mut cuts: Vec<usize> = cuts.into_iter()
                .map(|c| c % (text.len() + 1))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            cuts.sort_unstable();
            let mut p = parser();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts.into_iter().chain([text.len()]) {
                pieces.extend(p.push(&text[last..c]));
                last = c;
            }
            pieces.extend(p.finish(End::Plain));
            let (streamed_text, streamed_calls) = split(pieces);
            let expected = whole(text, End::Plain);
            proptest::prop_assert!(!expected.1.is_empty() || which == 3);
            if !expected.1.is_empty() {
                let shown = streamed_text.contains("<tool_call>{\"name\": \"get_time\"");
                proptest::prop_assert!(!shown, "a call's tag was shown as text");
            }
            proptest::prop_assert_eq!((streamed_text, streamed_calls), expected);
        }
    }
}
