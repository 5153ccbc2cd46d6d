//! Workload files: one JSON object per line, each a prompt (raw text) or chat messages, with
//! `max_tokens`, `temperature`, `seed` and a `tag` that names the workload it belongs to
//! (`code-edit`, `chat`, ...). Results are aggregated per tag.
//!
//! ```text
//! {"tag": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48}
//! {"tag": "code-complete", "prompt": "def fib(n):", "max_tokens": 48, "temperature": 0, "seed": 0}
//! ```
//!
//! Blank lines and lines starting with `//` are skipped, so files can carry comments.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// One request of a workload, as written in the file and as handed to every worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Item {
    /// The workload this item belongs to; results are grouped by it.
    pub tag: String,
    /// Raw text, tokenized as is (exactly one of `prompt` and `messages`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Chat messages, rendered with the model's chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<Message>>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Seed of the sampler.
    #[serde(default)]
    pub seed: u64,
}

impl Item {
    /// Checks what serde cannot: one input kind, sane numbers.
    fn validate(&self) -> Result<()> {
        match (&self.prompt, &self.messages) {
            (Some(_), Some(_)) => bail!("give either \"prompt\" or \"messages\", not both"),
            (None, None) => bail!("missing \"prompt\" or \"messages\""),
            (Some(p), None) if p.is_empty() => bail!("\"prompt\" is empty"),
            (None, Some(m)) if m.is_empty() => bail!("\"messages\" is empty"),
            _ => {}
        }
        if self.tag.trim().is_empty() {
            bail!("\"tag\" is empty");
        }
        if self.max_tokens < 2 {
            bail!(
                "\"max_tokens\" is {}: decode speed needs at least 2",
                self.max_tokens
            );
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("\"temperature\" must be finite and >= 0");
        }
        Ok(())
    }
}

/// Parses workload text; `origin` names it in errors.
///
/// # Errors
/// The first malformed line, with its number and what is wrong; a workload without items.
pub fn parse(origin: &str, text: &str) -> Result<Vec<Item>> {
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        let item: Item = serde_json::from_str(line)
            .map_err(anyhow::Error::from)
            .and_then(|item: Item| item.validate().map(|()| item))
            .with_context(|| format!("{origin}:{}: bad workload line", i + 1))?;
        items.push(item);
    }
    if items.is_empty() {
        bail!("{origin}: the workload has no items");
    }
    Ok(items)
}

/// Reads and parses a workload file.
///
/// # Errors
/// An unreadable file, or what [`parse`] rejects.
pub fn load(path: &Path) -> Result<Vec<Item>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading workload {}", path.display()))?;
    parse(&path.display().to_string(), &text)
}

/// Writes items as JSON lines (the form workers read).
///
/// # Errors
/// The file cannot be written.
pub fn save(path: &Path, items: &[Item]) -> Result<()> {
    let mut text = String::new();
    for item in items {
        text.push_str(&serde_json::to_string(item)?);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prompts_and_messages_and_skips_comments() {
        let text = "// a comment\n\n{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8}\n\
            {\"tag\":\"b\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,\"temperature\":0.5,\"seed\":7}\n";
        let items = parse("w", text).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].prompt.as_deref(), Some("x"));
        assert_eq!(items[0].temperature, 0.0);
        assert_eq!(items[1].messages.as_ref().unwrap()[0].content, "hi");
        assert_eq!((items[1].temperature, items[1].seed), (0.5, 7));
    }

    /// The shipped files load, with the same tags and as many items a tag as they say.
    #[test]
    fn shipped_workloads_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
        for (file, per_tag) in [("default.jsonl", 2), ("verdict.jsonl", 8)] {
            let items = load(&dir.join(file)).unwrap();
            let mut tags = std::collections::BTreeMap::<&str, usize>::new();
            for item in &items {
                *tags.entry(item.tag.as_str()).or_default() += 1;
            }
            let want = [
                "chat",
                "code-complete",
                "code-edit",
                "creative",
                "summarise",
            ];
            assert_eq!(tags.keys().copied().collect::<Vec<_>>(), want, "{file}");
            assert!(tags.values().all(|&n| n == per_tag), "{file}: {tags:?}");
        }
    }

    #[test]
    fn malformed_line_names_its_number() {
        let text =
            "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8}\n{\"tag\":\"a\",\"prompt\":\"x\"\n";
        let err = format!("{:#}", parse("w.jsonl", text).unwrap_err());
        assert!(err.contains("w.jsonl:2"), "{err}");
    }

    #[test]
    fn rejects_bad_items_with_reasons() {
        let cases = [
            ("{\"tag\":\"a\",\"max_tokens\":8}", "missing \"prompt\""),
            (
                "{\"tag\":\"a\",\"prompt\":\"x\",\"messages\":[],\"max_tokens\":8}",
                "not both",
            ),
            (
                "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":1}",
                "at least 2",
            ),
            (
                "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8,\"temperature\":-1}",
                "temperature",
            ),
            (
                "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8,\"k\":1}",
                "unknown field",
            ),
            ("", "no items"),
        ];
        for (line, want) in cases {
            let err = format!("{:#}", parse("w", line).unwrap_err());
            assert!(err.contains(want), "{line}: {err}");
        }
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let items = parse("w", "{\"tag\":\"a\",\"prompt\":\"x\",\"max_tokens\":8}").unwrap();
        let path = dir.path().join("w.jsonl");
        save(&path, &items).unwrap();
        assert_eq!(load(&path).unwrap(), items);
    }
}
