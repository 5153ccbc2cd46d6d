//! Measures the process-boundary cost: Draft → Drafted round trips through `DrafterClient` to a
//! real drafter process (default: `ngram`, found next to this binary), against a fake target.
//!
//! `drafter-rtt [ROUNDS] [DRAFTER]` prints p50/p90/p99/max of the round trip and of a whole
//! round (draft + commit).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use specula_models::sampling::SamplingParams;
use specula_protocol::wire::TargetInfo;
use specula_tests::proposers::draft;
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec};
use target_host::proposer::{Proposer, Verdict};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args
        .next()
        .map_or(Ok(2000), |s| s.parse())
        .context("ROUNDS")?;
    let drafter = args.next().unwrap_or_else(|| "ngram".to_string());
    let target = TargetInfo {
        architecture: "fake".into(),
        vocab_size: 151_936,
        hidden_size: 896,
        num_layers: 24,
        num_kv_heads: 2,
        head_dim: 64,
        tokenizer_fingerprint: "fake".into(),
        eos_ids: vec![0],
        weights_path: String::new(),
        context_len: 32768,
        ..TargetInfo::default()
    };
    let mut client =
        DrafterClient::start(DrafterSpec::new(drafter), target, ClientConfig::default())?;
    // A repetitive "document" so the n-gram drafter always finds a match and drafts 8 ids.
    let prompt: Vec<u32> = (0..2048u32).map(|i| 1000 + i % 97).collect();
    client.open(1, &prompt, &SamplingParams::default(), None);
    let mut next = 1000 + 2048 % 97;
    let mut whole = Vec::with_capacity(rounds);
    let mut drafted = 0;
    for _ in 0..rounds {
        let t0 = Instant::now();
        let draft = draft(&mut client, 1, 8);
        drafted += draft.tokens.len();
        let committed = [next];
        next = 1000 + (next - 1000 + 1) % 97;
        client.commit(
            1,
            &Verdict {
                drafted: draft.tokens.len(),
                accepted: 0,
                committed: &committed,
                taps: None,
            },
        );
        whole.push(t0.elapsed());
    }
    let stats = client.stats();
    let mut rtt: Vec<Duration> = stats
        .rtt_us
        .iter()
        .map(|&us| Duration::from_micros(us.into()))
        .collect();
    rtt.sort_unstable();
    whole.sort_unstable();
    for (name, d) in [("draft round trip", &rtt), ("draft + commit", &whole)] {
        println!(
            "{name:>16}: n={} p50={:?} p90={:?} p99={:?} max={:?}",
            d.len(),
            percentile(d, 0.5),
            percentile(d, 0.9),
            percentile(d, 0.99),
            d[d.len() - 1]
        );
    }
    println!(
        "drafted {drafted} ids in {rounds} rounds; deadline misses {}, discarded {}",
        stats.deadline_misses, stats.discarded
    );
    Ok(())
}
