//! Tiny random-weight models with a word-level tokenizer, loaded through the real loader.

use std::path::Path;

use specula_models::loader::{load, LoadOptions, LoadedModel};
use specula_models::testing::TinyModel;

/// Writes a word-level tokenizer for ids `0..vocab` (token `t{i}`), with `t2` as EOS and `t1`
/// as BOS (matching [`TinyModel::tiny_config`]).
pub fn write_tiny_tokenizer(dir: &Path, vocab: usize) -> std::io::Result<()> {
    let tokenizer = specula_models::random::word_level_tokenizer_json(vocab);
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())?;
    let config = serde_json::json!({"bos_token": "t1", "eos_token": "t2", "add_bos_token": false});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string())
}

/// A tiny model of `model_type` (llama, qwen2, qwen3) with weights from `seed`, written to a
/// temporary HF directory and loaded back with its tokenizer. Keep the `TempDir` alive while
/// the model is used.
pub fn tiny_loaded(model_type: &str, seed: u64) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().expect("temp dir");
    let tiny = TinyModel::new(model_type, seed).expect("tiny model");
    tiny.write_hf_dir(dir.path()).expect("write tiny model");
    let vocab = TinyModel::tiny_config(model_type)
        .expect("tiny config")
        .vocab_size;
    write_tiny_tokenizer(dir.path(), vocab).expect("write tiny tokenizer");
    let loaded = load(dir.path(), &LoadOptions::default()).expect("load tiny model");
    (dir, loaded)
}
