//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion.
//!
//! With `tools`, the template renders them (or the fallback of a template without a tools
//! branch does: `specula_models::chat`), and the reply is parsed for calls ([`crate::tools`]):
//! `message.tool_calls` with `finish_reason: "tool_calls"`, streamed as OpenAI's
//! `delta.tool_calls` (a call's id and name first, then its arguments). `tool_choice:
//! "required"` or a named function is forced by a grammar ([`ToolSet::forced_grammar`]) that
//! runs on every verify row like `response_format`, so speculation stays on and lossless.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use specula_models::chat::{ChatMessage, GenerationPrompt, RenderOptions, RenderedPrompt};
use specula_models::tokenizer::Tokenizer;

use super::error::{parse_value, ApiError, ApiJson};
use super::openai_types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageIn, ChatMessageOut,
    ChatRequest, ChatResponse, ChatTokenLogprob, FunctionCallIn, MessageContent, ToolCallOut,
    TopLogprob, Usage, CHAT_FIELDS, MESSAGE_FIELDS,
};
use super::request::{check_common, check_fields, check_top_logprobs, COMMON_FIELDS};
use super::stream::{collect, finish_reason, sse, Chunks, TokenOut, Tracker};
use super::{encode_rendered, new_id, respond, token_text, unix_now, AppState};
use crate::generation::{FinishReason, Generation};
use crate::tools::parse::{ParsedCall, Piece};
use crate::tools::{call_id, Reply, ToolError, ToolSet};

/// `POST /v1/chat/completions`.
pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Response {
    respond(&state, "chat", run(&state, body).await)
}

async fn run(state: &Arc<AppState>, body: Result<ApiJson, ApiError>) -> Result<Response, ApiError> {
    let ApiJson(body) = body?;
    check_fields(&body, &[COMMON_FIELDS, CHAT_FIELDS])?;
    let req: ChatRequest = parse_value(&body)?;
    let checked = check_common(state, &parse_value(&body)?)?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs = true",
            ))
        }
        (false, None) => None,
        (true, n) => Some(check_top_logprobs("top_logprobs", n.unwrap_or(0))?),
    };
    check_messages(&body)?;
    let tools = tool_set(&body)?;
    let prompt = render(state, &req, tools.as_ref())?;
    super::check_prompt_size(state, &prompt.text(), "messages").await?;
    let prompt_ids = encode_rendered(state, prompt, "messages").await?;
    let mut checked = checked;
    if let Some(stop) = tools.as_ref().and_then(ToolSet::stop) {
        checked.stop.push(stop.to_string());
    }
    if let Some(forced) = forced_constraint(state, tools.as_ref(), checked.grammar.is_some())? {
        checked.grammar = Some(forced);
    }
    let (gen_req, plan) = checked.into_request(state, prompt_ids, logprobs, "messages")?;
    let rx = match super::admission::submit(state, "chat", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(refused.respond(ApiError::to_json)),
    };
    let tracker = Tracker::new(state.metrics.clone(), "chat");
    let mut chunks = ChatChunks {
        id: new_id("chatcmpl"),
        created: unix_now(),
        model: state.model_name.clone(),
        state: state.clone(),
        logprobs: logprobs.is_some(),
        shown: 0,
        reply: Reply::new(tools.as_ref()),
        calls: 0,
    };
    if plan.stream {
        return Ok(sse(rx, chunks, plan.include_usage, tracker).into_response());
    }
    let (generation, tokens) = collect(rx, tracker).await?;
    let logprobs = logprobs.map(|_| chunks.logprobs_of(&tokens));
    let stopped = generation.finish_reason == FinishReason::Stop;
    let (content, calls) = chunks.reply.clone().split_whole(&generation.text, stopped);
    let finish = match calls.is_empty() {
        true => finish_reason(generation.finish_reason),
        false => "tool_calls",
    };
    let tool_calls = (!calls.is_empty()).then(|| calls.into_iter().map(tool_call_out).collect());
    let content = match (&tool_calls, content.is_empty()) {
        (Some(_), true) => None,
        _ => Some(content),
    };
    let response = ChatResponse {
        id: std::mem::take(&mut chunks.id),
        object: "chat.completion",
        created: chunks.created,
        model: chunks.model.clone(),
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessageOut {
                role: "assistant",
                content,
                tool_calls,
            },
            logprobs,
            finish_reason: finish,
        }],
        usage: Usage::from_stats(&generation.stats),
    };
    Ok(axum::Json(response).into_response())
}

/// Renders the chat request in `body` (its messages and template options) as
/// `/v1/chat/completions` would.
///
/// # Errors
/// 400 naming the field at fault.
pub fn render_body(state: &AppState, body: &serde_json::Value) -> Result<RenderedPrompt, ApiError> {
    let req: ChatRequest = parse_value(body)?;
    check_messages(body)?;
    let tools = tool_set(body)?;
    render(state, &req, tools.as_ref())
}

/// The request's tools (`tools`, `tool_choice`, `parallel_tool_calls`), checked.
fn tool_set(body: &serde_json::Value) -> Result<Option<ToolSet>, ApiError> {
    let tools = ToolSet::from_openai(
        body.get("tools"),
        body.get("tool_choice"),
        body.get("parallel_tool_calls"),
    )
    .map_err(tool_error)?;
    Ok(tools)
}

/// The grammar that forces the call a `tool_choice` of `required` or a named function asks
/// for (`None` for any other choice); `has_format`: the request also has a `response_format`,
/// which cannot hold at the same time.
///
/// # Errors
/// 400 naming both fields when `has_format`; 400 on `tools` when a schema cannot be enforced.
pub fn forced_constraint(
    state: &AppState,
    tools: Option<&ToolSet>,
    has_format: bool,
) -> Result<Option<crate::grammar::Constraint>, ApiError> {
    let Some(tools) = tools.filter(|t| t.forced().is_some()) else {
        return Ok(None);
    };
    if has_format {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice forces a tool call and response_format forces the reply's format: \
             a request may have one of them, not both",
        ));
    }
    let vocab = crate::grammar::Vocab::of(state.engine.tokenizer()).map_err(|e| {
        ApiError::invalid(
            "tool_choice",
            format!("forced tool calls are not available for this model: {e:#}"),
        )
    })?;
    tools.forced_constraint(&vocab, "tools").map_err(tool_error)
}

/// A [`ToolError`] as a 400 naming its field.
pub fn tool_error(e: ToolError) -> ApiError {
    ApiError::invalid(&e.param, e.message)
}

/// A parsed call as OpenAI's response writes it.
fn tool_call_out(c: ParsedCall) -> ToolCallOut {
    ToolCallOut {
        id: call_id("call_"),
        kind: "function",
        function: FunctionCallIn {
            arguments: c.arguments_json(),
            name: c.name,
        },
    }
}

/// Roles a message may have (`developer` is OpenAI's newer name for `system`).
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// 400 for a message field this server does not read.
fn check_messages(body: &serde_json::Value) -> Result<(), ApiError> {
    let Some(messages) = body["messages"].as_array() else {
        return Ok(());
    };
    for (i, m) in messages.iter().enumerate() {
        if let Some(k) = m
            .as_object()
            .and_then(|o| o.keys().find(|k| !MESSAGE_FIELDS.contains(&k.as_str())))
        {
            return Err(ApiError::invalid(
                &format!("messages[{i}].{k}"),
                format!("unsupported message field `{k}`"),
            ));
        }
    }
    Ok(())
}

/// Renders the request's messages with the model's chat template; special-token text inside
/// them stays text unless the server trusts its callers.
fn render(
    state: &AppState,
    req: &ChatRequest,
    tools: Option<&ToolSet>,
) -> Result<RenderedPrompt, ApiError> {
    let messages = &req.messages;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let template = state.engine.chat_template().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "no_chat_template",
            "the model has no chat template: use /v1/completions",
        )
    })?;
    let mut plain = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        plain.push(message(i, m)?);
    }
    let add = req
        .add_generation_prompt
        .unwrap_or(!req.continue_final_message);
    if add && req.continue_final_message {
        return Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    if req.continue_final_message && plain.last().is_some_and(|m| m.role != "assistant") {
        return Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message needs the last message to be the assistant's",
        ));
    }
    let template_tools = tools.map(ToolSet::template_tools);
    let opts = RenderOptions {
        generation: match add {
            true => GenerationPrompt::Add,
            false => GenerationPrompt::Omit,
        },
        continue_final_message: req.continue_final_message,
        tools: template_tools.as_ref(),
        kwargs: req.chat_template_kwargs.as_ref(),
        content_special: state.content_special,
    };
    template.render_prompt(&plain, &opts).map_err(|e| {
        let param = match e.to_string().contains("chat_template_kwargs") {
            true => "chat_template_kwargs",
            false => "messages",
        };
        ApiError::invalid(
            param,
            format!("the chat template rejected the request: {e}"),
        )
    })
}

/// One request message as the template sees it.
fn message(i: usize, m: &ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "developer" => "system",
        r if ROLES.contains(&r) => r,
        other => {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!(
                    "unknown role `{other}`: expected one of {}",
                    ROLES.join(", ")
                ),
            ))
        }
    };
    let content = match &m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].content[{j}]"),
                            format!(
                                "content part of type `{}` is not supported: only text",
                                p.kind
                            ),
                        ))
                    }
                }
            }
            text
        }
    };
    if m.tool_calls.is_some() && role != "assistant" {
        return Err(ApiError::invalid(
            &format!("messages[{i}].tool_calls"),
            "only assistant messages have tool_calls",
        ));
    }
    if m.tool_call_id.is_some() && role != "tool" {
        return Err(ApiError::invalid(
            &format!("messages[{i}].tool_call_id"),
            "only tool messages have a tool_call_id",
        ));
    }
    let tool_calls = match &m.tool_calls {
        None => None,
        Some(calls) => {
            let mut out = Vec::with_capacity(calls.len());
            for (j, c) in calls.iter().enumerate() {
                // Templates iterate `arguments` as a mapping, as transformers passes it.
                let arguments: serde_json::Value = serde_json::from_str(&c.function.arguments)
                    .map_err(|e| {
                        ApiError::invalid(
                            &format!("messages[{i}].tool_calls[{j}].function.arguments"),
                            format!("arguments must be a JSON object encoded as a string: {e}"),
                        )
                    })?;
                out.push(serde_json::json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": arguments},
                }));
            }
            Some(serde_json::Value::Array(out))
        }
    };
    Ok(ChatMessage {
        role: role.to_string(),
        content,
        tool_calls,
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
    })
}

struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    /// The state, for its tokenizer (the stream outlives the handler).
    state: Arc<AppState>,
    logprobs: bool,
    /// Bytes of generated text fed to `reply` so far.
    shown: usize,
    /// Content and calls of the reply.
    reply: Reply,
    /// Calls streamed so far (the next call's `index`).
    calls: usize,
}

impl ChatChunks {
    fn logprobs_of(&self, tokens: &[TokenOut]) -> ChatLogprobs {
        let tokenizer: &Tokenizer = self.state.engine.tokenizer();
        // The token's own bytes: a token holding part of a character has no text of its own
        // (its `token` reads U+FFFD), and its bytes let a client join the pieces.
        let entry = |id: u32, logprob: f32| {
            (
                tokenizer.token_bytes(id).to_vec(),
                token_text(tokenizer, id),
                logprob,
            )
        };
        let content = tokens
            .iter()
            .filter_map(|t| t.logprob.as_ref().map(|lp| (t.id, lp)))
            .map(|(id, lp)| {
                let (bytes, token, logprob) = entry(id, lp.logprob);
                let top_logprobs = lp
                    .top
                    .iter()
                    .map(|&(id, p)| {
                        let (bytes, token, logprob) = entry(id, p);
                        TopLogprob {
                            token,
                            logprob,
                            bytes,
                        }
                    })
                    .collect();
                ChatTokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs,
                }
            })
            .collect();
        ChatLogprobs { content }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> serde_json::Value {
        serde_json::to_value(ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .expect("invariant: a chat chunk serializes")
    }
}

impl ChatChunks {
    fn delta(&self, delta: ChatDelta, finish: Option<&'static str>) -> serde_json::Value {
        self.chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: finish,
            }],
            None,
        )
    }

    /// The chunks of released pieces: content deltas, and for a call one delta with its
    /// index, id and name, then one with its arguments.
    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(text) => out.push(self.delta(
                    ChatDelta {
                        content: Some(text),
                        ..ChatDelta::default()
                    },
                    None,
                )),
                Piece::Call(call) => {
                    let index = self.calls;
                    self.calls += 1;
                    let call = tool_call_out(call);
                    let head = serde_json::json!({"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.function.name, "arguments": ""}});
                    let args = serde_json::json!({"index": index,
                        "function": {"arguments": call.function.arguments}});
                    for d in [head, args] {
                        out.push(self.delta(
                            ChatDelta {
                                tool_calls: Some(vec![d]),
                                ..ChatDelta::default()
                            },
                            None,
                        ));
                    }
                }
            }
        }
        out
    }
}

impl Chunks for ChatChunks {
    fn start(&mut self) -> Vec<serde_json::Value> {
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
            tool_calls: None,
        };
        vec![self.delta(delta, None)]
    }

    fn token(&mut self, token: TokenOut) -> Vec<serde_json::Value> {
        self.shown += token.text.len();
        let pieces = self.reply.push(&token.text);
        let mut out = self.pieces(pieces);
        if self.logprobs {
            let logprobs = self.logprobs_of(std::slice::from_ref(&token));
            if out.is_empty() {
                // The token's text is held back (or empty): its logprobs still come now.
                out.push(self.delta(
                    ChatDelta {
                        content: Some(String::new()),
                        ..ChatDelta::default()
                    },
                    None,
                ));
            }
            out[0]["choices"][0]["logprobs"] =
                serde_json::to_value(logprobs).expect("invariant: logprobs serialize");
        }
        out
    }

    fn finish(&mut self, generation: &Generation) -> Vec<serde_json::Value> {
        // Text the tokens held back (a stop-string prefix that never completed, a possible
        // tag) comes with the last chunks, so a stream shows exactly the non-streamed reply.
        let tail = generation.text.get(self.shown..).unwrap_or_default();
        let mut pieces = self.reply.push(tail);
        pieces.extend(
            self.reply
                .finish(generation.finish_reason == FinishReason::Stop),
        );
        let mut out = self.pieces(pieces);
        let finish = match self.calls {
            0 => finish_reason(generation.finish_reason),
            _ => "tool_calls",
        };
        out.push(self.delta(ChatDelta::default(), Some(finish)));
        out
    }

    fn usage(&mut self, usage: Usage) -> serde_json::Value {
        self.chunk(Vec::new(), Some(usage))
    }
}
