//! Misbehaving drafters against the real model: whatever the drafter does (random or
//! out-of-vocabulary ids, too many ids, NaN probabilities, sleeping past the deadline, exiting
//! mid-request, speaking an old protocol, refusing the target), the request completes with
//! exactly the plain greedy output. The DFlash drafter killed mid-request is respawned and
//! re-opened with the whole context's taps, and drafts as before.

use specula_tests::{cli_generate, model_path};

const PROMPT: &str = "List the days of the week, then the months of the year.";

#[test]
fn misbehaving_drafters_never_change_the_output() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let (_, plain) = cli_generate(model, "chat", PROMPT, 40, &["--no-speculation"]);
    assert!(!plain.is_empty());
    for mode in [
        "random-ids",
        "oov-ids",
        "too-many",
        "nan-q",
        "sleep-past-deadline",
        "exit-mid-request",
        "wrong-major",
        "refuse-target",
    ] {
        let mode_arg = format!("--drafter-arg={mode}");
        let mut extra = vec![
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            &mode_arg,
        ];
        // Short deadline: the sleeping drafter must cost one empty round, not the test's time.
        extra.extend(["--draft-deadline-ms", "50"]);
        if mode == "exit-mid-request" {
            extra.extend(["--drafter-arg=--after", "--drafter-arg=2"]);
        }
        let (_, spec) = cli_generate(model, "chat", PROMPT, 40, &extra);
        assert_eq!(spec, plain, "drafter mode {mode} changed the output");
    }
}

/// A draft deadline shorter than the engine's own floor (5 ms) is the user's to set: it is
/// honoured (a drafter slower than it costs draft-less rounds), not a crash of the engine, and
/// the output is plain's. `0` means never wait.
#[test]
fn draft_deadlines_under_the_engines_floor_are_honoured() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let (_, plain) = cli_generate(model, "chat", PROMPT, 24, &["--no-speculation"]);
    for ms in ["0", "1", "4"] {
        for drafter in [
            &["--drafter", "ngram"][..],
            &[
                "--drafter",
                "chaos-drafter",
                "--drafter-arg=--mode",
                "--drafter-arg=sleep-past-deadline",
            ],
        ] {
            let mut extra = drafter.to_vec();
            extra.extend(["--draft-deadline-ms", ms]);
            let (_, spec) = cli_generate(model, "chat", PROMPT, 24, &extra);
            assert_eq!(spec, plain, "{extra:?} changed the output");
        }
    }
}

/// A drafter that asks for hidden taps and K/V rows of the real model gets them on every round
/// (none torn), and the output is unchanged.
#[test]
fn taps_reach_a_drafter_from_the_real_model() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("taps.log");
    let out_arg = format!("--drafter-arg={}", out.display());
    let (_, plain) = cli_generate(
        model,
        "prompt",
        "One, two, three, four,",
        24,
        &["--no-speculation"],
    );
    let (_, spec) = cli_generate(
        model,
        "prompt",
        "One, two, three, four,",
        24,
        &[
            // A fixed k: rounds commit drafts whatever the controller would choose (it may
            // choose k = 0 throughout on a loaded machine, which delivers taps by Advance only).
            "--fixed-draft",
            // Patient deadlines too: a miss on a loaded machine is a round without a commit.
            "--draft-deadline-steps",
            "1000",
            "--draft-deadline-ms",
            "10000",
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            "--drafter-arg=taps-check",
            "--drafter-arg=--out",
            &out_arg,
        ],
    );
    assert_eq!(spec, plain);
    let log = std::fs::read_to_string(&out).expect("the drafter wrote its log");
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with("open ")),
        "no open in {log}"
    );
    assert!(
        lines.iter().filter(|l| l.starts_with("commit ")).count() >= 1,
        "no commit in {log}"
    );
    assert!(!log.contains("torn"), "torn taps: {log}");
}

/// A drafter path that names no runnable program is the user's error: a clear message and a
/// non-zero exit. A drafter that runs but speaks another protocol major is logged, naming
/// both versions, and generation goes on without speculation.
#[test]
fn bad_drafter_paths_and_old_protocols() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let dir = tempfile::tempdir().expect("temp dir");
    let not_exec = dir.path().join("drafter.txt");
    std::fs::write(&not_exec, "not a program").expect("write");
    let missing = dir.path().join("no-such-drafter");
    for (drafter, expected) in [
        (missing.to_str().expect("utf-8"), "not found"),
        (not_exec.to_str().expect("utf-8"), "not an executable"),
    ] {
        let out = generate_hi(model, &["--max-tokens", "2", "--drafter", drafter]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{drafter}: should fail");
        assert!(
            stderr.contains(expected),
            "{drafter}: stderr lacks {expected:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = generate_hi(
        model,
        &[
            "--max-tokens",
            "4",
            "--drafter",
            "chaos-drafter",
            "--drafter-arg=--mode",
            "--drafter-arg=wrong-major",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("2.0") && stderr.contains(&specula_protocol::PROTOCOL_VERSION.to_string()),
        "versions not named: {stderr}"
    );
}

/// Runs `target-host generate --model MODEL --prompt Hi EXTRA...`.
fn generate_hi(model: &str, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(specula_tests::bin_path("target-host"))
        .args(["generate", "--model", model, "--prompt", "Hi"])
        .args(extra)
        .output()
        .expect("run target-host")
}

/// One line the DFlash drafter logs at debug level (through the host's log): its pid, the event
/// (`open`, `draft`, `commit`) and its fields.
#[derive(Debug, Clone)]
pub(crate) struct DrafterEvent {
    pub(crate) pid: u32,
    pub(crate) event: String,
    fields: Vec<(String, String)>,
}

impl DrafterEvent {
    /// Parses a host log line `... drafter: ... dflash::drafter: EVENT k=v ... pid=N`.
    pub(crate) fn parse(line: &str) -> Option<DrafterEvent> {
        let line = strip_ansi(line);
        let (_, rest) = line.split_once("dflash::drafter: ")?;
        let (event, rest) = rest.split_once(' ')?;
        let mut fields = Vec::new();
        // (key start, '=') of every field; values never hold '=' (ids print as [1, 2, 3]).
        let pieces: Vec<(usize, usize)> = rest
            .match_indices('=')
            .map(|(i, _)| (rest[..i].rfind(' ').map_or(0, |s| s + 1), i))
            .collect();
        for (n, &(from, eq)) in pieces.iter().enumerate() {
            let end = pieces.get(n + 1).map_or(rest.len(), |&(next, _)| next);
            fields.push((
                rest[from..eq].to_string(),
                rest[eq + 1..end].trim().to_string(),
            ));
        }
        let pid = fields.iter().find(|(k, _)| k == "pid")?.1.parse().ok()?;
        Some(DrafterEvent {
            pid,
            event: event.to_string(),
            fields,
        })
    }

    pub(crate) fn get(&self, key: &str) -> &str {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map_or("", |(_, v)| v.as_str())
    }

    pub(crate) fn num(&self, key: &str) -> usize {
        self.get(key)
            .parse()
            .unwrap_or_else(|_| panic!("{key} in {self:?}"))
    }
}

/// The `(pos, tokens)` of each draft made on a context without holes: once a process logs a
/// `missing` position (taps torn or late under load), its later drafts are not comparable with
/// another run's, so they are left out.
pub(crate) fn drafts_without_holes(events: &[&DrafterEvent]) -> Vec<(usize, String)> {
    let mut holed: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for e in events {
        match e.event.as_str() {
            "open" | "commit" if e.num("missing") > 0 => holed.push(e.pid),
            "draft" if !holed.contains(&e.pid) => {
                out.push((e.num("pos"), e.get("tokens").to_string()));
            }
            _ => {}
        }
    }
    out
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `target-host generate` with the DFlash drafter process (debug log on), SIGKILLing the
/// drafter after its `kill_after`-th commit when that is not 0; returns (ids, drafter events).
fn dflash_generate(kill_after: usize) -> (Vec<u32>, Vec<DrafterEvent>) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let model = model_path("smollm2-135m");
    let mut child = Command::new(specula_tests::bin_path("target-host"))
        .args(["generate", "--json", "--max-tokens", "64", "--chat", PROMPT])
        .arg("--model")
        .arg(&model)
        .arg("--drafter")
        .arg(specula_tests::bin_path("dflash"))
        .args(["--num-draft-tokens", "7", "--fixed-draft"])
        // An f32 target on one thread: the rest of the generation after the kill must outlast the
        // respawned drafter's start (backoff + loading), or no round after it can be compared;
        // with the quantized target on two idle cores the 64 tokens were done first.
        .args(["--dtype", "f32"])
        .env("RAYON_NUM_THREADS", "1")
        // The deadline is a few measured target steps, capped by the ms: on a loaded machine a
        // miss would halve later drafts and no round could be compared. Let the cap decide.
        .args([
            "--draft-deadline-ms",
            "10000",
            "--draft-deadline-steps",
            "1000",
        ])
        .env("RUST_LOG", "info,dflash=debug")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn target-host");
    let stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut s).map(|_| s)
    });
    let mut events = Vec::new();
    let mut log = String::new();
    let mut killed = false;
    for line in BufReader::new(child.stderr.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        log.push_str(&line);
        log.push('\n');
        let Some(e) = DrafterEvent::parse(&line) else {
            continue;
        };
        let commits = events
            .iter()
            .filter(|x: &&DrafterEvent| x.event == "commit")
            .count();
        let is_commit = e.event == "commit";
        let pid = e.pid;
        events.push(e);
        if kill_after > 0 && !killed && is_commit && commits + 1 == kill_after {
            let status = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status()
                .expect("kill");
            assert!(status.success());
            killed = true;
        }
    }
    let status = child.wait().expect("target-host exits");
    let out = reader.join().expect("reader").expect("stdout");
    assert!(status.success(), "target-host failed:\n{log}");
    assert!(
        kill_after == 0 || killed,
        "never killed the drafter:\n{log}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("--json output");
    let ids = v["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    (ids, events)
}

/// The DFlash drafter SIGKILLed mid-request: the host respawns it and re-opens the session with
/// the taps of the whole context, so the output equals plain decoding and the new process
/// drafts, from its first round, exactly what the undisturbed drafter drafted at the same
/// positions (acceptance back to full at once).
#[test]
fn dflash_respawn_after_a_kill_recovers_full_acceptance() {
    let path = model_path("smollm2-135m");
    let model = path.to_str().expect("utf-8 path");
    let (_, plain) = cli_generate(
        model,
        "chat",
        PROMPT,
        64,
        &["--no-speculation", "--dtype", "f32"],
    );
    let (clean_ids, clean) = dflash_generate(0);
    assert_eq!(clean_ids, plain);
    let (ids, events) = dflash_generate(3);
    assert_eq!(ids, plain, "the kill changed the output");
    let first_pid = events[0].pid;
    let after: Vec<&DrafterEvent> = events.iter().filter(|e| e.pid != first_pid).collect();
    let open = after
        .iter()
        .find(|e| e.event == "open")
        .unwrap_or_else(|| panic!("the respawned drafter was never opened: {events:?}"));
    assert_eq!(
        (open.num("rows"), open.num("missing")),
        (open.num("pos"), 0),
        "the re-open carries the taps of every position before the pending one: {open:?}"
    );
    let clean_drafts = drafts_without_holes(&clean.iter().collect::<Vec<_>>());
    let new_drafts = drafts_without_holes(&after);
    let compared: Vec<_> = new_drafts
        .iter()
        .filter_map(|(pos, t)| {
            clean_drafts
                .iter()
                .find(|(p, _)| p == pos)
                .map(|(_, c)| (pos, t == c))
        })
        .collect();
    assert!(
        compared.len() >= 2 && compared.iter().all(|(_, same)| *same),
        "after the respawn: {compared:?}\nnew {new_drafts:?}\nclean {clean_drafts:?}"
    );
}
