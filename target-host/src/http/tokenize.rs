//! `POST /tokenize`, `POST /detokenize` (vLLM's shapes) and `GET /version`.
//!
//! `/tokenize` takes a raw `prompt` (special tokens parsed, as `/v1/completions` does) or chat
//! `messages` (rendered and tokenized exactly as `/v1/chat/completions` would, so a client can
//! count a conversation's tokens before sending it).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use specula_models::chat::RenderedPrompt;
use specula_models::tokenizer::Special;

use super::error::{parse_value, ApiError, ApiJson};
use super::request::check_fields;
use super::{encode_rendered, AppState};

/// `POST /tokenize` body.
#[derive(Debug, Deserialize)]
pub(super) struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    /// Prepend BOS when the model uses one (default true, as vLLM).
    add_special_tokens: Option<bool>,
}

const TOKENIZE_FIELDS: &[&str] = &["model", "prompt", "add_special_tokens"];
/// Chat fields `/tokenize` reads (through the chat renderer).
const TOKENIZE_CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
];

/// `POST /detokenize` body.
#[derive(Debug, Deserialize)]
pub(super) struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.model_name => Err(super::models::not_found(state, m)),
        _ => Ok(()),
    }
}

/// `POST /tokenize`: `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Response {
    run_tokenize(&state, body)
        .await
        .map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

async fn run_tokenize(
    state: &Arc<AppState>,
    body: Result<ApiJson, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ApiJson(body) = body?;
    let ids = if body.get("messages").is_some() {
        check_fields(&body, &[TOKENIZE_CHAT_FIELDS])?;
        let model = body["model"].as_str();
        check_model(state, model)?;
        let prompt = super::chat::render_body(state, &body)?;
        encode_rendered(state, prompt, "messages").await?
    } else {
        check_fields(&body, &[TOKENIZE_FIELDS])?;
        let req: TokenizeRequest = parse_value(&body)?;
        check_model(state, req.model.as_deref())?;
        let text = req
            .prompt
            .ok_or_else(|| ApiError::invalid("prompt", "`prompt` or `messages` is required"))?;
        super::check_prompt_size(state, &text, "prompt").await?;
        let tokenizer = state.engine.tokenizer();
        let bos_text = tokenizer.bos_id().and_then(|b| tokenizer.id_to_token(b));
        let starts_with_bos = bos_text.is_some_and(|b| text.starts_with(&b));
        let prompt = RenderedPrompt {
            segments: vec![(text, Special::Parse)],
        };
        let mut ids = encode_rendered(state, prompt, "prompt").await?;
        if req.add_special_tokens == Some(false) && tokenizer.adds_bos() && !starts_with_bos {
            // encode() prepended the BOS the text did not write.
            ids.remove(0);
        }
        ids
    };
    Ok(Json(serde_json::json!({
        "count": ids.len(),
        "max_model_len": state.engine.model().context_len(),
        "tokens": ids,
    })))
}

/// `POST /detokenize`: `{"prompt"}`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ApiJson(body) = body?;
    check_fields(&body, &[&["model", "tokens"]])?;
    let req: DetokenizeRequest = parse_value(&body)?;
    check_model(&state, req.model.as_deref())?;
    let vocab = state.engine.tokenizer().vocab_size();
    let ids = req
        .tokens
        .iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("token ids must be in 0..{vocab}, got {t}"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let text = state
        .engine
        .tokenizer()
        .decode(&ids)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(serde_json::json!({ "prompt": text })))
}

/// `GET /version`: the server's and the drafter protocol's versions.
pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "protocol_version": specula_protocol::PROTOCOL_VERSION.to_string(),
    }))
}
