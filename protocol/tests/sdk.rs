//! The SDK's serve loop against an in-test host, over real ipc channels (threads, no processes).

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use specula_protocol::donor::{DonorBlock, DonorLayout, DonorWriter};
use specula_protocol::doorbell::{decode, encode, Doorbell, Frame};
use specula_protocol::sdk::{
    self, AdvanceArgs, Advanced, CommitArgs, DraftAsk, Drafter, DrafterInfo, OpenArgs, Outcome,
    Proposal,
};
use specula_protocol::shm::{ShmWriter, TapViews};
use specula_protocol::transport::{Accepted, Bootstrap, Sender};
use specula_protocol::wire::*;
use specula_protocol::{Version, PROTOCOL_VERSION};

/// Proposes `0, 1, 2, …` (more than asked, with confidences) and logs every call.
struct Recorder {
    log: Arc<Mutex<Vec<String>>>,
    versions: Vec<Version>,
    refuse: bool,
    /// States `tap_layers: [num_layers - 1]` once it knows the target.
    late: bool,
    /// Takes `Advance` itself instead of leaving the ids for the next draft.
    takes_advance: bool,
}

impl Drafter for Recorder {
    fn info(&self) -> DrafterInfo {
        let mut caps = Capabilities::tokens_only(3);
        caps.final_hidden = true;
        let info = DrafterInfo {
            versions: self.versions.clone(),
            ..DrafterInfo::new("rec", "1", caps)
        };
        match self.late {
            true => info.with_late_capabilities(),
            false => info,
        }
    }
    fn capabilities(&mut self, target: &TargetInfo) -> Capabilities {
        Capabilities {
            tap_layers: vec![target.num_layers - 1],
            ..self.info().capabilities
        }
    }
    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        match self.refuse {
            true => Err(format!("no thanks, {}", target.architecture)),
            false => Ok(()),
        }
    }
    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let taps = args.taps.map(|t| t.final_hidden.unwrap().to_f32().unwrap());
        self.log
            .lock()
            .unwrap()
            .push(format!("open {session} {:?} {taps:?}", args.prompt));
    }
    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        self.log
            .lock()
            .unwrap()
            .push(format!("draft {session} {new_tokens:?} {n}"));
        Proposal {
            confidence: Some((0..10).map(|i| 1.0 / (i + 1) as f32).collect()),
            ..Proposal::tokens((0..10).collect())
        }
    }
    fn draft_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Proposal> {
        self.log
            .lock()
            .unwrap()
            .push(format!("batch {}", asks.len()));
        for d in asks.iter().filter_map(|a| a.donors) {
            // Position 33 of donor layer 0, head 0, dimension 0 (block 1, offset 1), then V.
            let (k, v) = d.copy_rows(0, 33..34).unwrap();
            self.log.lock().unwrap().push(format!(
                "donors {} {} {} {}",
                d.len(),
                d.k_block(0, 1, 0)[1],
                k[0],
                v[1]
            ));
        }
        asks.iter()
            .map(|a| self.draft(a.session, a.new_tokens, a.n))
            .collect()
    }
    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        let taps = args.taps.map(|t| t.final_hidden.unwrap().to_f32().unwrap());
        self.log
            .lock()
            .unwrap()
            .push(format!("advance {session} {:?} {taps:?}", args.ids));
        match self.takes_advance {
            true => Advanced::Taken,
            false => Advanced::AsNewTokens,
        }
    }
    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        let taps = args.taps.map(|t| t.final_hidden.unwrap().to_f32().unwrap());
        self.log
            .lock()
            .unwrap()
            .push(format!("commit {session} {:?} {taps:?}", args.ids));
    }
    fn close(&mut self, session: SessionId) {
        self.log.lock().unwrap().push(format!("close {session}"));
    }
}

fn target() -> TargetInfo {
    TargetInfo {
        architecture: "fake".into(),
        vocab_size: 100,
        hidden_size: 2,
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 2,
        tokenizer_fingerprint: "f".into(),
        eos_ids: vec![],
        weights_path: String::new(),
        context_len: 64,
        ..TargetInfo::default()
    }
}

fn spawn(drafter: Recorder) -> (Accepted, JoinHandle<Outcome>) {
    let bootstrap = Bootstrap::new().unwrap();
    let name = bootstrap.name().to_string();
    let thread = std::thread::spawn(move || sdk::run(drafter, &name).unwrap());
    (bootstrap.accept().unwrap(), thread)
}

fn recorder(versions: Vec<Version>, refuse: bool) -> (Recorder, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    (
        Recorder {
            log: log.clone(),
            versions,
            refuse,
            late: false,
            takes_advance: false,
        },
        log,
    )
}

fn request(a: &Accepted, seq: Seq, request: Request) {
    a.to_drafter
        .send(HostMsg::Request { seq, request })
        .unwrap();
}

fn one_tap(region: &mut ShmWriter, values: &[f32]) -> TapViews {
    TapViews {
        pos: 0,
        rows: 1,
        layers: vec![],
        final_hidden: Some(region.write_f32(values, &[1, values.len() as u32]).unwrap()),
        kv: vec![],
    }
}

#[test]
fn serves_a_whole_session_and_caps_drafts() {
    let (drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    assert_eq!(a.hello.name, "rec");
    a.reply(&HandshakeReply::Welcome(Welcome {
        version: PROTOCOL_VERSION,
        target: target(),
    }))
    .unwrap();
    let mut region = ShmWriter::new(4, 256).unwrap();
    request(
        &a,
        0,
        Request::MapRegion(MapRegion {
            region: 4,
            shm: region.handle(),
        }),
    );
    let taps = one_tap(&mut region, &[0.5, -2.0]);
    let open = Open {
        session: 1,
        prompt_ids: vec![7, 8],
        sampling: SamplingSpec::greedy(),
        prompt_taps: Some(taps),
    };
    request(&a, 1, Request::Open(open));
    let rows = vec![
        DraftRow {
            session: 1,
            new_tokens: vec![9],
            n: 2,
            step: 0,
        },
        DraftRow {
            session: 1,
            new_tokens: vec![],
            n: 50,
            step: 1,
        },
        DraftRow {
            session: 99,
            new_tokens: vec![],
            n: 2,
            step: 0,
        },
    ];
    request(&a, 2, Request::Draft(Draft { rows }));
    let DrafterMsg::Reply {
        seq,
        reply: Reply::Proposed(d),
    } = a.from_drafter.recv().unwrap()
    else {
        panic!("expected Proposed (the 1.1 reply)");
    };
    assert_eq!(seq, 2, "the reply carries its request's number");
    let tokens: Vec<_> = d
        .rows
        .iter()
        .map(|r| (r.session, r.tokens.clone()))
        .collect();
    // Capped at n (2), then at max_draft_len (3); an unknown session gets nothing.
    assert_eq!(
        tokens,
        vec![(1, vec![0, 1]), (1, vec![0, 1, 2]), (99, vec![])]
    );
    // Confidences travel with their tokens, capped the same way.
    assert_eq!(d.rows[0].confidence, Some(vec![1.0, 0.5]));
    assert_eq!(d.rows[1].confidence.as_ref().map(Vec::len), Some(3));
    assert_eq!(d.rows[2].confidence, None);
    let taps = one_tap(&mut region, &[1.0, 3.0]);
    let commit = Commit {
        session: 1,
        drafted: 2,
        accepted: 1,
        accepted_ids: vec![0, 5],
        taps: Some(taps),
    };
    request(&a, 3, Request::Commit(commit));
    request(&a, 4, Request::Close(Close { session: 1 }));
    request(&a, 5, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    assert_eq!(
        *log.lock().unwrap(),
        vec![
            "open 1 [7, 8] Some([0.5, -2.0])",
            "batch 2",
            "draft 1 [9] 2",
            "draft 1 [] 3",
            "commit 1 [0, 5] Some([1.0, 3.0])",
            "close 1",
        ]
    );
}

#[test]
fn refusal_by_the_host_ends_with_exit_status_2() {
    let (drafter, _) = recorder(vec![Version { major: 2, minor: 0 }], false);
    let (a, thread) = spawn(drafter);
    assert_eq!(a.hello.versions, vec![Version { major: 2, minor: 0 }]);
    a.reply(&HandshakeReply::Refused {
        reason: "host speaks 1.0, drafter speaks 2.0".into(),
    })
    .unwrap();
    let outcome = thread.join().unwrap();
    assert!(matches!(&outcome, Outcome::Refused { reason } if reason.contains("2.0")));
    assert_eq!(outcome.exit_code(), std::process::ExitCode::from(2));
}

#[test]
fn drafter_declines_a_target_with_goodbye() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], true);
    let (a, thread) = spawn(drafter);
    a.reply(&HandshakeReply::Welcome(Welcome {
        version: PROTOCOL_VERSION,
        target: target(),
    }))
    .unwrap();
    let DrafterMsg::Goodbye { reason } = a.from_drafter.recv().unwrap() else {
        panic!("expected Goodbye");
    };
    assert_eq!(reason, "no thanks, fake");
    assert!(matches!(thread.join().unwrap(), Outcome::Declined { .. }));
}

#[test]
fn drafter_declines_a_version_it_does_not_speak() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    let newer = Version { major: 1, minor: 5 };
    a.reply(&HandshakeReply::Welcome(Welcome {
        version: newer,
        target: target(),
    }))
    .unwrap();
    let DrafterMsg::Goodbye { reason } = a.from_drafter.recv().unwrap() else {
        panic!("expected Goodbye");
    };
    let ours = PROTOCOL_VERSION.to_string();
    assert!(reason.contains("1.5") && reason.contains(&ours), "{reason}");
    thread.join().unwrap();
}

#[test]
fn host_going_away_ends_the_drafter_cleanly() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    a.reply(&HandshakeReply::Welcome(Welcome {
        version: PROTOCOL_VERSION,
        target: target(),
    }))
    .unwrap();
    drop(a);
    assert_eq!(thread.join().unwrap(), Outcome::HostGone);
}

fn welcome(a: &Accepted, version: Version) {
    a.reply(&HandshakeReply::Welcome(Welcome {
        version,
        target: target(),
    }))
    .unwrap();
}

fn draft_one(a: &Accepted, seq: Seq, new_tokens: Vec<u32>) -> Reply {
    let row = DraftRow {
        session: 1,
        new_tokens,
        n: 2,
        step: 0,
    };
    request(a, seq, Request::Draft(Draft { rows: vec![row] }));
    match a.from_drafter.recv().unwrap() {
        DrafterMsg::Reply { seq: got, reply } if got == seq => reply,
        other => panic!("expected the reply to {seq}, got {other:?}"),
    }
}

fn open_session(a: &Accepted, seq: Seq) {
    let open = Open {
        session: 1,
        prompt_ids: vec![7],
        sampling: SamplingSpec::greedy(),
        prompt_taps: None,
    };
    request(a, seq, Request::Open(open));
}

#[test]
fn advance_reaches_the_drafter_with_its_taps() {
    let (mut drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    drafter.takes_advance = true;
    let (a, thread) = spawn(drafter);
    welcome(&a, PROTOCOL_VERSION);
    let mut region = ShmWriter::new(0, 256).unwrap();
    let map = MapRegion {
        region: 0,
        shm: region.handle(),
    };
    request(&a, 0, Request::MapRegion(map));
    open_session(&a, 1);
    let taps = one_tap(&mut region, &[4.0, 5.0]);
    let advance = Advance {
        session: 1,
        ids: vec![8],
        taps: Some(taps),
    };
    request(&a, 2, Request::Advance(advance));
    // Taken by the drafter: the next draft gets only its own new tokens.
    draft_one(&a, 3, vec![]);
    request(&a, 4, Request::Shutdown);
    thread.join().unwrap();
    assert_eq!(
        log.lock().unwrap()[1..],
        ["advance 1 [8] Some([4.0, 5.0])", "batch 1", "draft 1 [] 2"]
    );
}

#[test]
fn by_default_advanced_ids_arrive_with_the_next_draft() {
    let (drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    welcome(&a, PROTOCOL_VERSION);
    open_session(&a, 0);
    for (seq, ids) in [(1, vec![8, 9]), (2, vec![10])] {
        let advance = Advance {
            session: 1,
            ids,
            taps: None,
        };
        request(&a, seq, Request::Advance(advance));
    }
    draft_one(&a, 3, vec![11]);
    draft_one(&a, 4, vec![]);
    request(&a, 5, Request::Shutdown);
    thread.join().unwrap();
    let log = log.lock().unwrap();
    assert_eq!(log[4], "draft 1 [8, 9, 10, 11] 2", "{log:?}");
    assert_eq!(log[6], "draft 1 [] 2", "ids are handed over once");
}

#[test]
fn late_capabilities_follow_welcome_at_1_1() {
    let (mut drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    drafter.late = true;
    let (a, thread) = spawn(drafter);
    assert!(a.hello.late_capabilities);
    assert!(a.hello.capabilities.tap_layers.is_empty());
    welcome(&a, PROTOCOL_VERSION);
    let DrafterMsg::Capabilities(caps) = a.from_drafter.recv().unwrap() else {
        panic!("expected Capabilities");
    };
    assert_eq!(
        caps.tap_layers,
        vec![1],
        "the target has 2 layers: the last is 1"
    );
    request(&a, 0, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
}

const V1_0: Version = Version { major: 1, minor: 0 };

/// A 1.1 drafter whose host speaks 1.0: it never sends a 1.1 message (Proposed, Capabilities).
#[test]
fn a_1_0_host_never_receives_a_1_1_message() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    welcome(&a, V1_0);
    open_session(&a, 0);
    let Reply::Drafted(d) = draft_one(&a, 1, vec![]) else {
        panic!("a 1.0 host must get Drafted, not Proposed");
    };
    assert_eq!(
        d.rows[0].tokens,
        vec![0, 1],
        "confidences are dropped, drafts kept"
    );
    request(&a, 2, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
}

#[test]
fn late_capabilities_at_1_0_are_the_hellos_or_a_clear_goodbye() {
    // Its late capabilities differ from the Hello's: it cannot tell a 1.0 host, so it declines.
    let (mut drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    drafter.late = true;
    let (a, thread) = spawn(drafter);
    welcome(&a, V1_0);
    let DrafterMsg::Goodbye { reason } = a.from_drafter.recv().unwrap() else {
        panic!("expected Goodbye, never Capabilities at 1.0");
    };
    assert!(reason.contains("needs protocol 1.1"), "{reason}");
    assert!(matches!(thread.join().unwrap(), Outcome::Declined { .. }));
}

/// A drafter built for 1.0 against this (1.1) host: the host's sender refuses every 1.1
/// message, so the drafter only ever sees what it can decode.
#[test]
fn a_1_0_drafter_never_receives_a_1_1_message() {
    let (drafter, log) = recorder(vec![V1_0], false);
    let (a, thread) = spawn(drafter);
    let negotiated = specula_protocol::version::negotiate(&[PROTOCOL_VERSION], &a.hello.versions);
    assert_eq!(negotiated, Some(V1_0));
    welcome(&a, V1_0);
    let sender = Sender::new(a.to_drafter.clone(), V1_0);
    let advance = HostMsg::Request {
        seq: 0,
        request: Request::Advance(Advance {
            session: 1,
            ids: vec![1],
            taps: None,
        }),
    };
    assert!(matches!(
        sender.send(advance),
        Err(specula_protocol::Error::TooNew {
            message: "Advance",
            ..
        })
    ));
    let mut region = ShmWriter::new(0, 256).unwrap();
    let bf16 = TapViews {
        pos: 0,
        rows: 1,
        layers: vec![region.write_bf16(&[0x3f80], &[1, 1]).unwrap()],
        final_hidden: None,
        kv: vec![],
    };
    let open = HostMsg::Request {
        seq: 0,
        request: Request::Open(Open {
            session: 1,
            prompt_ids: vec![7],
            sampling: SamplingSpec::greedy(),
            prompt_taps: Some(bf16),
        }),
    };
    assert!(
        sender.send(open).is_err(),
        "bf16 taps need 1.1: the sender refuses them"
    );
    open_session(&a, 1);
    let Reply::Drafted(_) = draft_one(&a, 2, vec![]) else {
        panic!("a 1.0 drafter answers Drafted");
    };
    request(&a, 3, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    assert_eq!(
        log.lock().unwrap()[0],
        "open 1 [7] None",
        "the refused Open never arrived"
    );
}

/// A drafter asking for donor views reads the session's K/V in place, from the block table the
/// host announced; a reused block is noticed.
#[test]
fn donor_views_reach_draft_batch() {
    let (drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    let drafter = Recorder {
        late: false,
        ..drafter
    };
    let (a, thread) = spawn(drafter);
    welcome(&a, PROTOCOL_VERSION);
    let mut donors = DonorWriter::new(1, DonorLayout::f32(&[(1, 1, 2)], 4).unwrap()).unwrap();
    donors.claim(3);
    donors.claim(0);
    let (e3, e0) = (donors.publish(3), donors.publish(0));
    for p in 0..40usize {
        let row = [p as f32, p as f32 + 0.5];
        donors.write_row(0, [3, 0][p / 32], p % 32, &row, &row.map(|x| -x));
    }
    request(
        &a,
        0,
        Request::MapDonors(MapDonors {
            region: 1,
            shm: donors.handle(),
            layout: donors.layout().clone(),
        }),
    );
    open_session(&a, 1);
    let table = |keep, append: Vec<DonorBlock>, len| {
        Request::DonorTables(DonorTables {
            tables: vec![DonorTable {
                session: 1,
                keep,
                append,
                len,
            }],
        })
    };
    let b = |block, epoch| DonorBlock { block, epoch };
    request(&a, 2, table(0, vec![b(3, e3)], 32));
    request(&a, 3, table(1, vec![b(0, e0)], 40));
    draft_one(&a, 4, vec![]);
    request(&a, 5, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    let log = log.lock().unwrap();
    assert_eq!(log[2], "donors 40 33 33 -33.5", "{log:?}");
}

const V1_1: Version = Version { major: 1, minor: 1 };

/// A 1.2 drafter at a 1.1 host: the host's sender refuses the donor messages, and the drafter
/// drafts without donors.
#[test]
fn a_1_1_host_sends_no_donor_views_and_the_drafter_goes_on() {
    let (drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    welcome(&a, V1_1);
    let sender = Sender::new(a.to_drafter.clone(), V1_1);
    let tables = HostMsg::Request {
        seq: 0,
        request: Request::DonorTables(DonorTables { tables: vec![] }),
    };
    assert!(matches!(
        sender.send(tables),
        Err(specula_protocol::Error::TooNew {
            message: "DonorTables",
            ..
        })
    ));
    open_session(&a, 1);
    let Reply::Proposed(_) = draft_one(&a, 2, vec![]) else {
        panic!("a 1.1 host gets Proposed");
    };
    request(&a, 3, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    assert!(
        !log.lock().unwrap().iter().any(|l| l.starts_with("donors")),
        "no donor views at 1.1"
    );
}

/// The host's side of a doorbell in these tests: requests as frames (those with a memfd on the
/// socket, announced by an empty frame), replies read from the ring.
struct Bell<'a> {
    a: &'a Accepted,
    bell: Doorbell,
}

impl Bell<'_> {
    fn map(a: &Accepted) -> Bell<'_> {
        let bell = Doorbell::host(1 << 12, Duration::from_micros(10)).unwrap();
        let map = MapDoorbell {
            shm: bell.handle(),
            spin_us: 10,
        };
        request(a, 0, Request::MapDoorbell(map));
        Bell { a, bell }
    }

    fn request(&self, seq: Seq, request: Request) {
        let forever = Duration::from_secs(60);
        let msg = HostMsg::Request { seq, request };
        match &msg {
            HostMsg::Request { request, .. } if request.carries_fd() => {
                self.a.to_drafter.send(msg).unwrap();
                self.bell.send(&[], forever).unwrap();
            }
            _ => self.bell.send(&encode(&msg).unwrap(), forever).unwrap(),
        }
    }

    fn reply(&self) -> DrafterMsg {
        match self.bell.recv(Duration::from_secs(60)).unwrap() {
            Some(Frame::Message(bytes)) => decode(&bytes).unwrap(),
            other => panic!("expected a reply frame, got {other:?}"),
        }
    }
}

#[test]
fn a_whole_session_through_the_doorbell() {
    let (drafter, log) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    assert!(a.hello.doorbell, "the SDK offers the doorbell");
    welcome(&a, PROTOCOL_VERSION);
    let bell = Bell::map(&a);
    // MapRegion carries a memfd: it takes the socket, in its place in the ring's order.
    let mut region = ShmWriter::new(2, 256).unwrap();
    let map = MapRegion {
        region: 2,
        shm: region.handle(),
    };
    bell.request(1, Request::MapRegion(map));
    let open = Open {
        session: 1,
        prompt_ids: vec![7, 8],
        sampling: SamplingSpec::greedy(),
        prompt_taps: Some(one_tap(&mut region, &[0.5, -2.0])),
    };
    bell.request(2, Request::Open(open));
    let row = DraftRow {
        session: 1,
        new_tokens: vec![9],
        n: 2,
        step: 0,
    };
    bell.request(3, Request::Draft(Draft { rows: vec![row] }));
    let DrafterMsg::Reply {
        seq: 3,
        reply: Reply::Proposed(p),
    } = bell.reply()
    else {
        panic!("expected the reply to 3");
    };
    assert_eq!(p.rows[0].tokens, vec![0, 1]);
    let commit = Commit {
        session: 1,
        drafted: 2,
        accepted: 2,
        accepted_ids: vec![0, 1, 4],
        taps: Some(one_tap(&mut region, &[1.0, 3.0])),
    };
    bell.request(4, Request::Commit(commit));
    bell.request(5, Request::Close(Close { session: 1 }));
    bell.request(6, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    assert!(
        a.from_drafter.try_recv().is_err(),
        "the reply came through the ring, not the socket"
    );
    assert_eq!(
        *log.lock().unwrap(),
        vec![
            "open 1 [7, 8] Some([0.5, -2.0])",
            "batch 1",
            "draft 1 [9] 2",
            "commit 1 [0, 1, 4] Some([1.0, 3.0])",
            "close 1",
        ]
    );
}

#[test]
fn a_drafter_waiting_on_its_doorbell_ends_when_the_host_goes_away() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    welcome(&a, PROTOCOL_VERSION);
    let bell = Bell::map(&a);
    open_session(&a, 1);
    // The ring stays quiet; the socket says the host is gone.
    drop(bell);
    drop(a);
    assert_eq!(thread.join().unwrap(), Outcome::HostGone);
}

#[test]
fn a_bad_frame_from_the_host_ends_the_drafter_with_an_error() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let bootstrap = Bootstrap::new().unwrap();
    let name = bootstrap.name().to_string();
    let thread = std::thread::spawn(move || sdk::run(drafter, &name));
    let a = bootstrap.accept().unwrap();
    welcome(&a, PROTOCOL_VERSION);
    let bell = Bell::map(&a);
    bell.bell.send(&[0xff; 9], Duration::ZERO).unwrap();
    let err = thread.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("does not decode"), "{err}");
}

const V1_2: Version = Version { major: 1, minor: 2 };

/// A 1.3 drafter at a 1.2 host: the host's sender refuses `MapDoorbell`, and every message
/// stays on the socket; a drafter built `without_doorbell` does not offer it.
#[test]
fn a_1_2_host_maps_no_doorbell_and_the_socket_serves() {
    let (drafter, _) = recorder(vec![PROTOCOL_VERSION], false);
    let (a, thread) = spawn(drafter);
    welcome(&a, V1_2);
    let sender = Sender::new(a.to_drafter.clone(), V1_2);
    let bell = Doorbell::host(1 << 12, Duration::ZERO).unwrap();
    let map = HostMsg::Request {
        seq: 0,
        request: Request::MapDoorbell(MapDoorbell {
            shm: bell.handle(),
            spin_us: 0,
        }),
    };
    assert!(matches!(
        sender.send(map),
        Err(specula_protocol::Error::TooNew {
            message: "MapDoorbell",
            ..
        })
    ));
    open_session(&a, 1);
    let Reply::Proposed(_) = draft_one(&a, 2, vec![]) else {
        panic!("a 1.2 host gets Proposed");
    };
    request(&a, 3, Request::Shutdown);
    assert_eq!(thread.join().unwrap(), Outcome::Shutdown);
    let info = DrafterInfo::new("plain", "1", Capabilities::tokens_only(2)).without_doorbell();
    assert!(!info.doorbell);
}
