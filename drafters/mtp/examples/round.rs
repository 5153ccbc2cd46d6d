//! The MTP drafter's per-round cost on a real target's parts, without the target: a session
//! opened on `--context` positions, then `--rounds` rounds of what a verify loop asks after a
//! round that accepted `--accepted` drafts (one `Commit` of `accepted + 1` rows with their
//! hiddens, one `Draft` of `--k`). The hiddens are random unit-RMS rows (the cost does not depend
//! on their values). Prints wall ms per round; for CPU time run it under
//! `RAYON_NUM_THREADS=1 /usr/bin/time -f %U` (or `perf record`), A/B against another build.
//!
//! ```text
//! cargo run -p mtp --example round -- --k 2 --rounds 300 [--linear-dtype q8_0]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mtp::feed::{target_info, HostFeed};
use mtp::{LinearDType, MtpDrafter, Options, WeightsSource};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
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
    let start = Instant::now();
    for _ in 0..rounds {
        let n = accepted + 1;
        feed.commit(&mut d, 1, pos, n);
        pos += n;
        drafted += d.draft(1, &[], k).tokens.len();
    }
    let ms = start.elapsed().as_secs_f64() * 1e3 / rounds as f64;
    println!(
        "k {k}, accepted {accepted}, context {context}: {ms:.3} ms wall a round \
         ({drafted} drafts in {rounds} rounds)"
    );
    Ok(())
}
