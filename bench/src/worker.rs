//! `specula-bench worker`: a group's Specula configurations in one process. It loads the target
//! once (several copies of a 1.5B model would not fit beside the peers in 24 GB), starts each
//! configuration's drafter the way `target-host` does (or the n-gram logic in process), then
//! serves the [`crate::messages`] line protocol. Drafter processes keep their own peak RSS.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ngram::{NgramConfig, NgramDrafter};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::loader::LoadedModel;
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use target_host::drafter::{ClientConfig, DrafterClient, DrafterSpec, InProcess};
use target_host::drafter_args::target_info;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, GenerationRequest, Speculation};
use target_host::models::{load_model, ModelArgs};
use target_host::proposer::{Proposer, ProposerSlot, Shared};

use crate::messages::{Done, Ready, Reply, Request, Sample};
use crate::suite::{Config, Drafter, Placement};
use crate::sysinfo::peak_rss_kb;
use crate::workload::{self, Item};

/// Longest draft the in-process n-gram drafter offers (the `ngram` binary's default).
const NGRAM_MAX_DRAFT: u32 = 16;

/// What a worker is told on its command line.
#[derive(Debug, Clone)]
pub struct WorkerArgs {
    /// The configurations to serve (one target model, loaded once).
    pub configs: Vec<Config>,
    /// The target model file.
    pub model: PathBuf,
    /// Draft model files by the name configurations give (`draft_model`); a name missing here
    /// could not be resolved and its configurations are skipped.
    pub drafts: HashMap<String, PathBuf>,
    /// The items file (JSON lines, see [`crate::workload`]).
    pub items: PathBuf,
}

/// One configuration ready to run.
struct Served {
    config: Config,
    slot: ProposerSlot,
    client: Observed,
    /// Bytes of taps the host writes per committed position for this drafter.
    tap_row_bytes: usize,
}

/// Runs the worker until its input ends.
///
/// # Errors
/// The model cannot be loaded, or the harness went away. A drafter that cannot start only
/// skips its configuration.
pub fn run(args: &WorkerArgs) -> Result<()> {
    let started = Instant::now();
    let items = workload::load(&args.items)?;
    let loaded = load_model(&model_args(&args.model))?;
    let prompts = items
        .iter()
        .map(|item| prompt_ids(&loaded, item))
        .collect::<Result<Vec<_>>>()?;
    let mut out = std::io::stdout().lock();
    let mut served = Vec::new();
    for config in &args.configs {
        let draft = config
            .draft_model
            .as_ref()
            .map(|d| args.drafts.get(d).context(d.clone()));
        let proposer = match draft.transpose() {
            Ok(draft) => proposer(config, draft.map(PathBuf::as_path), &loaded),
            Err(name) => Err(anyhow::anyhow!(
                "draft model {name} was not found or could not be fetched"
            )),
        };
        let reply = match proposer {
            Ok((slot, client)) => {
                let tap_row_bytes = client.as_ref().map_or(0, |c| tap_row_bytes(c, &loaded));
                served.push(Some(Served {
                    config: config.clone(),
                    slot,
                    client,
                    tap_row_bytes,
                }));
                Reply::Ready(Ready {
                    engine: format!("specula {}", env!("CARGO_PKG_VERSION")),
                    load_s: started.elapsed().as_secs_f64(),
                })
            }
            Err(e) => {
                served.push(None);
                Reply::Skipped(format!("FAILED to start: {e:#}"))
            }
        };
        send(&mut out, &reply)?;
    }
    for (session, line) in std::io::stdin().lock().lines().enumerate() {
        let req: Request = serde_json::from_str(&line?).context("bad request from the harness")?;
        let found = (
            items.get(req.item),
            prompts.get(req.item),
            served.get(req.config),
        );
        let reply = match found {
            (Some(item), Some(ids), Some(Some(s))) => {
                let sampling = SamplingParams {
                    temperature: s.config.temperature.unwrap_or(item.temperature),
                    seed: Some(item.seed),
                    ..SamplingParams::default()
                };
                let gen = GenerationRequest {
                    session: session as u64 + 1,
                    prompt_ids: ids.clone(),
                    max_tokens: item.max_tokens,
                    sampling,
                    stop: vec![],
                    speculation: speculation(&s.config),
                    logprobs: None,
                    grammar: None,
                };
                match run_item(&loaded, &s.slot, &gen) {
                    Ok(mut sample) => {
                        // Every committed position's taps go to the drafter once (protocol
                        // README): the decode's share is one row per generated token.
                        sample.tap_bytes =
                            (s.tap_row_bytes > 0).then_some(s.tap_row_bytes * sample.tokens);
                        Reply::Sample(sample)
                    }
                    Err(e) => Reply::Error(format!("{e:#}")),
                }
            }
            _ => Reply::Error(format!(
                "no item {} for configuration {}",
                req.item, req.config
            )),
        };
        send(&mut out, &reply)?;
    }
    let per_config = served
        .iter()
        .map(|s| s.as_ref().map(drafter_done).unwrap_or_default())
        .collect();
    let done = Done {
        peak_rss_kb: peak_rss_kb(None),
        per_config,
        ..Done::default()
    };
    send(&mut out, &Reply::Done(done))
}

/// The drafter side of a configuration's final report: its process's peak RSS and round trips.
fn drafter_done(s: &Served) -> Done {
    let Some(client) = &s.client else {
        return Done::default();
    };
    let mut c = client.lock().unwrap_or_else(|e| e.into_inner());
    let stats = c.stats();
    let us = |p| stats.rtt_percentile(p).map(|d| d.as_secs_f64() * 1e6);
    Done {
        drafter_peak_rss_kb: c.pid().and_then(|pid| peak_rss_kb(Some(pid))),
        rtt_p50_us: us(0.5),
        rtt_p99_us: us(0.99),
        deadline_misses: Some(stats.deadline_misses),
        ..Done::default()
    }
}

/// Bytes of one position's taps (f32, as the host writes them) for the drafter's capabilities:
/// each tapped layer's and the final hidden row, and K and V rows of each K/V layer.
fn tap_row_bytes(client: &Arc<Mutex<DrafterClient>>, loaded: &LoadedModel) -> usize {
    let c = client.lock().unwrap_or_else(|e| e.into_inner());
    let caps = c.capabilities();
    let config = loaded.model.config();
    let hidden = caps.tap_layers.len() + usize::from(caps.final_hidden);
    let kv = 2 * caps.kv_layers.len() * config.kv_heads() * config.head_dim();
    4 * (hidden * config.hidden_size + kv)
}

/// `target-host`'s own defaults for `--model PATH`: parsing (rather than building the struct)
/// keeps the worker loading exactly what `target-host generate --model PATH` loads.
fn model_args(model: &Path) -> ModelArgs {
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        model: ModelArgs,
    }
    let wrapper: Wrapper =
        clap::Parser::parse_from(["worker".as_ref(), "--model".as_ref(), model.as_os_str()]);
    wrapper.model
}

fn send(out: &mut impl Write, reply: &Reply) -> Result<()> {
    writeln!(out, "{}", serde_json::to_string(reply)?)?;
    out.flush().context("writing to the harness")
}

/// The item's prompt in the target's tokens: chat messages through the model's template.
fn prompt_ids(loaded: &LoadedModel, item: &Item) -> Result<Vec<u32>> {
    if let Some(messages) = &item.messages {
        let template = loaded
            .chat_template
            .as_ref()
            .context("the model has no chat template for a chat item")?;
        let messages: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(&m.role, &m.content))
            .collect();
        let text = template.render(&messages, GenerationPrompt::Add)?;
        Ok(loaded.tokenizer.encode(&text, Special::Parse)?)
    } else {
        let prompt = item.prompt.as_deref().unwrap_or_default();
        Ok(loaded.tokenizer.encode(prompt, Special::Plain)?)
    }
}

fn speculation(config: &Config) -> Speculation {
    match config.k {
        Some(k) if config.speculates() && config.controller => Speculation::Adaptive {
            max_draft_tokens: k,
        },
        Some(k) if config.speculates() => Speculation::On {
            num_draft_tokens: k,
        },
        _ => Speculation::Off,
    }
}

type Observed = Option<Arc<Mutex<DrafterClient>>>;

/// The proposer slot for `config`, plus a handle on the drafter client to read its counters.
fn proposer(
    config: &Config,
    draft_model: Option<&Path>,
    loaded: &LoadedModel,
) -> Result<(ProposerSlot, Observed)> {
    let spec = match (config.drafter, config.placement) {
        (Drafter::None, _) => return Ok((ProposerSlot::new(None), None)),
        (Drafter::Ngram, Placement::InProcess) => {
            let drafter = NgramDrafter::new(NgramConfig::default(), NGRAM_MAX_DRAFT);
            let proposer: Box<dyn Proposer> = Box::new(InProcess::new(drafter));
            return Ok((ProposerSlot::new(Some(proposer)), None));
        }
        (Drafter::Ngram, Placement::Process) => DrafterSpec::new("ngram"),
        (Drafter::TwoModel, _) => {
            let path = draft_model.context("two-model needs a draft model")?;
            DrafterSpec::new("two-model").with_args(["--model".to_string(), arg(path)])
        }
        (Drafter::Dflash, _) => DrafterSpec::new("dflash").with_args(["--kind=dflash"]),
        (Drafter::Dspark, _) => DrafterSpec::new("dflash").with_args(["--kind=dspark"]),
        (Drafter::Mtp, _) => DrafterSpec::new("mtp"),
        (Drafter::Assistant, _) => DrafterSpec::new("assistant"),
        (other, _) => anyhow::bail!("Specula has no drafter {other:?}"),
    };
    // A generous deadline: a slow draft must show up as drafter latency, not as lost drafts.
    let client_config = ClientConfig {
        draft_deadline: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    let spec = spec.with_args(config.drafter_args.iter().cloned());
    let name = spec.path.display().to_string();
    let client = DrafterClient::start(
        spec,
        target_info(&loaded.model, &loaded.tokenizer),
        client_config,
    )
    .with_context(|| {
        format!("starting drafter {name} (built with `cargo build --release -p {name}`?)")
    })?;
    let (shared, handle) = Shared::new(client);
    Ok((ProposerSlot::new(Some(Box::new(shared))), Some(handle)))
}

fn arg(path: &Path) -> String {
    path.display().to_string()
}

/// One generation, timed: the clock for time to first token starts before prefill.
fn run_item(loaded: &LoadedModel, slot: &ProposerSlot, req: &GenerationRequest) -> Result<Sample> {
    let start = Instant::now();
    let mut first: Option<Duration> = None;
    let config = EngineConfig::default();
    let gen = generate(
        &loaded.model,
        &loaded.tokenizer,
        slot,
        &config,
        req,
        &mut |_| {
            first.get_or_insert_with(|| start.elapsed());
            Flow::Continue
        },
    )?;
    let s = &gen.stats;
    let speculating = !matches!(req.speculation, Speculation::Off);
    Ok(Sample {
        prompt_tokens: s.prompt_tokens,
        tokens: s.generated_tokens,
        decode_s: s.decode_ms / 1e3,
        ttft_s: first.unwrap_or_default().as_secs_f64(),
        drafted: speculating.then_some(s.drafted),
        accepted: speculating.then_some(s.accepted),
        rounds: speculating.then_some(s.rounds),
        target_forwards: Some(s.target_forwards),
        draft_s: speculating.then_some(s.draft_ms / 1e3),
        tap_bytes: None,
        token_ids: gen.token_ids,
    })
}
