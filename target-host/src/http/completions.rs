//! `POST /v1/completions`: raw text in, text out (legacy OpenAI completions, with the legacy
//! parallel-array `logprobs`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::error::{parse_value, ApiError, ApiJson};
use super::openai_types::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptField, Usage,
};
use super::request::{check_common, check_top_logprobs};
use super::stream::{collect, finish_reason, sse, Chunks, TokenOut, Tracker};
use super::{encode, new_id, respond, unix_now, AppState};
use crate::generation::Generation;
use specula_models::tokenizer::Tokenizer;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

/// `POST /v1/completions`.
pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Response {
    respond(&state, "completions", run(&state, body).await)
}

async fn run(state: &Arc<AppState>, body: Result<ApiJson, ApiError>) -> Result<Response, ApiError> {
    let ApiJson(body) = body?;
    let req: CompletionRequest = parse_value(&body)?;
    let mut checked = check_common(state, &parse_value(&body)?)?;
    checked.default_max_tokens = Some(DEFAULT_MAX_TOKENS);
    if req.echo {
        return Err(ApiError::invalid("echo", "echo = true is not supported"));
    }
    let prompt = match req.prompt {
        PromptField::One(p) => p,
        PromptField::Many(mut v) if v.len() == 1 => v.remove(0),
        PromptField::Many(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "a batch of {} prompts is not supported: send one prompt",
                    v.len()
                ),
            ))
        }
    };
    let logprobs = req
        .logprobs
        .map(|n| check_top_logprobs("logprobs", n))
        .transpose()?;
    let prompt_ids = encode(state, &prompt, "prompt").await?;
    let (gen_req, plan) = checked.into_request(state, prompt_ids, logprobs, "prompt")?;
    let rx = match super::admission::submit(state, "completions", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(*refused),
    };
    let tracker = Tracker::new(state.metrics.clone(), "completions");
    let chunks = CompletionChunks {
        id: new_id("cmpl"),
        created: unix_now(),
        model: state.model_name.clone(),
        state: state.clone(),
        offset: 0,
        logprobs: logprobs.is_some(),
    };
    if plan.stream {
        return Ok(sse(rx, chunks, plan.include_usage, tracker).into_response());
    }
    let (generation, tokens) = collect(rx, tracker).await?;
    let logprobs = logprobs.map(|_| legacy_logprobs(state.engine.tokenizer(), &tokens, 0));
    let response = CompletionResponse {
        id: chunks.id,
        object: "text_completion",
        created: chunks.created,
        model: chunks.model,
        choices: vec![CompletionChoice {
            index: 0,
            text: generation.text.clone(),
            logprobs,
            finish_reason: Some(finish_reason(generation.finish_reason)),
        }],
        usage: Some(Usage::from_stats(&generation.stats)),
    };
    Ok(axum::Json(response).into_response())
}

/// The legacy `logprobs` object for `tokens`, whose text starts at byte `offset`.
fn legacy_logprobs(
    tokenizer: &Tokenizer,
    tokens: &[TokenOut],
    offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for t in tokens {
        let Some(lp) = &t.logprob else { continue };
        let text = super::token_text(tokenizer, t.id);
        out.text_offset.push(at);
        at += text.len();
        out.tokens.push(text);
        out.token_logprobs.push(lp.logprob);
        let mut top = serde_json::Map::new();
        for &(id, p) in &lp.top {
            top.insert(super::token_text(tokenizer, id), p.into());
        }
        out.top_logprobs.push(top);
    }
    out
}

struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    /// The state, for its tokenizer (the stream outlives the handler).
    state: Arc<AppState>,
    /// Bytes of completion text streamed so far (for `text_offset`).
    offset: usize,
    logprobs: bool,
}

impl CompletionChunks {
    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> serde_json::Value {
        serde_json::to_value(CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .expect("invariant: a completion chunk serializes")
    }
}

impl Chunks for CompletionChunks {
    fn start(&mut self) -> Vec<serde_json::Value> {
        Vec::new()
    }

    fn token(&mut self, token: TokenOut) -> Option<serde_json::Value> {
        if token.text.is_empty() && !self.logprobs {
            return None;
        }
        let logprobs = self.logprobs.then(|| {
            legacy_logprobs(
                self.state.engine.tokenizer(),
                std::slice::from_ref(&token),
                self.offset,
            )
        });
        self.offset += token.text.len();
        let choice = CompletionChoice {
            index: 0,
            text: token.text,
            logprobs,
            finish_reason: None,
        };
        Some(self.chunk(vec![choice], None))
    }

    fn finish(&mut self, generation: &Generation) -> serde_json::Value {
        let choice = CompletionChoice {
            index: 0,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(finish_reason(generation.finish_reason)),
        };
        self.chunk(vec![choice], None)
    }

    fn usage(&mut self, usage: Usage) -> serde_json::Value {
        self.chunk(Vec::new(), Some(usage))
    }
}
