//! Wire-format tests: a golden JSON file per message, and postcard round trips over a real
//! ipc channel (the codec the peers actually use).
//!
//! Regenerate the golden files after a deliberate change with `UPDATE_GOLDEN=1 cargo test`.

use std::path::PathBuf;

use ipc_channel::ipc::{self, IpcSharedMemory};
use serde::{de::DeserializeOwned, Serialize};
use specula_protocol::shm::{DType, KvView, TapViews, TensorView};
use specula_protocol::transport::{check, Sender};
use specula_protocol::wire::*;
use specula_protocol::{Error, Version, PROTOCOL_VERSION};

fn view(epoch: u64, shape: &[u32]) -> TensorView {
    TensorView {
        region: 1,
        offset: 64 + epoch,
        dtype: DType::F32,
        shape: shape.to_vec(),
        epoch,
    }
}

fn taps() -> TapViews {
    TapViews {
        pos: 17,
        rows: 2,
        layers: vec![view(0, &[2, 8])],
        final_hidden: Some(view(64, &[2, 8])),
        kv: vec![KvView {
            k: view(128, &[2, 2, 4]),
            v: view(192, &[2, 2, 4]),
        }],
    }
}

fn hello() -> Hello {
    Hello {
        versions: vec![PROTOCOL_VERSION],
        name: "ngram".into(),
        drafter_version: "0.1.0".into(),
        capabilities: Capabilities {
            max_draft_len: 8,
            prefill: PrefillMode::LeaveLastPending,
            tap_layers: vec![3, 11],
            final_hidden: true,
            kv_layers: vec![0],
        },
    }
}

fn target() -> TargetInfo {
    TargetInfo {
        architecture: "qwen2".into(),
        vocab_size: 151936,
        hidden_size: 896,
        num_layers: 24,
        num_kv_heads: 2,
        head_dim: 64,
        tokenizer_fingerprint: "sha256:abc".into(),
        eos_ids: vec![151643, 151645],
        weights_path: "/models/q.gguf".into(),
        context_len: 32768,
    }
}

fn sampling() -> SamplingSpec {
    SamplingSpec {
        temperature: 0.7,
        top_p: 0.9,
        top_k: Some(40),
        min_p: 0.05,
        seed: Some(7),
    }
}

/// Every request variant (except MapRegion: its memfd only exists inside an ipc message).
fn requests() -> Vec<(&'static str, Request)> {
    vec![
        (
            "open",
            Request::Open(Open {
                session: 5,
                prompt_ids: vec![1, 2, 3],
                sampling: sampling(),
                prompt_taps: Some(taps()),
            }),
        ),
        (
            "draft",
            Request::Draft(Draft {
                rows: vec![DraftRow {
                    session: 5,
                    new_tokens: vec![9],
                    n: 4,
                    step: 2,
                }],
            }),
        ),
        (
            "commit",
            Request::Commit(Commit {
                session: 5,
                drafted: 4,
                accepted: 1,
                accepted_ids: vec![10, 11],
                taps: Some(taps()),
            }),
        ),
        ("close", Request::Close(Close { session: 5 })),
        ("shutdown", Request::Shutdown),
    ]
}

fn drafted() -> DrafterMsg {
    DrafterMsg::Reply {
        seq: 41,
        reply: Reply::Drafted(Drafted {
            rows: vec![
                DraftedRow {
                    session: 5,
                    tokens: vec![10, 12],
                    q: Some(vec![vec![0.25, 0.75], vec![1.0, 0.0]]),
                },
                DraftedRow {
                    session: 6,
                    tokens: vec![],
                    q: None,
                },
            ],
        }),
    }
}

fn golden<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(name: &str, value: &T) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{name}.json"));
    let json = serde_json::to_string_pretty(value).unwrap() + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &json).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", path.display()));
    assert_eq!(
        json, want,
        "{name} changed its JSON form: a wire change needs a version bump"
    );
    let back: T = serde_json::from_str(&want).unwrap();
    assert_eq!(&back, value, "{name} does not round-trip through JSON");
}

#[test]
fn golden_json_for_every_message() {
    golden("hello", &hello());
    golden(
        "welcome",
        &HandshakeReply::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            target: target(),
        }),
    );
    golden(
        "refused",
        &HandshakeReply::Refused {
            reason: "no common protocol version".into(),
        },
    );
    golden("handshake", &HostMsg::Handshake("{}".into()));
    for (i, (name, request)) in requests().into_iter().enumerate() {
        golden(
            name,
            &HostMsg::Request {
                seq: i as u64,
                request,
            },
        );
    }
    golden("drafted", &drafted());
    golden(
        "goodbye",
        &DrafterMsg::Goodbye {
            reason: "tokenizer mismatch".into(),
        },
    );
}

#[test]
fn newer_handshake_fields_are_ignored_and_missing_options_default() {
    // A 1.1 peer may add fields; a 1.0 peer must still read the Hello (JSON is self-describing).
    let mut json: serde_json::Value = serde_json::to_value(hello()).unwrap();
    json["capabilities"]["speaks_tree_drafts"] = true.into();
    json["added_in_1_1"] = serde_json::json!({"x": 1});
    let back: Hello = serde_json::from_value(json).unwrap();
    assert_eq!(back, hello());
}

#[test]
fn postcard_round_trip_over_a_real_channel() {
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    for (i, (_, request)) in requests().into_iter().enumerate() {
        let msg = HostMsg::Request {
            seq: i as u64,
            request,
        };
        tx.send(msg.clone()).unwrap();
        assert_eq!(rx.recv().unwrap(), msg);
    }
    let (tx, rx) = ipc::channel::<DrafterMsg>().unwrap();
    tx.send(drafted()).unwrap();
    assert_eq!(rx.recv().unwrap(), drafted());
}

#[test]
fn map_region_carries_live_shared_memory() {
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let shm = IpcSharedMemory::from_bytes(&[1, 2, 3, 4]);
    let msg = HostMsg::Request {
        seq: 0,
        request: Request::MapRegion(MapRegion {
            region: 9,
            shm: shm.clone(),
        }),
    };
    tx.send(msg).unwrap();
    let HostMsg::Request {
        request: Request::MapRegion(got),
        ..
    } = rx.recv().unwrap()
    else {
        panic!("expected MapRegion");
    };
    assert_eq!(got.region, 9);
    assert_eq!(&got.shm[..], &[1, 2, 3, 4]);
}

#[test]
fn sender_refuses_messages_newer_than_negotiated() {
    let msg = HostMsg::Request {
        seq: 0,
        request: Request::Shutdown,
    };
    // Every current message is 1.0: fine at 1.0 and at any later 1.x.
    check(&msg, PROTOCOL_VERSION).unwrap();
    check(&msg, Version { major: 1, minor: 9 }).unwrap();
    // A peer of another major cannot read it.
    let err = check(&msg, Version { major: 2, minor: 0 }).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooNew {
                message: "Shutdown",
                ..
            }
        ),
        "{err}"
    );
    // A message from 1.1 must not reach a 1.0 peer; nothing is sent.
    struct FromV1_1;
    impl Since for FromV1_1 {
        fn kind(&self) -> &'static str {
            "FromV1_1"
        }
        fn since(&self) -> Version {
            Version { major: 1, minor: 1 }
        }
    }
    let err = check(&FromV1_1, PROTOCOL_VERSION).unwrap_err();
    assert_eq!(
        err.to_string(),
        "message `FromV1_1` needs protocol 1.1 but 1.0 was negotiated"
    );
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let sender = Sender::new(tx, Version { major: 2, minor: 0 });
    assert!(sender.send(msg).is_err());
    drop(sender);
    assert!(rx.recv().is_err(), "a refused message must not be sent");
}
