//! Structured output under speculation, on SmolLM2:
//! - the engine: greedy output under a JSON schema is the same token stream with speculation
//!   off, with the n-gram drafter, with a drafter that proposes only grammar-violating ids, and
//!   with an oracle whose drafts are all accepted;
//! - the server: 100 seeded `response_format` requests (several schemas, greedy and sampled,
//!   streamed and not, chat and completions) all return JSON that the schema accepts, with
//!   drafts accepted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ngram::{NgramConfig, NgramDrafter};
use serde_json::{json, Value};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::loader::{load, LoadedModel};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use specula_models::LoadOptions;
use specula_tests::model_path;
use specula_tests::proposers::{BadProposer, ScriptProposer};
use target_host::drafter::InProcess;
use target_host::engine::EngineConfig;
use target_host::generation::{
    generate, FinishReason, Flow, Generation, GenerationRequest, Speculation,
};
use target_host::grammar::{Constraint, Vocab};
use target_host::proposer::{Proposer, ProposerSlot};

/// A person: required fields of every kind (string, integer with bounds, enum, array).
fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": false
    })
}

/// A point: numbers (floats with bounds) and a boolean.
fn point() -> Value {
    json!({
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -100, "maximum": 100},
            "y": {"type": "number", "minimum": -100, "maximum": 100},
            "visible": {"type": "boolean"}
        },
        "required": ["x", "y", "visible"],
        "additionalProperties": false
    })
}

/// A list of colours: an array of enums with a length range.
fn colours() -> Value {
    json!({
        "type": "object",
        "properties": {
            "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1, "maxItems": 4}
        },
        "required": ["colours"],
        "additionalProperties": false
    })
}

/// Whether `v` satisfies `schema` (the subset of JSON Schema the schemas above use: object
/// with required/additionalProperties, string maxLength, integer/number bounds, boolean, enum,
/// array items/minItems/maxItems).
fn valid(v: &Value, schema: &Value) -> bool {
    if let Some(options) = schema["enum"].as_array() {
        return options.contains(v);
    }
    let num_ok = |x: f64| {
        schema["minimum"].as_f64().is_none_or(|m| x >= m)
            && schema["maximum"].as_f64().is_none_or(|m| x <= m)
    };
    match schema["type"].as_str() {
        Some("object") => {
            let (Some(o), Some(props)) = (v.as_object(), schema["properties"].as_object()) else {
                return false;
            };
            let required = schema["required"].as_array().cloned().unwrap_or_default();
            required
                .iter()
                .all(|k| k.as_str().is_some_and(|k| o.contains_key(k)))
                && o.iter()
                    .all(|(k, x)| props.get(k).is_some_and(|s| valid(x, s)))
        }
        Some("array") => v.as_array().is_some_and(|a| {
            schema["minItems"]
                .as_u64()
                .is_none_or(|m| a.len() as u64 >= m)
                && schema["maxItems"]
                    .as_u64()
                    .is_none_or(|m| a.len() as u64 <= m)
                && a.iter().all(|x| valid(x, &schema["items"]))
        }),
        Some("string") => v.as_str().is_some_and(|s| {
            schema["maxLength"]
                .as_u64()
                .is_none_or(|m| s.chars().count() as u64 <= m)
        }),
        Some("integer") => v.as_i64().is_some_and(|x| num_ok(x as f64)),
        Some("number") => v.as_f64().is_some_and(num_ok),
        Some("boolean") => v.is_boolean(),
        other => panic!("the test's checker does not know type {other:?}"),
    }
}

#[test]
fn the_checker_rejects_what_the_schemas_forbid() {
    let p = person();
    assert!(valid(
        &json!({"name": "Ada", "age": 36, "role": "admin", "tags": ["x"]}),
        &p
    ));
    for bad in [
        json!({"name": "Ada", "age": 36, "role": "admin"}),
        json!({"name": "Ada", "age": 360, "role": "admin", "tags": []}),
        json!({"name": "Ada", "age": 36, "role": "boss", "tags": []}),
        json!({"name": "Ada", "age": 36, "role": "admin", "tags": [], "extra": 1}),
        json!({"name": "Ada", "age": 3.5, "role": "admin", "tags": []}),
    ] {
        assert!(!valid(&bad, &p), "{bad}");
    }
    assert!(!valid(&json!({"colours": []}), &colours()));
    assert!(!valid(
        &json!({"x": 1, "y": 200, "visible": true}),
        &point()
    ));
}

fn smollm() -> LoadedModel {
    load(&model_path("smollm2-135m"), &LoadOptions::default()).expect("load SmolLM2")
}

fn chat_prompt(loaded: &LoadedModel, text: &str) -> Vec<u32> {
    let template = loaded.chat_template.as_ref().expect("chat template");
    let rendered = template
        .render(&[ChatMessage::new("user", text)], GenerationPrompt::Add)
        .expect("render");
    loaded
        .tokenizer
        .encode(&rendered, Special::Parse)
        .expect("encode")
}

fn run(
    loaded: &LoadedModel,
    prompt: &[u32],
    schema: &Value,
    sampling: SamplingParams,
    proposer: Option<Box<dyn Proposer>>,
) -> Generation {
    let vocab = Vocab::of(&loaded.tokenizer).expect("vocabulary");
    let speculation = match proposer {
        Some(_) => Speculation::On {
            num_draft_tokens: 4,
        },
        None => Speculation::Off,
    };
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt.to_vec(),
        max_tokens: 96,
        sampling,
        stop: vec![],
        speculation,
        logprobs: None,
        grammar: Some(Constraint::json_schema(&vocab, schema, true).expect("schema compiles")),
    };
    let slot = ProposerSlot::new(proposer);
    generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &EngineConfig::default(),
        &req,
        &mut |_| Flow::Continue,
    )
    .expect("generate")
}

#[test]
fn greedy_under_a_grammar_is_the_same_with_any_drafter() {
    let loaded = smollm();
    let vocab = loaded.tokenizer.vocab_size();
    let cases = [
        ("Describe a person as JSON.", person()),
        ("Give a point as JSON.", point()),
    ];
    for (text, schema) in cases {
        let prompt = chat_prompt(&loaded, text);
        let plain = run(&loaded, &prompt, &schema, SamplingParams::default(), None);
        assert_eq!(plain.finish_reason, FinishReason::Stop, "{}", plain.text);
        let v: Value = serde_json::from_str(&plain.text).expect("JSON");
        assert!(valid(&v, &schema), "{}", plain.text);
        let drafters: Vec<(&str, Box<dyn Proposer>)> = vec![
            (
                "ngram",
                Box::new(InProcess::new(NgramDrafter::new(
                    NgramConfig::default(),
                    16,
                ))),
            ),
            ("chaos", Box::new(BadProposer::new(vocab, false, 1))),
            ("chaos sampled", Box::new(BadProposer::new(vocab, true, 2))),
            (
                "oracle",
                Box::new(ScriptProposer::new(&prompt, &plain.token_ids)),
            ),
        ];
        for (name, p) in drafters {
            let spec = run(
                &loaded,
                &prompt,
                &schema,
                SamplingParams::default(),
                Some(p),
            );
            assert_eq!(spec.token_ids, plain.token_ids, "{name}: {}", spec.text);
            assert_eq!(spec.finish_reason, plain.finish_reason, "{name}");
            match name {
                // Random ids break the grammar outside strings: cut before the forward.
                "chaos" | "chaos sampled" => assert!(
                    spec.stats.drafted < 4 * spec.stats.target_forwards,
                    "{name}: {} drafts verified in {} rounds of 4",
                    spec.stats.drafted,
                    spec.stats.target_forwards
                ),
                "oracle" => assert!(
                    spec.stats.accepted * 10 >= plain.token_ids.len() * 7,
                    "oracle accepted {} of {}",
                    spec.stats.accepted,
                    plain.token_ids.len()
                ),
                _ => {}
            }
        }
    }
}

#[test]
fn sampled_output_under_a_grammar_is_valid_with_speculation() {
    let loaded = smollm();
    let prompt = chat_prompt(&loaded, "List some colours as JSON.");
    let mut accepted = 0;
    for seed in 0..4 {
        let sampling = SamplingParams {
            temperature: 0.9,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let drafter = InProcess::new(NgramDrafter::new(NgramConfig::default(), 16));
        let g = run(
            &loaded,
            &prompt,
            &colours(),
            sampling,
            Some(Box::new(drafter)),
        );
        let v: Value = serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{e}: {}", g.text));
        assert!(valid(&v, &colours()), "{}", g.text);
        accepted += g.stats.accepted;
    }
    assert!(accepted > 0, "no draft accepted in four sampled requests");
}

/// A running `target-host serve`, killed on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new(specula_tests::bin_path("target-host"))
            .arg("serve")
            .arg("--model")
            .arg(model_path("smollm2-135m"))
            .args([
                "--port",
                "0",
                "--drafter",
                "ngram",
                "--num-draft-tokens",
                "4",
            ])
            .args(["--fixed-draft", "--max-running", "4"])
            .env_remove("SPECULA_API_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn target-host serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Drain stderr for the server's whole life: a full pipe would block it.
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server did not start");
        Server { child, addr }
    }

    /// POSTs `body` as JSON; returns the status and the body.
    fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).expect("connect");
        let body = body.to_string();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .expect("send");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read");
        let raw = String::from_utf8(raw).expect("UTF-8 response");
        let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP response");
        let status = head[9..12].parse().expect("status");
        let body = match head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            true => dechunk(body),
            false => body.to_string(),
        };
        (status, body)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// The text and `usage` of a response, streamed (server-sent events) or not.
fn answer(body: &str, chat: bool, stream: bool) -> (String, Value) {
    let piece = |c: &Value| match chat {
        true => c["message"]["content"]
            .as_str()
            .or(c["delta"]["content"].as_str())
            .unwrap_or("")
            .to_string(),
        false => c["text"].as_str().unwrap_or("").to_string(),
    };
    if !stream {
        let v: Value = serde_json::from_str(body).expect("JSON body");
        return (piece(&v["choices"][0]), v["usage"].clone());
    }
    let (mut text, mut usage) = (String::new(), Value::Null);
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).expect("JSON event");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(&piece(c));
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, usage)
}

#[test]
fn a_hundred_schema_requests_return_valid_json_with_drafts_accepted() {
    let server = Server::start();
    let schemas = [
        ("person", person(), "Describe a person as JSON."),
        ("point", point(), "Give a point on the plane as JSON."),
        ("colours", colours(), "List your favourite colours as JSON."),
    ];
    let one = |i: u64| -> (u64, u64) {
        let (name, schema, ask) = &schemas[i as usize % schemas.len()];
        let chat = i % 4 != 3;
        let stream = i % 5 == 1;
        let temperature = [0.0, 0.7, 1.0][(i as usize / 3) % 3];
        let mut body = json!({
            "max_tokens": 96,
            "temperature": temperature,
            "seed": i,
            "stream": stream,
            "response_format": {"type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": true}},
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let path = match chat {
            true => {
                body["messages"] = json!([{"role": "user", "content": ask}]);
                "/v1/chat/completions"
            }
            false => {
                body["prompt"] = json!(format!("{ask}\nJSON:"));
                "/v1/completions"
            }
        };
        let (status, text) = server.post(path, &body);
        assert_eq!(status, 200, "request {i}: {text}");
        let (out, usage) = answer(&text, chat, stream);
        let v: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("request {i} ({name}, t={temperature}): {e}: {out:?}"));
        assert!(valid(&v, schema), "request {i} ({name}): {out}");
        let count = |k: &str| usage["speculative"][k].as_u64().expect("usage");
        (count("accepted"), count("drafted"))
    };
    // Four clients at once, as the server batches them.
    let (accepted, drafted) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u64)
            .map(|w| s.spawn(move || (w..100).step_by(4).map(one).collect::<Vec<_>>()))
            .collect();
        workers
            .into_iter()
            .flat_map(|h| h.join().expect("client thread"))
            .fold((0, 0), |(a, d), (x, y)| (a + x, d + y))
    });
    eprintln!("100 requests: {accepted} of {drafted} drafts accepted");
    assert!(
        accepted > 0,
        "speculation accepted no draft ({drafted} drafted)"
    );
}

#[test]
fn bad_response_formats_are_400s_naming_the_part() {
    let server = Server::start();
    let chat = |format: Value| {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": format});
        let (status, text) = server.post("/v1/chat/completions", &body);
        let v: Value = serde_json::from_str(&text).expect("JSON");
        (
            status,
            v["error"]["param"].as_str().unwrap_or("").to_string(),
            text,
        )
    };
    let schema = |s: Value, strict: bool| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": strict}});
    for (format, param, says) in [
        (json!({"type": "yaml"}), "response_format.type", "yaml"),
        (
            schema(json!({"type": "array", "uniqueItems": true}), true),
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        (
            schema(json!({"type": "objekt"}), false),
            "response_format.json_schema.schema",
            "objekt",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            "response_format.json_schema.name",
            "a b",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
            "schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": 1}}),
            "response_format.json_schema",
            "x",
        ),
    ] {
        let (status, got, text) = chat(format.clone());
        assert_eq!(status, 400, "{format}: {text}");
        assert!(
            got.starts_with(param),
            "{format}: param {got:?}, want {param}"
        );
        assert!(text.contains(says), "{format}: {text}");
    }
    // Not strict, an unenforceable keyword is dropped and the answer is still JSON.
    let body = json!({"messages": [{"role": "user", "content": "Numbers as JSON"}],
        "max_tokens": 48, "temperature": 0,
        "response_format": schema(json!({"type": "object", "properties": {"n": {"type": "array",
            "items": {"type": "integer"}, "uniqueItems": true, "maxItems": 3}},
            "required": ["n"], "additionalProperties": false}), false)});
    let (status, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let (out, _) = answer(&text, true, false);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["n"].is_array(), "{out}");
    // json_object on completions: any JSON object.
    let body = json!({"prompt": "A cat as JSON:", "max_tokens": 48, "temperature": 0,
        "response_format": {"type": "json_object"}});
    let (status, text) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    let (out, _) = answer(&text, false, false);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v.is_object(), "{out}");
}
