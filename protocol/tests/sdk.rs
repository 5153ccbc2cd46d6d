//! The SDK's serve loop against an in-test host, over real ipc channels (threads, no processes).

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use specula_protocol::sdk::{self, CommitArgs, Drafter, DrafterInfo, OpenArgs, Outcome, Proposal};
use specula_protocol::shm::{ShmWriter, TapViews};
use specula_protocol::transport::{Accepted, Bootstrap};
use specula_protocol::wire::*;
use specula_protocol::{Version, PROTOCOL_VERSION};

/// Proposes `0, 1, 2, …` (more than asked) and logs every call.
struct Recorder {
    log: Arc<Mutex<Vec<String>>>,
    versions: Vec<Version>,
    refuse: bool,
}

impl Drafter for Recorder {
    fn info(&self) -> DrafterInfo {
        let mut caps = Capabilities::tokens_only(3);
        caps.final_hidden = true;
        DrafterInfo {
            versions: self.versions.clone(),
            ..DrafterInfo::new("rec", "1", caps)
        }
    }
    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        match self.refuse {
            true => Err(format!("no thanks, {}", target.architecture)),
            false => Ok(()),
        }
    }
    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let taps = args.taps.map(|t| t.final_hidden.unwrap());
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
        Proposal::tokens((0..10).collect())
    }
    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        let taps = args.taps.map(|t| t.final_hidden.unwrap());
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
        reply: Reply::Drafted(d),
    } = a.from_drafter.recv().unwrap()
    else {
        panic!("expected Drafted");
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
    assert!(reason.contains("1.5") && reason.contains("1.0"), "{reason}");
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
