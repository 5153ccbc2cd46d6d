//! A drafter that misbehaves on purpose, to test the host's defences. It speaks the protocol
//! through `specula_protocol`'s transport directly (not the SDK, which would stop it from
//! misbehaving).
//!
//! `chaos-drafter --mode MODE [--out FILE] [--after N] [--sleep-ms MS]`, modes:
//! - `random-ids`: valid but random ids;
//! - `oov-ids`: ids at or past the vocabulary size;
//! - `sleep-past-deadline`: replies correctly, `--sleep-ms` late (default 500); with
//!   `--late-for N`, only the first N draft requests are late (then it answers at once);
//! - `exit-mid-request`: exits (status 1) on the draft request after `--after` (default 0) good ones;
//! - `wrong-major`: speaks only protocol 2.0;
//! - `too-many`: proposes `n + 3` ids;
//! - `nan-q`: proposes with `q` rows full of NaN;
//! - `refuse-target`: says Goodbye after Welcome;
//! - `taps-check`: asks for layer taps, the final hidden and KV rows, and appends to `--out` one
//!   line per Open/Commit/Advance: `open|commit|advance SESSION ROWS CHECKSUM` (FNV-1a over the
//!   f32 bits of every tensor, in message order) or `open|commit|advance SESSION torn`; with
//!   `--rows` each line goes on with ` POS C0,C1,…` (the first row's position and a checksum per
//!   row), and a message without taps is logged as `open|commit|advance SESSION 0 none`;
//!   `--crash-once FILE` exits (status 1) on the draft request after `--after` good ones when
//!   FILE does not exist yet, creating it first, so the respawned process runs on;
//! - `late-caps`: like `taps-check`, but its Hello asks for nothing and sets
//!   `late_capabilities`; after Welcome it asks for the target's last layer and the final hidden;
//! - `late-caps-bad`: states late capabilities asking for layer `num_layers` (out of range);
//! - `late-caps-silent`: sets `late_capabilities` and never states them.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use specula_protocol::sdk::OwnedTaps;
use specula_protocol::shm::{ShmReader, TapViews};
use specula_protocol::transport::{self, Sender, BOOTSTRAP_ENV};
use specula_protocol::wire::*;
use specula_protocol::{Version, PROTOCOL_VERSION};

struct Args {
    mode: String,
    out: Option<String>,
    after: u64,
    sleep_ms: u64,
    late_for: Option<u64>,
    rows: bool,
    crash_once: Option<String>,
}

fn parse() -> Result<Args> {
    let mut args = Args {
        mode: String::new(),
        out: None,
        after: 0,
        sleep_ms: 500,
        late_for: None,
        rows: false,
        crash_once: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--rows" {
            args.rows = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--mode" => args.mode = value,
            "--out" => args.out = Some(value),
            "--after" => args.after = value.parse().context("--after")?,
            "--sleep-ms" => args.sleep_ms = value.parse().context("--sleep-ms")?,
            "--late-for" => args.late_for = Some(value.parse().context("--late-for")?),
            "--crash-once" => args.crash_once = Some(value),
            _ => bail!("unknown flag {flag}"),
        }
    }
    const MODES: &[&str] = &[
        "random-ids",
        "oov-ids",
        "sleep-past-deadline",
        "exit-mid-request",
        "wrong-major",
        "too-many",
        "nan-q",
        "refuse-target",
        "taps-check",
        "late-caps",
        "late-caps-bad",
        "late-caps-silent",
    ];
    if !MODES.contains(&args.mode.as_str()) {
        bail!("--mode must be one of {MODES:?}, got {:?}", args.mode);
    }
    Ok(args)
}

/// FNV-1a over the bit patterns: any changed bit changes the sum.
fn checksum(taps: &OwnedTaps) -> u64 {
    let tensors = taps
        .layers
        .iter()
        .chain(&taps.final_hidden)
        .chain(taps.kv.iter().flat_map(|(k, v)| [k, v]));
    tensors.flatten().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3)
    })
}

/// [`checksum`] of each row on its own (every tensor's slice of that row, in tensor order).
fn row_checksums(taps: &OwnedTaps) -> Vec<u64> {
    let rows = taps.rows as usize;
    let tensors: Vec<&Vec<f32>> = taps
        .layers
        .iter()
        .chain(&taps.final_hidden)
        .chain(taps.kv.iter().flat_map(|(k, v)| [k, v]))
        .collect();
    (0..rows)
        .map(|r| {
            tensors.iter().fold(0xcbf2_9ce4_8422_2325, |h, t| {
                let w = t.len() / rows;
                t[r * w..(r + 1) * w].iter().fold(h, |h, x| {
                    (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3)
                })
            })
        })
        .collect()
}

fn read(region: Option<&ShmReader>, views: &TapViews) -> specula_protocol::Result<OwnedTaps> {
    let region = region.ok_or(specula_protocol::Error::Violation {
        reason: "taps before MapRegion".into(),
    })?;
    Ok(OwnedTaps {
        pos: views.pos,
        rows: views.rows,
        layers: views
            .layers
            .iter()
            .map(|v| region.read_f32(v))
            .collect::<Result<_, _>>()?,
        final_hidden: views
            .final_hidden
            .as_ref()
            .map(|v| region.read_f32(v))
            .transpose()?,
        kv: views
            .kv
            .iter()
            .map(|kv| Ok((region.read_f32(&kv.k)?, region.read_f32(&kv.v)?)))
            .collect::<specula_protocol::Result<_>>()?,
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chaos-drafter: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<()> {
    let args = parse()?;
    let bootstrap = std::env::var(BOOTSTRAP_ENV).context("started without a host")?;
    let taps = args.mode == "taps-check";
    let late = args.mode.starts_with("late-caps");
    let hello = Hello {
        versions: match args.mode.as_str() {
            "wrong-major" => vec![Version { major: 2, minor: 0 }],
            _ => vec![PROTOCOL_VERSION],
        },
        name: format!("chaos-{}", args.mode),
        drafter_version: "0".into(),
        capabilities: Capabilities {
            max_draft_len: 8,
            prefill: PrefillMode::LeaveLastPending,
            tap_layers: if taps { vec![0, 1] } else { vec![] },
            final_hidden: taps,
            kv_layers: if taps { vec![1] } else { vec![] },
        },
        late_capabilities: late,
        kv_donor_views: false,
        // It reads the socket itself.
        doorbell: false,
    };
    let connected = transport::connect(&bootstrap, &hello).context("connect")?;
    let welcome = match connected.reply {
        HandshakeReply::Welcome(w) => w,
        HandshakeReply::Refused { reason } => bail!("refused by the host: {reason}"),
    };
    let tx = Sender::new(connected.to_host, welcome.version);
    if args.mode == "refuse-target" {
        tx.send(DrafterMsg::Goodbye {
            reason: "chaos refuses every target".into(),
        })?;
        bail!("refused the target");
    }
    let last = welcome.target.num_layers.saturating_sub(1);
    let late_caps = |tap_layers| Capabilities {
        max_draft_len: 8,
        prefill: PrefillMode::LeaveLastPending,
        tap_layers,
        final_hidden: true,
        kv_layers: vec![],
    };
    match args.mode.as_str() {
        "late-caps" => tx.send(DrafterMsg::Capabilities(late_caps(vec![last])))?,
        "late-caps-bad" => tx.send(DrafterMsg::Capabilities(late_caps(vec![last + 1])))?,
        _ => {}
    }
    let vocab = welcome.target.vocab_size;
    let mut out = match &args.out {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => None,
    };
    let mut region = None;
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut drafts = 0u64;
    loop {
        let Ok(HostMsg::Request { seq, request }) = connected.from_host.recv() else {
            return Ok(()); // the host is gone
        };
        let mut log = |what: &str, session: SessionId, views: &Option<TapViews>| -> Result<()> {
            let Some(out) = out.as_mut() else {
                return Ok(());
            };
            let Some(views) = views else {
                if args.rows {
                    writeln!(out, "{what} {session} 0 none")?;
                }
                return Ok(());
            };
            match read(region.as_ref(), views) {
                Ok(t) if args.rows => {
                    let rows: Vec<String> = row_checksums(&t).iter().map(u64::to_string).collect();
                    writeln!(
                        out,
                        "{what} {session} {} {} {} {}",
                        t.rows,
                        checksum(&t),
                        t.pos,
                        rows.join(",")
                    )?
                }
                Ok(t) => writeln!(out, "{what} {session} {} {}", t.rows, checksum(&t))?,
                Err(_) => writeln!(out, "{what} {session} torn")?,
            }
            Ok(())
        };
        match request {
            Request::MapRegion(m) => region = Some(ShmReader::new(m.region, m.shm)?),
            Request::Open(o) => log("open", o.session, &o.prompt_taps)?,
            Request::Commit(c) => log("commit", c.session, &c.taps)?,
            Request::Advance(a) => log("advance", a.session, &a.taps)?,
            Request::Close(_) | Request::MapDonors(_) | Request::DonorTables(_) => {}
            Request::Shutdown => return Ok(()),
            Request::MapDoorbell(_) => bail!("a doorbell it did not ask for"),
            Request::Draft(d) => {
                let rows = d.rows.iter().map(|row| {
                    let n = row.n;
                    let mut next = || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        (rng % u64::from(vocab)) as u32
                    };
                    let (tokens, q) = match args.mode.as_str() {
                        "oov-ids" => ((0..n).map(|i| vocab + i).collect(), None),
                        "too-many" => ((0..n + 3).map(|_| next()).collect(), None),
                        "nan-q" => {
                            let q = vec![vec![f32::NAN; vocab as usize]; n as usize];
                            ((0..n).map(|_| next()).collect(), Some(q))
                        }
                        _ => ((0..n).map(|_| next()).collect(), None),
                    };
                    DraftedRow {
                        session: row.session,
                        tokens,
                        q,
                    }
                });
                let drafted = Drafted {
                    rows: rows.collect(),
                };
                // The handshake ping (no rows) is always answered on time.
                if !d.rows.is_empty() {
                    drafts += 1;
                    match args.mode.as_str() {
                        "sleep-past-deadline" if args.late_for.is_none_or(|n| drafts <= n) => {
                            std::thread::sleep(Duration::from_millis(args.sleep_ms))
                        }
                        "exit-mid-request" if drafts > args.after => std::process::exit(1),
                        _ => {}
                    }
                    if let Some(flag) = &args.crash_once {
                        if drafts > args.after && !std::path::Path::new(flag).exists() {
                            std::fs::write(flag, b"crashed\n")?;
                            std::process::exit(1);
                        }
                    }
                }
                tx.send(DrafterMsg::Reply {
                    seq,
                    reply: Reply::Drafted(drafted),
                })?;
            }
        }
    }
}
