//! A minimal host for process-level tests: starts one drafter through `DrafterClient` against a
//! fake target (no model), then runs one scenario.
//!
//! `mini-host SCENARIO DRAFTER [ARGS…]`, scenarios:
//! - `wait`: prints `pid <drafter pid>` and sleeps (the test SIGKILLs this host);
//! - `kill-drafter`: counts its open fds, starts the drafter, drafts, SIGKILLs the drafter, waits
//!   for the respawn, drops the client, and prints `fds <before> <after>`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use specula_models::sampling::SamplingParams;
use specula_protocol::wire::TargetInfo;
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec, DrafterState};
use target_host::proposer::Proposer;

/// The fake target the drafter tests use.
fn target() -> TargetInfo {
    TargetInfo {
        architecture: "fake".into(),
        vocab_size: 1000,
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

fn open_fds() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")?.count())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let scenario = args
        .next()
        .context("usage: mini-host SCENARIO DRAFTER [ARGS…]")?;
    let drafter = args.next().context("missing DRAFTER")?;
    let spec = DrafterSpec::new(drafter).with_args(args);
    match scenario.as_str() {
        "wait" => {
            let mut client = DrafterClient::start(spec, target(), ClientConfig::default())?;
            println!("pid {}", client.pid().context("no drafter")?);
            std::thread::sleep(Duration::from_secs(60));
        }
        "kill-drafter" => {
            let before = open_fds()?;
            let mut client = DrafterClient::start(spec, target(), ClientConfig::default())?;
            client.open(1, &[5, 6, 7, 5, 6], &SamplingParams::default(), None);
            specula_tests::proposers::draft(&mut client, 1, 4);
            let pid = client.pid().context("no drafter")?;
            let status = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status()?;
            if !status.success() {
                bail!("kill -9 {pid} failed");
            }
            let until = Instant::now() + Duration::from_secs(10);
            // The first draft after the kill notices the crash; then the respawn runs.
            specula_tests::proposers::draft(&mut client, 1, 4);
            while client.poll() != DrafterState::Ready {
                if Instant::now() > until {
                    bail!("no respawn: state {:?}", client.state());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if client.pid() == Some(pid) {
                bail!("the respawned drafter has the old pid");
            }
            drop(client);
            println!("fds {before} {}", open_fds()?);
        }
        _ => bail!("unknown scenario {scenario}"),
    }
    Ok(())
}
