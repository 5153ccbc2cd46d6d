//! The `--drafter` command-line options shared by `generate` and `serve`.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use specula_models::layers::RopeStyle;
use specula_models::loader::LoadedModel;
use specula_models::tokenizer::Tokenizer;
use specula_models::Model;
use specula_protocol::shm::DType;
use specula_protocol::wire::{RopeLayout, TargetInfo};

use crate::drafter::{ClientConfig, DrafterClient, DrafterSpec, DEFAULT_DOORBELL_SPIN};

use crate::generation::Speculation;
use crate::proposer::Proposer;

/// Drafts per round when `--num-draft-tokens` is not given.
pub const DEFAULT_NUM_DRAFT_TOKENS: usize = 4;

/// Which drafter to run, and how.
#[derive(Args, Debug, Clone, Default)]
pub struct DrafterArgs {
    /// Drafter executable: a path, or a bare name (`ngram`) resolved next to `target-host`.
    #[arg(long)]
    pub drafter: Option<String>,
    /// An argument passed to the drafter (repeatable; use `--drafter-arg=--flag` for flags).
    #[arg(long = "drafter-arg", allow_hyphen_values = true)]
    pub drafter_args: Vec<String>,
    /// Most drafts per round (k); exactly k with `--fixed-draft`.
    #[arg(long, default_value_t = DEFAULT_NUM_DRAFT_TOKENS)]
    pub num_draft_tokens: usize,
    /// Always draft `--num-draft-tokens` per round and verify every draft the drafter sends
    /// (its confidences cut nothing), instead of letting the speculation controller choose
    /// each sequence's k in `0..=--num-draft-tokens` from the measured verify cost, draft
    /// latency and acceptance, and cut drafts whose confidences fall below the break-even
    /// reach of a verify row (`target_host::engine::controller`, the default).
    #[arg(long, conflicts_with = "adaptive_draft")]
    pub fixed_draft: bool,
    /// The controller chooses k (the default; kept so existing scripts keep working).
    #[arg(long)]
    pub adaptive_draft: bool,
    /// Decode without speculation even when a drafter is given.
    #[arg(long)]
    pub no_speculation: bool,
    /// How long the host waits for a drafter's reply before verifying without drafts.
    #[arg(long, default_value_t = 500)]
    pub draft_deadline_ms: u64,
    /// How long host and drafter poll the doorbell's shared-memory rings before they sleep on
    /// its futex, in µs (drafters speaking protocol ≥ 1.3). Longer polling shortens the round
    /// trip and holds a core meanwhile; 0 sleeps at once.
    #[arg(long, default_value_t = DEFAULT_DOORBELL_SPIN.as_micros() as u64)]
    pub doorbell_spin_us: u64,
    /// Keep every drafter message on the socket (no doorbell).
    #[arg(long)]
    pub no_doorbell: bool,
}

impl DrafterArgs {
    /// The speculation these options ask for when a drafter runs: controller-chosen (default)
    /// or fixed k.
    pub fn speculation(&self) -> Speculation {
        let k = self.num_draft_tokens.max(1);
        match self.fixed_draft {
            false => Speculation::Adaptive {
                max_draft_tokens: k,
            },
            true => Speculation::On {
                num_draft_tokens: k,
            },
        }
    }

    /// The client deadlines these options ask for.
    pub fn client_config(&self) -> ClientConfig {
        ClientConfig {
            draft_deadline: Duration::from_millis(self.draft_deadline_ms),
            doorbell_spin: match self.no_doorbell {
                true => None,
                false => Some(Duration::from_micros(self.doorbell_spin_us)),
            },
            ..ClientConfig::default()
        }
    }

    /// Spawns the drafter (when one is named and speculation is on) for the target `loaded`.
    ///
    /// # Errors
    /// The drafter cannot be found, started or handshaken with.
    pub fn start(&self, loaded: &LoadedModel) -> Result<(Option<Box<dyn Proposer>>, Speculation)> {
        let Some(path) = self.drafter.as_ref().filter(|_| !self.no_speculation) else {
            return Ok((None, Speculation::Off));
        };
        let spec = DrafterSpec::new(path).with_args(self.drafter_args.iter().cloned());
        let target = target_info(&loaded.model, &loaded.tokenizer);
        let client = match DrafterClient::start(spec, target, self.client_config()) {
            Ok(client) => client,
            Err(e) if e.is_handshake_failure() => {
                tracing::warn!("{e}; continuing without speculation");
                return Ok((None, Speculation::Off));
            }
            Err(e) => return Err(e).with_context(|| format!("starting drafter {path}")),
        };
        Ok((Some(Box::new(client)), self.speculation()))
    }
}

/// The layout the runtime rotates q/k in: GGUF llama files keep the converter's permuted rows
/// (interleaved pairs), HF files and GGUF qwen keep halves. K rows handed to drafters are in it.
fn rope_layout(model: &Model) -> RopeLayout {
    let gguf = model
        .weights_path()
        .extension()
        .is_some_and(|e| e == "gguf");
    let style = match gguf {
        true => specula_models::arch::llama::Switches::of(&model.config().model_type)
            .map(|s| s.gguf_rope),
        false => Some(RopeStyle::HalfSplit),
    };
    match style {
        Some(RopeStyle::Interleaved) => RopeLayout::Interleaved,
        // A loaded model always has a known architecture.
        Some(RopeStyle::HalfSplit) | None => RopeLayout::Halves,
    }
}

/// What a drafter learns about the target in the handshake.
pub fn target_info(model: &Model, tokenizer: &Tokenizer) -> TargetInfo {
    let config = model.config();
    TargetInfo {
        architecture: config.model_type.clone(),
        vocab_size: config.vocab_size as u32,
        hidden_size: config.hidden_size as u32,
        num_layers: config.num_hidden_layers as u32,
        num_kv_heads: config.kv_heads() as u32,
        head_dim: config.head_dim() as u32,
        tokenizer_fingerprint: tokenizer.fingerprint().to_string(),
        eos_ids: tokenizer.eos_ids().to_vec(),
        weights_path: model.weights_path().display().to_string(),
        context_len: model.context_len() as u32,
        rope_theta: Some(config.rope_theta as f32),
        rope_layout: Some(rope_layout(model)),
        rms_norm_eps: Some(config.rms_norm_eps as f32),
        tie_word_embeddings: Some(config.tie_word_embeddings),
        // The host writes taps as f32 (the runtime computes activations in f32).
        tap_dtype: Some(DType::F32),
    }
}
