//! Tool calling through `target-host serve` on real Qwen2.5-Coder-0.5B (its chat template's
//! tools branch): a greedy request that calls `get_weather`, whole and streamed, the round trip
//! with the tool's result, `tool_choice: none`, and bad tools answered 400.

use serde_json::{json, Value};

use crate::server::{sse_data, Server};

const CHAT: &str = "/v1/chat/completions";

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"]}}}])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather like in Paris right now?"}],
        "tools": weather_tool(), "temperature": 0, "max_tokens": 40});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn qwen_calls_a_tool_whole_streamed_and_round_trip() {
    let srv = Server::start_model("qwen2.5-coder-0.5b", &[]);

    // Whole: Qwen2.5-Coder-0.5B answers greedily with the bare call object (checked by hand:
    // `{"name": "get_weather", "arguments": {"city": "Paris"}}`, then EOS).
    let r = srv.post(CHAT, &ask(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let call = &calls[0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{v}");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // Streamed: the same call as OpenAI's deltas (index, id and name first, then arguments).
    let r = srv.post(CHAT, &ask(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.text());
    let data = sse_data(&r.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let deltas: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(deltas.len(), 2, "{chunks:?}");
    assert_eq!(deltas[0]["index"], 0);
    assert!(deltas[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(deltas[0]["function"]["name"], "get_weather");
    assert_eq!(
        deltas[1]["function"]["arguments"],
        call["function"]["arguments"]
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "", "no call text leaks into the content");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // Round trip: the call and the tool's answer in the history, then the model's reply.
    let history = json!({"messages": [
        {"role": "user", "content": "What is the weather like in Paris right now?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}
    ]});
    let r = srv.post(CHAT, &ask(history));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(!reply.trim().is_empty(), "{v}");
    // The prompt holds the tool's result: more tokens than the first turn's.
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 181, "{v}");

    // `none`: the tools are shown, the reply is text (the same object, not parsed).
    let v = srv.post(CHAT, &ask(json!({"tool_choice": "none"}))).json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("get_weather"), "{v}");

    // Bad tools are a 400 naming the field.
    for (extra, param) in [
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]}),
            "tools[0].function.parameters.properties",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"parallel_tool_calls": 1}), "parallel_tool_calls"),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{bad"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ] {
        let e = srv.post(CHAT, &ask(extra.clone())).error(400);
        assert_eq!(e["param"], param, "{extra}: {e}");
    }
}
