//! Property tests of the request parsing: arbitrary bytes and arbitrary JSON through every
//! function that reads a client's body or headers before the model does — the bodies of
//! `/v1/chat/completions`, `/v1/completions`, `/v1/messages` (its content blocks too),
//! `/tokenize`, `/detokenize` and `/admin/drafters`, OpenAI and Anthropic `tools` /
//! `tool_choice`, the tool-call parser over arbitrary generated text, and the auth and
//! content-type headers. Zero panics is the property; each case is bounded (no loops over
//! input-controlled counts), and the case count is fixed, so the run time is bounded in CI.

use proptest::prelude::*;
use serde_json::Value;

use super::admin::InstallRequest;
use super::auth::{credential, DrafterPolicy};
use super::error::{is_json_content_type, parse_value};
use super::openai_types::{ChatRequest, CommonParams, CompletionRequest};
use super::request::{check_fields, COMMON_FIELDS};
use super::tokenize::{DetokenizeRequest, TokenizeRequest};
use crate::tools::{Reply, ToolSet};

/// Arbitrary JSON, nested a few levels, with the field names the parsers look for.
fn json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("messages".to_string()),
        Just("prompt".to_string()),
        Just("max_tokens".to_string()),
        Just("logit_bias".to_string()),
        Just("stop".to_string()),
        Just("role".to_string()),
        Just("content".to_string()),
        Just("tool_calls".to_string()),
        Just("speculative".to_string()),
        Just("tools".to_string()),
        Just("tool_choice".to_string()),
        Just("type".to_string()),
        Just("function".to_string()),
        Just("name".to_string()),
        Just("parameters".to_string()),
        Just("input_schema".to_string()),
        Just("tool_use_id".to_string()),
        Just("properties".to_string()),
        "[a-z_]{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,16}".prop_map(Value::from),
        prop_oneof![
            Just("text"),
            Just("tool_use"),
            Just("tool_result"),
            Just("function"),
            Just("object"),
            Just("any"),
            Just("tool"),
            Just("required"),
            Just("user"),
            Just("assistant"),
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn bodies_never_panic(v in json()) {
        let _ = parse_value::<ChatRequest>(&v);
        let _ = parse_value::<CommonParams>(&v);
        let _ = parse_value::<CompletionRequest>(&v);
        let _ = check_fields(&v, &[COMMON_FIELDS]);
        if let Some(p) = v.get("prompt") {
            let _ = super::completions::prompt_of_for_tests(p, 100);
        }
        let _ = super::anthropic::parse_for_tests(&v);
        let _ = parse_value::<TokenizeRequest>(&v);
        let _ = parse_value::<DetokenizeRequest>(&v);
        let _ = parse_value::<InstallRequest>(&v);
        let _ = ToolSet::from_openai(v.get("tools"), v.get("tool_choice"), v.get("parallel"));
        // A body nested as a request, and as tools.
        let body = serde_json::json!({"messages": [v.clone()], "prompt": v});
        let _ = parse_value::<ChatRequest>(&body);
        let _ = super::anthropic::parse_for_tests(&body);
        let _ = ToolSet::from_openai(Some(&serde_json::json!([v.clone()])), None, None);
        let _ = ToolSet::from_anthropic(Some(&serde_json::json!([v])), None);
    }

    /// Generated text, cut anywhere, through the tool-call parser of a request with tools.
    #[test]
    fn tool_call_parsing_never_panics(
        text in "(<tool_call>|</tool_call>|\\{\"name\": \"f\"|\"arguments\"|[{}:,\" \\n]|.){0,40}",
        cut in 0usize..200,
    ) {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let set = ToolSet::from_openai(Some(&tools), None, None).unwrap();
        let mut reply = Reply::new(set.as_ref());
        let cut = (0..=cut.min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
        let _ = reply.push(&text[..cut]);
        let _ = reply.push(&text[cut..]);
        let _ = reply.finish(cut % 2 == 0);
    }

    #[test]
    fn raw_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            let _ = parse_value::<ChatRequest>(&v);
            let _ = parse_value::<CommonParams>(&v);
        }
        let text = String::from_utf8_lossy(&bytes);
        let _ = is_json_content_type(&text);
        let policy = DrafterPolicy::default();
        let _ = policy.check(&text);
        if let Ok(h) = axum::http::HeaderValue::from_bytes(&bytes) {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert(axum::http::header::AUTHORIZATION, h.clone());
            let _ = credential(&headers);
            headers.clear();
            headers.insert("x-api-key", h);
            let _ = credential(&headers);
        }
    }
}
