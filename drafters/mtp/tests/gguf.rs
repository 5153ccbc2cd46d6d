//! An MTP layer inside a GGUF target, under llama.cpp's NextN names (`blk.{L}.nextn.{eh_proj,
//! enorm, hnorm, shared_head_head, shared_head_norm}` plus the block's usual `blk.{L}.attn_*` /
//! `ffn_*`, `{arch}.nextn_predict_layers`, `block_count` counting the layer; gguf-py
//! `MODEL_TENSOR.NEXTN_*` 0.19.0): a tiny random llama target written once as an HF checkpoint
//! and once as a GGUF file by `TinyModel` (llama q/k rows permuted as llama.cpp's converter
//! does) gives the same target and the same drafts, found in the target's own file.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use mtp::feed::{target_info, HostFeed};
use mtp::{LinearDType, MtpDrafter, Options, WeightsSource};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specula_models::drafter_support::draft_vocab::VocabChoice;
use specula_models::testing::TinyModel;
use specula_models::{load_model, ForwardRequest, LoadOptions, Model, Rows, TapId, WeightDType};
use specula_protocol::sdk::Drafter;
use specula_protocol::wire::TargetInfo;

/// A tiny llama target with a random DeepSeek-layout MTP layer `model.layers.{L}.*` (with its
/// own `shared_head.head` when `own_head`).
fn tiny_with_mtp(seed: u64, own_head: bool) -> TinyModel {
    let mut tiny = TinyModel::new("llama", seed).expect("tiny llama");
    let c = tiny.config.clone();
    let (h, hd, inter) = (c.hidden_size, c.head_dim(), c.intermediate_size);
    let (q, kv) = (c.num_attention_heads * hd, c.kv_heads() * hd);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6767_7566);
    let p = format!("model.layers.{}.", c.num_hidden_layers);
    let mut put = |name: &str, dims: &[usize], centre: f32| {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| centre + (rng.random::<f32>() - 0.5) * 0.3)
            .collect();
        let t = Tensor::from_vec(data, dims, &Device::Cpu).expect("tensor");
        tiny.tensors.push((format!("{p}{name}.weight"), t));
    };
    for n in [
        "enorm",
        "hnorm",
        "shared_head.norm",
        "input_layernorm",
        "post_attention_layernorm",
    ] {
        put(n, &[h], 1.0);
    }
    put("eh_proj", &[h, 2 * h], 0.0);
    put("self_attn.q_proj", &[q, h], 0.0);
    put("self_attn.k_proj", &[kv, h], 0.0);
    put("self_attn.v_proj", &[kv, h], 0.0);
    put("self_attn.o_proj", &[h, q], 0.0);
    put("mlp.gate_proj", &[inter, h], 0.0);
    put("mlp.up_proj", &[inter, h], 0.0);
    put("mlp.down_proj", &[h, inter], 0.0);
    if own_head {
        put("shared_head.head", &[c.vocab_size, h], 0.0);
    }
    tiny
}

fn info(model: &Model, path: &Path) -> TargetInfo {
    target_info(model.config(), path, model.context_len())
}

fn f32_model(path: &Path) -> Model {
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..Default::default()
    };
    load_model(path, &opts).expect("load the tiny target")
}

/// Logits of every row and final-norm hiddens of `seq`.
fn forward(model: &Model, seq: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let req = ForwardRequest {
        logits: Rows::All,
        taps: vec![TapId::FinalNorm],
        tap_rows: Rows::All,
    };
    let out = model
        .forward(seq, &mut model.new_cache(), &req)
        .expect("forward");
    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1()).expect("f32");
    (flat(&out.logits), flat(&out.taps[0].1))
}

/// The drafter on `target` (its own checkpoint only: the shipped-heads root is empty), fed the
/// hiddens `h` of `seq` as the host feeds it: drafts of 3 after the prompt (8 ids) and after each
/// later id.
fn drafts(target: &TargetInfo, seq: &[u32], h: &[f32], hidden: usize) -> Vec<Vec<u32>> {
    let empty = tempfile::tempdir().expect("temp dir");
    let source = WeightsSource::Auto {
        root: empty.path().to_path_buf(),
    };
    let mut d = MtpDrafter::new(
        source,
        Options {
            max_draft: 3,
            linear_dtype: LinearDType::Stored,
            // The references' numerics: every row of the vocabulary, every draft proposed.
            draft_vocab: VocabChoice::Full,
            min_confidence: 0.0,
        },
    )
    .expect("options");
    d.accept_target(target)
        .expect("the MTP layer is found in the target's file");
    let feed = HostFeed {
        seq,
        hiddens: h,
        hidden,
    };
    let pending = 8;
    feed.open(&mut d, 1, pending);
    let mut out = vec![d.draft(1, &[], 3).tokens];
    for t in pending..seq.len() - 1 {
        feed.commit(&mut d, 1, t, 1);
        out.push(d.draft(1, &[], 3).tokens);
    }
    out
}

fn seq(vocab: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(7);
    (0..24).map(|_| rng.random_range(3..vocab as u32)).collect()
}

#[test]
fn a_nextn_layer_in_a_gguf_target_drafts_as_the_same_layer_in_an_hf_checkpoint() {
    for own_head in [false, true] {
        let tiny = tiny_with_mtp(11, own_head);
        let dir = tempfile::tempdir().expect("temp dir");
        let hf = dir.path().join("hf");
        tiny.write_hf_dir(&hf).expect("write HF checkpoint");
        let gguf = dir.path().join("tiny.gguf");
        tiny.write_gguf_with_nextn(&gguf, GgmlDType::F32, 1)
            .expect("write GGUF");
        let (hf_model, gguf_model) = (f32_model(&hf), f32_model(&gguf));
        // The target runs its decoder layers only: the NextN block is not a layer.
        assert_eq!(gguf_model.config().num_hidden_layers, 2);
        let s = seq(tiny.config.vocab_size);
        let (hf_logits, h) = forward(&hf_model, &s);
        let (gguf_logits, _) = forward(&gguf_model, &s);
        let worst = hf_logits
            .iter()
            .zip(&gguf_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "GGUF target logits differ by {worst}");
        let hidden = tiny.config.hidden_size;
        let want = drafts(&info(&hf_model, &hf), &s, &h, hidden);
        let got = drafts(&info(&gguf_model, &gguf), &s, &h, hidden);
        assert_eq!(want.len(), 16);
        assert!(want.iter().all(|d| d.len() == 3), "{want:?}");
        assert_eq!(got, want, "own_head {own_head}: GGUF drafts differ from HF");
        // Not a constant: the module's drafts depend on its inputs.
        assert!(want.windows(2).any(|w| w[0] != w[1]), "{want:?}");
    }
}

#[test]
fn a_quantized_gguf_nextn_layer_loads_and_drafts() {
    let tiny = tiny_with_mtp(12, false);
    let dir = tempfile::tempdir().expect("temp dir");
    let gguf = dir.path().join("tiny-q8.gguf");
    tiny.write_gguf_with_nextn(&gguf, GgmlDType::Q8_0, 1)
        .expect("write GGUF");
    let model = load_model(&gguf, &LoadOptions::default()).expect("load native");
    let s = seq(tiny.config.vocab_size);
    let (_, h) = forward(&model, &s);
    let d = drafts(&info(&model, &gguf), &s, &h, tiny.config.hidden_size);
    assert!(d.iter().all(|d| d.len() == 3), "{d:?}");
}

#[test]
fn a_gguf_without_a_nextn_layer_is_refused_by_name() {
    let tiny = TinyModel::new("llama", 13).expect("tiny llama");
    let dir = tempfile::tempdir().expect("temp dir");
    let gguf = dir.path().join("plain.gguf");
    tiny.write_gguf(&gguf, GgmlDType::F32).expect("write GGUF");
    let model = f32_model(&gguf);
    let target = info(&model, &gguf);
    // Found nowhere: the target's own file has no MTP layer and no head is shipped for it.
    let empty = tempfile::tempdir().expect("temp dir");
    let auto = WeightsSource::Auto {
        root: empty.path().to_path_buf(),
    };
    let mut d = MtpDrafter::new(auto, Options::default()).expect("options");
    let err = d.accept_target(&target).unwrap_err();
    assert!(err.contains("no MTP weights for target llama"), "{err}");
    // Named explicitly: the file is read and the missing tensor named.
    let named = WeightsSource::Path(gguf.clone());
    let mut d = MtpDrafter::new(named, Options::default()).expect("options");
    let err = d.accept_target(&target).unwrap_err();
    assert!(err.contains("model.layers.2.eh_proj"), "{err}");
}
