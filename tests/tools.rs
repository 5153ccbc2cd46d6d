//! Tool calling through `target-host serve`:
//! - on real Qwen2.5-Coder-0.5B (its chat template's tools branch): a greedy request that calls
//!   `get_weather`, whole and streamed, the round trip with the tool's result,
//!   `tool_choice: none`, and bad tools answered 400;
//! - forced calls (`tool_choice: "required"` and a named function) on SmolLM2 (no tools branch:
//!   the fallback prompt) and Qwen: the call names a listed function, its arguments match the
//!   schema, streamed deltas reassemble to the whole reply, and greedy output with speculation
//!   (the n-gram drafter, drafting) equals the same request with speculation off;
//! - Anthropic's `/v1/messages` with `tools`: `tool_use` blocks and `stop_reason: "tool_use"`,
//!   whole and streamed (`content_block_start` of type `tool_use`, `input_json_delta`), forced
//!   by `any` / `tool`, and the round trip with a `tool_result`.

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

/// Two functions with typed, required arguments.
fn weather_and_add() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

/// Whether `args` (a call's JSON arguments) match `name`'s schema in [`weather_and_add`].
fn valid_arguments(name: &str, args: &str) -> bool {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(args) else {
        return false;
    };
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    match name {
        "get_weather" => {
            keys.len() == 2
                && o.get("city")
                    .and_then(Value::as_str)
                    .is_some_and(|c| c.chars().count() <= 40)
                && o.get("unit")
                    .is_some_and(|u| u == "celsius" || u == "fahrenheit")
        }
        "add" => keys.len() == 2 && o["a"].is_i64() && o["b"].is_i64(),
        _ => false,
    }
}

/// A forced request: greedy, `tool_choice` and `parallel_tool_calls` as given.
fn forced_body(choice: Value, parallel: bool, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user",
            "content": "What is 17 plus 25? Also, how is the weather in Paris?"}],
        "tools": weather_and_add(), "tool_choice": choice, "parallel_tool_calls": parallel,
        "temperature": 0, "max_tokens": 96});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The calls of a whole reply as (name, arguments), checked to be a `tool_calls` answer.
fn calls_of(v: &Value) -> Vec<(String, String)> {
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    choice["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls: {v}"))
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{v}");
            let f = &c["function"];
            (
                f["name"].as_str().unwrap().to_string(),
                f["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The calls of a streamed reply, reassembled from the deltas as a client does (by index:
/// name from the first delta, arguments concatenated).
fn streamed_calls(text: &str) -> Vec<(String, String)> {
    let data = sse_data(text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finish = Value::Null;
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        for delta in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = delta["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((String::new(), String::new()));
            }
            if let Some(name) = delta["function"]["name"].as_str() {
                calls[i].0.push_str(name);
            }
            if let Some(args) = delta["function"]["arguments"].as_str() {
                calls[i].1.push_str(args);
            }
        }
    }
    assert_eq!(finish, "tool_calls", "{text}");
    calls
}

/// Forced calls on `model`: `required` and each named function, with speculation on and
/// off, whole and streamed; several calls only when parallel; a forced call with a
/// `response_format` is a 400 naming both.
fn forced_calls(model: &str, requests: &[(Value, &[&str])]) {
    let srv = Server::start_model(model, &["--drafter", "ngram", "--num-draft-tokens", "4"]);
    let mut drafted = 0;
    for (choice, names) in requests {
        // Fixed k: the adaptive controller may choose k = 0 on a loaded machine.
        let on = json!({"speculative": {"adaptive": false, "num_draft_tokens": 4}});
        let body = forced_body(choice.clone(), false, on);
        let r = srv.post(CHAT, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let calls = calls_of(&v);
        assert_eq!(calls.len(), 1, "one call without parallel_tool_calls: {v}");
        let (name, args) = &calls[0];
        assert!(names.contains(&name.as_str()), "{choice}: called {name}");
        assert!(valid_arguments(name, args), "{name}: {args}");
        drafted += v["usage"]["speculative"]["drafted"].as_u64().unwrap();

        // Greedy: speculation changes nothing (the mask held on every verify row).
        let off = forced_body(
            choice.clone(),
            false,
            json!({"speculative": {"enabled": false}}),
        );
        let v_off = srv.post(CHAT, &off).json();
        assert_eq!(calls_of(&v_off), calls, "speculation off: {v_off}");
        assert_eq!(
            v_off["usage"]["completion_tokens"],
            v["usage"]["completion_tokens"]
        );

        // Streamed: the deltas reassemble to the same call.
        let streamed = forced_body(choice.clone(), false, json!({"stream": true}));
        let r = srv.post(CHAT, &streamed);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(streamed_calls(&r.text()), calls);
    }
    assert!(drafted > 0, "speculation stayed on under the tool grammar");

    // Parallel: one call or more, each of a listed function with valid arguments.
    let v = srv
        .post(CHAT, &forced_body(json!("required"), true, json!({})))
        .json();
    let calls = calls_of(&v);
    assert!(!calls.is_empty());
    for (name, args) in &calls {
        assert!(valid_arguments(name, args), "{name}: {args} in {v}");
    }

    // A forced call and a response format cannot both hold.
    let both = forced_body(
        json!("required"),
        false,
        json!({"response_format": {"type": "json_object"}}),
    );
    let e = srv.post(CHAT, &both).error(400);
    assert_eq!(e["param"], "tool_choice", "{e}");
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("response_format"), "{e}");
}

fn named(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name}})
}

#[test]
fn forced_tool_calls_on_smollm2_through_the_fallback_prompt() {
    forced_calls(
        "smollm2-135m",
        &[
            (json!("required"), &["get_weather", "add"]),
            (named("add"), &["add"]),
            (named("get_weather"), &["get_weather"]),
        ],
    );
}

#[test]
fn forced_tool_calls_on_qwen_through_its_template() {
    forced_calls(
        "qwen2.5-coder-0.5b",
        &[
            (json!("required"), &["get_weather", "add"]),
            (named("add"), &["add"]),
        ],
    );
}

const MESSAGES: &str = "/v1/messages";

/// [`weather_and_add`] in Anthropic's shape.
fn anthropic_tools() -> Value {
    Value::Array(
        weather_and_add()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let f = &t["function"];
                json!({"name": f["name"], "description": f["description"],
                    "input_schema": f["parameters"]})
            })
            .collect(),
    )
}

fn anthropic_body(choice: Value, extra: Value) -> Value {
    let mut body = json!({"model": "smollm2-135m", "max_tokens": 96, "temperature": 0,
        "messages": [{"role": "user",
            "content": "What is 17 plus 25? Also, how is the weather in Paris?"}],
        "tools": anthropic_tools(), "tool_choice": choice});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The `tool_use` blocks of a whole Anthropic reply as (id, name, input), checked to end
/// with `stop_reason: "tool_use"`.
fn tool_uses(v: &Value) -> Vec<(String, String, Value)> {
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let uses: Vec<_> = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| {
            let id = b["id"].as_str().unwrap().to_string();
            assert!(id.starts_with("toolu_"), "{v}");
            (
                id,
                b["name"].as_str().unwrap().to_string(),
                b["input"].clone(),
            )
        })
        .collect();
    assert!(!uses.is_empty(), "{v}");
    uses
}

/// The blocks of a streamed Anthropic reply, rebuilt from its events as the client does:
/// (type, name, input or text); and the stop reason. Checks every block opens, takes deltas
/// of its own kind and closes in order.
fn streamed_blocks(raw: &str) -> (Vec<(String, String, String)>, Value) {
    let mut blocks: Vec<(String, String, String)> = Vec::new();
    let mut open: Option<usize> = None;
    let mut stop = Value::Null;
    for d in sse_data(raw) {
        let e: Value = serde_json::from_str(&d).unwrap();
        match e["type"].as_str().unwrap() {
            "content_block_start" => {
                assert_eq!(open, None, "a block opened inside another: {raw}");
                assert_eq!(e["index"], blocks.len(), "{raw}");
                open = Some(blocks.len());
                let b = &e["content_block"];
                let name = b["name"].as_str().unwrap_or_default().to_string();
                blocks.push((b["type"].as_str().unwrap().to_string(), name, String::new()));
            }
            "content_block_delta" => {
                let i = e["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(i), "{raw}");
                let delta = &e["delta"];
                let piece = match (blocks[i].0.as_str(), delta["type"].as_str().unwrap()) {
                    ("text", "text_delta") => delta["text"].as_str(),
                    ("tool_use", "input_json_delta") => delta["partial_json"].as_str(),
                    other => panic!("delta {other:?}: {raw}"),
                };
                blocks[i].2.push_str(piece.unwrap());
            }
            "content_block_stop" => {
                assert_eq!(
                    open.take(),
                    e["index"].as_u64().map(|i| i as usize),
                    "{raw}"
                );
            }
            "message_delta" => stop = e["delta"]["stop_reason"].clone(),
            _ => {}
        }
    }
    assert_eq!(open, None, "{raw}");
    (blocks, stop)
}

#[test]
fn anthropic_tool_use_forced_streamed_and_round_trip_on_smollm2() {
    let srv = Server::start_model("smollm2-135m", &["--drafter", "ngram"]);
    for (choice, names) in [
        (json!({"type": "any"}), &["get_weather", "add"][..]),
        (json!({"type": "tool", "name": "add"}), &["add"][..]),
        (
            json!({"type": "any", "disable_parallel_tool_use": true}),
            &["get_weather", "add"][..],
        ),
    ] {
        let r = srv.post(MESSAGES, &anthropic_body(choice.clone(), json!({})));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let uses = tool_uses(&v);
        if choice.get("disable_parallel_tool_use").is_some() {
            assert_eq!(uses.len(), 1, "{v}");
        }
        for (_, name, input) in &uses {
            assert!(names.contains(&name.as_str()), "{choice}: {v}");
            assert!(valid_arguments(name, &input.to_string()), "{v}");
        }
        assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0);

        // Streamed: the same blocks, a tool_use's input from its input_json_delta chunks.
        let raw = srv
            .post(
                MESSAGES,
                &anthropic_body(choice.clone(), json!({"stream": true})),
            )
            .text();
        let (blocks, stop) = streamed_blocks(&raw);
        assert_eq!(stop, "tool_use", "{raw}");
        let whole: Vec<(String, String, String)> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| match b["type"].as_str().unwrap() {
                "tool_use" => (
                    "tool_use".into(),
                    b["name"].as_str().unwrap().into(),
                    b["input"].to_string(),
                ),
                _ => (
                    "text".into(),
                    String::new(),
                    b["text"].as_str().unwrap().into(),
                ),
            })
            .collect();
        let streamed: Vec<(String, String, String)> = blocks
            .into_iter()
            .map(|(kind, name, body)| match kind.as_str() {
                // Compare inputs as JSON values: the same object, whatever its spacing.
                "tool_use" => {
                    let input: Value = serde_json::from_str(&body).unwrap();
                    (kind, name, input.to_string())
                }
                _ => (kind, name, body),
            })
            .collect();
        assert_eq!(streamed, whole, "{raw}");
    }

    // Round trip: the call and its result in the history; the reply is text.
    let v = srv
        .post(
            MESSAGES,
            &anthropic_body(json!({"type": "tool", "name": "add"}), json!({})),
        )
        .json();
    let (id, name, input) = tool_uses(&v).remove(0);
    let history = json!({"messages": [
        {"role": "user", "content": "What is 17 plus 25?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": name, "input": input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id,
            "content": [{"type": "text", "text": "42"}]}]}
    ], "tool_choice": {"type": "auto"}, "max_tokens": 24});
    let r = srv.post(MESSAGES, &anthropic_body(json!(null), history));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(
        v["stop_reason"] == "end_turn" || v["stop_reason"] == "max_tokens",
        "{v}"
    );
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    // The result is in the prompt: more input than the question alone.
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 60, "{v}");

    // `none`: tools shown, the reply is text; bad tools are Anthropic 400s naming the field.
    let v = srv
        .post(
            MESSAGES,
            &anthropic_body(json!({"type": "none"}), json!({"max_tokens": 12})),
        )
        .json();
    assert_ne!(v["stop_reason"], "tool_use", "{v}");
    assert!(v["content"]
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b["type"] == "text"));
    for (extra, needle) in [
        (json!({"tools": [{"name": "f"}]}), "tools[0].input_schema"),
        (
            json!({"tool_choice": {"type": "tool", "name": "nope"}}),
            "nope",
        ),
        (
            json!({"tool_choice": {"type": "sometimes"}}),
            "tool_choice.type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}),
            "messages[0].content[0].tool_use_id",
        ),
    ] {
        let r = srv.post(
            MESSAGES,
            &anthropic_body(json!({"type": "auto"}), extra.clone()),
        );
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(needle),
            "{extra}: {e}"
        );
    }
}
