//! Behaviour of [`Model`] on tiny random models loaded through the real GGUF and HF paths.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;

use super::*;
use crate::loader::{load_model, LoadOptions};
use crate::testing::TinyModel;
use crate::weights::WeightDType;

const ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "specula-models-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn hf_model(arch: &str, seed: u64, dir: &TempDir) -> Model {
    let tiny = TinyModel::new(arch, seed).unwrap();
    tiny.write_hf_dir(dir.path()).unwrap();
    load_model(dir.path(), &LoadOptions::default()).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn last_k(k: usize) -> ForwardRequest {
    ForwardRequest {
        last_k: k,
        ..Default::default()
    }
}

const PROMPT: [u32; 7] = [1, 17, 42, 5, 88, 23, 60];

#[test]
fn chunk_equals_single_steps() {
    for arch in ARCHS {
        let dir = TempDir::new();
        let m = hf_model(arch, 1, &dir);
        let mut c1 = m.new_cache();
        m.forward(&PROMPT[..4], &mut c1, &Default::default())
            .unwrap();
        let chunk = m.forward(&[7, 9, 11], &mut c1, &last_k(3)).unwrap().logits;
        assert_eq!(chunk.dims(), &[3, 96]);

        let mut c2 = m.new_cache();
        m.forward(&PROMPT[..4], &mut c2, &Default::default())
            .unwrap();
        let steps: Vec<Tensor> = [7, 9, 11]
            .iter()
            .map(|&t| {
                m.forward(&[t], &mut c2, &Default::default())
                    .unwrap()
                    .logits
            })
            .collect();
        let steps = Tensor::cat(&steps, 0).unwrap();
        assert!(max_diff(&chunk, &steps) < 1e-4, "{arch}");
        assert_eq!(c1.len(), 7);
        assert_eq!(c2.len(), 7);
        // The logits depend on the context: not a degenerate model.
        assert!(
            max_diff(
                &chunk.narrow(0, 0, 1).unwrap(),
                &chunk.narrow(0, 1, 1).unwrap()
            ) > 1e-3
        );
    }
}

#[test]
fn trim_then_reforward_reproduces_logits() {
    let dir = TempDir::new();
    let m = hf_model("qwen3", 2, &dir);
    let mut c = m.new_cache();
    m.forward(&PROMPT, &mut c, &Default::default()).unwrap();
    let accepted = m.forward(&[3, 4], &mut c, &last_k(2)).unwrap().logits;
    // A rejected draft, rolled back.
    m.forward(&[50, 51, 52], &mut c, &last_k(3)).unwrap();
    c.trim(5).unwrap();
    assert_eq!(c.len(), PROMPT.len());
    let again = m.forward(&[3, 4], &mut c, &last_k(2)).unwrap().logits;
    assert!(max_diff(&accepted, &again) < 1e-5);
    // A different continuation after truncate gives different logits.
    c.truncate(PROMPT.len()).unwrap();
    let other = m.forward(&[30, 4], &mut c, &last_k(1)).unwrap().logits;
    assert!(max_diff(&other, &again.narrow(0, 1, 1).unwrap()) > 1e-3);
}

#[test]
fn taps_shapes_and_final_norm_gives_logits() {
    let dir = TempDir::new();
    let m = hf_model("llama", 3, &dir);
    let req = ForwardRequest {
        last_k: 2,
        taps: vec![TapId::FinalNorm, TapId::Layer(1), TapId::Layer(0)],
        taps_all_positions: false,
    };
    let mut c = m.new_cache();
    let out = m.forward(&PROMPT, &mut c, &req).unwrap();
    let ids: Vec<TapId> = out.taps.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, req.taps, "taps come back in request order");
    for (_, t) in &out.taps {
        assert_eq!(t.dims(), &[2, 64]);
    }
    let from_tap = m.lm_head(&out.taps[0].1).unwrap();
    assert!(max_diff(&from_tap, &out.logits) < 1e-5);
    assert!(
        max_diff(&out.taps[1].1, &out.taps[2].1) > 1e-3,
        "layers differ"
    );

    // All positions, computed in prefill chunks of 3, match one forward.
    let all = ForwardRequest {
        taps_all_positions: true,
        ..req.clone()
    };
    let mut c1 = m.new_cache();
    let one = m.forward(&PROMPT, &mut c1, &all).unwrap();
    let chunked = Model {
        prefill_chunk: 3,
        ..m.clone()
    };
    let mut c2 = chunked.new_cache();
    let parts = chunked.prefill(&PROMPT, &mut c2, &all).unwrap();
    assert!(max_diff(&one.logits, &parts.logits) < 1e-4);
    for ((_, a), (_, b)) in one.taps.iter().zip(&parts.taps) {
        assert_eq!(a.dims(), &[PROMPT.len(), 64]);
        assert!(max_diff(a, b) < 1e-4);
    }
    // The tapped rows of the call are the last `last_k` rows of the all-positions taps.
    assert!(max_diff(&out.taps[1].1, &one.taps[1].1.narrow(0, 5, 2).unwrap()) < 1e-5);

    // last_k spanning a chunk boundary (chunk 3: rows 3..6 | 6) and last_k 0.
    let mut c3 = chunked.new_cache();
    let span = chunked
        .prefill(&PROMPT, &mut c3, &last_k(5))
        .unwrap()
        .logits;
    let mut c4 = m.new_cache();
    let whole = m.forward(&PROMPT, &mut c4, &last_k(5)).unwrap().logits;
    assert!(max_diff(&span, &whole) < 1e-4);
    let mut c5 = m.new_cache();
    let none = m.forward(&PROMPT, &mut c5, &last_k(0)).unwrap();
    assert_eq!(none.logits.dims(), &[0, 96]);
    assert_eq!(c5.len(), PROMPT.len());
}

#[test]
fn bad_requests_error_and_leave_cache_alone() {
    let dir = TempDir::new();
    let m = hf_model("qwen2", 4, &dir);
    let mut c = m.new_cache();
    m.forward(&PROMPT, &mut c, &Default::default()).unwrap();
    let before = c.len();

    let ctx = m.context_len();
    let long = vec![5u32; ctx - before + 1];
    let err = m.forward(&long, &mut c, &Default::default()).unwrap_err();
    assert!(
        matches!(err, Error::ContextOverflow { got, max } if got == ctx + 1 && max == ctx),
        "{err}"
    );
    let err = m.prefill(&long, &mut c, &Default::default()).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { .. }), "{err}");

    let bad = [
        (vec![], last_k(0)),
        (vec![1, 2], last_k(3)),
        (vec![1, 96], last_k(1)),
        (
            vec![1],
            ForwardRequest {
                taps: vec![TapId::Layer(2)],
                ..Default::default()
            },
        ),
    ];
    for (tokens, req) in bad {
        let err = m.forward(&tokens, &mut c, &req).unwrap_err();
        assert!(matches!(err, Error::InvalidRequest { .. }), "{err}");
        assert_eq!(c.len(), before, "cache untouched after {err}");
    }
    // Filling exactly to the context works.
    let fill = vec![5u32; ctx - before];
    m.prefill(&fill, &mut c, &Default::default()).unwrap();
    assert_eq!(c.len(), ctx);
}

#[test]
fn gguf_and_hf_dir_give_equal_logits() {
    for arch in ARCHS {
        let dir = TempDir::new();
        let tiny = TinyModel::new(arch, 5).unwrap();
        tiny.write_hf_dir(dir.path()).unwrap();
        let gguf = dir.path().join("tiny.gguf");
        tiny.write_gguf(&gguf, GgmlDType::F32).unwrap();
        let hf = load_model(dir.path(), &LoadOptions::default()).unwrap();
        let gg = load_model(&gguf, &LoadOptions::default()).unwrap();
        assert_eq!(hf.config().num_hidden_layers, gg.config().num_hidden_layers);
        assert_eq!(
            hf.config().tie_word_embeddings,
            gg.config().tie_word_embeddings
        );
        let run = |m: &Model| {
            let mut c = m.new_cache();
            m.forward(&PROMPT, &mut c, &last_k(3)).unwrap().logits
        };
        let (a, b) = (run(&hf), run(&gg));
        assert!(max_diff(&a, &b) < 1e-4, "{arch}: {}", max_diff(&a, &b));
    }
}

#[test]
fn quantized_gguf_native_and_dequantized_agree() {
    let dir = TempDir::new();
    let tiny = TinyModel::new("llama", 6).unwrap();
    tiny.write_hf_dir(dir.path()).unwrap();
    let gguf = dir.path().join("tiny-q8.gguf");
    tiny.write_gguf(&gguf, GgmlDType::Q8_0).unwrap();
    let run = |path: &Path, dtype: WeightDType| {
        let opts = LoadOptions {
            dtype,
            ..Default::default()
        };
        let m = load_model(path, &opts).unwrap();
        let mut c = m.new_cache();
        m.forward(&PROMPT, &mut c, &last_k(3)).unwrap().logits
    };
    let native = run(&gguf, WeightDType::Native);
    let f32 = run(&gguf, WeightDType::F32);
    let hf = run(dir.path(), WeightDType::Native);
    let bf16 = run(dir.path(), WeightDType::Bf16);
    // Native q8_0 quantizes activations too, so it is close to but not equal to f32.
    let q_err = max_diff(&native, &f32);
    assert!(q_err < 0.05, "{q_err}");
    assert!(max_diff(&f32, &hf) < 0.05);
    let b_err = max_diff(&bf16, &hf);
    assert!(b_err > 0.0 && b_err < 0.1, "{b_err}");
    // Q4_1 / Q5_0 run through layers::qmatmul: native must match the dequantized weights.
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_0] {
        let path = dir.path().join(format!("tiny-{dtype:?}.gguf"));
        tiny.write_gguf(&path, dtype).unwrap();
        let exact = run(&path, WeightDType::F32);
        let err = max_diff(&run(&path, WeightDType::Native), &exact);
        // Only the 8-bit activations differ: about 1% of the logit range.
        let scale = exact
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err < 0.02 * scale, "{dtype:?}: {err} (max |logit| {scale})");
    }
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = TempDir::new();
    let mut cfg = TinyModel::tiny_config("llama").unwrap();
    let tiny = TinyModel::with_config(cfg.clone(), 1).unwrap();
    cfg.model_type = "gpt2".into();
    TinyModel {
        config: cfg,
        tensors: tiny.tensors,
    }
    .write_hf_dir(dir.path())
    .unwrap();
    let err = load_model(dir.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::UnsupportedArchitecture { got, supported }
            if got == "gpt2" && supported.contains("qwen3")),
        "{err}"
    );
}

#[test]
fn truncated_or_missing_files_give_clear_errors() {
    let dir = TempDir::new();
    let tiny = TinyModel::new("qwen2", 7).unwrap();
    let gguf = dir.path().join("tiny.gguf");
    tiny.write_gguf(&gguf, GgmlDType::Q8_0).unwrap();
    let bytes = std::fs::read(&gguf).unwrap();
    let half = dir.path().join("half.gguf");
    std::fs::write(&half, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model(&half, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidModel { reason, .. } if reason.contains("truncated")),
        "{err}"
    );
    // Cut inside the header.
    std::fs::write(&half, &bytes[..40]).unwrap();
    let err = load_model(&half, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::InvalidModel { .. }), "{err}");
    std::fs::write(&half, b"not a gguf at all").unwrap();
    let err = load_model(&half, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::InvalidModel { .. }), "{err}");

    let err = load_model(&dir.path().join("absent.gguf"), &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Io { .. }), "{err}");
    let err = load_model(&dir.path().join("absent-dir"), &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Io { .. }), "{err}");

    // HF dir with truncated safetensors, then without weights at all.
    let hf = dir.path().join("hf");
    tiny.write_hf_dir(&hf).unwrap();
    let st = hf.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_model(&hf, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::InvalidModel { .. }), "{err}");
    std::fs::remove_file(&st).unwrap();
    let err = load_model(&hf, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Missing { .. }), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = TempDir::new();
    let mut tiny = TinyModel::new("qwen3", 8).unwrap();
    tiny.tensors
        .retain(|(n, _)| n != "model.layers.1.self_attn.k_norm.weight");
    let gguf = dir.path().join("tiny.gguf");
    tiny.write_gguf(&gguf, GgmlDType::F32).unwrap();
    let err = load_model(&gguf, &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::Missing { what, .. } if what.contains("blk.1.attn_k_norm.weight")),
        "{err}"
    );
}

#[test]
fn load_without_tokenizer_metadata_is_a_tokenizer_error() {
    let dir = TempDir::new();
    let gguf = dir.path().join("tiny.gguf");
    TinyModel::new("llama", 9)
        .unwrap()
        .write_gguf(&gguf, GgmlDType::F32)
        .unwrap();
    let err = crate::loader::load(&gguf, &LoadOptions::default())
        .err()
        .expect("no tokenizer in a weights-only GGUF");
    assert!(
        matches!(err, Error::Tokenizer(_) | Error::Missing { .. }),
        "{err}"
    );
}
