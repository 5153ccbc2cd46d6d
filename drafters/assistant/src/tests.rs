//! Parity with transformers' `Gemma4AssistantForCausalLM` on tiny random weights
//! (`tests/fixtures/gemma4-assistant-tiny`, `scripts/reference/gemma4_assistant.py`), borrowing
//! the K/V of Specula's own Gemma 4 target (`tests/fixtures/gemma4-tiny/full`).

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde_json::Value;
use specula_models::config::{LayerType, ModelConfig};
use specula_models::{ForwardRequest, LoadOptions, Rows, TapId, WeightDType};

use super::{Assistant, Donor, DonorKv};

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn draft_steps_match_transformers() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("gemma4-assistant-tiny/reference.json")).unwrap(),
    )
    .unwrap();
    let target_dir = fixtures().join("gemma4-tiny/full");
    let opts = LoadOptions {
        dtype: WeightDType::F32,
        ..LoadOptions::default()
    };
    let target = specula_models::load_model(&target_dir, &opts).unwrap();
    let params = ModelConfig::from_hf_json(&target_dir.join("config.json"))
        .unwrap()
        .gemma4()
        .unwrap();
    let ids: Vec<u32> = serde_json::from_value(reference["ids"].clone()).unwrap();
    let pending = ids.len() - 1;
    // The target runs the committed ids 0..P; the pending id has no K/V yet.
    let mut cache = target.new_cache();
    let req = ForwardRequest {
        logits: Rows::Last(0),
        taps: vec![TapId::FinalNorm],
        tap_rows: Rows::Last(1),
    };
    let out = target.forward(&ids[..pending], &mut cache, &req).unwrap();
    let h0 = out.taps[0].1.flatten_all().unwrap();
    let want_h0: Vec<f32> = serde_json::from_value(reference["h0"].clone()).unwrap();
    assert!(max_diff(&h0.to_vec1::<f32>().unwrap(), &want_h0) < TOL);
    let donors: Vec<(LayerType, Vec<f32>, Vec<f32>)> =
        [LayerType::SlidingAttention, LayerType::FullAttention]
            .into_iter()
            .map(|kind| {
                let slot = params.donor_slot(kind).expect("the target has both kinds");
                let (k, v) = cache.rows(slot, 0..pending).unwrap();
                (kind, k, v)
            })
            .collect();
    let donor = |kind: LayerType| {
        donors.iter().find(|d| d.0 == kind).map(|(_, k, v)| {
            Donor::Rows(DonorKv {
                k,
                v,
                rows: pending,
            })
        })
    };
    for case in reference["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let assistant =
            Assistant::load(&fixtures().join("gemma4-assistant-tiny").join(name)).unwrap();
        assert_eq!(
            assistant.layer_kinds(),
            [LayerType::SlidingAttention, LayerType::FullAttention]
        );
        let (mut tok, mut hidden) = (ids[pending], h0.clone());
        for (k, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let embed: Tensor = target.arch().embed(&[tok]).unwrap();
            let out = assistant.step(&embed, &hidden, pending, donor).unwrap();
            let want: Vec<f32> = serde_json::from_value(step["logits"].clone()).unwrap();
            let d = max_diff(&out.logits, &want);
            assert!(d < TOL, "{name} step {k}: logits differ by {d}");
            let want: Vec<f32> = serde_json::from_value(step["projected"].clone()).unwrap();
            let got = out.projected.to_vec1::<f32>().unwrap();
            assert!(
                max_diff(&got, &want) < TOL,
                "{name} step {k}: projected state"
            );
            let argmax = (0..out.logits.len())
                .max_by(|&a, &b| out.logits[a].total_cmp(&out.logits[b]))
                .unwrap() as u32;
            assert_eq!(argmax as u64, step["argmax"].as_u64().unwrap());
            (tok, hidden) = (argmax, out.projected);
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let dir = fixtures().join("gemma4-assistant-tiny/plain");
    let assistant = Assistant::load(&dir).unwrap();
    let x = Tensor::zeros(64, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let short = Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let none = |_: LayerType| -> Option<Donor<'static>> { None };
    let err = assistant.step(&short, &x, 3, none).unwrap_err().to_string();
    assert!(err.contains("embedding has 3 values"), "{err}");
    let err = assistant.step(&x, &x, 3, none).unwrap_err().to_string();
    assert!(err.contains("no donor"), "{err}");
    let k = vec![0.0; 5];
    let err = assistant
        .step(&x, &x, 3, |_| {
            Some(Donor::Rows(DonorKv {
                k: &k,
                v: &k,
                rows: 2,
            }))
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("donor K/V of 5"), "{err}");
    // A target's folder is not an assistant.
    let err = Assistant::load(&fixtures().join("gemma4-tiny/full"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("gemma4_assistant"), "{err}");
}

/// The same step over the donor K/V read in place from a donor region (protocol 1.2 views, the
/// KV pool's block layout) equals the step over row-major copies, bit for bit.
#[test]
fn donor_blocks_in_place_equal_row_copies() {
    use specula_protocol::donor::{DonorBlock, DonorLayout, DonorReader, DonorWriter};
    let assistant = Assistant::load(&fixtures().join("gemma4-assistant-tiny/plain")).unwrap();
    let shapes = assistant.layer_shapes();
    // 37 positions: two blocks, the second partial; random-looking K/V per layer kind.
    let rows = 37;
    let data: Vec<(Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, (heads, hd)))| {
            let n = rows * heads * hd;
            let f = |s: f32| {
                (0..n)
                    .map(|j| (j as f32 * 0.37 + s + i as f32).sin())
                    .collect()
            };
            (f(0.1), f(2.3))
        })
        .collect();
    let dims: Vec<(u32, u32, u32)> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, (h, d)))| (i as u32, *h as u32, *d as u32))
        .collect();
    let layout = DonorLayout::f32(&dims, 4).unwrap();
    let mut writer = DonorWriter::new(0, layout.clone()).unwrap();
    let table: Vec<DonorBlock> = [2u32, 0]
        .iter()
        .map(|&block| DonorBlock {
            block,
            epoch: {
                writer.claim(block);
                writer.publish(block)
            },
        })
        .collect();
    for (i, (k, v)) in data.iter().enumerate() {
        let w = k.len() / rows;
        for p in 0..rows {
            let block = table[p / 32].block;
            writer.write_row(
                i,
                block,
                p % 32,
                &k[p * w..(p + 1) * w],
                &v[p * w..(p + 1) * w],
            );
        }
    }
    let reader = DonorReader::new(0, writer.handle(), layout).unwrap();
    let view = reader.rows(&table, rows).unwrap();
    let kind_index = |kind: LayerType| shapes.iter().position(|s| s.0 == kind);
    let dev = candle_core::Device::Cpu;
    let x = Tensor::new(
        &(0..64).map(|i| (i as f32 * 0.1).cos()).collect::<Vec<_>>()[..],
        &dev,
    )
    .unwrap();
    let copies = assistant
        .step(&x, &x, rows, |kind| {
            let (k, v) = &data[kind_index(kind)?];
            Some(Donor::Rows(DonorKv { k, v, rows }))
        })
        .unwrap();
    let in_place = assistant
        .step(&x, &x, rows, |kind| {
            Some(Donor::Blocks {
                rows: view,
                layer: kind_index(kind)?,
            })
        })
        .unwrap();
    assert_eq!(copies.logits, in_place.logits);
    view.check().unwrap();
}
