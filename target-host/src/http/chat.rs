//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use specula_models::chat::{ChatMessage, GenerationPrompt, RenderOptions, RenderedPrompt};
use specula_models::tokenizer::Tokenizer;

use super::error::{parse_value, ApiError, ApiJson};
use super::openai_types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageIn, ChatMessageOut,
    ChatRequest, ChatResponse, ChatTokenLogprob, MessageContent, TopLogprob, Usage, CHAT_FIELDS,
    MESSAGE_FIELDS,
};
use super::request::{check_common, check_fields, check_top_logprobs, COMMON_FIELDS};
use super::stream::{collect, finish_reason, sse, Chunks, TokenOut, Tracker};
use super::{encode_rendered, new_id, respond, token_text, unix_now, AppState};
use crate::generation::Generation;

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
    let prompt = render(state, &req)?;
    super::check_prompt_size(state, &prompt.text(), "messages").await?;
    let prompt_ids = encode_rendered(state, prompt, "messages").await?;
    let (gen_req, plan) = checked.into_request(state, prompt_ids, logprobs, "messages")?;
    let rx = match super::admission::submit(state, "chat", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(*refused),
    };
    let tracker = Tracker::new(state.metrics.clone(), "chat");
    let mut chunks = ChatChunks {
        id: new_id("chatcmpl"),
        created: unix_now(),
        model: state.model_name.clone(),
        state: state.clone(),
        logprobs: logprobs.is_some(),
        shown: 0,
    };
    if plan.stream {
        return Ok(sse(rx, chunks, plan.include_usage, tracker).into_response());
    }
    let (generation, tokens) = collect(rx, tracker).await?;
    let logprobs = logprobs.map(|_| chunks.logprobs_of(&tokens));
    let response = ChatResponse {
        id: std::mem::take(&mut chunks.id),
        object: "chat.completion",
        created: chunks.created,
        model: chunks.model.clone(),
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessageOut {
                role: "assistant",
                content: generation.text.clone(),
            },
            logprobs,
            finish_reason: finish_reason(generation.finish_reason),
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
    render(state, &req)
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
fn render(state: &AppState, req: &ChatRequest) -> Result<RenderedPrompt, ApiError> {
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
    let opts = RenderOptions {
        generation: match add {
            true => GenerationPrompt::Add,
            false => GenerationPrompt::Omit,
        },
        continue_final_message: req.continue_final_message,
        tools: None,
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
    /// Bytes of content streamed so far.
    shown: usize,
}

impl ChatChunks {
    fn logprobs_of(&self, tokens: &[TokenOut]) -> ChatLogprobs {
        let tokenizer: &Tokenizer = self.state.engine.tokenizer();
        let entry = |id: u32, logprob: f32| {
            let token = token_text(tokenizer, id);
            (token.as_bytes().to_vec(), token, logprob)
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

impl Chunks for ChatChunks {
    fn start(&mut self) -> Vec<serde_json::Value> {
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        vec![self.chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: None,
            }],
            None,
        )]
    }

    fn token(&mut self, token: TokenOut) -> Option<serde_json::Value> {
        if token.text.is_empty() && !self.logprobs {
            return None;
        }
        let logprobs = self
            .logprobs
            .then(|| self.logprobs_of(std::slice::from_ref(&token)));
        self.shown += token.text.len();
        let delta = ChatDelta {
            role: None,
            content: Some(token.text),
        };
        Some(self.chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: None,
            }],
            None,
        ))
    }

    fn finish(&mut self, generation: &Generation) -> Vec<serde_json::Value> {
        // Text the tokens held back (a stop-string prefix that never completed) comes with the
        // last chunk, so a stream shows exactly the non-streamed text.
        let tail = generation.text.get(self.shown..).unwrap_or_default();
        vec![self.chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: None,
                    content: (!tail.is_empty()).then(|| tail.to_string()),
                },
                logprobs: None,
                finish_reason: Some(finish_reason(generation.finish_reason)),
            }],
            None,
        )]
    }

    fn usage(&mut self, usage: Usage) -> serde_json::Value {
        self.chunk(Vec::new(), Some(usage))
    }
}
