//! `POST /v1/completions`: raw text in, text out (legacy OpenAI completions, with the legacy
//! parallel-array `logprobs`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::error::{parse_value, ApiError, ApiJson};
use super::openai_types::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage,
    COMPLETION_FIELDS,
};
use super::request::{check_common, check_fields, check_top_logprobs, COMMON_FIELDS};
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
    check_fields(&body, &[COMMON_FIELDS, COMPLETION_FIELDS])?;
    let req: CompletionRequest = parse_value(&body)?;
    let mut checked = check_common(state, &parse_value(&body)?)?;
    checked.default_max_tokens = Some(DEFAULT_MAX_TOKENS);
    if req.echo {
        return Err(ApiError::invalid("echo", "echo = true is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "suffix (insertion) is not supported",
        ));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    let logprobs = req
        .logprobs
        .map(|n| check_top_logprobs("logprobs", n))
        .transpose()?;
    let prompt_ids = match prompt_of(&req.prompt, state.engine.tokenizer().vocab_size())? {
        Prompt::Text(text) => {
            super::check_prompt_size(state, &text, "prompt").await?;
            encode(state, &text, "prompt").await?
        }
        Prompt::Ids(ids) => ids,
    };
    let (gen_req, plan) = checked.into_request(state, prompt_ids, logprobs, "prompt")?;
    let rx = match super::admission::submit(state, "completions", gen_req) {
        Ok(rx) => rx,
        Err(refused) => return Ok(refused.respond(ApiError::to_json)),
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

/// A completions prompt, read.
#[derive(Debug, PartialEq)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Reads `prompt` as OpenAI and vLLM take it: a string, a list of token ids, or a batch (a list)
/// of one of either. Larger batches are refused: `n`-way batching is not served.
///
/// # Errors
/// 400 naming `prompt` with what is wrong.
fn prompt_of(v: &serde_json::Value, vocab: usize) -> Result<Prompt, ApiError> {
    use serde_json::Value as J;
    let bad = |m: String| ApiError::invalid("prompt", m);
    let ids = |a: &[J]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|x| {
                x.as_u64()
                    .filter(|&id| (id as usize) < vocab)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        bad(format!("token ids must be integers in 0..{vocab}, got {x}"))
                    })
            })
            .collect()
    };
    match v {
        J::String(s) => Ok(Prompt::Text(s.clone())),
        J::Array(a) if a.is_empty() => Err(bad("the prompt is empty".into())),
        J::Array(a) if a.iter().all(J::is_number) => Ok(Prompt::Ids(ids(a)?)),
        J::Array(a) if a.len() > 1 => Err(bad(format!(
            "a batch of {} prompts is not supported: send one prompt",
            a.len()
        ))),
        J::Array(a) => match &a[0] {
            J::String(s) => Ok(Prompt::Text(s.clone())),
            J::Array(inner) if !inner.is_empty() && inner.iter().all(J::is_number) => {
                Ok(Prompt::Ids(ids(inner)?))
            }
            other => Err(bad(format!(
                "a prompt in a list must be a string or a list of token ids, got {other}"
            ))),
        },
        other => Err(bad(format!(
            "prompt must be a string, a list of token ids, or a list of one of either; got {}",
            kind(other)
        ))),
    }
}

/// [`prompt_of`] for the property tests, which only care that it returns.
#[cfg(test)]
pub(super) fn prompt_of_for_tests(v: &serde_json::Value, vocab: usize) -> bool {
    prompt_of(v, vocab).is_ok()
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
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

    fn token(&mut self, token: TokenOut) -> Vec<serde_json::Value> {
        if token.text.is_empty() && !self.logprobs {
            return Vec::new();
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
        vec![self.chunk(vec![choice], None)]
    }

    fn finish(&mut self, generation: &Generation) -> Vec<serde_json::Value> {
        // Text the tokens held back (a stop-string prefix that never completed) comes with the
        // last chunk, so a stream shows exactly the non-streamed text.
        let tail = generation.text.get(self.offset..).unwrap_or_default();
        let choice = CompletionChoice {
            index: 0,
            text: tail.to_string(),
            logprobs: None,
            finish_reason: Some(finish_reason(generation.finish_reason)),
        };
        vec![self.chunk(vec![choice], None)]
    }

    fn usage(&mut self, usage: Usage) -> serde_json::Value {
        self.chunk(Vec::new(), Some(usage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_as_openai_and_vllm_take_them() {
        let ok = |v| prompt_of(&v, 100).unwrap();
        assert_eq!(ok(json!("hi")), Prompt::Text("hi".into()));
        assert_eq!(ok(json!(["hi"])), Prompt::Text("hi".into()));
        assert_eq!(ok(json!([1, 2, 3])), Prompt::Ids(vec![1, 2, 3]));
        assert_eq!(ok(json!([[4, 5]])), Prompt::Ids(vec![4, 5]));
        for bad in [
            json!([]),
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([100]),
            json!([-1]),
            json!([1.5]),
            json!(7),
            json!(null),
            json!([{}]),
            json!([[]]),
        ] {
            let e = prompt_of(&bad, 100).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
            assert!(!e.message.contains("untagged"), "{}", e.message);
        }
    }
}
