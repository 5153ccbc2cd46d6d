//! Drafter processes through the host-side client, without a model: the real `ngram`,
//! `echo-drafter`, `chaos-drafter` and `mini-host` binaries, a fake target, real processes, real
//! ipc channels and shared memory. (Build them first: `cargo build -p ngram -p echo-drafter
//! -p specula-tests`.)

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use specula_models::sampling::SamplingParams;
use specula_protocol::wire::TargetInfo;
use specula_tests::bin_path;
use specula_tests::proposers::draft;
use target_host::drafter::{ClientConfig, DrafterClient, DrafterError, DrafterSpec, DrafterState};
use target_host::proposer::{Health, Proposer, TapRows, Verdict};

const VOCAB: u32 = 1000;

fn target() -> TargetInfo {
    TargetInfo {
        architecture: "fake".into(),
        vocab_size: VOCAB,
        hidden_size: 8,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 4,
        tokenizer_fingerprint: "fake".into(),
        eos_ids: vec![0],
        weights_path: String::new(),
        context_len: 4096,
        ..TargetInfo::default()
    }
}

fn start(bin: &str, args: &[&str], config: ClientConfig) -> Result<DrafterClient, DrafterError> {
    let spec = DrafterSpec::new(bin_path(bin)).with_args(args.iter().copied());
    DrafterClient::start(spec, target(), config)
}

fn chaos(mode: &str, extra: &[&str], config: ClientConfig) -> Result<DrafterClient, DrafterError> {
    let args: Vec<&str> = ["--mode", mode].iter().chain(extra).copied().collect();
    start("chaos-drafter", &args, config)
}

/// Behaviour tests use a generous deadline: a busy test machine must not turn into a miss.
fn config() -> ClientConfig {
    ClientConfig {
        draft_deadline: Duration::from_secs(5),
        ..ClientConfig::default()
    }
}

fn greedy() -> SamplingParams {
    SamplingParams::default()
}

fn verdict<'a>(drafted: usize, accepted: usize, committed: &'a [u32]) -> Verdict<'a> {
    Verdict {
        drafted,
        accepted,
        committed,
        taps: None,
    }
}

fn wait_ready(client: &mut DrafterClient) {
    let until = Instant::now() + Duration::from_secs(10);
    while client.poll() != DrafterState::Ready {
        assert!(Instant::now() < until, "no respawn: {:?}", client.state());
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill9(pid: u32) {
    let ok = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

#[test]
fn ngram_drafts_the_continuation_across_the_process_boundary() {
    let mut c = start("ngram", &["--min-ngram", "2", "--max-ngram", "3"], config()).unwrap();
    assert_eq!(c.name(), "ngram");
    assert_eq!(c.state(), DrafterState::Ready);
    // "10 11 12 13 14 … 10 11": the suffix "10 11" was followed by "12 13 14".
    c.open(7, &[10, 11, 12, 13, 14, 99, 10, 11], &greedy(), None);
    assert_eq!(draft(&mut c, 7, 3).tokens, vec![12, 13, 14]);
    // The target accepted 12 and then produced 50: "11 12 50" has no match, "12 50" neither.
    c.commit(7, &verdict(3, 1, &[12, 50]));
    assert!(draft(&mut c, 7, 3).tokens.is_empty());
    // Tokens committed without drafts reach it (as `new_tokens` of a 1.0 peer): "… 10 11" again, whose
    // latest occurrence (after 99) was followed by the committed "12 50".
    assert_eq!(
        {
            c.advance(7, &[10, 11], None);
            draft(&mut c, 7, 2)
        }
        .tokens,
        vec![12, 50]
    );
    c.close(7);
    assert!(draft(&mut c, 7, 3).tokens.is_empty(), "closed session");
    let stats = c.stats();
    assert_eq!((stats.requests, stats.drafted, stats.accepted), (3, 5, 1));
    assert_eq!(stats.rtt_us.len(), 3);
    assert_eq!(stats.deadline_misses + stats.discarded + stats.restarts, 0);
}

#[test]
fn example_drafter_written_against_the_sdk_serves() {
    let mut c = start("echo-drafter", &[], config()).unwrap();
    assert_eq!(c.name(), "echo");
    c.open(1, &[3, 4, 5], &greedy(), None);
    assert_eq!(draft(&mut c, 1, 2).tokens, vec![5, 5]);
    c.commit(1, &verdict(2, 0, &[9]));
    // The SDK caps the draft at the drafter's max_draft_len (4), whatever the host asks.
    assert_eq!(draft(&mut c, 1, 10).tokens, vec![9; 4]);
}

#[test]
fn wrong_major_is_refused_naming_both_versions() {
    let err = chaos("wrong-major", &[], config()).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, DrafterError::VersionMismatch { .. }),
        "{text}"
    );
    assert!(
        text.contains("2.0") && text.contains(&specula_protocol::PROTOCOL_VERSION.to_string()),
        "{text}"
    );
}

#[test]
fn drafter_that_refuses_the_target_is_reported() {
    let err = chaos("refuse-target", &[], config()).unwrap_err();
    assert!(
        matches!(&err, DrafterError::Refused { reason, .. } if reason.contains("refuses every target")),
        "{err}"
    );
}

#[test]
fn missing_and_non_executable_paths_are_clear_errors() {
    let missing = DrafterSpec::new("/nonexistent/drafter");
    let err = DrafterClient::start(missing, target(), config()).unwrap_err();
    assert!(matches!(err, DrafterError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/drafter"));
    // A bare name resolves next to the running executable, where no such drafter exists.
    let bare = DrafterSpec::new("no-such-drafter");
    let err = DrafterClient::start(bare, target(), config()).unwrap_err();
    assert!(matches!(err, DrafterError::NotFound { .. }), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("drafter.sh");
    std::fs::write(&file, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    for path in [file.as_path(), dir.path()] {
        let err = DrafterClient::start(DrafterSpec::new(path), target(), config()).unwrap_err();
        assert!(matches!(err, DrafterError::NotExecutable { .. }), "{err}");
    }
}

#[test]
fn drafter_exiting_during_handshake_shows_its_stderr() {
    let err = chaos("no-such-mode", &[], config()).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, DrafterError::ExitedDuringHandshake { .. }),
        "{text}"
    );
    assert!(text.contains("--mode must be one of"), "{text}");
}

#[test]
fn silent_drafter_times_out_the_handshake() {
    let config = ClientConfig {
        handshake_timeout: Duration::from_millis(300),
        ..config()
    };
    let spec = DrafterSpec::new("/bin/sleep").with_args(["30"]);
    let t0 = Instant::now();
    let err = DrafterClient::start(spec, target(), config).unwrap_err();
    assert!(
        matches!(err, DrafterError::HandshakeTimeout { .. }),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[test]
fn sigkilled_drafter_is_respawned_and_sessions_reopened() {
    let config = config();
    let mut c = start("ngram", &[], config).unwrap();
    c.open(1, &[20, 21, 22, 23, 24, 20, 21], &greedy(), None);
    assert_eq!(draft(&mut c, 1, 2).tokens, vec![22, 23]);
    c.commit(1, &verdict(2, 2, &[22, 23, 24]));
    let pid = c.pid().unwrap();
    kill9(pid);
    // The request goes on without drafts while the drafter is down.
    assert!(draft(&mut c, 1, 2).tokens.is_empty());
    assert_ne!(c.state(), DrafterState::Ready);
    wait_ready(&mut c);
    assert_ne!(c.pid(), Some(pid));
    assert_eq!(c.stats().restarts, 1);
    assert_eq!(c.incarnation(), 1, "a new life: its sessions are forgotten");
    assert!(
        draft(&mut c, 1, 2).tokens.is_empty(),
        "not open on the new process"
    );
    // The engine opens it again with the whole context: "… 22 23 24 20 21" → "22 23".
    c.open(
        1,
        &[20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21],
        &greedy(),
        None,
    );
    assert_eq!(draft(&mut c, 1, 2).tokens, vec![22, 23]);
}

#[test]
fn deadline_miss_gives_an_empty_draft_and_the_late_reply_is_dropped() {
    let config = ClientConfig {
        draft_deadline: Duration::from_millis(50),
        ..config()
    };
    let mut c = chaos("sleep-past-deadline", &["--sleep-ms", "1000"], config).unwrap();
    c.open(1, &[1, 2, 3], &greedy(), None);
    let t0 = Instant::now();
    assert!(draft(&mut c, 1, 4).tokens.is_empty());
    assert!(
        t0.elapsed() < Duration::from_millis(800),
        "waited {:?}",
        t0.elapsed()
    );
    // Long past the first reply (at ~1 s), with margin for a loaded machine.
    std::thread::sleep(Duration::from_millis(2000));
    // The first reply arrived meanwhile, with the old sequence number: dropped, not used as
    // this one.
    assert!(draft(&mut c, 1, 4).tokens.is_empty());
    let stats = c.stats();
    assert_eq!((stats.deadline_misses, stats.late_replies), (2, 1));
    assert_eq!(stats.drafted, 0);
    assert_eq!(
        c.state(),
        DrafterState::Ready,
        "slowness alone is not a restart"
    );
}

/// A late drafter is paced: a miss halves its drafts, a second stops them (degraded); then one
/// probe at a time goes out, never waited for; once it answers in time it drafts again, the
/// budget doubling back to healthy.
#[test]
fn a_late_drafter_stops_being_asked_and_recovers_when_it_answers_in_time() {
    // Wide margins (the rule itself is tested without clocks in target-host's `pace`): a
    // prompt reply must come within the deadline even on a loaded machine.
    let config = ClientConfig {
        draft_deadline: Duration::from_millis(400),
        ..config()
    };
    // Late (2.4 s) for its first two draft requests, then at once.
    let args = ["--sleep-ms", "2400", "--late-for", "2"];
    let mut c = chaos("sleep-past-deadline", &args, config).unwrap();
    c.open(1, &[1, 2, 3], &greedy(), None);
    assert_eq!(c.health(), Health::Healthy);
    assert!(draft(&mut c, 1, 4).tokens.is_empty(), "miss 1");
    assert_eq!(c.health(), Health::Degraded, "a miss lowers the budget");
    assert!(draft(&mut c, 1, 4).tokens.is_empty(), "miss 2");
    let sent = c.stats().requests;
    // Stopped: a probe goes out and is not waited for (no further miss); while it is out,
    // nothing more is sent.
    for _ in 0..5 {
        assert!(draft(&mut c, 1, 4).tokens.is_empty());
    }
    let stats = c.stats();
    assert_eq!(stats.requests, sent + 1, "one probe at a time");
    assert_eq!(stats.deadline_misses, 2, "probes are never waited for");
    assert_eq!(c.health(), Health::Degraded);
    // The backlog (two late replies, then the probe's) drains by ~4.8 s; the drafter is
    // prompt now.
    std::thread::sleep(Duration::from_millis(6000));
    let lens: Vec<usize> = (0..4).map(|_| draft(&mut c, 1, 4).tokens.len()).collect();
    assert_eq!(
        lens,
        vec![1, 2, 4, 4],
        "drafting resumes at one, doubling back"
    );
    assert_eq!(c.health(), Health::Healthy);
    assert_eq!(c.stats().late_replies, 2);
}

#[test]
fn invalid_replies_are_discarded_and_a_repeat_offender_restarted() {
    for mode in ["oov-ids", "too-many", "nan-q"] {
        let config = ClientConfig {
            max_bad_replies: 3,
            ..config()
        };
        let mut c = chaos(mode, &[], config).unwrap();
        c.open(1, &[1, 2, 3], &greedy(), None);
        for round in 0..3 {
            assert!(
                draft(&mut c, 1, 4).tokens.is_empty(),
                "{mode} round {round}"
            );
        }
        assert_eq!(c.stats().discarded, 3, "{mode}");
        assert_eq!(
            c.state(),
            DrafterState::Backoff,
            "{mode}: restarted after 3 bad replies"
        );
        wait_ready(&mut c);
        assert_eq!(c.stats().restarts, 1, "{mode}");
    }
}

#[test]
fn random_valid_ids_pass_validation() {
    let mut c = chaos("random-ids", &[], config()).unwrap();
    c.open(1, &[1], &greedy(), None);
    for _ in 0..20 {
        let d = draft(&mut c, 1, 5);
        assert_eq!(d.tokens.len(), 5);
        assert!(d.tokens.iter().all(|&id| id < VOCAB));
    }
    assert_eq!(c.stats().discarded, 0);
}

#[test]
fn drafter_exiting_mid_request_is_respawned() {
    let mut c = chaos("exit-mid-request", &["--after", "1"], config()).unwrap();
    c.open(1, &[1, 2], &greedy(), None);
    assert_eq!(draft(&mut c, 1, 3).tokens.len(), 3);
    assert!(
        draft(&mut c, 1, 3).tokens.is_empty(),
        "it exits during this request"
    );
    assert_eq!(c.state(), DrafterState::Backoff);
    wait_ready(&mut c);
    c.open(1, &[1, 2], &greedy(), None);
    assert_eq!(draft(&mut c, 1, 3).tokens.len(), 3);
}

/// FNV-1a over the f32 bits, in the order the chaos drafter reads them.
fn checksum(taps: &TapRows) -> u64 {
    let tensors = taps
        .layers
        .iter()
        .chain(&taps.final_hidden)
        .chain(taps.kv.iter().flat_map(|(k, v)| [k, v]));
    tensors.flatten().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3)
    })
}

fn tap_rows(pos: usize, rows: usize, salt: f32) -> TapRows {
    let t = target();
    let (hidden, kv) = (
        t.hidden_size as usize,
        (t.num_kv_heads * t.head_dim) as usize,
    );
    let fill = |n: usize, k: f32| (0..n).map(|i| (i as f32 * 0.37 + k + salt).sin()).collect();
    TapRows {
        pos,
        rows,
        layers: vec![fill(rows * hidden, 1.0), fill(rows * hidden, 2.0)],
        final_hidden: Some(fill(rows * hidden, 3.0)),
        kv: vec![(fill(rows * kv, 4.0), fill(rows * kv, 5.0))],
        donor: None,
    }
}

#[test]
fn taps_reach_the_drafter_bit_for_bit_through_shared_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("taps.log");
    let mut c = chaos("taps-check", &["--out", out.to_str().unwrap()], config()).unwrap();
    let wants = c.wants();
    assert_eq!(
        (wants.tap_layers, wants.final_hidden, wants.kv_layers),
        (vec![0, 1], true, vec![1])
    );
    let prompt = tap_rows(0, 5, 0.0);
    c.open(3, &[1, 2, 3, 4, 5, 6], &greedy(), Some(&prompt));
    let mut expect = vec![format!("open 3 5 {}", checksum(&prompt))];
    for round in 0..20 {
        let taps = tap_rows(6 + round, 3, round as f32);
        draft(&mut c, 3, 2);
        let v = Verdict {
            drafted: 2,
            accepted: 2,
            committed: &[7, 8, 9],
            taps: Some(&taps),
        };
        c.commit(3, &v);
        expect.push(format!("commit 3 3 {}", checksum(&taps)));
    }
    // A draft round trip orders every earlier message before it: the log is complete.
    draft(&mut c, 3, 1);
    let got = std::fs::read_to_string(&out).unwrap();
    assert_eq!(got.lines().collect::<Vec<_>>(), expect);
}

/// Rounds without drafts that the engine held back reach the drafter as one `Advance`, which can
/// hold more rows than one window of the shared region: the client splits it like a large
/// `Open` (windows of at most half the region, each written after the drafter read the one
/// before), and every row arrives once, in order, bit for bit.
#[test]
fn a_held_back_advance_larger_than_a_window_is_split() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("taps.log");
    // 160 bytes a row here: half of 4 KiB, less alignment, holds 10.
    let small = ClientConfig {
        region_bytes: 4096,
        ..config()
    };
    let mut c = chaos("taps-check", &["--out", out.to_str().unwrap()], small).unwrap();
    let prompt = tap_rows(0, 2, 0.0);
    c.open(3, &[1, 2, 3], &greedy(), Some(&prompt));
    let held = tap_rows(2, 25, 1.0);
    let ids: Vec<u32> = (10..35).collect();
    c.advance(3, &ids, Some(&held));
    draft(&mut c, 3, 1);
    assert_eq!(c.stats().split_advances, 1, "{:?}", c.stats());
    let got = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = got.lines().collect();
    assert_eq!(lines[0], format!("open 3 2 {}", checksum(&prompt)));
    let mut at = 0;
    for line in &lines[1..] {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f[..2], ["advance", "3"], "{lines:?}");
        let rows: usize = f[2].parse().unwrap();
        assert!(
            (1..=10).contains(&rows),
            "a window of {rows} rows: {lines:?}"
        );
        assert_eq!(
            f[3],
            checksum(&held.window(at, rows)).to_string(),
            "{lines:?}"
        );
        at += rows;
    }
    assert_eq!((at, lines.len()), (25, 4), "{lines:?}");
}

#[test]
fn late_capabilities_replace_the_hellos_and_taps_follow_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("taps.log");
    let mut c = chaos("late-caps", &["--out", out.to_str().unwrap()], config()).unwrap();
    let wants = c.wants();
    // The Hello asked for nothing; the late capabilities ask for the last of the 4 layers.
    assert_eq!(
        (wants.tap_layers, wants.final_hidden, wants.kv_layers),
        (vec![3], true, vec![])
    );
    let rows = |pos, n| TapRows {
        pos,
        rows: n,
        layers: vec![(0..n * 8).map(|i| i as f32).collect()],
        final_hidden: Some((0..n * 8).map(|i| -(i as f32)).collect()),
        kv: vec![],
        donor: None,
    };
    c.open(1, &[1, 2, 3], &greedy(), Some(&rows(0, 2)));
    draft(&mut c, 1, 2);
    let got = std::fs::read_to_string(&out).unwrap();
    assert!(
        got.starts_with("open 1 2 "),
        "a region was mapped for the late taps: {got}"
    );
}

#[test]
fn late_capabilities_are_checked_and_waited_for_within_the_handshake() {
    let err = chaos("late-caps-bad", &[], config()).unwrap_err();
    assert!(matches!(err, DrafterError::BadCapabilities { .. }), "{err}");
    assert!(err.to_string().contains("layer 4"), "{err}");
    let quick = ClientConfig {
        handshake_timeout: Duration::from_millis(500),
        ..config()
    };
    let err = chaos("late-caps-silent", &[], quick).unwrap_err();
    assert!(
        matches!(err, DrafterError::HandshakeTimeout { .. }),
        "{err}"
    );
}

fn dev_shm() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn alive(pid: u32) -> bool {
    // A reaped process is gone; an unreaped one is a zombie ('Z'): neither holds resources.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

#[test]
fn sigkill_of_the_drafter_leaks_no_fds_or_shm_on_the_host() {
    let shm_before = dev_shm();
    // In its own process, so other tests' files do not blur the fd count.
    let out = Command::new(bin_path("mini-host"))
        .args([
            "kill-drafter",
            bin_path("chaos-drafter").to_str().unwrap(),
            "--mode",
            "taps-check",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fds: Vec<usize> = stdout
        .trim()
        .strip_prefix("fds ")
        .unwrap_or_else(|| panic!("unexpected output {stdout:?}"))
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(fds[0], fds[1], "fds before/after");
    assert_eq!(dev_shm(), shm_before);
}

/// SIGKILLs a `mini-host` serving `drafter args…`: the drafter must end, and leave no shm.
fn host_killed_under(drafter: &str, args: &[&str]) {
    let shm_before = dev_shm();
    let mut host = Command::new(bin_path("mini-host"))
        .arg("wait")
        .arg(bin_path(drafter))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(host.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let pid: u32 = line.trim().strip_prefix("pid ").unwrap().parse().unwrap();
    assert!(alive(pid));
    host.kill().unwrap(); // SIGKILL
    host.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        assert!(Instant::now() < until, "drafter {pid} outlived its host");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(dev_shm(), shm_before);
}

#[test]
fn sigkill_of_the_host_ends_the_drafter() {
    host_killed_under("chaos-drafter", &["--mode", "taps-check"]);
}

/// A drafter asleep on its doorbell's futex hears of a dead host from the socket.
#[test]
fn sigkill_of_the_host_ends_a_drafter_waiting_on_its_doorbell() {
    host_killed_under("ngram", &[]);
}

/// The doorbell (protocol 1.3) changes the transport only: the same requests get the same
/// drafts as on the socket, and it is what an SDK drafter gets unless the host turns it off.
#[test]
fn ngram_drafts_the_same_through_the_doorbell_and_the_socket() {
    let mut drafts = Vec::new();
    for spin in [Some(Duration::ZERO), Some(Duration::from_micros(500)), None] {
        let config = ClientConfig {
            doorbell_spin: spin,
            ..config()
        };
        let mut c = start("ngram", &[], config).unwrap();
        assert_eq!(c.doorbell(), spin.is_some(), "{spin:?}");
        c.open(3, &[10, 11, 12, 13, 14, 99, 10, 11], &greedy(), None);
        let mut got = vec![draft(&mut c, 3, 3).tokens];
        c.commit(3, &verdict(3, 3, &[12, 13, 14, 99]));
        c.advance(3, &[10, 11], None);
        got.push(draft(&mut c, 3, 4).tokens);
        c.close(3);
        got.push(draft(&mut c, 3, 4).tokens);
        assert_eq!(c.stats().restarts, 0);
        drafts.push(got);
    }
    assert_eq!(
        drafts[0],
        vec![vec![12, 13, 14], vec![12, 13, 14, 99], vec![]]
    );
    assert!(drafts.iter().all(|d| *d == drafts[0]), "{drafts:?}");
}

#[test]
fn in_process_ngram_drafts_exactly_what_its_process_drafts() {
    use ngram::{NgramConfig, NgramDrafter};
    use target_host::drafter::InProcess;

    let mut process = start("ngram", &["--max-draft", "6"], config()).unwrap();
    let mut local = InProcess::new(NgramDrafter::new(NgramConfig::default(), 6));
    assert_eq!(local.name(), process.name());
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7 + i / 13) % 23).collect();
    process.open(1, &prompt, &greedy(), None);
    local.open(1, &prompt, &greedy(), None);
    let mut drafted = 0;
    for round in 0..100u32 {
        let (a, b) = (draft(&mut process, 1, 8), draft(&mut local, 1, 8));
        assert_eq!(a, b, "round {round}");
        drafted += a.tokens.len();
        // Accept the first draft when there is one, then a "target" token.
        let committed: Vec<u32> = a
            .tokens
            .iter()
            .take(1)
            .copied()
            .chain([round % 23])
            .collect();
        let v = verdict(a.tokens.len(), committed.len() - 1, &committed);
        process.commit(1, &v);
        local.commit(1, &v);
    }
    assert!(
        drafted > 100,
        "the prompt is repetitive: drafts expected, got {drafted}"
    );
}
