//! Tool (function) calling shared by `/v1/chat/completions` and `/v1/messages`: the tools a
//! request offers and how the model may use them ([`ToolSet`]), checked from either API's JSON
//! shape; the parser that turns `<tool_call>…</tool_call>` blocks in generated text back into
//! calls, streamed or not ([`parse`]); the grammar that forces a call when `tool_choice` asks
//! for one ([`ToolSet::forced_grammar`]).
//!
//! The call format is the Hermes / Qwen2.5 one, which Qwen2.5's chat template teaches and which
//! the fallback prompt of templates without a tools branch (`specula_models::chat`) teaches too:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! References: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`
//! (<https://platform.openai.com/docs/api-reference/chat/create>), Anthropic's `tools` /
//! `tool_choice` (<https://docs.anthropic.com/en/docs/build-with-claude/tool-use>), vLLM's
//! Hermes tool parser (`vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`).

pub mod parse;
mod schema;

use serde_json::{json, Map, Value};

use crate::grammar::{Constraint, Vocab};

/// Longest function name (OpenAI's limit).
const MAX_NAME_LEN: usize = 64;

/// Most tools per request (OpenAI allows 128).
const MAX_TOOLS: usize = 128;

/// A request field that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct ToolError {
    /// The field at fault, as the client spelled it (`tools[0].function.name`).
    pub param: String,
    /// What is wrong with it.
    pub message: String,
}

fn bad(param: impl Into<String>, message: impl Into<String>) -> ToolError {
    ToolError {
        param: param.into(),
        message: message.into(),
    }
}

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name (`[A-Za-z0-9_-]{1,64}`, unique in the request).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// JSON schema of its arguments (an object schema; `{"type": "object", "properties": {}}`
    /// when the client gave none).
    pub parameters: Value,
    /// The client asked for arguments that follow the schema exactly (OpenAI's `strict`): a
    /// forced call whose schema has a part the grammar cannot enforce is then a 400, not a
    /// call checked for the rest.
    pub strict: bool,
}

/// How the model may use the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides whether to call.
    Auto,
    /// Tools are shown to the model but no call is parsed: the reply is text.
    None,
    /// The reply is one or more calls (forced by a grammar).
    Required,
    /// The reply is a call of this function (forced by a grammar).
    Named(String),
}

/// The tools of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    /// The tools, in the request's order.
    pub tools: Vec<Tool>,
    /// What the model may do with them.
    pub choice: ToolChoice,
    /// Whether the reply may hold several calls (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

impl ToolSet {
    /// The tools of an OpenAI chat request: `tools`, `tool_choice`, `parallel_tool_calls`.
    /// `None` when the request offers no tools (and asks nothing of them).
    ///
    /// # Errors
    /// A [`ToolError`] naming the field: a tool that is not `{"type": "function", "function":
    /// {...}}`, a bad or repeated name, parameters that are not an object schema, a
    /// `tool_choice` that is unknown, names a function not in `tools`, or comes without tools.
    pub fn from_openai(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel: Option<&Value>,
    ) -> Result<Option<ToolSet>, ToolError> {
        let parallel = match parallel {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("parallel_tool_calls", "must be a boolean")),
        };
        let tools = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, t)| openai_tool(i, t))
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(bad("tools", "must be a list of tools")),
        };
        let choice = match tool_choice {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("unknown tool_choice `{other}`: expected auto, none, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ))
                }
            }),
            Some(Value::Object(o)) => {
                check_keys(o, &["type", "function"], "tool_choice")?;
                if o.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(bad("tool_choice.type", "must be `function`"));
                }
                let f = o
                    .get("function")
                    .and_then(Value::as_object)
                    .ok_or_else(|| bad("tool_choice.function", "must be {\"name\": ...}"))?;
                check_keys(f, &["name"], "tool_choice.function")?;
                let name = f
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("tool_choice.function.name", "must be a string"))?;
                Some(ToolChoice::Named(name.to_string()))
            }
            Some(_) => return Err(bad("tool_choice", "must be a string or an object")),
        };
        ToolSet::assemble(tools, choice, parallel, "tool_choice", "tools")
    }

    /// The tools of an Anthropic Messages request: `tools` (`{name, description,
    /// input_schema}`) and `tool_choice` (`auto`, `any`, `tool`, `none`, with
    /// `disable_parallel_tool_use`).
    ///
    /// # Errors
    /// As [`ToolSet::from_openai`], in Anthropic's field names.
    pub fn from_anthropic(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
    ) -> Result<Option<ToolSet>, ToolError> {
        let tools = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, t)| anthropic_tool(i, t))
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(bad("tools", "must be a list of tools")),
        };
        let (choice, parallel) = match tool_choice {
            None | Some(Value::Null) => (None, true),
            Some(Value::Object(o)) => {
                let kind = o.get("type").and_then(Value::as_str).unwrap_or_default();
                let allowed: &[&str] = match kind {
                    "tool" => &["type", "name", "disable_parallel_tool_use"],
                    "none" => &["type"],
                    _ => &["type", "disable_parallel_tool_use"],
                };
                check_keys(o, allowed, "tool_choice")?;
                let parallel = match o.get("disable_parallel_tool_use") {
                    None => true,
                    Some(Value::Bool(b)) => !b,
                    Some(_) => {
                        return Err(bad(
                            "tool_choice.disable_parallel_tool_use",
                            "must be a boolean",
                        ))
                    }
                };
                let choice = match kind {
                    "auto" => ToolChoice::Auto,
                    "any" => ToolChoice::Required,
                    "none" => ToolChoice::None,
                    "tool" => ToolChoice::Named(
                        o.get("name")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("tool_choice.name", "must be a string"))?
                            .to_string(),
                    ),
                    other => {
                        return Err(bad(
                            "tool_choice.type",
                            format!(
                            "unknown tool_choice type `{other}`: expected auto, any, tool or none"
                        ),
                        ))
                    }
                };
                (Some(choice), parallel)
            }
            Some(_) => return Err(bad("tool_choice", "must be an object")),
        };
        ToolSet::assemble(tools, choice, parallel, "tool_choice", "tools")
    }

    fn assemble(
        tools: Vec<Tool>,
        choice: Option<ToolChoice>,
        parallel: bool,
        choice_param: &str,
        tools_param: &str,
    ) -> Result<Option<ToolSet>, ToolError> {
        if tools.len() > MAX_TOOLS {
            return Err(bad(
                tools_param,
                format!("at most {MAX_TOOLS} tools, got {}", tools.len()),
            ));
        }
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(bad(
                    format!("{tools_param}[{i}]"),
                    format!("tool name `{}` appears twice", t.name),
                ));
            }
        }
        let choice = match (choice, tools.is_empty()) {
            // No tools and nothing asked of them: a plain request.
            (None | Some(ToolChoice::None), true) => return Ok(None),
            (Some(_), true) => {
                return Err(bad(
                    choice_param,
                    "tool_choice needs tools: the request lists none",
                ))
            }
            (None, false) => ToolChoice::Auto,
            (Some(ToolChoice::Named(name)), false) => {
                if !tools.iter().any(|t| t.name == name) {
                    return Err(bad(
                        choice_param,
                        format!("tool_choice names `{name}`, which is not among the tools"),
                    ));
                }
                ToolChoice::Named(name)
            }
            (Some(c), false) => c,
        };
        Ok(Some(ToolSet {
            tools,
            choice,
            parallel,
        }))
    }

    /// The tools as chat templates read them: OpenAI's `[{"type": "function", "function":
    /// {"name", "description", "parameters"}}]`, as transformers passes them.
    pub fn template_tools(&self) -> Value {
        Value::Array(
            self.tools
                .iter()
                .map(|t| {
                    let mut f = Map::new();
                    f.insert("name".into(), t.name.clone().into());
                    if let Some(d) = &t.description {
                        f.insert("description".into(), d.clone().into());
                    }
                    f.insert("parameters".into(), t.parameters.clone());
                    json!({"type": "function", "function": f})
                })
                .collect(),
        )
    }

    /// Whether calls in the reply are parsed back (every choice but `none`).
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The tools a forced reply may call: all for `required`, the named one, none otherwise.
    pub fn forced(&self) -> Option<Vec<&Tool>> {
        match &self.choice {
            ToolChoice::Required => Some(self.tools.iter().collect()),
            ToolChoice::Named(name) => {
                Some(self.tools.iter().filter(|t| t.name == *name).collect())
            }
            ToolChoice::Auto | ToolChoice::None => None,
        }
    }

    /// The grammar a forced reply follows (`None` unless `tool_choice` forces a call): one
    /// `<tool_call>` block, or several separated by a newline when `parallel`, each holding
    /// `{"name": <a forced tool>, "arguments": <an object valid under its parameters>}` — the
    /// format the parser reads back ([`parse`]).
    pub fn forced_grammar(&self) -> Option<String> {
        let forced = self.forced()?;
        let calls: Vec<Value> = forced
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": &t.name}, "arguments": &t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = json!({"anyOf": calls});
        schema["x-guidance"] = json!({
            "lenient": !forced.iter().any(|t| t.strict),
            "whitespace_pattern": crate::grammar::WHITESPACE,
        });
        let block = format!(
            "block: {open} call {close}\ncall: %json {schema}",
            open = lark_string(&format!("{}\n", parse::OPEN)),
            close = lark_string(&format!("\n{}", parse::CLOSE)),
        );
        let start = match self.parallel {
            true => "start: block (\"\\n\" block)*",
            false => "start: block",
        };
        Some(format!("{start}\n{block}\n"))
    }

    /// The compiled [`ToolSet::forced_grammar`] for `vocab`.
    ///
    /// # Errors
    /// A [`ToolError`] on `tools_param` when a forced tool's schema cannot be enforced (or,
    /// strict, has a part the grammar cannot enforce).
    pub fn forced_constraint(
        &self,
        vocab: &Vocab,
        tools_param: &str,
    ) -> Result<Option<Constraint>, ToolError> {
        let Some(grammar) = self.forced_grammar() else {
            return Ok(None);
        };
        Constraint::lark(vocab, &grammar).map(Some).map_err(|e| {
            bad(
                tools_param,
                format!("the forced tool call's arguments cannot be enforced: {e}"),
            )
        })
    }

    /// The names a parsed call may have.
    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }

    /// A stop string the generation needs: `</tool_call>` when the reply may hold one call
    /// only (`parallel_tool_calls: false`), so generation ends with the first call.
    pub fn stop(&self) -> Option<&'static str> {
        (self.parses_calls() && !self.parallel).then_some(parse::CLOSE)
    }
}

/// The reply of a request as content and calls: parsed when the request's tools say so, else
/// all text.
#[derive(Debug, Clone)]
pub struct Reply {
    parser: Option<parse::CallParser>,
    /// Generation stops at `</tool_call>` ([`ToolSet::stop`]).
    stops_at_close: bool,
}

impl Reply {
    /// The reply of a request with `tools`.
    pub fn new(tools: Option<&ToolSet>) -> Reply {
        let tools = tools.filter(|t| t.parses_calls());
        Reply {
            parser: tools.map(|t| parse::CallParser::new(t.names())),
            stops_at_close: tools.is_some_and(|t| t.stop().is_some()),
        }
    }

    /// Feeds generated text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<parse::Piece> {
        match &mut self.parser {
            Some(p) => p.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![parse::Piece::Text(text.to_string())],
        }
    }

    /// Releases the rest; `stopped`: generation ended on EOS or a stop string (not at
    /// `max_tokens`).
    pub fn finish(&mut self, stopped: bool) -> Vec<parse::Piece> {
        let end = match stopped && self.stops_at_close {
            true => parse::End::AtClose,
            false => parse::End::Plain,
        };
        self.parser
            .as_mut()
            .map(|p| p.finish(end))
            .unwrap_or_default()
    }

    /// The whole reply `text` as content and calls.
    pub fn split_whole(self, text: &str, stopped: bool) -> (String, Vec<parse::ParsedCall>) {
        parse::split(self.whole(text, stopped))
    }

    /// The whole reply `text` as pieces, in order.
    pub fn whole(mut self, text: &str, stopped: bool) -> Vec<parse::Piece> {
        let mut pieces = self.push(text);
        pieces.extend(self.finish(stopped));
        pieces
    }
}

/// A fresh call id: `prefix` and 24 hex digits (`call_…` for OpenAI, `toolu_…` for Anthropic).
pub fn call_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// `s` as a Lark string literal (JSON escaping is a subset of Lark's).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// 400 for a key of `o` not in `allowed` (nothing is silently ignored).
fn check_keys(o: &Map<String, Value>, allowed: &[&str], param: &str) -> Result<(), ToolError> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(bad(
            format!("{param}.{k}"),
            format!("unsupported field `{k}`"),
        )),
    }
}

fn openai_tool(i: usize, t: &Value) -> Result<Tool, ToolError> {
    let at = format!("tools[{i}]");
    let o = t
        .as_object()
        .ok_or_else(|| bad(&at, "a tool must be an object"))?;
    check_keys(o, &["type", "function"], &at)?;
    match o.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(bad(
                format!("{at}.type"),
                format!("tool type `{other}` is not supported: only `function`"),
            ))
        }
        None => return Err(bad(format!("{at}.type"), "missing: expected `function`")),
    }
    let at = format!("{at}.function");
    let f = o
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&at, "must be an object with a name"))?;
    check_keys(f, &["name", "description", "parameters", "strict"], &at)?;
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad(format!("{at}.strict"), "must be a boolean")),
    };
    // A forced call is grammar-constrained to the schema (`strict` decides whether a part the
    // grammar cannot enforce is an error); an `auto` call is parsed as the model wrote it.
    let mut t = tool(
        &at,
        f.get("name"),
        f.get("description"),
        f.get("parameters"),
        "parameters",
    )?;
    t.strict = strict;
    Ok(t)
}

fn anthropic_tool(i: usize, t: &Value) -> Result<Tool, ToolError> {
    let at = format!("tools[{i}]");
    let o = t
        .as_object()
        .ok_or_else(|| bad(&at, "a tool must be an object"))?;
    // Server tools (`web_search_20250305`, ...) carry a `type`; client tools have none or
    // `custom`.
    if let Some(kind) = o.get("type") {
        if kind != "custom" {
            return Err(bad(
                format!("{at}.type"),
                format!("tool type {kind} is not supported: only client tools"),
            ));
        }
    }
    // `cache_control` marks a cache breakpoint: prefixes are cached automatically here, so it
    // is accepted as on content blocks.
    check_keys(
        o,
        &[
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
        ],
        &at,
    )?;
    if o.get("input_schema").is_none() {
        return Err(bad(format!("{at}.input_schema"), "missing"));
    }
    tool(
        &at,
        o.get("name"),
        o.get("description"),
        o.get("input_schema"),
        "input_schema",
    )
}

fn tool(
    at: &str,
    name: Option<&Value>,
    description: Option<&Value>,
    parameters: Option<&Value>,
    schema_key: &str,
) -> Result<Tool, ToolError> {
    let name = name
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("{at}.name"), "missing or not a string"))?;
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > MAX_NAME_LEN || !name.chars().all(valid) {
        return Err(bad(
            format!("{at}.name"),
            format!("tool name {name:?} must be 1 to {MAX_NAME_LEN} of a-z, A-Z, 0-9, _ and -"),
        ));
    }
    let description = match description {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad(format!("{at}.description"), "must be a string")),
    };
    let parameters = match parameters {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p) => {
            let param = format!("{at}.{schema_key}");
            schema::check(p, &param)?;
            match p.get("type") {
                Some(t) if t == "object" => {}
                _ => {
                    return Err(bad(
                        param,
                        "must be a JSON schema of type `object` (arguments are an object)",
                    ))
                }
            }
            p.clone()
        }
    };
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
        strict: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}])
    }

    #[test]
    fn openai_tools_and_choices() {
        let tools = weather();
        let set = ToolSet::from_openai(Some(&tools), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(set.choice, ToolChoice::Auto);
        assert!(set.parallel && set.parses_calls() && set.forced().is_none());
        assert_eq!(set.template_tools(), tools);
        for (choice, want) in [
            (json!("none"), ToolChoice::None),
            (json!("required"), ToolChoice::Required),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                ToolChoice::Named("get_weather".into()),
            ),
        ] {
            let set = ToolSet::from_openai(Some(&tools), Some(&choice), Some(&json!(false)))
                .unwrap()
                .unwrap();
            assert_eq!(set.choice, want);
            assert!(!set.parallel);
        }
        // No tools and none asked: a plain request.
        assert_eq!(ToolSet::from_openai(None, None, None), Ok(None));
        assert_eq!(ToolSet::from_openai(Some(&json!([])), None, None), Ok(None));
        // A tool without parameters takes an empty object.
        let bare = json!([{"type": "function", "function": {"name": "now"}}]);
        let set = ToolSet::from_openai(Some(&bare), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(set.tools[0].parameters["type"], "object");
    }

    #[test]
    fn bad_openai_tools_name_the_field() {
        let tools = weather();
        let cases = [
            (json!({"a": 1}), None, "tools"),
            (json!([1]), None, "tools[0]"),
            (json!([{"type": "retrieval"}]), None, "tools[0].type"),
            (json!([{"type": "function"}]), None, "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "bad name"}}]),
                None,
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
                None,
                "tools[0].function.parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}]),
                None,
                "tools[0].function.parameters.properties",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "extra": 1}}]),
                None,
                "tools[0].function.extra",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
                None,
                "tools[1]",
            ),
            (tools.clone(), Some(json!("sometimes")), "tool_choice"),
            (
                tools.clone(),
                Some(json!({"type": "function", "function": {"name": "other"}})),
                "tool_choice",
            ),
            (
                tools.clone(),
                Some(json!({"type": "tool", "function": {"name": "get_weather"}})),
                "tool_choice.type",
            ),
            (json!([]), Some(json!("required")), "tool_choice"),
        ];
        for (tools, choice, param) in cases {
            let err = ToolSet::from_openai(Some(&tools), choice.as_ref(), None).unwrap_err();
            assert_eq!(err.param, param, "{tools} {choice:?}: {err}");
            assert!(!err.message.is_empty());
        }
        let err = ToolSet::from_openai(Some(&tools), None, Some(&json!("yes"))).unwrap_err();
        assert_eq!(err.param, "parallel_tool_calls");
    }

    #[test]
    fn anthropic_tools_and_choices() {
        let tools = json!([{"name": "get_weather", "description": "Weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"}}]);
        let set = ToolSet::from_anthropic(Some(&tools), None)
            .unwrap()
            .unwrap();
        assert_eq!(set.choice, ToolChoice::Auto);
        assert_eq!(
            set.tools[0].parameters["properties"]["city"]["type"],
            "string"
        );
        for (choice, want, parallel) in [
            (json!({"type": "any"}), ToolChoice::Required, true),
            (json!({"type": "none"}), ToolChoice::None, true),
            (
                json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
                ToolChoice::Named("get_weather".into()),
                false,
            ),
        ] {
            let set = ToolSet::from_anthropic(Some(&tools), Some(&choice))
                .unwrap()
                .unwrap();
            assert_eq!((set.choice, set.parallel), (want, parallel));
        }
        for (tools, choice, param) in [
            (json!([{"name": "f"}]), None, "tools[0].input_schema"),
            (
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
                None,
                "tools[0].type",
            ),
            (
                tools.clone(),
                Some(json!({"type": "some"})),
                "tool_choice.type",
            ),
            (
                tools.clone(),
                Some(json!({"type": "tool", "name": "nope"})),
                "tool_choice",
            ),
            (
                tools.clone(),
                Some(json!({"type": "auto", "x": 1})),
                "tool_choice.x",
            ),
        ] {
            let err = ToolSet::from_anthropic(Some(&tools), choice.as_ref()).unwrap_err();
            assert_eq!(err.param, param, "{tools} {choice:?}: {err}");
        }
    }

    /// Whether the forced grammar of `tools` / `choice` / `parallel` takes `text` whole.
    fn forced_accepts(tools: &Value, choice: Value, parallel: bool, text: &str) -> bool {
        use specula_models::tokenizer::Special;
        let set = ToolSet::from_openai(Some(tools), Some(&choice), Some(&json!(parallel)))
            .unwrap()
            .unwrap();
        let vocab = crate::grammar::tests::vocab();
        let mut c = set.forced_constraint(&vocab, "tools").unwrap().unwrap();
        let ids = crate::grammar::tests::tokenizer()
            .encode(text, Special::Plain)
            .unwrap();
        c.check_draft(&ids) == ids.len() && {
            ids.iter().for_each(|&t| c.advance(t).unwrap());
            c.is_accepting()
        }
    }

    fn weather_and_add() -> Value {
        let mut tools = weather();
        tools
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "function", "function": {
            "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
            "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": false}}}));
        tools
    }

    #[test]
    fn forced_calls_follow_the_grammar() {
        let tools = weather_and_add();
        let add =
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>";
        let paris = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let required = || json!("required");
        assert!(forced_accepts(&tools, required(), false, add));
        assert!(forced_accepts(&tools, required(), false, paris));
        // Arguments of the other function, an unknown function, a missing required argument,
        // text before the call: refused.
        let wrong_args = add.replace("\"a\": 1, \"b\": 2", "\"city\": \"Oslo\"");
        assert!(!forced_accepts(&tools, required(), false, &wrong_args));
        assert!(!forced_accepts(
            &tools,
            required(),
            false,
            &add.replace("add", "sub")
        ));
        assert!(!forced_accepts(
            &tools,
            required(),
            false,
            &paris.replace("\"city\": \"Paris\"", "")
        ));
        assert!(!forced_accepts(
            &tools,
            required(),
            false,
            &format!("Sure. {add}")
        ));
        // Several calls only when parallel.
        let two = format!("{add}\n{paris}");
        assert!(forced_accepts(&tools, required(), true, &two));
        assert!(!forced_accepts(&tools, required(), false, &two));
        // A named function: that one only.
        let named = json!({"type": "function", "function": {"name": "add"}});
        assert!(forced_accepts(&tools, named.clone(), false, add));
        assert!(!forced_accepts(&tools, named, false, paris));
        // `auto` and `none` force nothing.
        for choice in ["auto", "none"] {
            let set = ToolSet::from_openai(Some(&tools), Some(&json!(choice)), None)
                .unwrap()
                .unwrap();
            assert!(set.forced_grammar().is_none());
        }
    }

    #[test]
    fn a_strict_schema_the_grammar_cannot_enforce_is_an_error() {
        let tools = json!([{"type": "function", "function": {"name": "f", "strict": true,
            "parameters": {"type": "object", "properties": {"s": {"type": "string",
            "format": "no-such-format"}}}}}]);
        let vocab = crate::grammar::tests::vocab();
        let set = ToolSet::from_openai(Some(&tools), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        let err = set.forced_constraint(&vocab, "tools").unwrap_err();
        assert_eq!(err.param, "tools");
        assert!(err.message.contains("no-such-format"), "{err}");
        // Not strict: the unknown format is not enforced, the rest is.
        let lenient = tools
            .to_string()
            .replace("\"strict\":true", "\"strict\":false");
        let lenient: Value = serde_json::from_str(&lenient).unwrap();
        let set = ToolSet::from_openai(Some(&lenient), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        assert!(set.forced_constraint(&vocab, "tools").unwrap().is_some());
    }
}
