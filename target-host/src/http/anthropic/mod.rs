//! `POST /v1/messages`: Anthropic's Messages API on the same engine and chat template as
//! `/v1/chat/completions`.
//!
//! Reference: <https://docs.anthropic.com/en/api/messages> and its streaming events
//! (`message_start`, `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`; errors as an `error` event). Errors use Anthropic's body,
//! `{"type": "error", "error": {"type", "message"}}`. Supported: `model`, `max_tokens`,
//! `messages` (string or `text` / `tool_use` / `tool_result` blocks: [`blocks`]), `system`,
//! `stop_sequences`, `stream`, `temperature` (0..=1), `top_p`, `top_k`, `metadata.user_id`,
//! `tools` and `tool_choice` (`auto`, `any`, `tool`, `none`; `any` and `tool` forced by the
//! grammar as on `/v1/chat/completions`), and Specula's `speculative`. Anything else (images,
//! thinking, server tools) is a 400 naming it.
//!
//! Calls in the reply are `tool_use` blocks with `stop_reason: "tool_use"`; streamed, each is a
//! `content_block_start` of type `tool_use`, its input as `input_json_delta`, then
//! `content_block_stop`. Blocks open as their content arrives (a reply that is only a call has
//! no text block), so the stream describes exactly the blocks of the whole reply.

mod blocks;

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use specula_models::chat::{ChatMessage, RenderOptions};
use specula_models::tokenizer::Tokenizer;

use self::blocks::{messages_of, text_of, Content};
use super::chat::{forced_constraint, tool_error};
use super::error::{parse_value, ApiError, ApiJson};
use super::request::{check_common, check_fields};
use super::stream::{collect, sse, Chunks, TokenOut, Tracker};
use super::{encode_rendered, new_id, AppState};
use crate::generation::{FinishReason, Generation};
use crate::tools::parse::{ParsedCall, Piece};
use crate::tools::{call_id, Reply, ToolSet};

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
    "tools",
    "tool_choice",
];

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<MessageIn>,
    system: Option<Content>,
    #[allow(dead_code)] // read through the shared checks; typed here so a bad one is named
    stop_sequences: Option<Vec<String>>,
    #[serde(default, deserialize_with = "crate::http::openai_types::null_as_false")]
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

/// Everything `/v1/messages` reads from a body before the model: the request, each message's
/// blocks, the tools — for the property tests, which only care that it returns.
#[cfg(test)]
pub(super) fn parse_for_tests(body: &Value) -> bool {
    let tools = ToolSet::from_anthropic(body.get("tools"), body.get("tool_choice")).is_ok();
    let Ok(req) = parse_value::<MessagesRequest>(body) else {
        return tools;
    };
    let system = req.system.as_ref().map(|s| text_of(s, "system").is_ok());
    let messages = req
        .messages
        .iter()
        .enumerate()
        .all(|(i, m)| messages_of(i, &m.role, &m.content).is_ok());
    tools && messages && system != Some(false)
}

/// An [`ApiError`] in Anthropic's shape.
pub(crate) fn anthropic_error(e: &ApiError) -> Value {
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
    // Errors name the fields as this API spells them.
    let anthropic_names = |mut e: ApiError| {
        if let Some(p) = &e.param {
            if let Some(rest) = p.strip_prefix("stop") {
                e.param = Some(format!("stop_sequences{rest}"));
                e.message = e.message.replace("stop strings", "stop_sequences");
            }
        }
        e
    };
    let mut checked = parse_value(&common)
        .and_then(|p| check_common(state, &p))
        .map_err(anthropic_names)?;
    let tools =
        ToolSet::from_anthropic(body.get("tools"), body.get("tool_choice")).map_err(tool_error)?;
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
        messages.extend(messages_of(i, &m.role, &m.content)?);
    }
    let template = state.engine.chat_template().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "no_chat_template",
            "the model has no chat template",
        )
    })?;
    let template_tools = tools.as_ref().map(ToolSet::template_tools);
    // A final assistant message is a prefill the reply continues, as Anthropic does.
    let prefill = messages.last().is_some_and(|m| m.role == "assistant");
    let opts = RenderOptions {
        generation: match prefill {
            true => specula_models::chat::GenerationPrompt::Omit,
            false => specula_models::chat::GenerationPrompt::Add,
        },
        continue_final_message: prefill,
        content_special: state.content_special,
        tools: template_tools.as_ref(),
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
    // The client's stop sequences, for `stop_sequence` (not the one a single call adds).
    let stops = checked.stop.clone();
    if let Some(stop) = tools.as_ref().and_then(ToolSet::stop) {
        checked.stop.push(stop.to_string());
    }
    checked.grammar = forced_constraint(state, tools.as_ref(), false)?;
    let (gen_req, plan) = checked.into_request(state, prompt_ids, None, "messages")?;
    let rx = match super::admission::submit(state, "messages", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(refused.respond(anthropic_error)),
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
        reply: Reply::new(tools.as_ref()),
        open_text: None,
        blocks: 0,
        calls: 0,
    };
    if plan.stream {
        return Ok(sse(rx, events, false, tracker).into_response());
    }
    let (generation, _) = collect(rx, tracker).await?;
    let stopped = generation.finish_reason == FinishReason::Stop;
    // The blocks in the reply's order: text runs and calls.
    let mut content: Vec<Value> = Vec::new();
    let mut calls = false;
    for piece in events.reply.clone().whole(&generation.text, stopped) {
        match piece {
            Piece::Text(t) if t.is_empty() => {}
            Piece::Text(t) => match content.last_mut() {
                Some(last) if last["type"] == "text" => {
                    let joined = format!("{}{t}", last["text"].as_str().unwrap_or_default());
                    last["text"] = joined.into();
                }
                _ => content.push(json!({"type": "text", "text": t})),
            },
            Piece::Call(c) => {
                calls = true;
                content.push(tool_use_block(c, true));
            }
        }
    }
    if content.is_empty() {
        content.push(json!({"type": "text", "text": ""}));
    }
    let (stop_reason, stop_sequence) = events.stop(&generation, calls);
    let body = json!({
        "id": std::mem::take(&mut events.id),
        "type": "message",
        "role": "assistant",
        "model": events.model,
        "content": content,
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
    /// Bytes of generated text fed to `reply` so far.
    shown: usize,
    /// Text and calls of the reply.
    reply: Reply,
    /// The index of the text block open now, if one is.
    open_text: Option<usize>,
    /// Blocks started so far (the next block's index).
    blocks: usize,
    /// Calls streamed so far.
    calls: usize,
}

/// A call as a `tool_use` block; `with_input`: its input in the block (a whole reply), else
/// `{}` (a stream's `content_block_start`, the input following as `input_json_delta`).
fn tool_use_block(c: ParsedCall, with_input: bool) -> Value {
    let input = match with_input {
        true => Value::Object(c.arguments),
        false => json!({}),
    };
    json!({"type": "tool_use", "id": call_id("toolu_"), "name": c.name, "input": input})
}

impl MessageEvents {
    /// Anthropic's `stop_reason` and, when a stop sequence ended the text, which one; `calls`:
    /// the reply holds tool calls.
    fn stop(&self, g: &Generation, calls: bool) -> (&'static str, Option<String>) {
        if calls {
            return ("tool_use", None);
        }
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

impl MessageEvents {
    /// The events of released pieces: text into the open text block (opened when needed), a
    /// call as its own `tool_use` block after closing the text block.
    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Value> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(text) if text.is_empty() => {}
                Piece::Text(text) => {
                    let index = match self.open_text {
                        Some(i) => i,
                        None => self.open_block(json!({"type": "text", "text": ""}), &mut out),
                    };
                    self.open_text = Some(index);
                    out.push(json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": text}}));
                }
                Piece::Call(call) => {
                    self.close_text(&mut out);
                    self.calls += 1;
                    let input = call.arguments_json();
                    let index = self.open_block(tool_use_block(call, false), &mut out);
                    out.push(json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": input}}));
                    out.push(json!({"type": "content_block_stop", "index": index}));
                }
            }
        }
        out
    }

    fn open_block(&mut self, block: Value, out: &mut Vec<Value>) -> usize {
        let index = self.blocks;
        self.blocks += 1;
        out.push(json!({"type": "content_block_start", "index": index, "content_block": block}));
        index
    }

    fn close_text(&mut self, out: &mut Vec<Value>) {
        if let Some(index) = self.open_text.take() {
            out.push(json!({"type": "content_block_stop", "index": index}));
        }
    }
}

impl Chunks for MessageEvents {
    fn start(&mut self) -> Vec<Value> {
        vec![
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}),
            json!({"type": "ping"}),
        ]
    }

    fn token(&mut self, token: TokenOut) -> Vec<Value> {
        self.shown += token.text.len();
        let pieces = self.reply.push(&token.text);
        self.pieces(pieces)
    }

    fn finish(&mut self, g: &Generation) -> Vec<Value> {
        // Text the tokens held back (a stop-string prefix, a possible call) comes before the
        // blocks close, so the stream holds exactly the blocks of the whole reply.
        let tail = g.text.get(self.shown..).unwrap_or_default();
        let mut pieces = self.reply.push(tail);
        pieces.extend(self.reply.finish(g.finish_reason == FinishReason::Stop));
        let mut out = self.pieces(pieces);
        if self.blocks == 0 {
            // An empty reply is one empty text block, as the whole reply is.
            self.open_text = Some(self.open_block(json!({"type": "text", "text": ""}), &mut out));
        }
        self.close_text(&mut out);
        let (stop_reason, stop_sequence) = self.stop(g, self.calls > 0);
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
