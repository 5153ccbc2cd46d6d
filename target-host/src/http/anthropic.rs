//! `POST /v1/messages`: Anthropic's Messages API on the same engine and chat template as
//! `/v1/chat/completions`.
//!
//! Reference: <https://docs.anthropic.com/en/api/messages> and its streaming events
//! (`message_start`, `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`; errors as an `error` event). Errors use Anthropic's body,
//! `{"type": "error", "error": {"type", "message"}}`. Supported: `model`, `max_tokens`,
//! `messages` (text content, string or blocks), `system`, `stop_sequences`, `stream`,
//! `temperature` (0..=1), `top_p`, `top_k`, `metadata.user_id`, and Specula's `speculative`.
//! Anything else (tools, images, thinking) is a 400 naming it.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use specula_models::chat::{ChatMessage, RenderOptions};
use specula_models::tokenizer::Tokenizer;

use super::error::{parse_value, ApiError, ApiJson};
use super::request::{check_common, check_fields};
use super::stream::{collect, sse, Chunks, TokenOut, Tracker};
use super::{encode_rendered, new_id, AppState};
use crate::generation::{FinishReason, Generation};

const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "speculative",
];

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<MessageIn>,
    system: Option<Content>,
    #[allow(dead_code)] // read through the shared checks; typed here so a bad one is named
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    metadata: Option<Metadata>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Metadata {
    user_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageIn {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

/// An [`ApiError`] in Anthropic's shape.
fn anthropic_error(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let message = match &e.param {
        Some(p) => format!("{p}: {}", e.message),
        None => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// `POST /v1/messages`.
pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Response {
    match run(&state, body).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.request("messages", e.status.as_u16());
            (e.status, axum::Json(anthropic_error(&e))).into_response()
        }
    }
}

fn text_of(content: &Content, param: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{j}]"),
                            format!(
                                "content block of type `{}` is not supported: only text",
                                kind.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(out)
        }
    }
}

async fn run(state: &Arc<AppState>, body: Result<ApiJson, ApiError>) -> Result<Response, ApiError> {
    let ApiJson(body) = body?;
    check_fields(&body, &[FIELDS])?;
    let req: MessagesRequest = parse_value(&body)?;
    if let Some(t) = req.temperature {
        if !(0.0..=1.0).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                "temperature must be in [0, 1]",
            ));
        }
    }
    if let Some(user) = req.metadata.as_ref().and_then(|m| m.user_id.as_ref()) {
        tracing::debug!(%user, "messages request");
    }
    // The sampling and length fields, under the names the shared checks read.
    let mut common = json!({
        "model": req.model,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    });
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
        ("speculative", "speculative"),
    ] {
        if let Some(v) = body.get(from) {
            common[to] = v.clone();
        }
    }
    let checked = check_common(state, &parse_value(&common)?)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        messages.push(ChatMessage::new("system", text_of(system, "system")?));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("unknown role `{}`: expected user or assistant", m.role),
            ));
        }
        let content = text_of(&m.content, &format!("messages[{i}].content"))?;
        messages.push(ChatMessage::new(m.role.clone(), content));
    }
    let template = state.engine.chat_template().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "no_chat_template",
            "the model has no chat template",
        )
    })?;
    // A final assistant message is a prefill the reply continues, as Anthropic does.
    let prefill = messages.last().is_some_and(|m| m.role == "assistant");
    let opts = RenderOptions {
        generation: match prefill {
            true => specula_models::chat::GenerationPrompt::Omit,
            false => specula_models::chat::GenerationPrompt::Add,
        },
        continue_final_message: prefill,
        content_special: state.content_special,
        ..RenderOptions::default()
    };
    let prompt = template.render_prompt(&messages, &opts).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("the chat template rejected the messages: {e}"),
        )
    })?;
    super::check_prompt_size(state, &prompt.text(), "messages").await?;
    let prompt_ids = encode_rendered(state, prompt, "messages").await?;
    let input_tokens = prompt_ids.len();
    let stops = checked.stop.clone();
    let (gen_req, plan) = checked.into_request(state, prompt_ids, None, "messages")?;
    let rx = match super::admission::submit(state, "messages", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(*refused),
    };
    let tracker = Tracker::new(state.metrics.clone(), "messages");
    let mut events = MessageEvents {
        // Anthropic ids look like `msg_01…`.
        id: new_id("msg").replacen('-', "_", 1),
        model: state.model_name.clone(),
        state: state.clone(),
        stops,
        input_tokens,
        shown: 0,
    };
    if plan.stream {
        return Ok(sse(rx, events, false, tracker).into_response());
    }
    let (generation, _) = collect(rx, tracker).await?;
    let (stop_reason, stop_sequence) = events.stop(&generation);
    let body = json!({
        "id": std::mem::take(&mut events.id),
        "type": "message",
        "role": "assistant",
        "model": events.model,
        "content": [{"type": "text", "text": generation.text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": generation.stats.generated_tokens},
    });
    Ok(axum::Json(body).into_response())
}

struct MessageEvents {
    id: String,
    model: String,
    /// The state, for its tokenizer (the stream outlives the handler).
    state: Arc<AppState>,
    stops: Vec<String>,
    input_tokens: usize,
    /// Bytes of text streamed so far.
    shown: usize,
}

impl MessageEvents {
    /// Anthropic's `stop_reason` and, when a stop sequence ended the text, which one.
    fn stop(&self, g: &Generation) -> (&'static str, Option<String>) {
        match g.finish_reason {
            FinishReason::Length => ("max_tokens", None),
            FinishReason::Stop | FinishReason::Cancelled => {
                let matched = stop_sequence(self.state.engine.tokenizer(), g, &self.stops);
                match matched {
                    Some(s) => ("stop_sequence", Some(s)),
                    None => ("end_turn", None),
                }
            }
        }
    }
}

/// The stop string that cut `g`'s text: the generated ids decode to the text followed by it.
fn stop_sequence(tok: &Tokenizer, g: &Generation, stops: &[String]) -> Option<String> {
    let full = tok.decode(&g.token_ids).ok()?;
    let rest = full.strip_prefix(g.text.as_str())?;
    stops.iter().find(|s| rest.starts_with(s.as_str())).cloned()
}

impl Chunks for MessageEvents {
    fn start(&mut self) -> Vec<Value> {
        vec![
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}),
            json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
            json!({"type": "ping"}),
        ]
    }

    fn token(&mut self, token: TokenOut) -> Vec<Value> {
        if token.text.is_empty() {
            return Vec::new();
        }
        self.shown += token.text.len();
        vec![json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": token.text}})]
    }

    fn finish(&mut self, g: &Generation) -> Vec<Value> {
        let mut out = Vec::new();
        // Text the tokens held back comes before the block closes.
        let tail = g.text.get(self.shown..).unwrap_or_default();
        if !tail.is_empty() {
            out.push(json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": tail}}));
        }
        let (stop_reason, stop_sequence) = self.stop(g);
        out.push(json!({"type": "content_block_stop", "index": 0}));
        out.push(json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": g.stats.generated_tokens}}));
        out.push(json!({"type": "message_stop"}));
        out
    }

    fn usage(&mut self, _usage: super::openai_types::Usage) -> Value {
        unreachable!(
            "invariant: Anthropic streams report usage in message_delta (include_usage is false)"
        )
    }

    fn error(&mut self, e: &ApiError) -> Value {
        anthropic_error(e)
    }

    fn done(&self) -> Option<&'static str> {
        None
    }

    fn named_events(&self) -> bool {
        true
    }
}
