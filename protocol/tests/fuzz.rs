//! Bounded fuzzing (property tests) of every decoder that runs on bytes from the other process.
//!
//! # What is fuzzed
//! - **postcard** (ipc-channel's codec) decoding of every session message enum and its payloads:
//!   [`HostMsg`], [`Request`], [`DrafterMsg`], [`Reply`], and the structs inside them, from
//!   arbitrary bytes and from mutated (bit-flipped, truncated, extended, spliced) valid encodings
//!   so that decoding reaches deep into the messages.
//! - **JSON** handshake payloads: [`Hello`], [`HandshakeReply`] (Welcome / Refused),
//!   [`Capabilities`], [`TargetInfo`], from arbitrary bytes and mutated valid JSON.
//! - **Views into shared memory**: arbitrary and mutated [`TensorView`]s checked by
//!   [`ShmReader::view`] against a real region, and arbitrary [`DonorLayout`]s, block tables and
//!   row ranges checked by [`DonorReader::new`], [`DonorReader::rows`] and
//!   [`DonorRows::copy_rows`]. A view that does not fit its region must be an `Err`.
//! - Untrusted length prefixes (a `Vec` or `String` claiming 2^60 elements) are refused quickly,
//!   without a large allocation.
//!
//! Every property asserts that decoding returns `Ok` or `Err` (never panics; tests build with
//! overflow checks, so an arithmetic overflow is a panic too).
//!
//! # What is not fuzzed
//! - The ipc handles themselves: [`Connect::to_drafter`] (an `IpcSender`), [`MapRegion::shm`]
//!   and [`MapDonors::shm`] (memfds). They travel out of band as file descriptors and cannot be
//!   built from bytes; outside an ipc receive, decoding one is an `Err` (which the arbitrary-bytes
//!   properties do exercise), so `MapRegion` / `MapDonors` are not used as mutation seeds. Their
//!   plain-data part ([`DonorLayout`]) is fuzzed on its own.
//! - ipc-channel's own framing (the OS message layer below postcard).
//! - Semantic checks of the host and the SDK on well-formed messages (covered by their tests).
//!
//! Case counts are fixed and small so the whole file runs in a few seconds.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use specula_protocol::donor::{DonorBlock, DonorLayer, DonorLayout, DonorReader, DonorWriter};
use specula_protocol::shm::{DType, KvView, ShmReader, ShmWriter, TapViews, TensorView};
use specula_protocol::wire::*;
use specula_protocol::PROTOCOL_VERSION;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Decodes `bytes` as `T` with postcard; must not panic. Returns whether it decoded.
fn pc<T: DeserializeOwned + Serialize>(bytes: &[u8]) -> bool {
    match postcard::from_bytes::<T>(bytes) {
        Ok(v) => {
            // What decoded must encode again.
            postcard::to_stdvec(&v).expect("a decoded message re-encodes");
            true
        }
        Err(_) => false,
    }
}

/// Every postcard decoder a peer runs, on the same bytes.
fn all_postcard(bytes: &[u8]) {
    pc::<HostMsg>(bytes);
    pc::<Request>(bytes);
    pc::<DrafterMsg>(bytes);
    pc::<Reply>(bytes);
    pc::<Open>(bytes);
    pc::<Draft>(bytes);
    pc::<Commit>(bytes);
    pc::<Advance>(bytes);
    pc::<Drafted>(bytes);
    pc::<Proposed>(bytes);
    pc::<DonorTables>(bytes);
    pc::<DonorLayout>(bytes);
    pc::<TapViews>(bytes);
    pc::<Capabilities>(bytes);
}

/// Every JSON decoder of the handshake, on the same bytes.
fn all_json(bytes: &[u8]) {
    let _ = serde_json::from_slice::<Hello>(bytes);
    let _ = serde_json::from_slice::<HandshakeReply>(bytes);
    let _ = serde_json::from_slice::<Welcome>(bytes);
    let _ = serde_json::from_slice::<Capabilities>(bytes);
    let _ = serde_json::from_slice::<TargetInfo>(bytes);
    // The peers decode `&str` (the JSON travels as a String).
    let text = String::from_utf8_lossy(bytes);
    let _ = serde_json::from_str::<Hello>(&text);
    let _ = serde_json::from_str::<HandshakeReply>(&text);
}

fn view(epoch: u64, shape: &[u32], dtype: DType) -> TensorView {
    TensorView {
        region: 1,
        offset: 64 + epoch,
        dtype,
        shape: shape.to_vec(),
        epoch,
    }
}

fn taps() -> TapViews {
    TapViews {
        pos: 17,
        rows: 2,
        layers: vec![view(0, &[2, 8], DType::F32)],
        final_hidden: Some(view(64, &[2, 8], DType::BF16)),
        kv: vec![KvView {
            k: view(128, &[2, 2, 4], DType::F32),
            v: view(192, &[2, 2, 4], DType::F32),
        }],
    }
}

fn capabilities() -> Capabilities {
    Capabilities {
        max_draft_len: 8,
        prefill: PrefillMode::FullPrompt,
        tap_layers: vec![3, 11],
        final_hidden: true,
        kv_layers: vec![0],
    }
}

fn hello() -> Hello {
    Hello {
        versions: vec![PROTOCOL_VERSION],
        name: "ngram".into(),
        drafter_version: "0.1.0".into(),
        capabilities: capabilities(),
        late_capabilities: true,
        kv_donor_views: true,
        doorbell: true,
    }
}

fn welcome() -> Welcome {
    Welcome {
        version: PROTOCOL_VERSION,
        target: TargetInfo {
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
            rope_layout: Some(RopeLayout::Interleaved),
            rms_norm_eps: Some(1e-6),
            tie_word_embeddings: Some(true),
            tap_dtype: Some(DType::BF16),
        },
    }
}

fn request(seq: u64, request: Request) -> HostMsg {
    HostMsg::Request { seq, request }
}

/// Valid postcard encodings of every plain-data message (the mutation seeds).
fn postcard_seeds() -> Vec<Vec<u8>> {
    let host = [
        HostMsg::Handshake(serde_json::to_string(&HandshakeReply::Welcome(welcome())).unwrap()),
        request(
            1,
            Request::Open(Open {
                session: 5,
                prompt_ids: vec![1, 2, 3],
                sampling: SamplingSpec {
                    temperature: 0.7,
                    top_p: 0.9,
                    top_k: Some(40),
                    min_p: 0.05,
                    seed: Some(7),
                },
                prompt_taps: Some(taps()),
            }),
        ),
        request(
            2,
            Request::Draft(Draft {
                rows: vec![DraftRow {
                    session: 5,
                    new_tokens: vec![9, 300_000],
                    n: 4,
                    step: 2,
                }],
            }),
        ),
        request(
            3,
            Request::Commit(Commit {
                session: 5,
                drafted: 4,
                accepted: 1,
                accepted_ids: vec![10, 11],
                taps: Some(taps()),
            }),
        ),
        request(4, Request::Close(Close { session: u64::MAX })),
        request(5, Request::Shutdown),
        request(
            6,
            Request::Advance(Advance {
                session: 5,
                ids: vec![12],
                taps: Some(taps()),
            }),
        ),
        request(
            7,
            Request::DonorTables(DonorTables {
                tables: vec![DonorTable {
                    session: 5,
                    keep: 1,
                    append: vec![DonorBlock { block: 3, epoch: 9 }],
                    len: 40,
                }],
            }),
        ),
    ];
    let drafter = [
        DrafterMsg::Goodbye {
            reason: "wrong tokenizer ✗".into(),
        },
        DrafterMsg::Reply {
            seq: 2,
            reply: Reply::Drafted(Drafted {
                rows: vec![DraftedRow {
                    session: 5,
                    tokens: vec![1, 2],
                    q: Some(vec![vec![0.5, 0.5], vec![1.0, 0.0]]),
                }],
            }),
        },
        DrafterMsg::Reply {
            seq: 2,
            reply: Reply::Proposed(Proposed {
                rows: vec![ProposedRow {
                    session: 5,
                    tokens: vec![1, 2, 3],
                    q: None,
                    confidence: Some(vec![0.9, 0.5, 0.1]),
                }],
            }),
        },
        DrafterMsg::Capabilities(capabilities()),
    ];
    let layout = DonorLayout::f32(&[(0, 2, 4), (5, 1, 8)], 3).unwrap();
    let mut seeds: Vec<Vec<u8>> = host
        .iter()
        .map(|m| postcard::to_stdvec(m).unwrap())
        .collect();
    seeds.extend(drafter.iter().map(|m| postcard::to_stdvec(m).unwrap()));
    seeds.push(postcard::to_stdvec(&layout).unwrap());
    seeds.push(postcard::to_stdvec(&taps()).unwrap());
    seeds
}

/// Valid JSON of every handshake payload (the mutation seeds).
fn json_seeds() -> Vec<Vec<u8>> {
    vec![
        serde_json::to_vec(&hello()).unwrap(),
        serde_json::to_vec(&HandshakeReply::Welcome(welcome())).unwrap(),
        serde_json::to_vec(&HandshakeReply::Refused {
            reason: "no shared major: 1.2 vs 2.0".into(),
        })
        .unwrap(),
        serde_json::to_vec(&capabilities()).unwrap(),
        serde_json::to_vec(&welcome().target).unwrap(),
    ]
}

/// One edit of a byte string.
#[derive(Debug, Clone)]
enum Edit {
    /// XOR the byte at (index mod len) with a non-zero mask.
    Flip(usize, u8),
    /// Set the byte at (index mod len).
    Set(usize, u8),
    /// Cut at (index mod (len + 1)).
    Truncate(usize),
    /// Insert bytes at (index mod (len + 1)).
    Insert(usize, Vec<u8>),
    /// Append bytes.
    Extend(Vec<u8>),
    /// Remove (count) bytes at (index mod len).
    Remove(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    // Boundary bytes that matter to varints and enum tags, besides any byte.
    let byte = prop_oneof![any::<u8>(), Just(0u8), Just(0x7f), Just(0x80), Just(0xff)];
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, m)| Edit::Flip(i, m)),
        (any::<usize>(), byte).prop_map(|(i, b)| Edit::Set(i, b)),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..10))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        prop::collection::vec(any::<u8>(), 1..10).prop_map(Edit::Extend),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Edit::Remove(i, n)),
    ]
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let len = bytes.len();
        match e {
            Edit::Flip(i, m) if len > 0 => bytes[i % len] ^= m,
            Edit::Set(i, b) if len > 0 => bytes[i % len] = *b,
            Edit::Truncate(i) => bytes.truncate(i % (len + 1)),
            Edit::Insert(i, b) => {
                let at = i % (len + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            Edit::Extend(b) => bytes.extend_from_slice(b),
            Edit::Remove(i, n) if len > 0 => {
                let at = i % len;
                bytes.drain(at..(at + n).min(len));
            }
            _ => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary bytes into every postcard and JSON decoder.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        all_postcard(&bytes);
        all_json(&bytes);
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Mutated valid postcard encodings into every postcard decoder.
    #[test]
    fn mutated_postcard_never_panics(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        let seeds = postcard_seeds();
        let bytes = apply(seeds[seed.index(seeds.len())].clone(), &edits);
        all_postcard(&bytes);
    }

    /// Mutated valid JSON into every handshake decoder.
    #[test]
    fn mutated_json_never_panics(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        let seeds = json_seeds();
        let bytes = apply(seeds[seed.index(seeds.len())].clone(), &edits);
        all_json(&bytes);
    }
}

#[test]
fn seeds_decode() {
    for s in postcard_seeds() {
        assert!(
            pc::<HostMsg>(&s)
                || pc::<DrafterMsg>(&s)
                || pc::<DonorLayout>(&s)
                || pc::<TapViews>(&s),
            "seed {s:?}"
        );
    }
    assert!(serde_json::from_slice::<Hello>(&json_seeds()[0]).is_ok());
    assert!(serde_json::from_slice::<HandshakeReply>(&json_seeds()[1]).is_ok());
}

/// LEB128 varint, as postcard writes lengths.
fn varint(mut n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

/// A length prefix of 2^60 (or u64::MAX) is refused at once, without allocating by it.
#[test]
fn huge_length_prefixes_are_refused_quickly() {
    for len in [1u64 << 60, u64::MAX, 1 << 32] {
        let start = Instant::now();
        // DrafterMsg::Reply { seq: 0, reply: Drafted { rows: <len> } }
        let mut rows = vec![1, 0, 0];
        rows.extend(varint(len));
        rows.extend([5, 0, 0]);
        assert!(postcard::from_bytes::<DrafterMsg>(&rows).is_err());
        // DrafterMsg::Goodbye { reason: <len> bytes }
        let mut reason = vec![0];
        reason.extend(varint(len));
        reason.extend(b"abc");
        assert!(postcard::from_bytes::<DrafterMsg>(&reason).is_err());
        // HostMsg::Request { seq: 0, Draft { rows: [{ session 0, new_tokens: <len> }] } }
        let mut tokens = vec![1, 0, 2, 1, 0];
        tokens.extend(varint(len));
        tokens.extend([1, 2, 3]);
        assert!(postcard::from_bytes::<HostMsg>(&tokens).is_err());
        // A q row of <len> floats.
        let mut q = vec![1, 0, 0, 1, 0, 0, 1, 1];
        q.extend(varint(len));
        q.extend([0; 8]);
        assert!(postcard::from_bytes::<DrafterMsg>(&q).is_err());
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "length {len} took {:?}",
            start.elapsed()
        );
    }
    // A varint longer than a u64 is an error too.
    let mut long = vec![0];
    long.extend([0xff; 12]);
    assert!(postcard::from_bytes::<DrafterMsg>(&long).is_err());
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16)]
}

/// Numbers near the edges of the ring and of the integer types.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..2048,
        Just(u64::MAX),
        Just(u64::MAX - 63),
        Just(1 << 63),
        Just(u64::from(u32::MAX)),
        any::<u64>(),
    ]
}

fn edgy_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        0u32..64,
        Just(u32::MAX),
        Just(1 << 31),
        Just(1 << 16),
        any::<u32>()
    ]
}

fn tensor_view() -> impl Strategy<Value = TensorView> {
    (
        prop_oneof![Just(1u32), any::<u32>()],
        edgy_u64(),
        dtype(),
        prop::collection::vec(edgy_u32(), 0..5),
        edgy_u64(),
    )
        .prop_map(|(region, offset, dtype, shape, epoch)| TensorView {
            region,
            offset,
            dtype,
            shape,
            epoch,
        })
}

/// A region of 1 KiB with two tensors written, and their views.
fn region() -> (ShmWriter, ShmReader, Vec<TensorView>) {
    let mut w = ShmWriter::new(1, 1024).unwrap();
    let a = w.write_f32(&[1.0; 16], &[2, 8]).unwrap();
    let b = w.write_bf16(&[0x3f80; 24], &[2, 3, 4]).unwrap();
    let r = ShmReader::new(1, w.handle()).unwrap();
    (w, r, vec![a, b])
}

fn read_view(r: &ShmReader, v: &TensorView) {
    if let Ok(t) = r.view(v) {
        // What is accepted must lie inside the region and be readable.
        assert!(t.numel() * t.dtype().size() <= 1024);
        let _ = t.to_f32();
        let mut out = Vec::new();
        let _ = t.extend_f32(0..t.numel(), &mut out);
    }
    let _ = r.read_f32(v);
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary tensor views against a real region: `Ok` only when in bounds, never a panic.
    #[test]
    fn arbitrary_tensor_views_never_panic(v in tensor_view()) {
        let (_w, r, _) = region();
        read_view(&r, &v);
    }

    /// Valid views with one field changed.
    #[test]
    fn mutated_tensor_views_never_panic(
        which in any::<prop::sample::Index>(),
        field in 0u8..5,
        x in edgy_u64(),
        shape in prop::collection::vec(edgy_u32(), 0..5),
    ) {
        let (_w, r, views) = region();
        let mut v = views[which.index(views.len())].clone();
        match field {
            0 => v.offset = x,
            1 => v.epoch = x,
            2 => v.shape = shape,
            3 => {
                v.offset = v.offset.wrapping_add(x % 128);
                v.epoch = v.epoch.wrapping_add(x % 128);
            }
            _ => v.dtype = if v.dtype == DType::F32 { DType::BF16 } else { DType::F32 },
        }
        read_view(&r, &v);
    }
}

fn donor_layer() -> impl Strategy<Value = DonorLayer> {
    (edgy_u32(), edgy_u32(), edgy_u32(), edgy_u64(), edgy_u64()).prop_map(
        |(layer, kv_heads, head_dim, k_offset, v_offset)| DonorLayer {
            layer,
            kv_heads,
            head_dim,
            k_offset,
            v_offset,
        },
    )
}

/// The valid layout of the donor region used below.
fn donor_layout() -> DonorLayout {
    DonorLayout::f32(&[(0, 2, 4), (5, 1, 8)], 3).unwrap()
}

fn check_donor(
    layout: DonorLayout,
    table: &[DonorBlock],
    len: usize,
    layer: usize,
    rows: (usize, usize),
) {
    let w = DonorWriter::new(1, donor_layout()).unwrap();
    let Ok(r) = DonorReader::new(1, w.handle(), layout) else {
        return;
    };
    let Ok(rows_view) = r.rows(table, len) else {
        return;
    };
    let _ = rows_view.check();
    let _ = rows_view.copy_rows(layer, rows.0..rows.1);
}

fn donor_block() -> impl Strategy<Value = DonorBlock> {
    (
        prop_oneof![0u32..4, any::<u32>()],
        prop_oneof![0u64..3, any::<u64>()],
    )
        .prop_map(|(block, epoch)| DonorBlock { block, epoch })
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary donor layouts against a real region.
    #[test]
    fn arbitrary_donor_layouts_never_panic(
        block_size in prop_oneof![Just(32u32), edgy_u32()],
        blocks in edgy_u32(),
        block_bytes in edgy_u64(),
        epochs_offset in edgy_u64(),
        data_offset in edgy_u64(),
        dtype in dtype(),
        layers in prop::collection::vec(donor_layer(), 0..3),
    ) {
        let layout = DonorLayout {
            block_size,
            blocks,
            block_bytes,
            epochs_offset,
            data_offset,
            dtype,
            layers,
        };
        check_donor(layout, &[DonorBlock { block: 0, epoch: 0 }], 1, 0, (0, 1));
    }

    /// The valid layout with one field changed, and arbitrary block tables and row ranges.
    #[test]
    fn mutated_donor_layouts_and_tables_never_panic(
        field in 0u8..9,
        x in edgy_u64(),
        table in prop::collection::vec(donor_block(), 0..5),
        len in prop_oneof![0usize..200, any::<usize>()],
        layer in prop_oneof![0usize..3, any::<usize>()],
        start in prop_oneof![0usize..200, any::<usize>()],
        end in prop_oneof![0usize..200, any::<usize>()],
    ) {
        let mut layout = donor_layout();
        match field {
            0 => layout.blocks = x as u32,
            1 => layout.block_bytes = x,
            2 => layout.epochs_offset = x,
            3 => layout.data_offset = x,
            4 => layout.layers[0].k_offset = x,
            5 => layout.layers[1].v_offset = x,
            6 => layout.layers[0].kv_heads = x as u32,
            7 => layout.layers[1].head_dim = x as u32,
            _ => {}
        }
        check_donor(layout, &table, len, layer, (start, end));
    }
}

/// Views whose size or position overflows the integer types are errors (regressions).
#[test]
fn overflowing_views_are_errors() {
    let (_w, r, views) = region();
    let mut v = views[0].clone();
    v.shape = vec![u32::MAX, u32::MAX, u32::MAX];
    assert!(r.view(&v).is_err());
    let mut v = views[0].clone();
    v.epoch = u64::MAX;
    v.offset = u64::MAX;
    assert!(r.view(&v).is_err());
}

/// Donor layouts whose sizes overflow are errors (regressions).
#[test]
fn overflowing_donor_layouts_are_errors() {
    let w = DonorWriter::new(1, donor_layout()).unwrap();
    let mut cases = Vec::new();
    let mut l = donor_layout();
    l.epochs_offset = u64::MAX - 7;
    cases.push(l);
    let mut l = donor_layout();
    l.block_bytes = u64::MAX - 63;
    cases.push(l);
    let mut l = donor_layout();
    l.layers[0].kv_heads = u32::MAX;
    l.layers[0].head_dim = u32::MAX;
    cases.push(l);
    let mut l = donor_layout();
    l.layers[0].k_offset = u64::MAX - 3;
    cases.push(l);
    for l in cases {
        assert!(DonorReader::new(1, w.handle(), l).is_err());
    }
}
