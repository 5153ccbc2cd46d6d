//! The drafter round trip (issue #17: under 5% of a target forward), socket against doorbell,
//! in one run.
//!
//! Each `--drafter` is started once per `--transport` (`socket`: every message on the
//! ipc-channel socket; `doorbell:N`: the protocol 1.3 doorbell with N µs of polling before
//! either side sleeps on the futex), with the same client the engine uses. A session is opened on a repeating
//! context (so prompt lookup drafts), then rounds run as the engine runs them: `Commit` of the
//! last verdict, `Draft` of up to `-k`, wait for the reply, then `--forward-us` of idle time
//! standing in for the target forward (the host thread sleeps, as it does while a GPU works).
//! Transports alternate in blocks of `--block` rounds; the round trip (`Draft` sent to reply
//! read, as [`target_host::drafter::DrafterStats::rtt_us`] records it) is reported per transport
//! as median, p90 and p99.
//!
//! ```sh
//! cargo run --release -p target-host --example drafter-rtt -- \
//!   --drafter target/release/ngram --drafter target/release/echo-drafter \
//!   --transport socket,doorbell:0,doorbell:50,doorbell:2000
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use specula_models::sampling::SamplingParams;
use specula_protocol::wire::TargetInfo;
use target_host::drafter::{
    parse_transport, transport_name, ClientConfig, DrafterClient, DrafterSpec,
};
use target_host::proposer::{DraftAsk, DraftBatch, Proposer, Verdict};

#[derive(Parser)]
struct Args {
    /// A drafter executable (repeatable).
    #[arg(long, required = true)]
    drafter: Vec<PathBuf>,
    /// Transports to compare: `socket`, `doorbell` or `doorbell:<µs of polling>`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "socket,doorbell:0,doorbell"
    )]
    transport: Vec<String>,
    /// Measured rounds per transport and drafter.
    #[arg(long, default_value_t = 2000)]
    rounds: usize,
    /// Rounds in a row before the next transport's turn.
    #[arg(long, default_value_t = 100)]
    block: usize,
    /// Idle time between rounds, standing in for the target forward, µs.
    #[arg(long, default_value_t = 700)]
    forward_us: u64,
    /// Drafts asked per round.
    #[arg(short, default_value_t = 4)]
    k: usize,
    /// Write the numbers as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The repeating context: prompt lookup finds every continuation.
const PERIOD: u32 = 37;

fn token(pos: usize) -> u32 {
    100 + (pos as u32 * 7) % PERIOD
}

/// One drafter behind one transport, mid-session.
struct Lane {
    name: String,
    transport: String,
    client: DrafterClient,
    /// Committed context length (the last id pending).
    len: usize,
    verdict: Option<(usize, usize, Vec<u32>)>,
}

impl Lane {
    fn round(&mut self, k: usize) {
        if let Some((drafted, accepted, ids)) = self.verdict.take() {
            let verdict = Verdict {
                drafted,
                accepted,
                committed: &ids,
                taps: None,
            };
            self.client.commit(1, &verdict);
        }
        let asks = [DraftAsk { session: 1, n: k }];
        let batch = DraftBatch {
            asks: &asks,
            deadline: Duration::from_millis(200),
        };
        let draft = self.client.draft(&batch).pop().unwrap_or_default();
        // The "target" continues the pattern: drafts that follow it are accepted.
        let accepted = (0..draft.tokens.len())
            .take_while(|&i| draft.tokens[i] == token(self.len + i))
            .count();
        let ids: Vec<u32> = (0..=accepted).map(|i| token(self.len + i)).collect();
        self.len += ids.len();
        self.verdict = Some((draft.tokens.len(), accepted, ids));
    }
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(rank).copied().unwrap_or(0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let target = TargetInfo {
        architecture: "llama".into(),
        vocab_size: 49152,
        hidden_size: 576,
        num_layers: 30,
        num_kv_heads: 3,
        head_dim: 64,
        tokenizer_fingerprint: "drafter-rtt".into(),
        eos_ids: vec![0],
        context_len: 1 << 20,
        ..TargetInfo::default()
    };
    let transports = args
        .transport
        .iter()
        .map(|t| parse_transport(t).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let mut lanes = Vec::new();
    for path in &args.drafter {
        let name = path
            .file_name()
            .map_or("drafter".into(), |n| n.to_string_lossy().into_owned());
        for &spin in &transports {
            let config = ClientConfig {
                doorbell_spin: spin,
                rtt_samples: args.rounds + args.block,
                ..ClientConfig::default()
            };
            let mut client = DrafterClient::start(DrafterSpec::new(path), target.clone(), config)
                .with_context(|| format!("start {}", path.display()))?;
            if client.doorbell() != spin.is_some() {
                bail!(
                    "{}: asked for {}, got the other",
                    path.display(),
                    transport_name(spin)
                );
            }
            let context: Vec<u32> = (0..64).map(token).collect();
            client.open(1, &context, &SamplingParams::default(), None);
            lanes.push(Lane {
                name: name.clone(),
                transport: transport_name(spin),
                client,
                len: context.len(),
                verdict: None,
            });
        }
    }
    let forward = Duration::from_micros(args.forward_us);
    // One block of warm-up per lane, then measured blocks, lanes alternating.
    for lane in &mut lanes {
        for _ in 0..args.block {
            lane.round(args.k);
            std::thread::sleep(forward);
        }
    }
    let warm: Vec<usize> = lanes
        .iter()
        .map(|l| l.client.stats().rtt_us.len())
        .collect();
    let started = Instant::now();
    for _ in 0..args.rounds.div_ceil(args.block) {
        for lane in &mut lanes {
            for _ in 0..args.block {
                lane.round(args.k);
                std::thread::sleep(forward);
            }
        }
    }
    println!(
        "drafter round trip, {} rounds per lane in blocks of {}, {} us idle between rounds, k {} \
         ({:.1} s)",
        args.rounds,
        args.block,
        args.forward_us,
        args.k,
        started.elapsed().as_secs_f64()
    );
    println!(
        "| drafter | transport | rounds | median us | p90 us | p99 us | drafted/round | misses |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (lane, warm) in lanes.iter().zip(warm) {
        let stats = lane.client.stats();
        let mut rtt: Vec<u32> = stats.rtt_us.iter().skip(warm).copied().collect();
        rtt.sort_unstable();
        let (p50, p90, p99) = (
            percentile(&rtt, 0.5),
            percentile(&rtt, 0.9),
            percentile(&rtt, 0.99),
        );
        let drafted = stats.drafted as f64 / stats.requests.max(1) as f64;
        println!(
            "| {} | {} | {} | {p50} | {p90} | {p99} | {drafted:.2} | {} |",
            lane.name,
            lane.transport,
            rtt.len(),
            stats.deadline_misses
        );
        rows.push(serde_json::json!({
            "drafter": lane.name, "transport": lane.transport, "rounds": rtt.len(),
            "rtt_p50_us": p50, "rtt_p90_us": p90, "rtt_p99_us": p99,
            "drafted_per_round": drafted, "deadline_misses": stats.deadline_misses,
        }));
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "forward_us": args.forward_us, "k": args.k, "block": args.block, "lanes": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}
