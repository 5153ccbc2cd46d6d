//! Reading a Hugging Face model folder's tokenizer: `tokenizer.json`, plus the special tokens
//! of `tokenizer_config.json` and `generation_config.json`.

use std::path::Path;

use serde_json::Value as Json;

use super::SpecialIds;
use crate::{Error, Result};

/// Builds the tokenizer, its vocabulary size and its special ids from a model folder.
pub(super) fn build(dir: &Path) -> Result<(tokenizers::Tokenizer, usize, SpecialIds)> {
    let path = dir.join("tokenizer.json");
    let bytes = std::fs::read(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    let inner = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation = read_json(&dir.join("generation_config.json"))?;

    let named = |key: &str| -> Result<Option<u32>> {
        let Some(text) = config.as_ref().and_then(|c| token_text(&c[key])) else {
            return Ok(None);
        };
        inner.token_to_id(text).map(Some).ok_or_else(|| {
            Error::Tokenizer(format!(
                "tokenizer_config.json names {key} '{text}', which is not in the vocabulary"
            ))
        })
    };
    let bos = match named("bos_token")? {
        Some(id) => Some(id),
        None => generation
            .as_ref()
            .and_then(|g| ids(&g["bos_token_id"]).first().copied()),
    };
    let mut declared_eos: Vec<u32> = named("eos_token")?.into_iter().collect();
    if let Some(g) = &generation {
        declared_eos.extend(ids(&g["eos_token_id"]));
    }
    // Without an explicit add_bos_token, BOS is added when tokenizer.json's post-processor adds
    // it (Llama 3 does; Qwen and SmolLM2 do not).
    let add_bos = match config.as_ref().and_then(|c| c["add_bos_token"].as_bool()) {
        Some(b) => b,
        None => post_processor_adds(&inner, bos)?,
    };
    let mut control: Vec<u32> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect();
    // A hash map's order would make eos_ids (and the fingerprint) vary from run to run.
    control.sort_unstable();
    let vocab_size = inner.get_vocab_size(true);
    let ids = SpecialIds {
        bos,
        add_bos,
        declared_eos,
        control,
    };
    Ok((inner, vocab_size, ids))
}

/// An optional JSON file; `None` when absent.
fn read_json(path: &Path) -> Result<Option<Json>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

/// A special token in tokenizer_config.json: `"<s>"` or `{"content": "<s>", ...}`.
fn token_text(v: &Json) -> Option<&str> {
    v.as_str().or_else(|| v["content"].as_str())
}

/// Token ids in generation_config.json: one integer or a list.
fn ids(v: &Json) -> Vec<u32> {
    match v {
        Json::Array(xs) => xs.iter().filter_map(as_id).collect(),
        other => as_id(other).into_iter().collect(),
    }
}

fn as_id(v: &Json) -> Option<u32> {
    v.as_u64().and_then(|i| u32::try_from(i).ok())
}

fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: Option<u32>) -> Result<bool> {
    let Some(bos) = bos else {
        return Ok(false);
    };
    let enc = inner
        .encode_fast("a", true)
        .map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
    Ok(enc.get_ids().first() == Some(&bos))
}

#[cfg(test)]
mod tests {
    use super::super::{tests::load, Special, Tokenizer};
    use crate::Error;

    /// A model folder written from a GGUF-built tokenizer, as a Hugging Face export would be.
    fn export(dir: &std::path::Path, config: &str) -> &'static Tokenizer {
        let tok = load("smollm2-135m");
        tok.inner
            .save(dir.join("tokenizer.json"), false)
            .expect("save tokenizer.json");
        std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
        tok
    }

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("specula-tok-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn hf_dir_matches_gguf() {
        let dir = temp_dir("same");
        let gguf = export(
            &dir,
            r#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": false}"#,
        );
        let hf = Tokenizer::from_hf_dir(&dir).unwrap();
        let text = "Hello 123 <|im_start|>user\ncafé 🙂";
        assert_eq!(
            hf.encode(text, Special::Parse).unwrap(),
            gguf.encode(text, Special::Parse).unwrap()
        );
        assert_eq!(hf.eos_ids(), gguf.eos_ids());
        assert_eq!(hf.bos_id(), gguf.bos_id());
        assert_eq!(hf.fingerprint(), gguf.fingerprint());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_dir_add_bos_and_bad_files() {
        let dir = temp_dir("bos");
        export(
            &dir,
            r#"{"bos_token": "<|im_start|>", "add_bos_token": true}"#,
        );
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        let bos = tok.bos_id().unwrap();
        assert_eq!(tok.encode("hi", Special::Parse).unwrap()[0], bos);
        // A prompt that already starts with BOS does not get a second one.
        let ids = tok.encode("<|im_start|>hi", Special::Parse).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);

        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "<nope>"}"#,
        )
        .unwrap();
        let err = Tokenizer::from_hf_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("'<nope>'"), "{err}");

        std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
        assert!(matches!(
            Tokenizer::from_hf_dir(&dir),
            Err(Error::Tokenizer(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(
            Tokenizer::from_hf_dir(&dir),
            Err(Error::Io { .. })
        ));
    }
}
