//! `POST /v1/chat/completions`: messages rendered through the model's chat template, then
//! generated like a completion.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::tokenizer::Tokenizer;

use super::error::{parse_value, ApiError, ApiJson};
use super::openai_types::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageIn, ChatMessageOut,
    ChatRequest, ChatResponse, ChatTokenLogprob, MessageContent, TopLogprob, Usage,
};
use super::request::{check_common, check_top_logprobs};
use super::stream::{collect, finish_reason, sse, Chunks, TokenOut, Tracker};
use super::{encode, new_id, respond, token_text, unix_now, AppState};
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
    let text = render(state, &req.messages)?;
    let prompt_ids = encode(state, &text, "messages").await?;
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

/// Renders `messages` with the model's chat template (with the generation prompt).
fn render(state: &AppState, messages: &[ChatMessageIn]) -> Result<String, ApiError> {
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
        plain.push(ChatMessage {
            role: m.role.clone(),
            content,
        });
    }
    template.render(&plain, GenerationPrompt::Add).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("the chat template rejected the messages: {e}"),
        )
    })
}

struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    /// The state, for its tokenizer (the stream outlives the handler).
    state: Arc<AppState>,
    logprobs: bool,
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

    fn finish(&mut self, generation: &Generation) -> serde_json::Value {
        self.chunk(
            vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta::default(),
                logprobs: None,
                finish_reason: Some(finish_reason(generation.finish_reason)),
            }],
            None,
        )
    }

    fn usage(&mut self, usage: Usage) -> serde_json::Value {
        self.chunk(Vec::new(), Some(usage))
    }
}
