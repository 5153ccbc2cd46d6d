//! `specula-bench`: the one command behind every speed claim Specula makes.
//!
//! It runs a workload file ([`workload`]) against the configurations of a suite ([`suite`]):
//! Specula plain, with the n-gram drafter out of process and in process, with the two-model
//! drafter, and peers (llama.cpp, mlx-lm, transformers) through `bench/peers/run_peer.py`.
//! Configurations alternate item by item so machine drift cancels; speed-ups are paired against
//! a baseline from the same run ([`stats`]). Output: `results.json`, `results.md`, and
//! `speedup.svg` under `bench-out/<time>/`; `--publish` also refreshes `bench/latest/` and the
//! generated section of `BENCHMARKS.md`.
//!
//! ```text
//! bench/run            # builds what it needs, runs bench/suites/default.json, publishes
//! bench/run --quick    # smoke run (bench/suites/quick.json), not published
//! ```

mod chart;
mod messages;
mod report;
mod results;
mod runner;
mod stats;
mod suite;
mod sysinfo;
mod worker;
mod workload;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::results::RunResults;
use crate::runner::Paths;
use crate::suite::Suite;

#[derive(Parser)]
#[command(about = "Specula's benchmark harness")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a suite and write results.json, results.md and speedup.svg.
    Run {
        /// The suite file (default: bench/suites/default.json).
        #[arg(long)]
        suite: Option<PathBuf>,
        /// Use the smoke-test suite, bench/suites/quick.json.
        #[arg(long, conflicts_with = "suite")]
        quick: bool,
        /// Output folder (default: bench-out/<UTC time>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Also copy the report and chart to bench/latest/ and rewrite BENCHMARKS.md's section.
        #[arg(long)]
        publish: bool,
    },
    /// Re-render results.md and speedup.svg from a results.json.
    Render {
        /// The results file.
        results: PathBuf,
        /// As for `run`.
        #[arg(long)]
        publish: bool,
    },
    /// Internal: serve a group's Specula configurations over stdin/stdout.
    #[command(hide = true)]
    Worker {
        /// The configurations, as a JSON list.
        #[arg(long)]
        configs: String,
        /// The target model file.
        #[arg(long)]
        model: PathBuf,
        /// Draft model files by name, as a JSON object.
        #[arg(long, default_value = "{}")]
        drafts: String,
        /// The items file.
        #[arg(long)]
        items: PathBuf,
    },
}

/// The repository this binary was built from: suites, workloads, models and peers live there.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Run {
            suite,
            quick,
            out,
            publish,
        } => {
            let root = repo_root();
            let name = if quick { "quick" } else { "default" };
            let suite_path =
                suite.unwrap_or_else(|| root.join(format!("bench/suites/{name}.json")));
            let suite = Suite::load(&suite_path)?;
            let started = sysinfo::utc_now();
            let out = out.unwrap_or_else(|| root.join("bench-out").join(started.replace(':', "")));
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            eprintln!("specula-bench: suite {} → {}", suite.name, out.display());
            let mut run = runner::run(
                &suite,
                &Paths {
                    root,
                    out: out.clone(),
                },
            )?;
            run.started = started;
            let json = out.join("results.json");
            std::fs::write(&json, serde_json::to_string_pretty(&run)?)?;
            write_outputs(&run, &out, publish)
        }
        Cmd::Render { results, publish } => {
            let text = std::fs::read_to_string(&results)
                .with_context(|| format!("reading {}", results.display()))?;
            let run: RunResults = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", results.display()))?;
            let out = results.parent().unwrap_or(Path::new(".")).to_path_buf();
            write_outputs(&run, &out, publish)
        }
        Cmd::Worker {
            configs,
            model,
            drafts,
            items,
        } => worker::run(&worker::WorkerArgs {
            configs: serde_json::from_str(&configs).context("--configs")?,
            model,
            drafts: serde_json::from_str(&drafts).context("--drafts")?,
            items,
        }),
    }
}

fn write_outputs(run: &RunResults, out: &Path, publish: bool) -> Result<()> {
    let md = report::render(run);
    std::fs::write(out.join("results.md"), &md)?;
    let svg = out.join("speedup.svg");
    let drawn = chart::draw(run, &svg)?;
    println!("{md}");
    eprintln!("wrote {}", out.display());
    if publish {
        let root = repo_root();
        let latest = root.join("bench/latest");
        std::fs::create_dir_all(&latest)?;
        std::fs::write(latest.join("results.md"), &md)?;
        let mut section = String::from("## Latest results (CPU)\n\n");
        if drawn {
            std::fs::copy(&svg, latest.join("speedup.svg"))?;
            section.push_str("![speed-up vs k](bench/latest/speedup.svg)\n\n");
        }
        section.push_str(&md);
        let doc_path = root.join("BENCHMARKS.md");
        let doc = std::fs::read_to_string(&doc_path).unwrap_or_default();
        std::fs::write(&doc_path, report::replace_section(&doc, &section)?)?;
        eprintln!(
            "published to {} and {}",
            latest.display(),
            doc_path.display()
        );
    }
    Ok(())
}
