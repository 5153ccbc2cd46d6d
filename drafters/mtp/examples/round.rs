//! The MTP drafter's per-round cost on a real target's parts, without the target: a session
//! opened on `--context` positions, then `--rounds` rounds of what a verify loop asks after a
//! round that accepted `--accepted` drafts (one `Commit` of `accepted + 1` rows with their
//! hiddens, one `Draft` of `--k`). The hiddens are random unit-RMS rows (the cost does not depend
//! on their values). Prints wall and CPU ms per round (the rounds only, not the load); run it under
//! `RAYON_NUM_THREADS=1` for one thread, A/B against another build.
//!
//! ```text
//! cargo run -p mtp --example round -- --k 2 --rounds 300 [--linear-dtype q8_0] [--draft-vocab shipped]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mtp::feed::{target_info, HostFeed};
use mtp::{LinearDType, MtpDrafter, Options, WeightsSource};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use specula_models::drafter_support::draft_vocab::VocabChoice;
use specula_models::drafter_support::TargetParts;
use specula_protocol::sdk::Drafter;

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (mut model, mut weights) = (
        root.join("models/cache/smollm2-135m.gguf"),
        root.join("drafters/weights/smollm2-135m/mtp"),
    );
    let (mut k, mut rounds, mut context, mut accepted) = (2usize, 200usize, 256usize, 1usize);
    let mut linear_dtype = LinearDType::Stored;
    let mut draft_vocab = VocabChoice::Full;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = val()?.into(),
            "--weights" => weights = val()?.into(),
            "--k" => k = val()?.parse()?,
            "--rounds" => rounds = val()?.parse()?,
            "--context" => context = val()?.parse()?,
            "--accepted" => accepted = val()?.parse()?,
            "--draft-vocab" => draft_vocab = val()?.parse().map_err(anyhow::Error::msg)?,
            "--linear-dtype" => {
                linear_dtype = match val()?.as_str() {
                    "stored" => LinearDType::Stored,
                    "q8_0" => LinearDType::Q8_0,
                    other => bail!("--linear-dtype {other}: stored or q8_0"),
                }
            }
            other => bail!("unknown argument {other}"),
        }
    }
    let parts = TargetParts::open(&model, &candle_core::Device::Cpu)?;
    let c = &parts.config;
    let target = target_info(c, &model, context + rounds * (accepted + 1) + 64);
    let mut d = MtpDrafter::new(
        WeightsSource::Path(weights),
        Options {
            max_draft: k,
            linear_dtype,
            draft_vocab,
            // Random hiddens give unsure drafts: every round drafts k here.
            min_confidence: 0.0,
        },
    )?;
    d.accept_target(&target).map_err(anyhow::Error::msg)?;
    let hidden = c.hidden_size;
    let mut rng = StdRng::seed_from_u64(1);
    let total = context + rounds * (accepted + 1) + 1;
    let ids: Vec<u32> = (0..total)
        .map(|_| rng.random_range(0..c.vocab_size as u32))
        .collect();
    let h: Vec<f32> = (0..total * hidden)
        .map(|_| rng.random::<f32>() * 3.4 - 1.7)
        .collect();
    let feed = HostFeed {
        seq: &ids,
        hiddens: &h,
        hidden,
    };
    feed.open(&mut d, 1, context);
    let (mut pos, mut drafted) = (context, 0);
    let (start, cpu0) = (Instant::now(), cpu_seconds());
    for _ in 0..rounds {
        let n = accepted + 1;
        feed.commit(&mut d, 1, pos, n);
        pos += n;
        drafted += d.draft(1, &[], k).tokens.len();
    }
    let ms = start.elapsed().as_secs_f64() * 1e3 / rounds as f64;
    let cpu = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) => format!("{:.3}", (b - a) * 1e3 / rounds as f64),
        _ => "?".into(),
    };
    println!(
        "k {k}, accepted {accepted}, context {context}: {ms:.3} ms wall, {cpu} ms CPU a round \
         ({drafted} drafts in {rounds} rounds)"
    );
    Ok(())
}

/// User + system CPU seconds of this process so far (Linux `/proc/self/stat`, 100 ticks a
/// second), so the load of the parts is not counted.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (u, s): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some((u + s) / 100.0)
}
