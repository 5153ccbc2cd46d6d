//! API errors with OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, and the
//! JSON extractor that turns every body rejection (bad JSON, wrong field type, oversized body)
//! into one.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable reason.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A stable machine-readable code.
    pub code: &'static str,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
            code: "invalid_value",
        }
    }

    /// An error with any status and code, not tied to a field.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code,
        }
    }

    /// The OpenAI `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The body as a JSON value (also sent as an SSE `data:` line when a stream fails).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(Body {
            error: Inner {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .expect("invariant: the error body serializes")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.to_json())).into_response()
    }
}

/// A JSON body whose rejections are [`ApiError`]s: 415 unless it is sent as
/// `application/json`, 400 for malformed JSON, 413 over the body limit. Fields are read from it
/// with [`parse_value`], which names a bad field.
///
/// `application/json` is required (not merely accepted) because a web page can post
/// `text/plain`, form types or a typeless body to any server without a CORS preflight.
pub struct ApiJson(pub serde_json::Value);

/// Whether a `Content-Type` value is `application/json` (any parameters, any case).
pub fn is_json_content_type(value: &str) -> bool {
    value
        .split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

impl<S: Send + Sync> FromRequest<S> for ApiJson {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let content_type = req
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("(not text)").to_string());
        if !content_type.as_deref().is_some_and(is_json_content_type) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!(
                    "the request body must be sent with `Content-Type: application/json` (got {})",
                    content_type.as_deref().unwrap_or("none")
                ),
            ));
        }
        // Bytes, not axum's Json: its rejections are not OpenAI error bodies.
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            let status = rej.status();
            let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "body_too_large"
            } else {
                "unreadable_body"
            };
            ApiError::new(status, code, rej.body_text())
        })?;
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the request body is not valid JSON: {e}"),
            )
        })?;
        if !value.is_object() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                "the request body must be a JSON object",
            ));
        }
        Ok(ApiJson(value))
    }
}

/// Reads `T` from a request body, naming the offending field on a type error.
///
/// # Errors
/// 400 `invalid_type` (with `param`) for a field of the wrong type or a missing required field.
pub fn parse_value<T: DeserializeOwned>(body: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != ".").then_some(path);
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: match &param {
                Some(p) => format!("invalid field `{p}`: {inner}"),
                None => format!("invalid request body: {inner}"),
            },
            param,
            code: "invalid_type",
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct T {
        #[allow(dead_code)] // read by serde only: the test is about its type
        max_tokens: Option<i64>,
    }

    #[test]
    fn only_application_json_is_a_json_body() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            " application/json ;x=y",
        ] {
            assert!(is_json_content_type(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
            "",
            "application/jsonx",
        ] {
            assert!(!is_json_content_type(bad), "{bad}");
        }
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = parse_value::<T>(&serde_json::json!({"max_tokens": "ten"})).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.code, "invalid_type");
        let body = e.to_json();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "max_tokens");
    }

    #[test]
    fn nested_paths_are_named() {
        #[derive(Debug, serde::Deserialize)]
        struct M {
            #[allow(dead_code)] // read by serde only: the test is about its type
            messages: Vec<T>,
        }
        let e = parse_value::<M>(
            &serde_json::json!({"messages": [{"max_tokens": 1}, {"max_tokens": []}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].max_tokens"));
    }
}
