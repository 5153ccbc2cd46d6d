//! Behaviour of [`Model`] on tiny random models loaded through the real GGUF and HF paths.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;

use super::*;
use crate::kv_pool::SeqId;
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
        logits: Rows::Last(k),
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
        logits: Rows::Last(2),
        taps: vec![TapId::FinalNorm, TapId::Layer(1), TapId::Layer(0)],
        tap_rows: Rows::Last(2),
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
        tap_rows: Rows::All,
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

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// What a packed forward of one sequence gives: its logits, taps and K/V of every slot.
#[derive(Debug, PartialEq)]
struct Seen {
    logits: Vec<u32>,
    taps: Vec<Vec<u32>>,
    kv: Vec<(Vec<u32>, Vec<u32>)>,
}

const TAPS: [TapId; 2] = [TapId::Layer(0), TapId::FinalNorm];

fn seen(m: &Model, out: &BatchOutput, i: usize, pool: &KvPool, seq: SeqId) -> Seen {
    let len = pool.len(seq).unwrap();
    let to_bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect();
    Seen {
        logits: bits(&out.logits_of(i).unwrap()),
        taps: TAPS
            .iter()
            .map(|t| bits(&out.tap_of(*t, i).unwrap()))
            .collect(),
        kv: (0..m.kv_layout().slots.len())
            .map(|s| {
                let (k, v) = pool.read_rows(seq, s, 0..len).unwrap();
                (to_bits(k), to_bits(v))
            })
            .collect(),
    }
}

fn rows(seq: SeqId, tokens: &[u32]) -> SeqRows {
    SeqRows {
        seq,
        tokens: tokens.to_vec(),
        logits: Rows::All,
        taps: Rows::All,
    }
}

/// Tiny model weights the invariance tests cover: HF f32 (`None`, the dense kernel), candle's
/// Q8_0 blocks and our own Q4_0 / Q5_0 kernels.
const WEIGHTS: [Option<GgmlDType>; 4] = [
    None,
    Some(GgmlDType::Q8_0),
    Some(GgmlDType::Q4_0),
    Some(GgmlDType::Q5_0),
];

/// A tiny `arch` model as an HF f32 directory (`None`) or a GGUF of `dtype`.
fn tiny_model(arch: &str, seed: u64, dtype: Option<GgmlDType>, dir: &TempDir) -> Model {
    let tiny = TinyModel::new(arch, seed).unwrap();
    let path = match dtype {
        None => {
            tiny.write_hf_dir(dir.path()).unwrap();
            dir.path().to_path_buf()
        }
        Some(dt) => {
            let p = dir.path().join(format!("tiny-{dt:?}.gguf"));
            tiny.write_gguf(&p, dt).unwrap();
            p
        }
    };
    load_model(&path, &LoadOptions::default()).unwrap()
}

#[test]
fn packed_rows_equal_each_sequence_alone() {
    for dt in WEIGHTS {
        for arch in ARCHS {
            packed_rows_equal_alone(&tiny_model(arch, 11, dt, &TempDir::new()));
        }
    }
}

#[test]
fn rows_are_independent_of_chunking() {
    for dt in WEIGHTS {
        rows_independent_of_chunking(&tiny_model("llama", 12, dt, &TempDir::new()));
    }
}

/// The rows of `[A; B]` in one packed forward equal A alone and B alone, bit for bit (logits,
/// taps, K/V), for decode rows after a prefix as well as for prompts.
fn packed_rows_equal_alone(m: &Model) {
    let path = m.weights_path().to_path_buf();
    {
        let a_prompt: Vec<u32> = (0..37).map(|i| (i * 5 + 1) % 96).collect();
        let b_prompt = [3u32, 9, 27, 81];
        let solo = |prefix: &[u32], tokens: &[u32]| {
            let mut pool = m.new_pool(8).unwrap();
            let s = pool.create();
            if !prefix.is_empty() {
                m.forward_batch(
                    &Batch {
                        seqs: vec![rows(s, prefix)],
                        taps: vec![],
                    },
                    &mut pool,
                )
                .unwrap();
            }
            let batch = Batch {
                seqs: vec![rows(s, tokens)],
                taps: TAPS.to_vec(),
            };
            let out = m.forward_batch(&batch, &mut pool).unwrap();
            seen(m, &out, 0, &pool, s)
        };
        // Prompts together.
        let mut pool = m.new_pool(8).unwrap();
        let (a, b) = (pool.create(), pool.create());
        let batch = Batch {
            seqs: vec![rows(a, &a_prompt), rows(b, &b_prompt)],
            taps: TAPS.to_vec(),
        };
        let out = m.forward_batch(&batch, &mut pool).unwrap();
        assert_eq!(out.logit_rows, vec![0..37, 37..41]);
        assert_eq!(
            seen(m, &out, 0, &pool, a),
            solo(&[], &a_prompt),
            "{path:?}: A"
        );
        assert_eq!(
            seen(m, &out, 1, &pool, b),
            solo(&[], &b_prompt),
            "{path:?}: B"
        );
        // Then a verify window of A beside a decode row of B (B first in the batch).
        let batch = Batch {
            seqs: vec![rows(b, &[50]), rows(a, &[7, 8, 9])],
            taps: TAPS.to_vec(),
        };
        let out = m.forward_batch(&batch, &mut pool).unwrap();
        let a_all = [&a_prompt[..], &[7, 8, 9]].concat();
        let mut want_a = solo(&a_prompt, &[7, 8, 9]);
        let mut got_a = seen(m, &out, 1, &pool, a);
        assert_eq!(got_a.kv, solo(&[], &a_all).kv, "{path:?}: A's K/V");
        (want_a.kv, got_a.kv) = (vec![], vec![]);
        assert_eq!(got_a, want_a, "{path:?}: A's window");
        assert_eq!(
            seen(m, &out, 0, &pool, b),
            solo(&b_prompt, &[50]),
            "{path:?}: B's step"
        );
    }
}

/// Prefill in chunks of 1..=N gives the bits of one chunk (logits of the requested rows, taps
/// of all rows, every K/V row), and a decode step after it too.
fn rows_independent_of_chunking(m: &Model) {
    let prompt: Vec<u32> = (0..45).map(|i| (i * 11 + 3) % 96).collect();
    let req = ForwardRequest {
        logits: Rows::Only(vec![0, 17, 33, 44]),
        taps: TAPS.to_vec(),
        tap_rows: Rows::All,
    };
    let run = |chunk: usize| {
        let mut c = m.new_cache();
        let out = m.forward_chunked(&prompt, &mut c, &req, chunk).unwrap();
        let step = m.forward(&[5], &mut c, &Default::default()).unwrap();
        let (pool, seq) = c.pool();
        let kv = pool.read_rows(seq, 1, 0..prompt.len() + 1).unwrap();
        let taps: Vec<Vec<u32>> = out.taps.iter().map(|(_, t)| bits(t)).collect();
        (bits(&out.logits), taps, bits(&step.logits), kv.0, kv.1)
    };
    let one = run(prompt.len());
    assert_eq!(one.1[0].len(), prompt.len() * 64);
    for chunk in [1, 2, 3, 7, 16, 31, 32, 33] {
        assert!(
            run(chunk) == one,
            "{:?}: chunk {chunk} differs",
            m.weights_path()
        );
    }
}

#[test]
fn batch_errors_roll_back_every_sequence() {
    let dir = TempDir::new();
    let m = tiny_model("qwen2", 13, Some(GgmlDType::Q4_0), &dir);
    // Two blocks: A takes one, B's 40 tokens need two.
    let mut pool = m.new_pool(2).unwrap();
    let (a, b) = (pool.create(), pool.create());
    m.forward_batch(
        &Batch {
            seqs: vec![rows(a, &[1, 2, 3])],
            taps: vec![],
        },
        &mut pool,
    )
    .unwrap();
    let batch = Batch {
        seqs: vec![rows(a, &[4]), rows(b, &[5; 40])],
        taps: vec![],
    };
    let err = m.forward_batch(&batch, &mut pool).unwrap_err();
    assert!(matches!(err, Error::KvPoolFull { .. }), "{err}");
    assert_eq!((pool.len(a).unwrap(), pool.len(b).unwrap()), (3, 0));
    let bad = [
        Batch::default(),
        Batch {
            seqs: vec![rows(a, &[])],
            taps: vec![],
        },
        Batch {
            seqs: vec![rows(a, &[1]), rows(a, &[2])],
            taps: vec![],
        },
        Batch {
            seqs: vec![rows(a, &[1]), rows(b, &[96])],
            taps: vec![],
        },
        Batch {
            seqs: vec![SeqRows {
                logits: Rows::Only(vec![1, 0]),
                ..rows(a, &[1, 2])
            }],
            taps: vec![],
        },
        Batch {
            seqs: vec![SeqRows {
                taps: Rows::Last(3),
                ..rows(a, &[1, 2])
            }],
            taps: vec![],
        },
        Batch {
            seqs: vec![rows(a, &[1])],
            taps: vec![TapId::Layer(2)],
        },
    ];
    for batch in bad {
        let err = m.forward_batch(&batch, &mut pool).unwrap_err();
        assert!(
            matches!(err, Error::InvalidRequest { .. }),
            "{batch:?}: {err}"
        );
        assert_eq!(
            (pool.len(a).unwrap(), pool.len(b).unwrap()),
            (3, 0),
            "{batch:?}"
        );
    }
    // A pool made for another model (3 layers).
    let mut wrong = KvPool::new(crate::kv_pool::KvLayout::uniform(3, 2, 16), 2).unwrap();
    let s = wrong.create();
    let err = m
        .forward_batch(
            &Batch {
                seqs: vec![rows(s, &[1])],
                taps: vec![],
            },
            &mut wrong,
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidRequest { .. }), "{err}");
    // A prefix hit skips the shared blocks and gives the same logits.
    let long: Vec<u32> = (0..40).map(|i| (i * 3) % 96).collect();
    let mut pool = m.new_pool(8).unwrap();
    let first = pool.create();
    let out1 = m
        .forward_batch(
            &Batch {
                seqs: vec![rows(first, &long)],
                taps: vec![],
            },
            &mut pool,
        )
        .unwrap();
    pool.release(first).unwrap();
    let second = pool.create();
    let hit = pool.adopt_prefix(second, &long[..long.len() - 1]).unwrap();
    assert_eq!(hit, crate::kv_pool::BLOCK_SIZE);
    let rest = SeqRows {
        logits: Rows::Last(1),
        ..rows(second, &long[hit..])
    };
    let out2 = m
        .forward_batch(
            &Batch {
                seqs: vec![rest],
                taps: vec![],
            },
            &mut pool,
        )
        .unwrap();
    assert_eq!(
        bits(&out2.logits),
        bits(&out1.logits.narrow(0, 39, 1).unwrap())
    );
}
