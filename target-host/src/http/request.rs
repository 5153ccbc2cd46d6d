//! Checking an API request and turning it into a [`GenerationRequest`]: every field the
//! engine would reject, or silently misread, is answered with a 400 naming the field, and so
//! is every field this server does not know ([`check_fields`]): nothing is silently ignored.

use axum::http::StatusCode;
use specula_models::sampling::SamplingParams;

use super::error::ApiError;
use super::openai_types::{CommonParams, JsonSchemaFormat, ResponseFormat};
use super::AppState;
use crate::generation::{GenerationRequest, Speculation};
use crate::grammar::{Constraint, Vocab};

/// Most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Most stop strings per request (OpenAI allows 4; more is cheap for us but unbounded is not).
const MAX_STOPS: usize = 16;

/// Most `logit_bias` entries (OpenAI allows 300).
const MAX_LOGIT_BIAS: usize = 300;

/// Fields both generation endpoints read ([`CommonParams`]). `user` is an end-user id that
/// is written to the request log.
pub const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "speculative",
    "user",
    "response_format",
];

/// Answers 400 for the first top-level field of `body` not in any of `known`.
///
/// # Errors
/// 400 `unknown_field` naming it.
pub fn check_fields(body: &serde_json::Value, known: &[&[&str]]) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else {
        return Ok(());
    };
    match obj
        .keys()
        .find(|k| !known.iter().any(|set| set.contains(&k.as_str())))
    {
        None => Ok(()),
        Some(k) => Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("unsupported request field `{k}`: this server does not implement it"),
            param: Some(k.clone()),
            code: "unknown_field",
        }),
    }
}

/// What generation needs besides the prompt, checked.
pub struct Checked {
    /// Default `max_tokens` when the request has none (`None`: the rest of the context).
    pub default_max_tokens: Option<usize>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Speculation for this request.
    pub speculation: Speculation,
    /// `max_tokens` as asked (checked > 0 and <= context).
    pub max_tokens: Option<usize>,
    /// Stream the answer.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// The compiled `response_format`.
    pub grammar: Option<Constraint>,
}

/// Checks the fields both endpoints share.
///
/// # Errors
/// 400 naming the field: `n` other than 1, `max_tokens` <= 0 or larger than the context,
/// sampling values out of range, too many or empty stop strings, `num_draft_tokens` of 0 or
/// absurd; 404 for a model other than the served one.
pub fn check_common(state: &AppState, p: &CommonParams) -> Result<Checked, ApiError> {
    if let Some(model) = &p.model {
        if *model != state.model_name {
            return Err(super::models::not_found(state, model));
        }
    }
    if let Some(n) = p.n {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("n = {n} is not supported: only n = 1"),
            ));
        }
    }
    if p.stream_options.is_some() && !p.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let context = state.engine.model().context_len();
    let (max_param, max_tokens) = match (p.max_completion_tokens, p.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max_tokens {
        None => None,
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid(
                max_param,
                format!("{max_param} must be at least 1, got {m}"),
            ))
        }
        Some(m) if m as u64 > context as u64 => {
            return Err(ApiError::invalid(
                max_param,
                format!("{max_param} = {m} exceeds the model's context of {context} tokens"),
            ))
        }
        Some(m) => Some(m as usize),
    };
    let top_k = match p.top_k {
        None | Some(0) | Some(-1) => None, // vLLM spells "off" as -1
        Some(k) if k < 0 => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be >= 0, got {k}"),
            ))
        }
        Some(k) => Some(k as usize),
    };
    let sampling = SamplingParams {
        temperature: p.temperature.unwrap_or(1.0),
        top_k,
        top_p: p.top_p.unwrap_or(1.0),
        min_p: p.min_p.unwrap_or(0.0),
        repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
        presence_penalty: p.presence_penalty.unwrap_or(0.0),
        frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
        logit_bias: logit_bias(state, p)?,
        seed: p.seed,
    };
    if let Err(e) = sampling.validate() {
        let param = match &e {
            specula_models::Error::Sampling { name, .. } => *name,
            _ => "temperature",
        };
        return Err(ApiError::invalid(param, e.to_string()));
    }
    if let Some(user) = &p.user {
        tracing::debug!(%user, "request");
    }
    let stop = p.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOPS} stop strings, got {}", stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let speculation = speculation(state, p)?;
    let grammar = p
        .response_format
        .as_ref()
        .map(|f| response_format(state, f))
        .transpose()?
        .flatten();
    Ok(Checked {
        grammar,
        default_max_tokens: None,
        sampling,
        stop,
        speculation,
        max_tokens,
        stream: p.stream,
        include_usage: p.stream_options.as_ref().is_some_and(|o| o.include_usage),
    })
}

/// The speculation of one request: the server's, unless `speculative` overrides it.
fn speculation(state: &AppState, p: &CommonParams) -> Result<Speculation, ApiError> {
    let Some(spec) = &p.speculative else {
        return Ok(state.speculation);
    };
    if spec.enabled == Some(false) {
        return Ok(Speculation::Off);
    }
    let k = match (spec.num_draft_tokens, state.speculation) {
        (Some(k), _) => k,
        (None, Speculation::On { num_draft_tokens }) => num_draft_tokens,
        (None, Speculation::Adaptive { max_draft_tokens }) => max_draft_tokens,
        (None, Speculation::Off) => state.default_num_draft_tokens,
    };
    let adaptive = spec
        .adaptive
        .unwrap_or(matches!(state.speculation, Speculation::Adaptive { .. }));
    if k == 0 || k > super::MAX_DRAFT_TOKENS {
        return Err(ApiError::invalid(
            "speculative.num_draft_tokens",
            format!(
                "num_draft_tokens must be in 1..={}, got {k}",
                super::MAX_DRAFT_TOKENS
            ),
        ));
    }
    Ok(match adaptive {
        true => Speculation::Adaptive {
            max_draft_tokens: k,
        },
        false => Speculation::On {
            num_draft_tokens: k,
        },
    })
}

/// Longest `response_format.json_schema.name` (OpenAI's limit).
const MAX_FORMAT_NAME: usize = 64;

/// Compiles `response_format` for the served model's vocabulary (`None`: free text).
///
/// # Errors
/// 400 naming the part at fault: a bad name, a missing schema, a schema that does not compile
/// or (strict) uses a part that cannot be enforced.
fn response_format(state: &AppState, f: &ResponseFormat) -> Result<Option<Constraint>, ApiError> {
    let schema = match (f.kind.as_str(), &f.json_schema) {
        ("json_schema", Some(s)) => Some(check_json_schema(s)?),
        ("json_schema", None) => {
            return Err(ApiError::invalid(
                "response_format.json_schema",
                "response_format of type json_schema needs json_schema",
            ))
        }
        ("text" | "json_object", Some(_)) => {
            return Err(ApiError::invalid(
                "response_format.json_schema",
                format!("json_schema goes with type json_schema, not {}", f.kind),
            ))
        }
        ("text", None) => return Ok(None),
        ("json_object", None) => None,
        (other, _) => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                    "unknown response_format type `{other}`: expected text, json_object or \
                     json_schema"
                ),
            ))
        }
    };
    let vocab = Vocab::of(state.engine.tokenizer()).map_err(|e| {
        ApiError::invalid(
            "response_format",
            format!("structured output is not available for this model: {e:#}"),
        )
    })?;
    let Some((schema, strict)) = schema else {
        return Ok(Some(Constraint::json_object(&vocab)));
    };
    Constraint::json_schema(&vocab, schema, strict)
        .map(Some)
        .map_err(|e| ApiError::invalid("response_format.json_schema.schema", e.to_string()))
}

fn check_json_schema(f: &JsonSchemaFormat) -> Result<(&serde_json::Value, bool), ApiError> {
    let name_ok = !f.name.is_empty()
        && f.name.len() <= MAX_FORMAT_NAME
        && f.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(ApiError::invalid(
            "response_format.json_schema.name",
            format!(
                "name must be 1 to {MAX_FORMAT_NAME} characters of a-z, A-Z, 0-9, _ and -, got {:?}",
                f.name
            ),
        ));
    }
    let schema = f.schema.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "response_format.json_schema.schema",
            "json_schema needs a schema",
        )
    })?;
    Ok((schema, f.strict.unwrap_or(false)))
}

/// `logit_bias` (`{"token id": bias}`) as (id, bias) pairs, ids checked against the vocabulary.
fn logit_bias(state: &AppState, p: &CommonParams) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &p.logit_bias else {
        return Ok(Vec::new());
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} entries, got {}", map.len()),
        ));
    }
    let vocab = state.engine.model().config().vocab_size;
    let mut out = Vec::with_capacity(map.len());
    for (k, &bias) in map {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias keys must be token ids below {vocab}, got {k:?}"),
                )
            })?;
        out.push((id, bias));
    }
    Ok(out)
}

/// Checks a `top_logprobs`-style count.
///
/// # Errors
/// 400 when it is outside `0..=20`.
pub fn check_top_logprobs(param: &str, n: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&n) {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be in 0..={MAX_TOP_LOGPROBS}, got {n}"),
        ));
    }
    Ok(n as usize)
}

impl Checked {
    /// The engine request for `prompt_ids`.
    ///
    /// # Errors
    /// 400 when the prompt is empty, or the prompt plus `max_tokens` does not fit the context.
    pub fn into_request(
        self,
        state: &AppState,
        prompt_ids: Vec<u32>,
        logprobs: Option<usize>,
        prompt_param: &str,
    ) -> Result<(GenerationRequest, StreamPlan), ApiError> {
        let context = state.engine.model().context_len();
        let n_prompt = prompt_ids.len();
        if n_prompt == 0 {
            return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
        }
        if n_prompt >= context {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!(
                    "the prompt is {n_prompt} tokens long; the model's context is {context} tokens"
                ),
                param: Some(prompt_param.into()),
                code: "context_length_exceeded",
            });
        }
        let room = context - n_prompt;
        let max_tokens = match self.max_tokens {
            Some(m) if m > room => {
                return Err(ApiError {
                    status: StatusCode::BAD_REQUEST,
                    message: format!(
                        "this model's context is {context} tokens, but {} were requested \
                         ({n_prompt} in the prompt, {m} to generate)",
                        n_prompt + m
                    ),
                    param: Some("max_tokens".into()),
                    code: "context_length_exceeded",
                })
            }
            Some(m) => m,
            None => self.default_max_tokens.map_or(room, |d| d.min(room)),
        };
        let req = GenerationRequest {
            session: 0, // the engine assigns one
            prompt_ids,
            max_tokens,
            sampling: self.sampling,
            stop: self.stop,
            speculation: self.speculation,
            logprobs,
            grammar: self.grammar,
        };
        let plan = StreamPlan {
            stream: self.stream,
            include_usage: self.include_usage,
        };
        Ok((req, plan))
    }
}

/// How to deliver the answer.
#[derive(Debug, Clone, Copy)]
pub struct StreamPlan {
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// A usage chunk before `[DONE]`.
    pub include_usage: bool,
}
