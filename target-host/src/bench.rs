//! `target-host bench`: the numbers that decide whether speculation pays on a device.
//!
//! One run measures, on the model `--model`/`--load-format random --config` names:
//!
//! | section | what | how |
//! |---|---|---|
//! | `copy` | device memory bandwidth | device-to-device copies of a large buffer, bytes read + written |
//! | `decode` | plain greedy decode tokens/s | [`generate`] without a drafter, after a `context`-token prompt |
//! | `verify` | forward time of a window of `w` tokens at `context` | forward + argmax copy, cache rolled back |
//! | `speculative` | the loop's own cost per round | [`generate`] with the drafter, `host_ms` and `draft_ms` against `forward_ms` |
//!
//! and the memory-bandwidth limit of decode: weight bytes read per token (every projection and
//! the lm_head, plus the KV cache at `context`) over the measured copy bandwidth. The report is
//! JSON (stdout or `--out`); `scripts/gpu-bench` turns it into a table.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::Args;
use serde::Serialize;
use specula_models::config::ModelConfig;
use specula_models::loader::LoadedModel;
use specula_models::sampling::SamplingParams;
use specula_models::{random, ForwardRequest, Model, Rows, WeightDType};

use crate::drafter_args::DrafterArgs;
use crate::engine::EngineConfig;
use crate::generation::{
    generate, Flow, Generation, GenerationRequest, GenerationStats, Speculation,
};
use crate::models::{load_model, LoadFormat, ModelArgs};
use crate::proposer::ProposerSlot;

/// Options of `target-host bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length before decode and verify measurements (positions in the cache).
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Tokens to decode in the plain and speculative runs.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Verify-window sizes to time (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub windows: Vec<usize>,
    /// Timed repetitions per verify window (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// MiB copied per bandwidth repetition (0 skips the copy measurement).
    #[arg(long, default_value_t = 2048)]
    pub copy_mib: usize,
    #[command(flatten)]
    pub drafter: DrafterArgs,
    /// Write the JSON report here instead of stdout.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Device-to-device copy bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct CopyBandwidth {
    /// Bytes read plus bytes written per copy.
    pub bytes_moved: u64,
    /// Median time of one copy.
    pub ms: f64,
    /// `bytes_moved / ms`, in GB/s (10^9).
    pub gb_per_s: f64,
}

/// Plain decode speed and its bandwidth limit.
#[derive(Debug, Clone, Serialize)]
pub struct Decode {
    /// Tokens per second after prefill.
    pub tokens_per_s: f64,
    /// Bytes of weights one decode step reads (projections + lm_head); known for dense
    /// weights (random, or `--dtype f32|f16|bf16`), not for quantized ones.
    pub weight_bytes_per_token: Option<u64>,
    /// Bytes of KV cache one decode step reads at `context`.
    pub kv_bytes_per_token: u64,
    /// `copy bandwidth / (weight + kv bytes per token)`, when the copy was measured.
    pub bandwidth_limit_tokens_per_s: Option<f64>,
    /// `tokens_per_s / bandwidth_limit_tokens_per_s`.
    pub fraction_of_limit: Option<f64>,
    /// The generation's own counters.
    pub stats: GenerationStats,
    /// Whether two plain runs generated the same ids.
    pub repeatable: bool,
    /// The ids generated (the speculative run must reproduce them).
    #[serde(skip)]
    pub token_ids: Vec<u32>,
}

/// One point of the verify-window curve.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyPoint {
    /// Tokens in the window.
    pub window: usize,
    /// Median forward time (argmax of every row copied back included).
    pub ms: f64,
    /// `ms / ms of the 1-token window`.
    pub relative_to_one: f64,
}

/// The speculative loop's overhead with an out-of-process drafter.
#[derive(Debug, Clone, Serialize)]
pub struct Speculative {
    /// The drafter, as given on the command line.
    pub drafter: String,
    /// Drafts per round asked for.
    pub num_draft_tokens: usize,
    /// Mean target forward per round, ms.
    pub forward_ms_per_round: f64,
    /// Mean time waiting for drafts (IPC + drafter) per round, ms.
    pub draft_ms_per_round: f64,
    /// Mean host time per round outside forward and draft (verify, sampling, rollback), ms.
    pub host_ms_per_round: f64,
    /// `(draft_ms + host_ms) / forward_ms`: the loop's overhead over the target forward.
    pub overhead_fraction: f64,
    /// `host_ms / forward_ms` alone.
    pub host_fraction: f64,
    /// Whether the speculative output equals plain decoding's, id for id (on a GPU it may
    /// differ after a near-tie: verify windows and single steps round differently there).
    pub matches_plain: bool,
    /// Ids equal to plain decoding's before the first difference.
    pub same_prefix: usize,
    /// Where the speculative output first differs from plain decoding's, if it does.
    pub divergence: Option<Divergence>,
    /// The generation's own counters.
    pub stats: GenerationStats,
}

/// The target's logits where a speculative run first chose another token than plain decoding:
/// a margin near rounding noise means a near-tie, not a bug.
#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    /// Index of the first differing generated token.
    pub index: usize,
    /// Plain decoding's token there.
    pub plain_id: u32,
    /// The speculative run's token there.
    pub speculative_id: u32,
    /// Logit of `plain_id` minus logit of `speculative_id`, recomputed by one prefill.
    pub margin: f32,
    /// Standard deviation of that logit row (the scale of the margin).
    pub logit_std: f32,
}

/// Everything one `bench` run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `--config` or `--model`.
    pub model: String,
    /// The device, as candle names it.
    pub device: String,
    /// Bytes per projection weight, when dense.
    pub weight_elem_bytes: Option<u64>,
    /// Cache positions before decode / verify.
    pub context: usize,
    /// Parameters of the model (embedding counted once when tied).
    pub parameters: u64,
    /// Copy bandwidth, unless `--copy-mib 0`.
    pub copy: Option<CopyBandwidth>,
    /// Plain decode.
    pub decode: Decode,
    /// The verify-window curve.
    pub verify: Vec<VerifyPoint>,
    /// The speculative loop, when a drafter was given.
    pub speculative: Option<Speculative>,
}

/// Runs every measurement and writes the report.
///
/// # Errors
/// A model that cannot be loaded, a drafter that cannot start, a failed forward.
pub fn run(args: &BenchArgs) -> Result<Report> {
    anyhow::ensure!(args.context >= 2, "--context must be at least 2");
    anyhow::ensure!(
        args.decode_tokens >= 2,
        "--decode-tokens must be at least 2"
    );
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    let loaded = load_model(&args.model)?;
    let model = &loaded.model;
    let device = model.device().clone();
    let cfg = model.config().clone();
    anyhow::ensure!(
        args.context + args.decode_tokens * 2 < model.context_len(),
        "--context plus twice --decode-tokens must fit the model's {} positions",
        model.context_len()
    );
    let elem = weight_elem_bytes(&args.model, &device);
    let copy = match args.copy_mib {
        0 => None,
        mib => Some(copy_bandwidth(&device, mib)?),
    };
    tracing::info!(?copy, "copy bandwidth");
    let decode = decode(&loaded, args, elem, copy.as_ref())?;
    tracing::info!(tokens_per_s = decode.tokens_per_s, "plain decode");
    let verify = verify_curve(model, args)?;
    let speculative = match args.drafter.drafter {
        Some(_) => Some(speculative(&loaded, args, &decode.token_ids)?),
        None => None,
    };
    Ok(Report {
        model: args
            .model
            .config
            .clone()
            .or(args.model.model.clone())
            .unwrap_or_default(),
        device: format!("{device:?}"),
        weight_elem_bytes: elem,
        context: args.context,
        parameters: parameters(&cfg),
        copy,
        decode,
        verify,
        speculative,
    })
}

/// A prompt of `n` ids: a pattern of 61 ids repeated, so that prompt-lookup drafters find
/// continuations (61 is prime: no shorter period).
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i % 61) * 7919 % vocab.max(1)) as u32)
        .collect()
}

fn greedy_request(args: &BenchArgs, vocab: usize, speculation: Speculation) -> GenerationRequest {
    GenerationRequest {
        session: 1,
        prompt_ids: prompt(args.context, vocab),
        max_tokens: args.decode_tokens,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        speculation,
        logprobs: None,
        grammar: None,
    }
}

fn run_generation(
    loaded: &LoadedModel,
    slot: &ProposerSlot,
    req: &GenerationRequest,
) -> Result<Generation> {
    generate(
        &loaded.model,
        &loaded.tokenizer,
        slot,
        &EngineConfig::default(),
        req,
        &mut |_| Flow::Continue,
    )
}

fn decode(
    loaded: &LoadedModel,
    args: &BenchArgs,
    elem: Option<u64>,
    copy: Option<&CopyBandwidth>,
) -> Result<Decode> {
    let cfg = loaded.model.config();
    let slot = ProposerSlot::new(None);
    let req = greedy_request(args, cfg.vocab_size, Speculation::Off);
    // The first run warms kernels and allocator caches up.
    let warm_up = run_generation(loaded, &slot, &req)?;
    let gen = run_generation(loaded, &slot, &req)?;
    let stats = gen.stats;
    let weight_bytes_per_token = elem.map(|e| projection_parameters(cfg) * e);
    // f32 K and V of every layer at `context` positions.
    let kv_bytes_per_token =
        (cfg.num_hidden_layers * 2 * cfg.kv_heads() * cfg.head_dim() * args.context * 4) as u64;
    let limit = copy
        .zip(weight_bytes_per_token)
        .map(|(c, w)| c.gb_per_s * 1e9 / (w + kv_bytes_per_token) as f64);
    Ok(Decode {
        tokens_per_s: stats.decode_tokens_per_s,
        weight_bytes_per_token,
        kv_bytes_per_token,
        bandwidth_limit_tokens_per_s: limit,
        fraction_of_limit: limit.map(|l| stats.decode_tokens_per_s / l),
        stats,
        repeatable: warm_up.token_ids == gen.token_ids,
        token_ids: gen.token_ids,
    })
}

fn verify_curve(model: &Model, args: &BenchArgs) -> Result<Vec<VerifyPoint>> {
    let vocab = model.config().vocab_size;
    let mut cache = model.new_cache();
    let ids = prompt(args.context + 64, vocab);
    model.prefill(&ids[..args.context], &mut cache, &ForwardRequest::default())?;
    let mut points: Vec<VerifyPoint> = Vec::new();
    for &w in &args.windows {
        anyhow::ensure!((1..=64).contains(&w), "--windows: {w} is not in 1..=64");
        let window = &ids[args.context..args.context + w];
        let req = ForwardRequest {
            logits: Rows::Last(w),
            ..ForwardRequest::default()
        };
        let mut times = Vec::with_capacity(args.reps);
        // Two untimed repetitions warm this shape's kernels up.
        for rep in 0..args.reps + 2 {
            let start = Instant::now();
            let out = model.forward(window, &mut cache, &req)?;
            let ids: Vec<u32> = out.logits.argmax(D::Minus1)?.to_vec1()?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            anyhow::ensure!(ids.len() == w, "window {w} gave {} rows", ids.len());
            cache.truncate(args.context)?;
            if rep >= 2 {
                times.push(ms);
            }
        }
        let ms = median(&mut times);
        let one = points.first().map_or(ms, |p| p.ms);
        points.push(VerifyPoint {
            window: w,
            ms,
            relative_to_one: ms / one,
        });
        tracing::info!(window = w, ms, "verify window");
    }
    Ok(points)
}

fn speculative(loaded: &LoadedModel, args: &BenchArgs, plain: &[u32]) -> Result<Speculative> {
    let (proposer, speculation) = args.drafter.start(loaded)?;
    let num_draft_tokens = match speculation {
        Speculation::On { num_draft_tokens } => num_draft_tokens,
        Speculation::Adaptive { max_draft_tokens } => max_draft_tokens,
        Speculation::Off => anyhow::bail!("the drafter did not start (see the log above)"),
    };
    let slot = ProposerSlot::new(proposer);
    let req = greedy_request(args, loaded.model.config().vocab_size, speculation);
    run_generation(loaded, &slot, &req)?;
    let gen = run_generation(loaded, &slot, &req)?;
    let stats = gen.stats;
    let same_prefix = plain
        .iter()
        .zip(&gen.token_ids)
        .take_while(|(a, b)| a == b)
        .count();
    let rounds = stats.target_forwards.max(1) as f64;
    Ok(Speculative {
        drafter: args.drafter.drafter.clone().unwrap_or_default(),
        num_draft_tokens,
        forward_ms_per_round: stats.forward_ms / rounds,
        draft_ms_per_round: stats.draft_ms / rounds,
        host_ms_per_round: stats.host_ms / rounds,
        overhead_fraction: (stats.draft_ms + stats.host_ms) / stats.forward_ms.max(1e-9),
        host_fraction: stats.host_ms / stats.forward_ms.max(1e-9),
        matches_plain: same_prefix == plain.len() && plain.len() == gen.token_ids.len(),
        same_prefix,
        divergence: match same_prefix < plain.len().min(gen.token_ids.len()) {
            true => Some(divergence(loaded, &req.prompt_ids, plain, &gen.token_ids)?),
            false => None,
        },
        stats,
    })
}

/// Recomputes the logit row before the first differing token with one prefill of the shared
/// prefix, and measures how far apart the two choices were.
fn divergence(
    loaded: &LoadedModel,
    prompt_ids: &[u32],
    plain: &[u32],
    spec: &[u32],
) -> Result<Divergence> {
    let index = plain.iter().zip(spec).take_while(|(a, b)| a == b).count();
    let mut ids = prompt_ids.to_vec();
    ids.extend_from_slice(&plain[..index]);
    let model = &loaded.model;
    let mut cache = model.new_cache();
    let row: Vec<f32> = model
        .prefill(&ids, &mut cache, &ForwardRequest::default())?
        .logits
        .squeeze(0)?
        .to_vec1()?;
    let (plain_id, speculative_id) = (plain[index], spec[index]);
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n;
    Ok(Divergence {
        index,
        plain_id,
        speculative_id,
        margin: row[plain_id as usize] - row[speculative_id as usize],
        logit_std: var.sqrt(),
    })
}

/// Median time of device-to-device copies of `mib` MiB (read + written bytes counted).
fn copy_bandwidth(device: &Device, mib: usize) -> Result<CopyBandwidth> {
    let n = mib * (1 << 20) / 4;
    let src = Tensor::zeros(n, DType::F32, device)?;
    device.synchronize()?;
    let mut times = Vec::new();
    for rep in 0..12 {
        let start = Instant::now();
        // A contiguous copy is the driver's device-to-device memcpy on CUDA (candle's strided
        // copy kernel, `slice_set`, reaches only about half of it).
        let dst = src.copy().context("device copy")?;
        device.synchronize()?;
        drop(dst);
        if rep >= 2 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let ms = median(&mut times);
    let bytes_moved = 2 * (n as u64) * 4;
    Ok(CopyBandwidth {
        bytes_moved,
        ms,
        gb_per_s: bytes_moved as f64 / (ms * 1e-3) / 1e9,
    })
}

/// Bytes per projection weight: random weights follow `specula_models::random::dtype` (bf16
/// on a GPU); checkpoints are known only when `--dtype` makes them dense.
fn weight_elem_bytes(model: &ModelArgs, device: &Device) -> Option<u64> {
    let dtype: WeightDType = model.dtype.parse().ok()?;
    match (model.load_format, dtype) {
        (LoadFormat::Random, d) => Some(random::dtype(d, device).size_in_bytes() as u64),
        (_, WeightDType::Native) => None,
        (_, WeightDType::F32) => Some(4),
        (_, WeightDType::F16 | WeightDType::Bf16) => Some(2),
    }
}

/// Weights a decode step reads: every projection of every layer and the lm_head.
fn projection_parameters(cfg: &ModelConfig) -> u64 {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (nh, kv) = (cfg.num_attention_heads, cfg.kv_heads());
    let attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h;
    let mlp = 3 * h * i;
    (cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * h) as u64
}

/// All parameters (norms and biases are too small to matter and are left out).
fn parameters(cfg: &ModelConfig) -> u64 {
    let embed = match cfg.tie_word_embeddings {
        true => 0,
        false => (cfg.vocab_size * cfg.hidden_size) as u64,
    };
    projection_parameters(cfg) + embed
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_models::random::preset;

    /// The parameter counts of the presets are those of the published models.
    #[test]
    fn preset_parameter_counts() {
        let q15 = parameters(&preset("qwen2.5-1.5b").unwrap());
        // Qwen2.5-1.5B: 1.54B parameters (biases and norms excluded here).
        assert!((1.52e9..1.56e9).contains(&(q15 as f64)), "{q15}");
        let q8 = parameters(&preset("qwen3-8b").unwrap());
        // Qwen3-8B: 8.2B parameters.
        assert!((8.1e9..8.3e9).contains(&(q8 as f64)), "{q8}");
    }

    /// The whole bench runs on the CPU on a tiny random model and reports consistent numbers.
    #[test]
    fn bench_runs_on_a_tiny_random_model() {
        let dir = std::env::temp_dir().join(format!("specula-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128,
        });
        let path = dir.join("config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let args = BenchArgs {
            model: ModelArgs {
                model: None,
                dtype: "native".into(),
                prefill_chunk: 512,
                device: "cpu".into(),
                load_format: LoadFormat::Random,
                config: Some(path.display().to_string()),
            },
            context: 16,
            decode_tokens: 8,
            windows: vec![1, 2, 4],
            reps: 2,
            copy_mib: 1,
            drafter: DrafterArgs::default(),
            out: None,
        };
        let report = run(&args).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let cfg = random::config(&path.display().to_string());
        assert!(cfg.is_err(), "the temp config is gone");
        assert_eq!(
            report.weight_elem_bytes,
            Some(4),
            "random weights are f32 on the CPU"
        );
        let d = &report.decode;
        assert_eq!(d.stats.generated_tokens, 8);
        assert!(d.tokens_per_s > 0.0);
        // 2 layers x (q 32x32 + k,v 2x16x32 + o 32x32 + mlp 3x32x64) + head 96x32, f32.
        let params = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64) + 96 * 32;
        assert_eq!(d.weight_bytes_per_token, Some(params * 4));
        assert_eq!(d.kv_bytes_per_token, 2 * 2 * 2 * 8 * 16 * 4);
        let limit = d.bandwidth_limit_tokens_per_s.unwrap();
        assert!((d.fraction_of_limit.unwrap() - d.tokens_per_s / limit).abs() < 1e-9);
        let windows: Vec<usize> = report.verify.iter().map(|v| v.window).collect();
        assert_eq!(windows, vec![1, 2, 4]);
        assert_eq!(report.verify[0].relative_to_one, 1.0);
        assert!(report.speculative.is_none());
    }

    #[test]
    fn prompt_repeats_with_period_61() {
        let p = prompt(200, 1000);
        assert_eq!(p[..61], p[61..122]);
        assert_ne!(p[0], p[1]);
    }
}
