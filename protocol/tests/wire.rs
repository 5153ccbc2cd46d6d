//! Wire-format tests: a golden JSON file per message, and postcard round trips over a real
//! ipc channel (the codec the peers actually use).
//!
//! Regenerate the golden files after a deliberate change with `UPDATE_GOLDEN=1 cargo test`.

use std::path::PathBuf;

use ipc_channel::ipc::{self, IpcSharedMemory};
use serde::{de::DeserializeOwned, Serialize};
use specula_protocol::donor::{DonorBlock, DonorLayout};
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
        late_capabilities: true,
        kv_donor_views: true,
        doorbell: true,
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
        rope_theta: Some(1_000_000.0),
        rope_layout: Some(RopeLayout::Halves),
        rms_norm_eps: Some(1e-6),
        tie_word_embeddings: Some(true),
        tap_dtype: Some(DType::F32),
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

/// Every request variant (except MapRegion, MapDonors and MapDoorbell: a memfd only exists inside
/// an ipc message).
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
        (
            "advance",
            Request::Advance(Advance {
                session: 5,
                ids: vec![12, 13],
                taps: Some(taps()),
            }),
        ),
        ("donor_tables", Request::DonorTables(donor_tables())),
    ]
}

fn donor_tables() -> DonorTables {
    DonorTables {
        tables: vec![
            DonorTable {
                session: 5,
                keep: 0,
                append: vec![
                    DonorBlock { block: 4, epoch: 1 },
                    DonorBlock { block: 0, epoch: 3 },
                ],
                len: 40,
            },
            DonorTable {
                session: 6,
                keep: 2,
                append: vec![],
                len: 64,
            },
        ],
    }
}

/// The layout a `MapDonors` carries: a Gemma-4-like pair of donor layers of different shapes.
fn donor_layout() -> DonorLayout {
    DonorLayout::f32(&[(3, 2, 16), (5, 1, 32)], 8).unwrap()
}

fn proposed() -> DrafterMsg {
    DrafterMsg::Reply {
        seq: 42,
        reply: Reply::Proposed(Proposed {
            rows: vec![
                ProposedRow {
                    session: 5,
                    tokens: vec![10, 12],
                    q: None,
                    confidence: Some(vec![0.875, 0.25]),
                },
                ProposedRow {
                    session: 6,
                    tokens: vec![3],
                    q: Some(vec![vec![0.0, 0.0, 0.0, 1.0]]),
                    confidence: None,
                },
            ],
        }),
    }
}

fn late_capabilities() -> DrafterMsg {
    DrafterMsg::Capabilities(Capabilities {
        max_draft_len: 15,
        prefill: PrefillMode::LeaveLastPending,
        tap_layers: vec![1, 9, 17, 25, 33],
        final_hidden: false,
        kv_layers: vec![],
    })
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
    golden("proposed", &proposed());
    golden("capabilities", &late_capabilities());
    golden("donor_layout", &donor_layout());
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
    for msg in [drafted(), proposed(), late_capabilities()] {
        tx.send(msg.clone()).unwrap();
        assert_eq!(rx.recv().unwrap(), msg);
    }
}

/// The 1.0 wire enums, frozen as a 1.0 peer compiled them (their payload structs did not change
/// shape in 1.1). Decoding with them is what a 1.0 peer does.
mod v1_0 {
    use serde::{Deserialize, Serialize};
    use specula_protocol::wire::{Close, Commit, Draft, Drafted, MapRegion, Open, Seq};

    #[derive(Debug, Serialize, Deserialize)]
    pub enum Request {
        MapRegion(MapRegion),
        Open(Open),
        Draft(Draft),
        Commit(Commit),
        Close(Close),
        Shutdown,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum HostMsg {
        Handshake(String),
        Request { seq: Seq, request: Request },
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum Reply {
        Drafted(Drafted),
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum DrafterMsg {
        Goodbye { reason: String },
        Reply { seq: Seq, reply: Reply },
    }
}

#[test]
fn a_1_0_peer_decodes_every_message_a_1_1_peer_may_send_it() {
    let v1_0 = Version { major: 1, minor: 0 };
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<v1_0::HostMsg> = rx.to_opaque().to();
    let mut sent = 0;
    for (i, (name, request)) in requests().into_iter().enumerate() {
        let msg = HostMsg::Request {
            seq: i as u64,
            request,
        };
        match check(&msg, v1_0) {
            Ok(()) => {
                tx.send(msg).unwrap();
                let got = rx.recv().unwrap_or_else(|e| panic!("{name}: {e:?}"));
                assert!(
                    matches!(got, v1_0::HostMsg::Request { seq, .. } if seq == i as u64),
                    "{name}: {got:?}"
                );
                sent += 1;
            }
            Err(Error::TooNew { message, .. }) => {
                assert!(
                    ["Advance", "DonorTables"].contains(&message),
                    "{message} is not newer than 1.0"
                );
                // Why the sender must refuse it: a 1.0 peer cannot decode it at all.
                tx.send(msg).unwrap();
                assert!(rx.recv().is_err(), "a 1.0 peer decoded a 1.1 message");
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    assert_eq!(sent, requests().len() - 2);
    // Drafter → host: a 1.1 drafter at 1.0 may send Drafted and Goodbye, never the rest.
    let (tx, rx) = ipc::channel::<DrafterMsg>().unwrap();
    let rx: ipc::IpcReceiver<v1_0::DrafterMsg> = rx.to_opaque().to();
    check(&drafted(), v1_0).unwrap();
    tx.send(drafted()).unwrap();
    assert!(matches!(
        rx.recv().unwrap(),
        v1_0::DrafterMsg::Reply { seq: 41, .. }
    ));
    for newer in [proposed(), late_capabilities()] {
        assert!(check(&newer, v1_0).is_err(), "{newer:?} is 1.1");
    }
}

/// The 1.1 wire enums, frozen as a 1.1 peer compiled them.
mod v1_1 {
    use serde::{Deserialize, Serialize};
    use specula_protocol::wire::{
        Advance, Capabilities, Close, Commit, Draft, Drafted, MapRegion, Open, Proposed, Seq,
    };

    #[derive(Debug, Serialize, Deserialize)]
    pub enum Request {
        MapRegion(MapRegion),
        Open(Open),
        Draft(Draft),
        Commit(Commit),
        Close(Close),
        Shutdown,
        Advance(Advance),
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum HostMsg {
        Handshake(String),
        Request { seq: Seq, request: Request },
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum Reply {
        Drafted(Drafted),
        Proposed(Proposed),
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum DrafterMsg {
        Goodbye { reason: String },
        Reply { seq: Seq, reply: Reply },
        Capabilities(Capabilities),
    }
}

#[test]
fn a_1_1_peer_decodes_every_message_a_1_2_peer_may_send_it() {
    let v1_1 = Version { major: 1, minor: 1 };
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<v1_1::HostMsg> = rx.to_opaque().to();
    let mut refused = Vec::new();
    for (i, (name, request)) in requests().into_iter().enumerate() {
        let msg = HostMsg::Request {
            seq: i as u64,
            request,
        };
        match check(&msg, v1_1) {
            Ok(()) => {
                tx.send(msg).unwrap();
                let got = rx.recv().unwrap_or_else(|e| panic!("{name}: {e:?}"));
                assert!(
                    matches!(got, v1_1::HostMsg::Request { seq, .. } if seq == i as u64),
                    "{name}: {got:?}"
                );
            }
            Err(Error::TooNew { message, .. }) => {
                refused.push(message);
                // Why the sender must refuse it: a 1.1 peer cannot decode it.
                tx.send(msg).unwrap();
                assert!(rx.recv().is_err(), "a 1.1 peer decoded a 1.2 message");
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    assert_eq!(refused, ["DonorTables"], "only the donor messages are 1.2");
    // MapDonors carries a memfd, so it is checked without a golden file.
    let map = HostMsg::Request {
        seq: 9,
        request: Request::MapDonors(MapDonors {
            region: 1,
            shm: IpcSharedMemory::from_byte(0, 8),
            layout: donor_layout(),
        }),
    };
    assert!(matches!(
        check(&map, v1_1),
        Err(Error::TooNew {
            message: "MapDonors",
            ..
        })
    ));
    check(&map, PROTOCOL_VERSION).unwrap();
    // Drafter → host: 1.2 added nothing; a 1.1 host decodes all a 1.2 drafter sends.
    let (tx, rx) = ipc::channel::<DrafterMsg>().unwrap();
    let rx: ipc::IpcReceiver<v1_1::DrafterMsg> = rx.to_opaque().to();
    for msg in [drafted(), proposed(), late_capabilities()] {
        check(&msg, v1_1).unwrap();
        tx.send(msg).unwrap();
        assert!(!matches!(
            rx.recv().unwrap(),
            v1_1::DrafterMsg::Goodbye { .. }
        ));
    }
}

#[test]
fn a_1_2_peer_decodes_a_1_1_peers_messages() {
    let (tx, rx) = ipc::channel::<v1_1::HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<HostMsg> = rx.to_opaque().to();
    let advance = Advance {
        session: 3,
        ids: vec![4],
        taps: Some(taps()),
    };
    tx.send(v1_1::HostMsg::Request {
        seq: 2,
        request: v1_1::Request::Advance(advance.clone()),
    })
    .unwrap();
    assert_eq!(
        rx.recv().unwrap(),
        HostMsg::Request {
            seq: 2,
            request: Request::Advance(advance)
        }
    );
    // A 1.1 Hello has no kv_donor_views: it reads as false (rows in the taps, as 1.1 sends).
    let mut hello = serde_json::to_value(hello()).unwrap();
    hello.as_object_mut().unwrap().remove("kv_donor_views");
    let hello: Hello = serde_json::from_value(hello).unwrap();
    assert!(!hello.kv_donor_views && hello.late_capabilities);
}

/// The 1.2 wire enums, frozen as a 1.2 peer compiled them.
mod v1_2 {
    use serde::{Deserialize, Serialize};
    use specula_protocol::wire::{
        Advance, Close, Commit, DonorTables, Draft, MapDonors, MapRegion, Open, Seq,
    };

    #[derive(Debug, Serialize, Deserialize)]
    pub enum Request {
        MapRegion(MapRegion),
        Open(Open),
        Draft(Draft),
        Commit(Commit),
        Close(Close),
        Shutdown,
        Advance(Advance),
        MapDonors(MapDonors),
        DonorTables(DonorTables),
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub enum HostMsg {
        Handshake(String),
        Request { seq: Seq, request: Request },
    }
}

#[test]
fn a_1_2_peer_decodes_every_message_a_1_3_peer_may_send_it() {
    let v1_2 = Version { major: 1, minor: 2 };
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<v1_2::HostMsg> = rx.to_opaque().to();
    for (i, (name, request)) in requests().into_iter().enumerate() {
        let msg = HostMsg::Request {
            seq: i as u64,
            request,
        };
        check(&msg, v1_2).unwrap_or_else(|e| panic!("{name}: {e}"));
        tx.send(msg).unwrap();
        let got = rx.recv().unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert!(
            matches!(got, v1_2::HostMsg::Request { seq, .. } if seq == i as u64),
            "{name}: {got:?}"
        );
    }
    // MapDoorbell is the only 1.3 message; it carries a memfd (no golden file). A 1.2 peer
    // cannot decode it, so the sender refuses it.
    let map = HostMsg::Request {
        seq: 20,
        request: Request::MapDoorbell(MapDoorbell {
            shm: IpcSharedMemory::from_byte(0, 8),
            spin_us: 50,
        }),
    };
    assert!(matches!(
        check(&map, v1_2),
        Err(Error::TooNew {
            message: "MapDoorbell",
            ..
        })
    ));
    check(&map, PROTOCOL_VERSION).unwrap();
    tx.send(map).unwrap();
    assert!(rx.recv().is_err(), "a 1.2 peer decoded MapDoorbell");
    // Drafter → host: 1.3 added no message (replies change only their transport).
    for msg in [drafted(), proposed(), late_capabilities()] {
        check(&msg, v1_2).unwrap();
    }
}

#[test]
fn a_1_3_peer_reads_a_1_2_hello_as_no_doorbell() {
    let mut hello = serde_json::to_value(hello()).unwrap();
    hello.as_object_mut().unwrap().remove("doorbell");
    let hello: Hello = serde_json::from_value(hello).unwrap();
    assert!(!hello.doorbell && hello.kv_donor_views);
    let (tx, rx) = ipc::channel::<v1_2::HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<HostMsg> = rx.to_opaque().to();
    tx.send(v1_2::HostMsg::Request {
        seq: 4,
        request: v1_2::Request::DonorTables(donor_tables()),
    })
    .unwrap();
    assert_eq!(
        rx.recv().unwrap(),
        HostMsg::Request {
            seq: 4,
            request: Request::DonorTables(donor_tables())
        }
    );
}

/// A doorbell frame is the message's postcard bytes, the socket's codec: every request and reply
/// that may travel in a ring comes out as it went in.
#[test]
fn every_ring_message_round_trips_through_a_frame() {
    use specula_protocol::doorbell::{decode, encode};
    for (i, (name, request)) in requests().into_iter().enumerate() {
        assert!(!request.carries_fd(), "{name}");
        let msg = HostMsg::Request {
            seq: i as u64,
            request,
        };
        assert_eq!(decode::<HostMsg>(&encode(&msg).unwrap()).unwrap(), msg);
    }
    for msg in [drafted(), proposed(), late_capabilities()] {
        assert_eq!(decode::<DrafterMsg>(&encode(&msg).unwrap()).unwrap(), msg);
    }
    let err = decode::<HostMsg>(&[0xff, 0xff, 0xff]).unwrap_err();
    assert!(err.to_string().contains("does not decode"), "{err}");
}

#[test]
fn map_doorbell_carries_a_live_doorbell() {
    use specula_protocol::doorbell::{Doorbell, Frame};
    use std::time::Duration;
    let host = Doorbell::host(4096, Duration::ZERO).unwrap();
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let map = MapDoorbell {
        shm: host.handle(),
        spin_us: 7,
    };
    assert!(Request::MapDoorbell(map.clone()).carries_fd());
    tx.send(HostMsg::Request {
        seq: 0,
        request: Request::MapDoorbell(map),
    })
    .unwrap();
    let HostMsg::Request {
        request: Request::MapDoorbell(got),
        ..
    } = rx.recv().unwrap()
    else {
        panic!("expected MapDoorbell");
    };
    assert_eq!(got.spin_us, 7);
    let drafter = Doorbell::drafter(got.shm, Duration::ZERO).unwrap();
    host.send(b"to the drafter", Duration::ZERO).unwrap();
    drafter.send(b"to the host", Duration::ZERO).unwrap();
    let frame = |bytes: &[u8]| Some(Frame::Message(bytes.to_vec()));
    assert_eq!(
        drafter.recv(Duration::ZERO).unwrap(),
        frame(b"to the drafter")
    );
    assert_eq!(host.recv(Duration::ZERO).unwrap(), frame(b"to the host"));
}

#[test]
fn map_donors_carries_live_shared_memory_and_its_layout() {
    use specula_protocol::donor::{DonorReader, DonorWriter};
    let mut writer = DonorWriter::new(2, donor_layout()).unwrap();
    writer.claim(6);
    let epoch = writer.publish(6);
    writer.write_row(1, 6, 3, &[1.5; 32], &[-2.5; 32]);
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let msg = HostMsg::Request {
        seq: 0,
        request: Request::MapDonors(MapDonors {
            region: 2,
            shm: writer.handle(),
            layout: writer.layout().clone(),
        }),
    };
    tx.send(msg).unwrap();
    let HostMsg::Request {
        request: Request::MapDonors(got),
        ..
    } = rx.recv().unwrap()
    else {
        panic!("expected MapDonors");
    };
    let reader = DonorReader::new(got.region, got.shm, got.layout).unwrap();
    let table = [DonorBlock { block: 6, epoch }];
    let rows = reader.rows(&table, 4).unwrap();
    let (k, v) = rows.copy_rows(1, 3..4).unwrap();
    assert_eq!((k, v), (vec![1.5; 32], vec![-2.5; 32]));
}

#[test]
fn a_1_1_peer_decodes_a_1_0_peers_messages() {
    let (tx, rx) = ipc::channel::<v1_0::DrafterMsg>().unwrap();
    let rx: ipc::IpcReceiver<DrafterMsg> = rx.to_opaque().to();
    let DrafterMsg::Reply { reply, .. } = drafted() else {
        unreachable!()
    };
    let Reply::Drafted(d) = reply else {
        unreachable!()
    };
    tx.send(v1_0::DrafterMsg::Reply {
        seq: 3,
        reply: v1_0::Reply::Drafted(d.clone()),
    })
    .unwrap();
    let got = rx.recv().unwrap();
    assert_eq!(
        got,
        DrafterMsg::Reply {
            seq: 3,
            reply: Reply::Drafted(d)
        }
    );
    let (tx, rx) = ipc::channel::<v1_0::HostMsg>().unwrap();
    let rx: ipc::IpcReceiver<HostMsg> = rx.to_opaque().to();
    tx.send(v1_0::HostMsg::Request {
        seq: 1,
        request: v1_0::Request::Close(Close { session: 2 }),
    })
    .unwrap();
    assert_eq!(
        rx.recv().unwrap(),
        HostMsg::Request {
            seq: 1,
            request: Request::Close(Close { session: 2 })
        }
    );
}

#[test]
fn a_1_0_hello_and_target_info_read_with_1_1_defaults() {
    // What a 1.0 peer writes: none of the 1.1 fields.
    let mut hello = serde_json::to_value(hello()).unwrap();
    hello.as_object_mut().unwrap().remove("late_capabilities");
    let hello: Hello = serde_json::from_value(hello).unwrap();
    assert!(!hello.late_capabilities);
    let mut info = serde_json::to_value(target()).unwrap();
    for field in [
        "rope_theta",
        "rope_layout",
        "rms_norm_eps",
        "tie_word_embeddings",
        "tap_dtype",
    ] {
        info.as_object_mut().unwrap().remove(field);
    }
    let info: TargetInfo = serde_json::from_value(info).unwrap();
    assert_eq!(
        (info.rope_theta, info.rope_layout, info.tap_dtype),
        (None, None, None)
    );
    assert_eq!(info.hidden_size, 896);
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
    // A 1.0 message is fine at 1.0 and at any later 1.x.
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
    let v1_0 = Version { major: 1, minor: 0 };
    let err = check(&FromV1_1, v1_0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "message `FromV1_1` needs protocol 1.1 but 1.0 was negotiated"
    );
    check(&FromV1_1, PROTOCOL_VERSION).unwrap();
    let (tx, rx) = ipc::channel::<HostMsg>().unwrap();
    let sender = Sender::new(tx, Version { major: 2, minor: 0 });
    assert!(sender.send(msg).is_err());
    drop(sender);
    assert!(rx.recv().is_err(), "a refused message must not be sent");
}
