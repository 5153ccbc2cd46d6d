//! A structural check of a tool's JSON schema: every keyword this server (and the grammar that
//! forces calls) reads has the JSON type the JSON Schema spec gives it, so a malformed schema is
//! a 400 naming the keyword rather than a tool the model is shown but cannot be held to.
//!
//! Keywords not listed are left to the grammar compiler (which refuses what it cannot express
//! when a call is forced); this check is about shape, not about what a schema means.

use serde_json::Value;

use super::{bad, ToolError};

/// JSON types a `type` keyword may name.
const TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// Deepest schema nesting accepted (a bound on recursion for hostile input).
const MAX_DEPTH: usize = 32;

/// Checks `schema` (found at `param`).
///
/// # Errors
/// A [`ToolError`] naming the first malformed keyword.
pub fn check(schema: &Value, param: &str) -> Result<(), ToolError> {
    check_at(schema, param, 0)
}

fn check_at(schema: &Value, at: &str, depth: usize) -> Result<(), ToolError> {
    if depth > MAX_DEPTH {
        return Err(bad(at, format!("schema nested deeper than {MAX_DEPTH}")));
    }
    let o = match schema {
        // `true` / `false` are schemas too (anything / nothing).
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        _ => return Err(bad(at, "a JSON schema must be an object")),
    };
    let sub = |k: &str| format!("{at}.{k}");
    for (k, v) in o {
        match k.as_str() {
            "type" => {
                let names: Vec<&Value> = match v {
                    Value::Array(a) if !a.is_empty() => a.iter().collect(),
                    Value::String(_) => vec![v],
                    _ => return Err(bad(sub(k), "must be a type name or a list of them")),
                };
                if let Some(n) = names
                    .iter()
                    .find(|n| !n.as_str().is_some_and(|s| TYPES.contains(&s)))
                {
                    return Err(bad(
                        sub(k),
                        format!("unknown type {n}: expected one of {}", TYPES.join(", ")),
                    ));
                }
            }
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                let props = v
                    .as_object()
                    .ok_or_else(|| bad(sub(k), "must be an object of schemas"))?;
                for (name, s) in props {
                    check_at(s, &format!("{at}.{k}.{name}"), depth + 1)?;
                }
            }
            "items" | "additionalProperties" | "not" | "contains" | "propertyNames" => {
                check_at(v, &sub(k), depth + 1)?
            }
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                let list = v
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| bad(sub(k), "must be a non-empty list of schemas"))?;
                for (i, s) in list.iter().enumerate() {
                    check_at(s, &format!("{at}.{k}[{i}]"), depth + 1)?;
                }
            }
            "required" => {
                let names = v
                    .as_array()
                    .filter(|a| a.iter().all(Value::is_string))
                    .ok_or_else(|| bad(sub(k), "must be a list of property names"))?;
                let props = o.get("properties").and_then(Value::as_object);
                let additional = o.get("additionalProperties") != Some(&Value::Bool(false));
                if let Some(missing) = names
                    .iter()
                    .filter_map(Value::as_str)
                    .find(|n| !additional && !props.is_some_and(|p| p.contains_key(*n)))
                {
                    return Err(bad(
                        sub(k),
                        format!("`{missing}` is required but additionalProperties is false and it is not a property"),
                    ));
                }
            }
            "enum" if !v.is_array() => return Err(bad(sub(k), "must be a list of values")),
            "description" | "title" | "pattern" | "format" | "$ref" | "$schema" | "$id"
                if !v.is_string() =>
            {
                return Err(bad(sub(k), "must be a string"))
            }
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" | "multipleOf"
                if !v.is_number() =>
            {
                return Err(bad(sub(k), "must be a number"))
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" | "minProperties"
            | "maxProperties"
                if !v.is_u64() =>
            {
                return Err(bad(sub(k), "must be a non-negative integer"))
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn good_schemas_pass() {
        for s in [
            json!({"type": "object", "properties": {"a": {"type": ["string", "null"]},
                "b": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1}},
                "required": ["a"], "additionalProperties": false}),
            json!({"anyOf": [{"type": "integer", "minimum": 0}, true]}),
            json!({"type": "object", "required": ["x"]}),
        ] {
            check(&s, "p").unwrap_or_else(|e| panic!("{s}: {e}"));
        }
    }

    #[test]
    fn malformed_keywords_are_named() {
        for (s, param) in [
            (json!("object"), "p"),
            (json!({"type": "dict"}), "p.type"),
            (json!({"type": []}), "p.type"),
            (json!({"properties": {"a": 3}}), "p.properties.a"),
            (json!({"items": [1]}), "p.items"),
            (json!({"anyOf": []}), "p.anyOf"),
            (json!({"required": "a"}), "p.required"),
            (
                json!({"required": ["b"], "properties": {"a": {}}, "additionalProperties": false}),
                "p.required",
            ),
            (json!({"minLength": -1}), "p.minLength"),
            (json!({"description": 5}), "p.description"),
            (
                json!({"properties": {"a": {"properties": {"b": {"type": 1}}}}}),
                "p.properties.a.properties.b.type",
            ),
        ] {
            let err = check(&s, "p").unwrap_err();
            assert_eq!(err.param, param, "{s}: {err}");
        }
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"items": deep});
        }
        assert!(check(&deep, "p").unwrap_err().message.contains("deeper"));
    }
}
