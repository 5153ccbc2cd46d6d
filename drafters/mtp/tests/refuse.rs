//! Every checkpoint the drafter cannot run is refused with a message naming what is missing:
//! MLA, MoE, gated attention, RoPE scaling, several MTP layers, no MTP module at all, a target
//! architecture without a dense block, a module of another width; and `--max-draft 0`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use mtp::config::{config_path, MtpConfig};
use mtp::{weights, Error, LinearDType, Mtp, MtpDrafter, Options, WeightsSource};
use serde_json::Value;
use specula_protocol::sdk::Drafter;
use specula_protocol::wire::TargetInfo;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/mtp")
        .join(case)
}

/// A copy of fixture `case` with its tensors and config edited; returns the folder.
fn edited(
    case: &str,
    tensors: impl FnOnce(&mut HashMap<String, Tensor>),
    config: impl FnOnce(&mut Value),
) -> tempfile::TempDir {
    let src = fixture(case);
    let mut t =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    tensors(&mut t);
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(config_path(&src)).unwrap()).unwrap();
    config(&mut c);
    let dir = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&t, dir.path().join("model.safetensors")).unwrap();
    std::fs::write(config_path(dir.path()), c.to_string()).unwrap();
    dir
}

/// Loads config and module of `dir` for a `block` target; the error text.
fn refusal(dir: &Path, block: &str) -> String {
    let mut w = weights::open(dir).unwrap();
    let result = MtpConfig::load(&config_path(dir), &w, block)
        .and_then(|c| Mtp::load(c, &mut w, 64, LinearDType::Stored).map(|_| ()));
    match result {
        Ok(()) => panic!("{} was accepted", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn zeros(dims: &[usize]) -> Tensor {
    Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap()
}

const P: &str = "model.layers.2.";

#[test]
fn refuses_mla_moe_and_gated_blocks_by_name() {
    let mla = edited(
        "deepseek_llama",
        |t| {
            t.insert(
                format!("{P}self_attn.kv_a_proj_with_mqa.weight"),
                zeros(&[8, 64]),
            );
        },
        |_| {},
    );
    assert!(refusal(mla.path(), "llama").contains("multi-head latent attention (MLA"));
    let moe = edited(
        "deepseek_llama",
        |t| {
            t.insert(format!("{P}mlp.gate.weight"), zeros(&[4, 64]));
        },
        |_| {},
    );
    assert!(refusal(moe.path(), "llama").contains("mixture-of-experts MLP"));
    let gated = edited(
        "qwen3_next",
        |t| {
            t.insert(
                "mtp.layers.0.self_attn.q_proj.weight".into(),
                zeros(&[128, 64]),
            );
        },
        |_| {},
    );
    assert!(refusal(gated.path(), "qwen3").contains("gated attention"));
    let gated_config = edited(
        "qwen3_next",
        |_| {},
        |c| c["attn_output_gate"] = true.into(),
    );
    assert!(refusal(gated_config.path(), "qwen3").contains("gated attention"));
}

#[test]
fn refuses_what_the_config_asks_for_and_a_missing_module() {
    let scaled = edited(
        "deepseek_llama",
        |_| {},
        |c| c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
    );
    assert!(refusal(scaled.path(), "llama").contains("rope_scaling"));
    let two = edited(
        "deepseek_llama",
        |t| {
            let more: Vec<(String, Tensor)> = t
                .iter()
                .filter_map(|(k, v)| {
                    k.strip_prefix(P)
                        .map(|rest| (format!("model.layers.3.{rest}"), v.clone()))
                })
                .collect();
            t.extend(more);
        },
        |c| c["num_nextn_predict_layers"] = 2.into(),
    );
    assert!(refusal(two.path(), "llama").contains("2 MTP layers: only one is implemented"));
    let none = edited(
        "deepseek_llama",
        |t| t.retain(|k, _| !k.contains("eh_proj")),
        |_| {},
    );
    assert!(refusal(none.path(), "llama").contains("no MTP module"));
    let missing = edited(
        "deepseek_llama",
        |t| {
            t.remove(&format!("{P}mlp.up_proj.weight"));
        },
        |_| {},
    );
    assert!(refusal(missing.path(), "llama").contains("mlp.up_proj"));
    assert!(refusal(&fixture("deepseek_llama"), "gemma3")
        .contains("MTP block for a gemma3 target is not implemented"));
}

#[test]
fn the_drafter_refuses_a_target_it_does_not_fit_and_a_zero_depth() {
    let err = MtpDrafter::new(
        WeightsSource::Path(fixture("mimo")),
        Options {
            max_draft: 0,
            ..Options::default()
        },
    )
    .err()
    .expect("--max-draft 0 is refused");
    assert!(matches!(err, Error::Options(_)), "{err}");
    let mut d = MtpDrafter::new(
        WeightsSource::Path(fixture("deepseek_llama")),
        Options::default(),
    )
    .unwrap();
    let target = TargetInfo {
        architecture: "llama".into(),
        hidden_size: 576,
        vocab_size: 120,
        num_layers: 2,
        ..TargetInfo::default()
    };
    let why = d.accept_target(&target).unwrap_err();
    assert!(why.contains("hidden size is 64, the target's 576"), "{why}");
    // Nothing shipped for this target, nothing in its checkpoint.
    let root = tempfile::tempdir().unwrap();
    let mut d = MtpDrafter::new(
        WeightsSource::Auto {
            root: root.path().to_path_buf(),
        },
        Options::default(),
    )
    .unwrap();
    let why = d.accept_target(&target).unwrap_err();
    assert!(
        why.contains("no MTP weights for target llama") && why.contains("--weights"),
        "{why}"
    );
}
