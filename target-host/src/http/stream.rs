//! Delivering an engine request to the client, either as one JSON body ([`collect`]) or as
//! server-sent events ([`sse`]), shared by both generation endpoints.
//!
//! # Cancel safety
//! Both hold the engine's receiver; when the client goes away axum drops the response future
//! or the SSE stream, the receiver with it, and the engine cancels the request at its next
//! token. A [`Tracker`] dropped before its request finished counts the cancellation.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::metrics::Metrics;
use super::openai_types::Usage;
use crate::engine::Event;
use crate::generation::{FinishReason, Generation, GenerationError, TokenLogprob};

/// One generated token as the endpoints format it.
#[derive(Debug, Clone)]
pub struct TokenOut {
    /// Token id.
    pub id: u32,
    /// The text delta this token released (may be empty).
    pub text: String,
    /// Log-probabilities, when asked for.
    pub logprob: Option<TokenLogprob>,
}

/// Counts a request's outcome in the metrics exactly once, even when it is dropped midway.
pub struct Tracker {
    metrics: Arc<Metrics>,
    endpoint: &'static str,
    started: Instant,
    first_token: Option<Instant>,
    finished: bool,
}

impl Tracker {
    /// Starts timing a request to `endpoint`.
    pub fn new(metrics: Arc<Metrics>, endpoint: &'static str) -> Self {
        Tracker {
            metrics,
            endpoint,
            started: Instant::now(),
            first_token: None,
            finished: false,
        }
    }

    fn token(&mut self) {
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
            self.metrics.first_token(self.started);
        }
    }

    fn finish(&mut self, result: &Result<Generation, GenerationError>) {
        self.finished = true;
        match result {
            Ok(g) => {
                self.metrics.request(self.endpoint, 200);
                self.metrics.generation(
                    g.stats.prompt_tokens,
                    g.stats.generated_tokens,
                    self.started,
                    self.first_token,
                );
            }
            Err(e) => self
                .metrics
                .request(self.endpoint, engine_error(e).status.as_u16()),
        }
    }
}

impl Tracker {
    /// Counts a request whose engine went away without finishing it (the worker panicked).
    fn lost(&mut self) -> ApiError {
        let e = GenerationError::Failed("the engine stopped before the request finished".into());
        let answer = engine_error(&e);
        self.finish(&Err(e));
        answer
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.cancelled();
            // 499: nginx's "client closed request"; no response was completed.
            self.metrics.request(self.endpoint, 499);
        }
    }
}

/// OpenAI's `finish_reason` string.
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        // Only seen by a consumer that is gone; never sent in practice.
        FinishReason::Cancelled => "cancelled",
    }
}

/// Waits for the whole generation.
///
/// # Errors
/// 500 when generation fails in the engine.
pub async fn collect(
    mut rx: UnboundedReceiver<Event>,
    mut tracker: Tracker,
) -> Result<(Generation, Vec<TokenOut>), ApiError> {
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { id, text, logprob } => {
                tracker.token();
                tokens.push(TokenOut { id, text, logprob });
            }
            Event::Done(result) => {
                tracker.finish(&result);
                return result.map(|g| (g, tokens)).map_err(|e| engine_error(&e));
            }
        }
    }
    Err(tracker.lost())
}

/// The answer to a request the engine ended without a generation: the client's error (400),
/// a refusal (by its kind), or the server's failure (500).
fn engine_error(e: &GenerationError) -> ApiError {
    match e {
        GenerationError::Invalid(message) => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
        GenerationError::Refused(refusal) => super::admission::refusal_error(refusal),
        GenerationError::Failed(message) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "generation_failed",
            message,
        ),
    }
}

/// Turns engine events into the JSON payloads of one endpoint's stream chunks.
pub trait Chunks: Send + 'static {
    /// Payloads sent before any token (chat: the `role` delta).
    fn start(&mut self) -> Vec<serde_json::Value>;
    /// The payloads for one token (none when it carries nothing to show yet).
    fn token(&mut self, token: TokenOut) -> Vec<serde_json::Value>;
    /// The last content chunks (with `finish_reason`).
    fn finish(&mut self, generation: &Generation) -> Vec<serde_json::Value>;
    /// The usage chunk (empty `choices`).
    fn usage(&mut self, usage: Usage) -> serde_json::Value;
    /// The payload that reports a failure mid-stream.
    fn error(&mut self, e: &ApiError) -> serde_json::Value {
        e.to_json()
    }
    /// The last `data:` line, after everything (OpenAI's `[DONE]`).
    fn done(&self) -> Option<&'static str> {
        Some("[DONE]")
    }
    /// Name each event after its payload's `type` (`event: message_start`), as Anthropic's
    /// stream does.
    fn named_events(&self) -> bool {
        false
    }
}

fn frame(v: &serde_json::Value, named: bool) -> SseEvent {
    let ev = SseEvent::default().data(v.to_string());
    match (named, v["type"].as_str()) {
        (true, Some(t)) => ev.event(t),
        _ => ev,
    }
}

/// Streams the request as server-sent events: `data: {chunk}` lines and a final
/// `data: [DONE]` (or what the [`Chunks`] say). An engine failure is sent as an error body
/// before the end.
pub fn sse<C: Chunks>(
    rx: UnboundedReceiver<Event>,
    mut chunks: C,
    include_usage: bool,
    tracker: Tracker,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let named = chunks.named_events();
    let data = move |v: &serde_json::Value| frame(v, named);
    let head: Vec<SseEvent> = chunks.start().iter().map(data).collect();
    let body = stream::unfold(Some((rx, chunks, tracker)), move |state| async move {
        let (mut rx, mut chunks, mut tracker) = state?;
        let ev = rx.recv().await;
        let mut out: Vec<SseEvent> = match ev {
            Some(Event::Token { id, text, logprob }) => {
                tracker.token();
                let payload = chunks.token(TokenOut { id, text, logprob });
                return Some((
                    payload.iter().map(data).collect(),
                    Some((rx, chunks, tracker)),
                ));
            }
            Some(Event::Done(result)) => {
                tracker.finish(&result);
                match result {
                    Ok(g) => {
                        let mut out: Vec<SseEvent> = chunks.finish(&g).iter().map(data).collect();
                        if include_usage {
                            out.push(data(&chunks.usage(Usage::from_stats(&g.stats))));
                        }
                        out
                    }
                    Err(e) => vec![data(&chunks.error(&engine_error(&e)))],
                }
            }
            None => {
                let e = tracker.lost();
                vec![data(&chunks.error(&e))]
            }
        };
        if let Some(done) = chunks.done() {
            out.push(SseEvent::default().data(done));
        }
        Some((out, None))
    });
    let events = stream::iter(head)
        .chain(body.flat_map(stream::iter))
        .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Refusal;

    #[test]
    fn an_engine_error_is_answered_by_its_kind() {
        let status = |e| engine_error(&e).status;
        assert_eq!(
            status(GenerationError::Invalid("bad top_p".into())),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(GenerationError::Refused(Refusal::Busy {
                running: 1,
                waiting: 2
            })),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            status(GenerationError::Refused(Refusal::TooLarge {
                need: 9,
                pool: 4
            })),
            StatusCode::BAD_REQUEST
        );
        let failed = engine_error(&GenerationError::Failed("the forward failed".into()));
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(failed.message, "the forward failed");
    }
}
