//! Tools for a chat template without a tools branch (SmolLM2's GGUF template is plain ChatML):
//! the conversation is rewritten into messages such a template renders, in the Hermes / Qwen2.5
//! format that tool-tuned models know.
//!
//! - The tools go in a system preamble, worded as Qwen2.5's template words it (the tool list
//!   inside `<tools></tools>`, one JSON object per line, then the `<tool_call>` format); it is
//!   appended to the first system message, or becomes the first message.
//! - An assistant's earlier calls become text after its content:
//!   `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`.
//! - Tool results become a user turn of `<tool_response>\n…\n</tool_response>` blocks, one turn
//!   for consecutive results (as Qwen2.5's template renders `role: tool`).
//!
//! The reply is then parsed for `<tool_call>` blocks exactly as with a native template.

use super::{py_json, ChatMessage};
use crate::{Error, Result};
use minijinja::value::Value;

/// Qwen2.5's tool preamble, before the tool list.
const HEAD: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";

/// After the tool list.
const TAIL: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// Whether `messages` or `tools` need the rewrite to reach a template without a tools branch.
pub fn needed(messages: &[ChatMessage], tools: Option<&serde_json::Value>) -> bool {
    tools.is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty()))
        || messages
            .iter()
            .any(|m| m.role == "tool" || m.tool_calls.is_some())
}

/// `messages` with `tools` and every tool call and result written as plain messages.
///
/// # Errors
/// [`Error::ChatTemplate`] when a tool or call cannot be written as JSON.
pub fn rewrite(
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Result<Vec<ChatMessage>> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // Whether the last message out is a turn of tool results (the next result joins it).
    let mut in_results = false;
    for m in messages {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(prev) if in_results => {
                    prev.content.push('\n');
                    prev.content.push_str(&block);
                }
                _ => out.push(ChatMessage::new("user", block)),
            }
            in_results = true;
            continue;
        }
        in_results = false;
        let mut m = m.clone();
        if let Some(calls) = m.tool_calls.take() {
            for call in calls.as_array().into_iter().flatten() {
                let f = call.get("function").unwrap_or(call);
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                m.content.push_str("<tool_call>\n{\"name\": ");
                m.content.push_str(&json(&f["name"])?);
                m.content.push_str(", \"arguments\": ");
                m.content.push_str(&json(&f["arguments"])?);
                m.content.push_str("}\n</tool_call>");
            }
        }
        out.push(m);
    }
    if let Some(list) = tools.and_then(|t| t.as_array()).filter(|a| !a.is_empty()) {
        let mut preamble = HEAD.to_string();
        for t in list {
            preamble.push('\n');
            preamble.push_str(&json(t)?);
        }
        preamble.push_str(TAIL);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content.push_str("\n\n");
                first.content.push_str(&preamble);
            }
            _ => out.insert(0, ChatMessage::new("system", preamble)),
        }
    }
    Ok(out)
}

/// `v` as the templates' `tojson` writes it (Python's `json.dumps`).
fn json(v: &serde_json::Value) -> Result<String> {
    let mut out = String::new();
    py_json(&Value::from_serialize(v), None, 0, &mut out)
        .map_err(|e| Error::ChatTemplate(format!("cannot write a tool as JSON: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_calls_and_results_become_plain_messages() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let call = |id: &str, city: &str| {
            json!({"id": id, "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}})
        };
        let msgs = vec![
            ChatMessage::new("user", "Weather in Paris and Rome?"),
            ChatMessage {
                tool_calls: Some(json!([call("a", "Paris"), call("b", "Rome")])),
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("a".into()),
                ..ChatMessage::new("tool", "18C")
            },
            ChatMessage {
                tool_call_id: Some("b".into()),
                ..ChatMessage::new("tool", "21C")
            },
        ];
        assert!(needed(&msgs, None) && needed(&msgs[..1], Some(&tools)));
        assert!(!needed(&msgs[..1], None) && !needed(&msgs[..1], Some(&json!([]))));
        let out = rewrite(&msgs, Some(&tools)).unwrap();
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(
            out[0].content,
            format!(
                "{HEAD}\n{{\"type\": \"function\", \"function\": {{\"name\": \"get_weather\", \"parameters\": {{\"type\": \"object\", \"properties\": {{\"city\": {{\"type\": \"string\"}}}}}}}}}}{TAIL}"
            )
        );
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
        );
        assert!(out[2].tool_calls.is_none());
        assert_eq!(
            out[3].content,
            "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>"
        );
        // An existing system message keeps its text, the preamble follows it.
        let with_system = [ChatMessage::new("system", "Be brief."), msgs[0].clone()];
        let out = rewrite(&with_system, Some(&tools)).unwrap();
        assert_eq!(out.len(), 2);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools"));
    }
}
