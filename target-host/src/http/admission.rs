//! Admission: handing a checked request to the engine, or answering why not. A full queue is
//! `429 Too Many Requests` with `Retry-After` (seconds, from the measured request rate); a
//! request larger than the whole KV pool is `400`; a stopped engine is `503`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::AppState;
use crate::engine::{Event, Refusal, Rejected};
use crate::generation::GenerationRequest;

/// A request the engine did not take: the error to answer with, and when to ask again.
#[derive(Debug)]
pub struct Refused {
    /// Status, code and message.
    pub error: ApiError,
    /// Sent as `Retry-After` (whole seconds, at least 1).
    pub retry_after: Option<std::time::Duration>,
}

impl Refused {
    /// The response, its body in the endpoint's error shape (`body`: OpenAI's
    /// [`ApiError::to_json`], or Anthropic's), with `Retry-After` when known.
    pub fn respond(self, body: impl FnOnce(&ApiError) -> Value) -> Response {
        let mut response = (self.error.status, axum::Json(body(&self.error))).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs().max(1).to_string();
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_str(&secs).expect("invariant: digits are a header value"),
            );
        }
        response
    }
}

/// Submits `req` to the engine; on refusal, what to answer (already counted under
/// `endpoint`).
pub fn submit(
    state: &AppState,
    endpoint: &'static str,
    req: GenerationRequest,
) -> Result<UnboundedReceiver<Event>, Box<Refused>> {
    state.engine.submit(req).map_err(|rejected| {
        let refused = refused(&rejected);
        state
            .metrics
            .request(endpoint, refused.error.status.as_u16());
        Box::new(refused)
    })
}

fn refused(rejected: &Rejected) -> Refused {
    Refused {
        error: refusal_error(&rejected.refusal),
        retry_after: rejected.retry_after,
    }
}

/// The status, code and message of a refusal.
pub(super) fn refusal_error(refusal: &Refusal) -> ApiError {
    let (status, code) = match refusal {
        Refusal::Busy { .. } => (StatusCode::TOO_MANY_REQUESTS, "server_busy"),
        Refusal::TooLarge { .. } => (StatusCode::BAD_REQUEST, "context_length_exceeded"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    ApiError::new(status, code, refusal.to_string())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_busy_refusal_is_429_with_retry_after() {
        let rejected = Rejected {
            refusal: Refusal::Busy {
                running: 4,
                waiting: 8,
            },
            retry_after: Some(Duration::from_secs(3)),
        };
        let r = refused(&rejected).respond(ApiError::to_json);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        let status = |refusal| {
            refused(&Rejected {
                refusal,
                retry_after: None,
            })
            .error
            .status
        };
        assert_eq!(
            status(Refusal::TooLarge { need: 10, pool: 5 }),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(status(Refusal::Stopped), StatusCode::SERVICE_UNAVAILABLE);
    }
}
