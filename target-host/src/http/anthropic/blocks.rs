//! Anthropic request content as chat messages: `text`, `tool_use` (assistant) and
//! `tool_result` (user) blocks become the plain messages the chat template renders — an
//! assistant message with OpenAI-shaped `tool_calls`, a `tool` message per result — so the
//! conversation renders exactly as the same one sent to `/v1/chat/completions`.
//!
//! Blocks of other types (images, documents, thinking) and unknown block fields are a 400
//! naming them. `cache_control` is accepted on every block: prefixes are cached
//! automatically here, marked or not.

use serde::Deserialize;
use serde_json::{json, Value};
use specula_models::chat::ChatMessage;

use super::super::error::ApiError;

/// A message's or the system prompt's content: a string or a list of blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content blocks.
    Blocks(Vec<Value>),
}

/// The text of `content`, which may hold text blocks only (the system prompt, a tool result).
///
/// # Errors
/// 400 naming the first block that is not text.
pub fn text_of(content: &Content, param: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                let at = format!("{param}[{j}]");
                match kind(b, &at)? {
                    "text" => out.push_str(text_block(b, &at)?),
                    other => return Err(unsupported(&at, other, "text")),
                }
            }
            Ok(out)
        }
    }
}

/// The chat messages of one request message (`role` already checked to be `user` or
/// `assistant`): a user message's tool results are `tool` messages, in block order, with the
/// text between them as user messages; an assistant message is one message with its text and
/// `tool_use` blocks as `tool_calls`.
///
/// # Errors
/// 400 naming the block or field at fault.
pub fn messages_of(i: usize, role: &str, content: &Content) -> Result<Vec<ChatMessage>, ApiError> {
    let param = format!("messages[{i}].content");
    let blocks = match content {
        Content::Text(t) => return Ok(vec![ChatMessage::new(role, t.clone())]),
        Content::Blocks(b) => b,
    };
    let mut out = Vec::new();
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{param}[{j}]");
        match (role, kind(b, &at)?) {
            (_, "text") => text.push_str(text_block(b, &at)?),
            ("assistant", "tool_use") => calls.push(tool_use(b, &at)?),
            ("user", "tool_result") => {
                if !text.is_empty() {
                    out.push(ChatMessage::new("user", std::mem::take(&mut text)));
                }
                out.push(tool_result(b, &at)?);
            }
            ("user", other) => return Err(unsupported(&at, other, "text and tool_result")),
            (_, other) => return Err(unsupported(&at, other, "text and tool_use")),
        }
    }
    match role {
        "assistant" => {
            let mut m = ChatMessage::new("assistant", text);
            m.tool_calls = (!calls.is_empty()).then_some(Value::Array(calls));
            out.push(m);
        }
        // A user message that held only tool results has no text message of its own.
        _ if !text.is_empty() || out.is_empty() => out.push(ChatMessage::new("user", text)),
        _ => {}
    }
    Ok(out)
}

fn kind<'a>(b: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(&format!("{at}.type"), "a content block needs a type"))
}

fn unsupported(at: &str, kind: &str, expected: &str) -> ApiError {
    ApiError::invalid(
        &format!("{at}.type"),
        format!("content block of type `{kind}` is not supported here: only {expected}"),
    )
}

/// 400 for a block field not in `allowed` (`type` and `cache_control` always are).
fn check_keys(b: &Value, allowed: &[&str], at: &str) -> Result<(), ApiError> {
    let Some(o) = b.as_object() else {
        return Err(ApiError::invalid(at, "a content block must be an object"));
    };
    match o
        .keys()
        .find(|k| !matches!(k.as_str(), "type" | "cache_control") && !allowed.contains(&k.as_str()))
    {
        None => Ok(()),
        Some(k) => Err(ApiError::invalid(
            &format!("{at}.{k}"),
            format!("unsupported content block field `{k}`"),
        )),
    }
}

fn string_field<'a>(b: &'a Value, key: &str, at: &str) -> Result<&'a str, ApiError> {
    b.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(&format!("{at}.{key}"), "missing or not a string"))
}

fn text_block<'a>(b: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    check_keys(b, &["text"], at)?;
    string_field(b, "text", at)
}

/// A `tool_use` block as an OpenAI-shaped call (`arguments` an object, as templates read it).
fn tool_use(b: &Value, at: &str) -> Result<Value, ApiError> {
    check_keys(b, &["id", "name", "input"], at)?;
    let id = string_field(b, "id", at)?;
    let name = string_field(b, "name", at)?;
    let input = b
        .get("input")
        .filter(|v| v.is_object())
        .ok_or_else(|| ApiError::invalid(&format!("{at}.input"), "must be an object"))?;
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

/// A `tool_result` block as a `tool` message; an error result is marked in its text, since
/// chat templates have no field for it.
fn tool_result(b: &Value, at: &str) -> Result<ChatMessage, ApiError> {
    check_keys(b, &["tool_use_id", "content", "is_error"], at)?;
    let id = string_field(b, "tool_use_id", at)?;
    let content = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(c) => {
            let c: Content = serde_json::from_value(c.clone()).map_err(|_| {
                ApiError::invalid(
                    &format!("{at}.content"),
                    "must be a string or a list of text blocks",
                )
            })?;
            text_of(&c, &format!("{at}.content"))?
        }
    };
    let is_error = match b.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(e)) => *e,
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{at}.is_error"),
                "must be a boolean",
            ))
        }
    };
    let mut m = ChatMessage::new(
        "tool",
        match is_error {
            true => format!("Error: {content}"),
            false => content,
        },
    );
    m.tool_call_id = Some(id.to_string());
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(v: Value) -> Content {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn tool_use_and_tool_result_become_chat_messages() {
        let assistant = blocks(json!([
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        ]));
        let m = messages_of(1, "assistant", &assistant).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_str()),
            ("assistant", "Let me look.")
        );
        assert_eq!(
            m[0].tool_calls,
            Some(json!([{"id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]))
        );
        let user = blocks(json!([
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                "content": [{"type": "text", "text": "no such city"}]},
            {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}}
        ]));
        let m = messages_of(2, "user", &user).unwrap();
        let got: Vec<(&str, &str, Option<&str>)> = m
            .iter()
            .map(|m| {
                (
                    m.role.as_str(),
                    m.content.as_str(),
                    m.tool_call_id.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("tool", "18 C", Some("toolu_1")),
                ("tool", "Error: no such city", Some("toolu_2")),
                ("user", "Thanks.", None)
            ]
        );
        // Only tool results: no empty user message after them.
        let only = blocks(json!([{"type": "tool_result", "tool_use_id": "t", "content": "x"}]));
        assert_eq!(messages_of(0, "user", &only).unwrap().len(), 1);
    }

    #[test]
    fn bad_blocks_name_the_field() {
        for (role, content, param) in [
            (
                "user",
                json!([{"type": "image", "source": {}}]),
                "messages[0].content[0].type",
            ),
            (
                "user",
                json!([{"type": "tool_use", "id": "a", "name": "f", "input": {}}]),
                "messages[0].content[0].type",
            ),
            (
                "assistant",
                json!([{"type": "tool_result", "tool_use_id": "a"}]),
                "messages[0].content[0].type",
            ),
            (
                "assistant",
                json!([{"type": "tool_use", "id": "a", "name": "f", "input": 3}]),
                "messages[0].content[0].input",
            ),
            (
                "assistant",
                json!([{"type": "tool_use", "name": "f", "input": {}}]),
                "messages[0].content[0].id",
            ),
            (
                "user",
                json!([{"type": "tool_result", "tool_use_id": "a", "content": 5}]),
                "messages[0].content[0].content",
            ),
            (
                "user",
                json!([{"type": "tool_result", "tool_use_id": "a",
                "content": [{"type": "image"}]}]),
                "messages[0].content[0].content[0].type",
            ),
            (
                "user",
                json!([{"type": "tool_result", "tool_use_id": "a", "is_error": "no"}]),
                "messages[0].content[0].is_error",
            ),
            (
                "user",
                json!([{"type": "text", "text": "a", "citations": []}]),
                "messages[0].content[0].citations",
            ),
            (
                "user",
                json!([{"text": "a"}]),
                "messages[0].content[0].type",
            ),
        ] {
            let e = messages_of(0, role, &blocks(content.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{content}: {}", e.message);
        }
    }
}
