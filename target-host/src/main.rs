//! `target-host`: generate, tokenize, and serve with speculative decoding.

use std::io::Write;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use specula_models::chat::{ChatMessage, GenerationPrompt};
use specula_models::sampling::SamplingParams;
use specula_models::tokenizer::Special;
use target_host::engine::EngineConfig;
use target_host::generation::{generate, Flow, GenerationRequest, Speculation};
use target_host::grammar::{Constraint, Vocab};
use target_host::models::{load_model, ModelArgs};
use target_host::proposer::ProposerSlot;

#[derive(Parser)]
#[command(
    name = "target-host",
    version,
    about = "Specula: speculative decoding with out-of-process drafters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt and stream it to stdout.
    Generate(GenerateArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize {
        #[command(flatten)]
        model: ModelArgs,
        /// The text to tokenize.
        #[arg(long)]
        text: String,
    },
    /// Serve the OpenAI-compatible HTTP API.
    Serve(target_host::http::ServeArgs),
    /// Measure copy bandwidth, decode speed, the verify-window curve and the speculative
    /// loop's overhead; prints (or writes) a JSON report.
    Bench(target_host::bench::BenchArgs),
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Raw completion text.
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens below this fraction of the top token's probability.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise tokens already in the context (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed: the same text every run without speculation; with a drafter, the same
    /// distribution (which drafts are verified can vary with timing and changes the draws).
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    drafter: target_host::drafter_args::DrafterArgs,
    #[command(flatten)]
    engine: EngineConfig,
    /// Print one JSON object with the text, ids and stats instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Structured output: the text is JSON valid under the schema in this file (strict: a
    /// schema part that cannot be enforced is an error).
    #[arg(long, conflicts_with = "json_object")]
    json_schema: Option<std::path::PathBuf>,
    /// Structured output: the text is one JSON object.
    #[arg(long)]
    json_object: bool,
}

fn main() -> std::process::ExitCode {
    specula_models::alloc::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate_cmd(args),
        Command::Tokenize { model, text } => {
            let loaded = load_model(&model)?;
            let ids = loaded.tokenizer.encode(&text, Special::Parse)?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Command::Serve(args) => target_host::http::serve(args),
        Command::Bench(args) => {
            let report = target_host::bench::run(&args)?;
            let json = serde_json::to_string_pretty(&report)?;
            match &args.out {
                Some(path) => std::fs::write(path, json)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => println!("{json}"),
            }
            Ok(())
        }
    }
}

fn generate_cmd(args: GenerateArgs) -> Result<()> {
    let loaded = load_model(&args.model)?;
    let text = match (&args.prompt, &args.chat) {
        (Some(p), _) => p.clone(),
        (None, Some(c)) => {
            let template = loaded
                .chat_template
                .as_ref()
                .context("--chat: the model has no chat template (use --prompt)")?;
            template.render(
                &[ChatMessage::new("user", c.as_str())],
                GenerationPrompt::Add,
            )?
        }
        (None, None) => unreachable!("clap requires --prompt or --chat"),
    };
    let prompt_ids = loaded.tokenizer.encode(&text, Special::Parse)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let grammar = grammar_of(&args, &loaded.tokenizer)?;
    let (proposer, speculation) = args.drafter.start(&loaded)?;
    let slot = ProposerSlot::new(proposer);
    let req = GenerationRequest {
        session: 1,
        prompt_ids: prompt_ids.clone(),
        max_tokens: args.max_tokens,
        sampling,
        stop: Vec::new(),
        speculation,
        logprobs: None,
        grammar,
    };
    let config = EngineConfig {
        draft_deadline_cap: args.drafter.client_config().draft_deadline,
        ..args.engine.clone()
    };
    config.validate()?;
    let stdout = std::io::stdout();
    let json = args.json;
    let mut shown = 0;
    let mut sink = |ev: target_host::generation::TokenEvent<'_>| {
        if !json {
            let mut out = stdout.lock();
            // A closed stdout (e.g. `| head`) ends generation quietly.
            if out
                .write_all(ev.text.as_bytes())
                .and_then(|_| out.flush())
                .is_err()
            {
                return Flow::Cancel;
            }
            shown += ev.text.len();
        }
        Flow::Continue
    };
    let gen = generate(
        &loaded.model,
        &loaded.tokenizer,
        &slot,
        &config,
        &req,
        &mut sink,
    )?;
    if !json {
        print!("{}", &gen.text[shown.min(gen.text.len())..]);
    }
    // What reached the drafter: K/V bytes copied (0 with donor views) and block tables sent.
    let transfer = slot.lock().proposer().map(|p| p.transfer());
    if json {
        let out = serde_json::json!({
            "text": gen.text,
            "prompt_ids": prompt_ids,
            "token_ids": gen.token_ids,
            "finish_reason": gen.finish_reason,
            "stats": gen.stats,
            "transfer": transfer,
        });
        println!("{out}");
    } else {
        println!();
    }
    if !matches!(speculation, Speculation::Off) {
        let s = &gen.stats;
        tracing::info!(
            "drafted {} accepted {} ({:.1}%), {:.2} accepted/round, {:.1} tok/s",
            s.drafted,
            s.accepted,
            100.0 * s.acceptance_rate,
            s.mean_accepted_per_round,
            s.decode_tokens_per_s
        );
        if let Some(t) = transfer.filter(|t| t.rounds > 0) {
            tracing::info!(
                "K/V copied for the drafter: {:.0} B/round ({} rounds), donor tables {} B",
                t.kv_bytes_per_round(),
                t.rounds,
                t.donor_table_bytes
            );
        }
    }
    Ok(())
}

/// The grammar `--json-schema` or `--json-object` asks for.
fn grammar_of(
    args: &GenerateArgs,
    tokenizer: &specula_models::tokenizer::Tokenizer,
) -> Result<Option<Constraint>> {
    if args.json_schema.is_none() && !args.json_object {
        return Ok(None);
    }
    let vocab = Vocab::of(tokenizer)?;
    let Some(path) = &args.json_schema else {
        return Ok(Some(Constraint::json_object(&vocab)));
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let schema: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let c = Constraint::json_schema(&vocab, &schema, true)
        .with_context(|| format!("--json-schema {}", path.display()))?;
    Ok(Some(c))
}
