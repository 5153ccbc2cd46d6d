//! Admission: handing a checked request to the engine, or answering why not. A full queue is
//! `429 Too Many Requests` with `Retry-After` (seconds, from the measured request rate); a
//! request larger than the whole KV pool is `400`; a stopped engine is `503`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::AppState;
use crate::engine::{Event, Refusal, Rejected};
use crate::generation::GenerationRequest;

/// Submits `req` to the engine; on refusal, the response to send (already counted under
/// `endpoint`).
pub fn submit(
    state: &AppState,
    endpoint: &'static str,
    req: GenerationRequest,
) -> Result<UnboundedReceiver<Event>, Box<Response>> {
    state.engine.submit(req).map_err(|rejected| {
        let (status, code) = status_of(&rejected.refusal);
        state.metrics.request(endpoint, status.as_u16());
        Box::new(refusal_response(&rejected, status, code))
    })
}

fn status_of(refusal: &Refusal) -> (StatusCode, &'static str) {
    match refusal {
        Refusal::Busy { .. } => (StatusCode::TOO_MANY_REQUESTS, "server_busy"),
        Refusal::TooLarge { .. } => (StatusCode::BAD_REQUEST, "context_length_exceeded"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    }
}

fn refusal_response(rejected: &Rejected, status: StatusCode, code: &'static str) -> Response {
    let mut response = ApiError::new(status, code, rejected.to_string()).into_response();
    if let Some(after) = rejected.retry_after {
        let secs = after.as_secs().max(1).to_string();
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from_str(&secs).expect("invariant: digits are a header value"),
        );
    }
    response
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
        let (status, code) = status_of(&rejected.refusal);
        let r = refusal_response(&rejected, status, code);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        let too_large = Refusal::TooLarge { need: 10, pool: 5 };
        assert_eq!(status_of(&too_large).0, StatusCode::BAD_REQUEST);
        assert_eq!(
            status_of(&Refusal::Stopped).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
