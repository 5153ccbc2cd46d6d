//! Tokenizers and chat templates rebuilt from real GGUF files, checked against reference
//! fixtures written by `scripts/reference/tokenizer_fixtures.py` (Hugging Face `tokenizers` and
//! transformers' chat-template rendering; see that script for why this reference).

use std::path::PathBuf;

use serde_json::Value;
use specula_models::chat::{ChatMessage, ChatTemplate, GenerationPrompt};
use specula_models::tokenizer::{Special, Tokenizer};

const MODELS: [&str; 2] = ["smollm2-135m", "qwen2.5-coder-0.5b"];

fn fixture(name: &str) -> Vec<Value> {
    let path: PathBuf = specula_tests::workspace_root()
        .join("tests/fixtures/tokenizer")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows: Vec<Value> = serde_json::from_str(&text).expect("fixture is JSON");
    assert!(!rows.is_empty(), "{} is empty", path.display());
    rows
}

#[test]
fn token_ids_match_reference() {
    for model in MODELS {
        let tok = Tokenizer::from_gguf_file(&specula_tests::model_path(model)).unwrap();
        for row in fixture(&format!("{model}.json")) {
            let text = row["text"].as_str().expect("text");
            let expected: Vec<u32> = serde_json::from_value(row["ids"].clone()).expect("ids");
            let got = tok.encode(text, Special::Parse).unwrap();
            assert_eq!(got, expected, "{model}: {text:?}");
        }
    }
}

#[test]
fn chat_templates_match_reference() {
    for model in MODELS {
        let path = specula_tests::model_path(model);
        let tok = Tokenizer::from_gguf_file(&path).unwrap();
        let chat = ChatTemplate::from_gguf_file(&path, &tok)
            .unwrap()
            .expect("template in GGUF");
        for row in fixture(&format!("{model}.chat.json")) {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(row["messages"].clone()).expect("messages");
            let generation = match row["add_generation_prompt"].as_bool().expect("flag") {
                true => GenerationPrompt::Add,
                false => GenerationPrompt::Omit,
            };
            let rendered = chat.render(&messages, generation).unwrap();
            assert_eq!(rendered, row["rendered"].as_str().unwrap(), "{model}");
        }
    }
}
