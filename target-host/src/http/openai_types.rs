//! Wire types of the OpenAI-compatible API: request bodies as clients send them and response
//! bodies shaped exactly as OpenAI's (`id`, `object`, `created`, `model`, `choices`, `usage`).
//!
//! Reference: <https://platform.openai.com/docs/api-reference/chat> and
//! <https://platform.openai.com/docs/api-reference/completions>. An unknown request field is a
//! 400 naming it (`request::check_fields`); fields we read are typed, so a wrong type is a 400
//! that names the field.
//!
//! Structured output: `response_format` (`text`, `json_object`, `json_schema` with `name`,
//! `schema`, `strict`) on chat and, as vLLM takes it, on completions.
//!
//! Extensions shared with vLLM: `top_k`, `min_p`, `repetition_penalty`, and on chat
//! `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`.
//!
//! Specula extensions (both optional, ignored by OpenAI clients):
//! - request `speculative: {"enabled": bool, "num_draft_tokens": int, "adaptive": bool}`
//!   overrides the server's speculation for one request (it can only change speed: greedy
//!   output is the same tokens, sampled output has the same distribution); `adaptive` lets the host pick each round's k up to `num_draft_tokens` and cut
//!   drafts by the drafter's confidences; `adaptive: false` verifies exactly the
//!   `num_draft_tokens` drafts the drafter sends every round, uncut;
//! - response `usage.speculative: {drafted, accepted, rounds, mean_accepted_per_round,
//!   acceptance_rate}`.

use serde::{Deserialize, Serialize};

use crate::generation::GenerationStats;

/// A boolean field that may also be sent as `null` (OpenAI's schema marks them nullable, and
/// some clients send every unset field so): `null` reads as `false`, as an absent field does.
pub(crate) fn null_as_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`) before `[DONE]`.
    #[serde(default, deserialize_with = "null_as_false")]
    pub include_usage: bool,
}

/// Specula extension: per-request speculation settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeField {
    /// `false` decodes without a drafter; `true` (default) drafts when a drafter is installed.
    pub enabled: Option<bool>,
    /// Drafts per round (default: the server's `--num-draft-tokens`); the most per round when
    /// `adaptive`.
    pub num_draft_tokens: Option<usize>,
    /// `true`: the host picks each round's k in `0..=num_draft_tokens` from the verify cost
    /// and the request's observed acceptance, and cuts drafts by the drafter's confidences
    /// (`target_host::engine::controller`); `false`: a fixed k, every draft verified uncut;
    /// default: the server's (`--fixed-draft` makes it `false`).
    pub adaptive: Option<bool>,
}

/// Fields shared by both generation endpoints, read from the same body as the endpoint's own
/// request type (not `#[serde(flatten)]`ed into it: flattening loses the path of a bad field).
///
/// Integers that may legitimately be out of range (`max_tokens`, `n`) are read as `i64` so a
/// negative value gets a range error rather than a type error.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Model name; when given it must be the served model.
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Chat alias of `max_tokens` (wins when both are given).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature (0 = greedy; default 1 as in OpenAI).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (0 or absent: off).
    pub top_k: Option<i64>,
    /// Relative probability floor.
    pub min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    pub repetition_penalty: Option<f32>,
    /// OpenAI's presence penalty (-2..=2).
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty (-2..=2).
    pub frequency_penalty: Option<f32>,
    /// `{"token id": bias}` with biases in -100..=100.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// End-user id (logged).
    pub user: Option<String>,
    /// Random seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Number of choices; only 1 is supported.
    pub n: Option<i64>,
    /// Stream with server-sent events.
    #[serde(default, deserialize_with = "null_as_false")]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Specula extension, see the module docs.
    pub speculative: Option<SpeculativeField>,
    /// Structured output: `text`, `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`, as OpenAI defines it (vLLM takes it on completions too). A plain struct
/// rather than a tagged enum, so that a bad field inside `json_schema` is named by its path.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFormat {
    /// `text` (the default), `json_object` (any JSON object) or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The schema, for `json_schema`.
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// Name of the format: `[a-zA-Z0-9_-]`, at most 64 characters.
    pub name: String,
    /// What the format is for (not used in generation).
    pub description: Option<String>,
    /// The JSON schema.
    pub schema: Option<serde_json::Value>,
    /// `true`: a schema part that cannot be enforced is an error; `false` (default): such a
    /// part is not enforced (the output is still JSON).
    pub strict: Option<bool>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt: text, token ids, or a batch of one of either (read by
    /// `completions::prompt_of`, which names what is wrong with a bad one).
    pub prompt: serde_json::Value,
    /// Number of top alternatives to report per token (0..=20).
    pub logprobs: Option<i64>,
    /// Echo the prompt before the completion (only `false` is supported).
    #[serde(default, deserialize_with = "null_as_false")]
    pub echo: bool,
    /// Text after the completion (insertion); only absent or empty is supported.
    pub suffix: Option<String>,
    /// Candidates to rank server-side; only 1 is supported.
    pub best_of: Option<i64>,
}

/// Fields of `POST /v1/completions` besides [`COMMON_FIELDS`](super::request::COMMON_FIELDS).
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo", "suffix", "best_of"];

/// Fields of `POST /v1/chat/completions` besides the common ones.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    // Read by `tools::ToolSet::from_openai`.
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Fields of one chat message.
pub const MESSAGE_FIELDS: &[&str] = &["role", "content", "name", "tool_calls", "tool_call_id"];

/// One chat message as clients send it.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer` (read as `system`), `user`, `assistant` or `tool`.
    pub role: String,
    /// The text, or a list of content parts.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// A participant's name.
    pub name: Option<String>,
    /// An assistant's earlier tool calls.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// A tool call in an assistant message, as OpenAI sends it.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ToolCallIn {
    /// Call id.
    pub id: Option<String>,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The function and its arguments.
    pub function: FunctionCallIn,
}

/// The function of a tool call.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct FunctionCallIn {
    /// Function name.
    pub name: String,
    /// Arguments, a JSON object encoded as a string.
    pub arguments: String,
}

/// Message content: a string or `[{"type": "text", "text": ...}]` parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts; only text parts are supported.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Report log-probabilities of the chosen tokens.
    #[serde(default, deserialize_with = "null_as_false")]
    pub logprobs: bool,
    /// Alternatives per token (0..=20); needs `logprobs: true`.
    pub top_logprobs: Option<i64>,
    /// Extra variables for the chat template (vLLM's extension).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// End the prompt with the assistant header (default `true`).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of starting a new one.
    #[serde(default, deserialize_with = "null_as_false")]
    pub continue_final_message: bool,
}

/// Speculation counters of one request (Specula extension of `usage`).
#[derive(Debug, Clone, Serialize)]
pub struct SpeculativeUsage {
    /// Drafts offered to the target.
    pub drafted: usize,
    /// Drafts the target accepted.
    pub accepted: usize,
    /// Rounds that had at least one draft.
    pub rounds: usize,
    /// `accepted / rounds`.
    pub mean_accepted_per_round: f64,
    /// `accepted / drafted`.
    pub acceptance_rate: f64,
}

/// `usage`.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// What of the prompt was not computed for this request.
    pub prompt_tokens_details: PromptTokensDetails,
    /// Speculation counters.
    pub speculative: SpeculativeUsage,
}

/// `usage.prompt_tokens_details`, as OpenAI reports it.
#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from the prefix cache (or shared with a request running beside
    /// it): their prefill was skipped. Prefixes are cached automatically, whole blocks at a
    /// time.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage of a finished generation.
    pub fn from_stats(s: &GenerationStats) -> Usage {
        Usage {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.generated_tokens,
            total_tokens: s.prompt_tokens + s.generated_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: s.cached_tokens,
            },
            speculative: SpeculativeUsage {
                drafted: s.drafted,
                accepted: s.accepted,
                rounds: s.rounds,
                mean_accepted_per_round: s.mean_accepted_per_round,
                acceptance_rate: s.acceptance_rate,
            },
        }
    }
}

/// Completions' `logprobs` object (legacy format, parallel arrays).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Per token, the top alternatives as `{text: logprob}`.
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Byte offset of each token in the completion text.
    pub text_offset: Vec<usize>,
}

/// One completion choice.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// Always 0 (`n` = 1).
    pub index: usize,
    /// Generated text (or the delta, in a stream chunk).
    pub text: String,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length`; `null` in stream chunks before the last.
    pub finish_reason: Option<&'static str>,
}

/// A completion response, or one stream chunk of it (`object: "text_completion"` for both, as
/// OpenAI does).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-…`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// The choices (empty in the final usage chunk).
    pub choices: Vec<CompletionChoice>,
    /// Token counts (stream chunks: only the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One alternative in chat logprobs.
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    /// Token text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token text.
    pub bytes: Vec<u8>,
}

/// Chat logprobs of one token.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    /// Token text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token text.
    pub bytes: Vec<u8>,
    /// Most likely alternatives, best first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `logprobs` object.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// The assistant's message in a chat response.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    /// `assistant`.
    pub role: &'static str,
    /// The generated text (`null` when the reply is only tool calls, as OpenAI sends it).
    pub content: Option<String>,
    /// The tool calls of the reply, when it made any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// A tool call in a response.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    /// `call_…`.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCallIn,
}

/// A chat choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: usize,
    /// The reply.
    pub message: ChatMessageOut,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// `chat.completion`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatResponse {
    /// `chatcmpl-…`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// The single choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// A streamed delta.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool-call deltas: `[{index, id, type, function: {name, arguments: ""}}]` when a call
    /// starts, then `[{index, function: {arguments}}]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// A chat stream chunk's choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What changed.
    pub delta: ChatDelta,
    /// Log-probabilities of the tokens in this chunk.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last content chunk.
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// Same id for every chunk of a stream.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Only in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `GET /v1/models` entry.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// Served model name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds when the server started.
    pub created: u64,
    /// `specula`.
    pub owned_by: &'static str,
    /// Context length in tokens (extension, as vLLM's `max_model_len`).
    pub max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        let one: CommonParams = serde_json::from_str(r#"{"stop": "x"}"#).unwrap();
        assert_eq!(one.stop.unwrap().into_vec(), vec!["x"]);
        let many: CommonParams = serde_json::from_str(r#"{"stop": ["a", "b"]}"#).unwrap();
        assert_eq!(many.stop.unwrap().into_vec(), vec!["a", "b"]);
        assert!(serde_json::from_str::<CommonParams>(r#"{"stop": 3}"#).is_err());
    }

    #[test]
    fn chat_and_common_fields_read_from_one_body() {
        let body = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                "max_tokens": 5, "stream": true, "logprobs": true, "top_logprobs": 2,
                "speculative": {"enabled": false}, "user": "someone"}"#;
        let req: ChatRequest = serde_json::from_str(body).unwrap();
        let common: CommonParams = serde_json::from_str(body).unwrap();
        assert_eq!(common.max_tokens, Some(5));
        assert!(common.stream && req.logprobs);
        assert_eq!(req.top_logprobs, Some(2));
        assert_eq!(common.speculative.unwrap().enabled, Some(false));
        assert!(matches!(
            req.messages[0].content,
            Some(MessageContent::Parts(ref p)) if p[0].text.as_deref() == Some("hi")
        ));
    }

    #[test]
    fn stream_chunk_omits_absent_usage() {
        let chunk = ChatChunk {
            id: "x".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "m".into(),
            choices: vec![],
            usage: None,
        };
        let v = serde_json::to_value(&chunk).unwrap();
        assert!(v.get("usage").is_none());
    }
}
