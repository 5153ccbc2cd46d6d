//! Real weights on the CUDA step, checked and speculated (run on the GPU machine):
//!
//!   cuda-generate --model M.gguf [--check] [--drafter PATH]... [-k 4] [--max-tokens 128]
//!                 [--transport socket,doorbell] [--out report.json]
//!
//! 1. Loads the GGUF file (dequantized to bf16, `specula_cuda::checkpoint`) into the step.
//! 2. `--check`: the CPU f32 runtime (specula-models, the path `target-host` serves on the CPU)
//!    decodes each prompt greedily; the step runs the same tokens (teacher-forced, windows of
//!    16) and every decision row is compared: relative logit error, and argmax equality with
//!    every mismatch listed with the CPU's top-2 margin (a near-tie when under `--tie-margin`).
//! 3. Plain greedy decode on the step (one CUDA graph per window size): tokens/s.
//! 4. For each `--drafter`: the drafter process (the same client, handshake and protocol as
//!    `target-host`'s) drafts k tokens a round, the step verifies `[pending, d1..dk]` in one
//!    forward and the greedy law ([`target_host::verify::verify_greedy`]) commits; the output
//!    must equal plain decode token for token. Reports tokens/s, acceptance, rounds, the
//!    drafter's round trip and the host's time per round against the forward's, once per
//!    `--transport` (the socket, or the protocol 1.3 doorbell).
//!
//! Exits 1 when a speculative output differs from plain decode, or (with `--check`) when an
//! argmax mismatch is not a near-tie.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use specula_cuda::checkpoint::load_gguf;
use specula_cuda::reference::rel_err;
use specula_cuda::shape::MAX_ROWS;
use specula_cuda::{Gpu, Step};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use specula_models::{ForwardRequest, LoadOptions, WeightDType};
use target_host::drafter::{
    parse_transport, transport_name, ClientConfig, DrafterClient, DrafterSpec,
};
use target_host::drafter_args::target_info;
use target_host::proposer::{DraftAsk, DraftBatch, Proposer, TapRows, Verdict};
use target_host::verify::verify_greedy;

#[derive(Parser)]
struct Args {
    /// The GGUF checkpoint.
    #[arg(long)]
    model: PathBuf,
    /// Compare the step against the CPU f32 runtime first.
    #[arg(long)]
    check: bool,
    /// Tokens the check decodes per prompt (the CPU path is the slow part).
    #[arg(long, default_value_t = 48)]
    check_tokens: usize,
    /// A CPU top-1 − top-2 logit margin under which an argmax mismatch counts as a near-tie.
    #[arg(long, default_value_t = 0.25)]
    tie_margin: f32,
    /// Drafter executables to speculate with, each as `PATH` or `PATH:K` (its drafts per round;
    /// default `-k`). Repeatable; every `--drafter-arg` goes to each.
    #[arg(long)]
    drafter: Vec<String>,
    #[arg(long = "drafter-arg", allow_hyphen_values = true)]
    drafter_args: Vec<String>,
    /// How each drafter talks to the host: `socket`, `doorbell` or `doorbell:<µs of polling>`
    /// (protocol 1.3). Comma-separated: each drafter runs once per transport. The default polls
    /// through a whole forward of a small model (the host's CPU idles while the GPU works): on
    /// the H200 the round trip fell from 58 µs (socket) to 10 µs.
    #[arg(long, value_delimiter = ',', default_value = "doorbell:1000")]
    transport: Vec<String>,
    /// Drafts per round.
    #[arg(short = 'k', long, default_value_t = 4)]
    num_draft_tokens: usize,
    /// Most tokens generated per prompt (stops earlier at an end-of-sequence id).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// KV cache positions.
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// How many times each generation is timed (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Prompts as raw completions (no chat template): code to continue, code to repeat with an
/// edit (where n-gram drafting pays), and prose.
const PROMPTS: &[&str] = &[
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1]\n\n# The same class with type hints and docstrings:\nclass TypedStack:\n",
    "The history of the printing press begins in",
];

fn main() -> Result<()> {
    let args = Args::parse();
    let t = Instant::now();
    let (_, shape, host) = load_gguf(&args.model)?;
    shape.check()?;
    let gpu = Gpu::new(0).context("opening the GPU")?;
    let device = gpu.name();
    let weights = host.upload(&gpu)?;
    drop(host);
    let mut step = Step::new(gpu, shape.clone(), args.context, weights)?;
    for m in 1..=MAX_ROWS {
        step.capture(m)?;
    }
    let load_s = t.elapsed().as_secs_f64();
    println!(
        "{} on {device}: {} layers, hidden {}, vocab {}; loaded and captured in {load_s:.1} s",
        args.model.display(),
        shape.layers,
        shape.hidden,
        shape.vocab
    );
    let opts = LoadOptions {
        dtype: if args.check {
            WeightDType::F32
        } else {
            WeightDType::Native
        },
        ..LoadOptions::default()
    };
    let loaded = specula_models::load(&args.model, &opts).context("loading the CPU model")?;
    let tok = &loaded.tokenizer;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p, Special::Plain).map_err(anyhow::Error::from))
        .collect::<Result<_>>()?;
    let eos = tok.eos_ids().to_vec();
    let mut report = json!({"model": args.model.display().to_string(), "device": device,
        "k": args.num_draft_tokens, "max_tokens": args.max_tokens});
    let mut failed = false;

    if args.check {
        let mut rows = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let c = check(
                &mut step,
                &loaded.model,
                p,
                args.check_tokens,
                args.tie_margin,
            )?;
            println!(
                "check prompt {i}: {} rows, logit rel err median {:.4} max {:.4}; argmax equal {}/{}; \
                 near-ties {}; other mismatches {}",
                c.rows, c.err_median, c.err_max, c.equal, c.rows, c.near_ties.len(), c.bad.len()
            );
            for (pos, margin) in c.near_ties.iter().chain(&c.bad) {
                println!("  mismatch at row {pos}: CPU top-2 margin {margin:.4}");
            }
            failed |= !c.bad.is_empty();
            rows.push(
                json!({"prompt": i, "rows": c.rows, "err_median": c.err_median,
                "err_max": c.err_max, "argmax_equal": c.equal,
                "near_ties": c.near_ties, "mismatches": c.bad}),
            );
        }
        report["check"] = json!(rows);
    }

    let mut plain_out = Vec::new();
    let mut plain_stats = Vec::new();
    for p in &prompts {
        let mut runs = Vec::new();
        let mut out = Vec::new();
        for _ in 0..args.reps {
            let (o, r) = generate(&mut step, p, args.max_tokens, &eos, None)?;
            out = o;
            runs.push(r);
        }
        plain_stats.push(median_run(runs));
        plain_out.push(out);
    }
    let plain_tps = summary("plain", &plain_stats, &plain_out);
    let mut drafters = vec![json!({"drafter": "none", "tokens_per_s": plain_tps,
        "runs": plain_stats.iter().map(Run::to_json).collect::<Vec<_>>()})];
    let transports = args
        .transport
        .iter()
        .map(|t| parse_transport(t).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let runs = args
        .drafter
        .iter()
        .flat_map(|d| transports.iter().map(move |&t| (d, t)));
    for (d, spin) in runs {
        let (d, k) = match d.rsplit_once(':') {
            Some((p, k)) => (PathBuf::from(p), k.parse().context("--drafter PATH:K")?),
            None => (PathBuf::from(d), args.num_draft_tokens),
        };
        let spec = DrafterSpec::new(&d).with_args(args.drafter_args.iter().cloned());
        let info = target_info(&loaded.model, tok);
        let config = ClientConfig {
            doorbell_spin: spin,
            ..ClientConfig::default()
        };
        let mut client = DrafterClient::start(spec, info, config)
            .with_context(|| format!("starting drafter {}", d.display()))?;
        let transport = match client.doorbell() {
            true => transport_name(spin),
            false => "socket".to_string(),
        };
        // Taps reach the drafter through the host: copied out of the graph, downloaded after
        // each forward and written to the client's shared-memory ring.
        let wants = client.wants();
        if !wants.kv_layers.is_empty() {
            bail!(
                "{} reads the target's K/V: not served by the CUDA step yet",
                d.display()
            );
        }
        step.set_taps(&wants.tap_layers, wants.final_hidden)?;
        let mut stats = Vec::new();
        let mut outs = Vec::new();
        let mut equal = 0;
        for (i, p) in prompts.iter().enumerate() {
            let mut runs = Vec::new();
            let mut out = Vec::new();
            for _ in 0..args.reps {
                let spec = Spec {
                    proposer: &mut client,
                    k,
                };
                let (o, r) = generate(&mut step, p, args.max_tokens, &eos, Some(spec))?;
                if o != plain_out[i] {
                    let at = o
                        .iter()
                        .zip(&plain_out[i])
                        .take_while(|(a, b)| a == b)
                        .count();
                    println!(
                        "{}: prompt {i} differs from plain decode at token {at}",
                        d.display()
                    );
                    failed = true;
                }
                out = o;
                runs.push(r);
            }
            equal += usize::from(out == plain_out[i]);
            stats.push(median_run(runs));
            outs.push(out);
        }
        step.set_taps(&[], false)?;
        let name = d
            .file_name()
            .map_or("?".into(), |n| n.to_string_lossy().to_string());
        let name = format!("{name} k{k} {transport}");
        let tps = summary(&name, &stats, &outs);
        let s = client.stats();
        let mut rtt: Vec<u32> = s.rtt_us.iter().copied().collect();
        rtt.sort_unstable();
        let rtt_med = rtt.get(rtt.len() / 2).copied().unwrap_or(0);
        println!(
            "{name}: speed-up {:.2}x plain; greedy equal on {equal}/{} prompts; drafter round trip \
             median {rtt_med} us; deadline misses {}",
            tps / plain_tps,
            prompts.len(),
            s.deadline_misses
        );
        drafters.push(
            json!({"drafter": name, "k": k, "transport": transport, "tokens_per_s": tps, "speedup": tps / plain_tps,
            "greedy_equal_prompts": equal, "prompts": prompts.len(), "rtt_median_us": rtt_med,
            "deadline_misses": s.deadline_misses,
            "runs": stats.iter().map(Run::to_json).collect::<Vec<_>>()}),
        );
    }
    report["generation"] = json!(drafters);
    if let Some(path) = &args.out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if failed {
        bail!("a check failed (see above)");
    }
    Ok(())
}

/// What the check found over one prompt's decision rows.
struct Check {
    rows: usize,
    err_median: f64,
    err_max: f64,
    equal: usize,
    /// (row, CPU top-2 margin) of mismatches under the margin, and of the others.
    near_ties: Vec<(usize, f32)>,
    bad: Vec<(usize, f32)>,
}

/// The CPU runtime decodes `n` tokens greedily after `prompt`; the step runs the same tokens
/// and each of the `n` decision rows is compared.
fn check(
    step: &mut Step,
    model: &specula_models::Model,
    prompt: &[u32],
    n: usize,
    tie_margin: f32,
) -> Result<Check> {
    let vocab = step.shape().vocab;
    let mut cache = model.new_cache();
    let mut cpu_rows: Vec<Vec<f32>> = Vec::new();
    let mut tokens = prompt.to_vec();
    let mut feed = prompt.to_vec();
    for _ in 0..n {
        let out = model
            .forward(&feed, &mut cache, &ForwardRequest::default())
            .context("CPU forward")?;
        let row: Vec<f32> = out.logits.flatten_all()?.to_vec1()?;
        let next = argmax(&row);
        cpu_rows.push(row);
        tokens.push(next as u32);
        feed = vec![next as u32];
    }
    // The step over prompt + the CPU's tokens; rows prompt.len() - 1 .. are the decisions.
    let first = prompt.len() - 1;
    let mut gpu_rows: Vec<Vec<f32>> = Vec::new();
    let mut pos = 0;
    let upto = prompt.len() + n - 1;
    while pos < upto {
        let m = (upto - pos).min(MAX_ROWS);
        step.forward(&tokens[pos..pos + m], pos, true)?;
        let logits = step.logits(m)?;
        for r in 0..m {
            if pos + r >= first {
                gpu_rows.push(logits[r * vocab..(r + 1) * vocab].to_vec());
            }
        }
        pos += m;
    }
    let mut errs = Vec::new();
    let (mut equal, mut near_ties, mut bad) = (0, Vec::new(), Vec::new());
    for (i, (g, c)) in gpu_rows.iter().zip(&cpu_rows).enumerate() {
        errs.push(rel_err(g, c));
        if argmax(g) == argmax(c) {
            equal += 1;
            continue;
        }
        let mut sorted = c.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let margin = sorted[0] - sorted[1];
        match margin < tie_margin {
            true => near_ties.push((i, margin)),
            false => bad.push((i, margin)),
        }
    }
    let err_max = errs.iter().copied().fold(0.0, f64::max);
    errs.sort_by(f64::total_cmp);
    Ok(Check {
        rows: gpu_rows.len(),
        err_median: errs[errs.len() / 2],
        err_max,
        equal,
        near_ties,
        bad,
    })
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}

/// A drafter and its k.
struct Spec<'a> {
    proposer: &'a mut DrafterClient,
    k: usize,
}

/// The taps of the last forward's first `rows` rows, at position `pos`, when the drafter wants
/// any.
fn tap_rows(step: &Step, taps: bool, pos: usize, rows: usize) -> Result<Option<TapRows>> {
    if !taps {
        return Ok(None);
    }
    let t = step.taps(rows)?;
    Ok(Some(TapRows {
        pos,
        rows,
        layers: t.layers,
        final_hidden: t.final_hidden,
        ..TapRows::default()
    }))
}

/// One timed generation.
#[derive(Clone, Debug, Default)]
struct Run {
    tokens: usize,
    /// From the first decode forward to the last token (the prompt's prefill left out).
    decode_s: f64,
    prefill_s: f64,
    rounds: usize,
    drafted: usize,
    accepted: usize,
    /// Host time in the loop outside forwards and drafting (verify, bookkeeping, commit).
    host_s: f64,
    /// Waiting for drafts (the drafter's round trip).
    draft_s: f64,
    /// Step forwards of the decode phase (launch, graph, sync).
    forward_s: f64,
}

impl Run {
    fn tps(&self) -> f64 {
        self.tokens as f64 / self.decode_s.max(1e-9)
    }

    fn to_json(&self) -> serde_json::Value {
        json!({"tokens": self.tokens, "tokens_per_s": self.tps(), "decode_s": self.decode_s,
            "prefill_s": self.prefill_s, "rounds": self.rounds, "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted as f64 / self.drafted.max(1) as f64,
            "host_per_round_us": 1e6 * self.host_s / self.rounds.max(1) as f64,
            "draft_per_round_us": 1e6 * self.draft_s / self.rounds.max(1) as f64,
            "forward_per_round_us": 1e6 * self.forward_s / self.rounds.max(1) as f64})
    }
}

fn median_run(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.tps().total_cmp(&b.tps()));
    runs[runs.len() / 2].clone()
}

/// Prints one line of a configuration's runs and returns its tokens/s over all prompts.
fn summary(name: &str, runs: &[Run], outs: &[Vec<u32>]) -> f64 {
    let tokens: usize = runs.iter().map(|r| r.tokens).sum();
    let secs: f64 = runs.iter().map(|r| r.decode_s).sum();
    let (drafted, accepted, rounds) = runs.iter().fold((0, 0, 0), |a, r| {
        (a.0 + r.drafted, a.1 + r.accepted, a.2 + r.rounds)
    });
    let per_round = |f: fn(&Run) -> f64| 1e6 * runs.iter().map(f).sum::<f64>() / rounds as f64;
    let tps = tokens as f64 / secs;
    println!(
        "{name}: {tps:.1} tok/s over {tokens} tokens ({} prompts, lengths {:?}); {rounds} rounds, \
         acceptance {:.3}; per round: forward {:.0} us, drafter {:.0} us, host {:.1} us",
        runs.len(),
        outs.iter().map(Vec::len).collect::<Vec<_>>(),
        accepted as f64 / drafted.max(1) as f64,
        per_round(|r| r.forward_s),
        per_round(|r| r.draft_s),
        per_round(|r| r.host_s),
    );
    tps
}

/// Greedy generation of up to `max` tokens after `prompt` (stopping at an `eos` id), plain
/// or speculative. The KV cache holds every committed position but the pending last one;
/// a round runs `[pending, drafts..]` at the pending position and rejected drafts' K/V are
/// overwritten by the next round's rows.
fn generate(
    step: &mut Step,
    prompt: &[u32],
    max: usize,
    eos: &[u32],
    mut spec: Option<Spec<'_>>,
) -> Result<(Vec<u32>, Run)> {
    if prompt.is_empty() || prompt.len() + max + MAX_ROWS > step.max_ctx() {
        bail!(
            "a prompt of {} tokens and {max} new ones do not fit a cache of {}",
            prompt.len(),
            step.max_ctx()
        );
    }
    let session = 1;
    let mut run = Run::default();
    let t0 = Instant::now();
    let taps = spec
        .as_ref()
        .is_some_and(|s| !s.proposer.wants().is_empty());
    let mut prompt_taps: Option<TapRows> = None;
    let mut pos = 0;
    let mut next = 0;
    while pos < prompt.len() {
        let m = (prompt.len() - pos).min(MAX_ROWS);
        let ids = step.forward(&prompt[pos..pos + m], pos, true)?;
        next = ids[m - 1] as u32;
        match (&mut prompt_taps, tap_rows(step, taps, pos, m)?) {
            (Some(all), Some(t)) => all.extend(&t),
            (all, t) => *all = t,
        }
        pos += m;
    }
    let mut ctx = prompt.to_vec();
    ctx.push(next);
    let mut out = vec![next];
    if let Some(s) = spec.as_mut() {
        let sampling = SamplingParams::default();
        s.proposer
            .open(session, &ctx, &sampling, prompt_taps.as_ref());
    }
    run.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    while out.len() < max && !eos.contains(out.last().expect("one token")) {
        run.rounds += 1;
        let left = max - out.len();
        let drafts = match spec.as_mut() {
            Some(s) if s.k > 0 && left > 1 => {
                let t = Instant::now();
                let asks = [DraftAsk {
                    session,
                    n: s.k.min(left - 1),
                }];
                let batch = DraftBatch {
                    asks: &asks,
                    deadline: Duration::from_millis(200),
                };
                let d = s.proposer.draft(&batch).pop().unwrap_or_default().tokens;
                run.draft_s += t.elapsed().as_secs_f64();
                d
            }
            _ => Vec::new(),
        };
        let pending = ctx.len() - 1;
        let mut window = vec![ctx[pending]];
        window.extend(&drafts);
        let t = Instant::now();
        let ids: Vec<u32> = step
            .forward(&window, pending, true)?
            .iter()
            .map(|&i| i as u32)
            .collect();
        run.forward_s += t.elapsed().as_secs_f64();
        let th = Instant::now();
        let acc = verify_greedy(&ids, &drafts);
        let mut committed = drafts[..acc.accepted].to_vec();
        committed.push(acc.next);
        // Tokens after an end-of-sequence id or past `max` are not committed.
        if let Some(e) = committed.iter().position(|t| eos.contains(t)) {
            committed.truncate(e + 1);
        }
        committed.truncate(left);
        run.drafted += drafts.len();
        run.accepted += acc.accepted;
        if let Some(s) = spec.as_mut() {
            // Rows [pending, d1..d_accepted] produced the committed tokens.
            let t = tap_rows(step, taps, pending, committed.len())?;
            if drafts.is_empty() {
                s.proposer.advance(session, &committed, t.as_ref());
            } else {
                let verdict = Verdict {
                    drafted: drafts.len(),
                    accepted: acc.accepted.min(committed.len() - 1),
                    committed: &committed,
                    taps: t.as_ref(),
                };
                s.proposer.commit(session, &verdict);
            }
        }
        ctx.extend(&committed);
        out.extend(&committed);
        run.host_s += th.elapsed().as_secs_f64();
    }
    if let Some(s) = spec.as_mut() {
        s.proposer.close(session);
    }
    run.decode_s = t1.elapsed().as_secs_f64();
    // The first token came from the prefill; the decode phase made the rest.
    run.tokens = out.len() - 1;
    Ok((out, run))
}
