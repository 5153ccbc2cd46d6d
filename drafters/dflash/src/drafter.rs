//! [`DFlash`]: a loaded DFlash or DSpark drafter with its sessions, behind the SDK's
//! [`Drafter`] trait.
//!
//! Per session it keeps the context K/V of every accepted position it got taps for (the prompt
//! at `Open`, then `accepted + 1` rows per `Commit` and one row per id of an `Advance`: rejected
//! tips never enter), the pending id (the anchor of the next block) and its position. A
//! `Draft` runs one backbone forward for the blocks of all its rows. Drafts without a confidence
//! head get calibrated confidences ([`crate::calibration`]) from what the target accepted in
//! the same session: each `Open` starts a fresh calibration, so a request's drafts never depend
//! on the requests before it. The host decides the cut from them; the drafter cuts only at an
//! explicit `--confidence-threshold` (off by default).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use specula_models::drafter_support::{value_digest, TargetParts};
use specula_models::layers::{Embedding, Linear, Rope, RopeStyle};
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk, Drafter, DrafterInfo, OpenArgs, Proposal, Taps,
};
use specula_protocol::wire::{Capabilities, PrefillMode, SamplingSpec, SessionId, TargetInfo};
use tracing::{debug, info, warn};

use crate::calibration::{probability_of, Calibration};
use crate::config::{DraftConfig, Kind};
use crate::device::{self, DeviceBackbone, DeviceChoice, DeviceContext};
use crate::heads::Heads;
use crate::model::{argmax_rows, Backbone, BlockAsk, Context};
use crate::sampling::{probs, sample};
use crate::tensors::{LinearDType, Tensors};
use crate::vocab::{self, VocabChoice};
use crate::weights::WeightsSource;
use crate::Error;

fn err(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}

/// Mixed into the request seed for the drafter's own sampling stream.
const DRAFT_SEED_SALT: u64 = 0xdf1a_5eed_0d5e_ed00;

/// Where one reference tap id comes from in Specula's taps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `Capabilities::tap_layers[i]`.
    Layer(usize),
    /// The post-final-norm hidden (HF `hidden_states[num_layers]`, a reference id of
    /// `num_layers − 1`).
    Final,
    /// The embedding output (DeepSpec id `−1`), looked up from the row's token.
    Embedding,
}

/// How the drafter runs (command-line options).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Shorter block than the checkpoint's (`--block-size`).
    pub block_size: Option<usize>,
    /// DSpark: cut the block at the first slot whose confidence is below this (0: never).
    pub confidence_threshold: f32,
    /// How the drafter's own projections are stored (`--linear-dtype`).
    pub linear_dtype: LinearDType,
    /// The ids drafts are computed over (`--draft-vocab`; [`crate::vocab`]).
    pub draft_vocab: VocabChoice,
    /// Where the forward runs (`--device`; [`crate::device`]).
    pub device: DeviceChoice,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            block_size: None,
            confidence_threshold: 0.0,
            linear_dtype: LinearDType::Stored,
            draft_vocab: VocabChoice::Full,
            device: DeviceChoice::Host,
        }
    }
}

/// The target's parts the drafter uses, or its own copies (DSpark checkpoints carry frozen
/// copies; they are used only when they differ from the target's).
struct Io {
    embedding: Embedding,
    /// The draft head: the lm_head's rows of the draft vocabulary (all rows without one).
    lm_head: Linear,
    /// Draft-head row → vocabulary id, with a draft vocabulary.
    d2t: Option<Vec<u32>>,
}

/// A loaded drafter: weights plus everything fixed for one target.
struct Loaded {
    config: DraftConfig,
    backbone: Backbone,
    heads: Option<Heads>,
    io: Io,
    /// `[B − 1, hidden]`: the block's MASK slots, embedded (the target's row or
    /// `mask_embedding`) and scaled once at load: every round reuses them.
    masks: Tensor,
    block: usize,
    sources: Vec<Source>,
    caps: Capabilities,
    max_pos: usize,
    threshold: f32,
    /// The device path's backbone (`--device` other than cpu): then `io.lm_head` and `heads`
    /// live on that device too.
    dev: Option<DeviceBackbone>,
}

/// One session's state.
struct Session {
    context: Context,
    /// The context on the device (the device path; `context` stays empty).
    dev: Option<DeviceContext>,
    /// The pending id: the next block's anchor.
    anchor: u32,
    /// Its absolute position.
    pos: usize,
    sampling: SamplingSpec,
    rng: StdRng,
    /// Positions whose taps never came (torn, missing): the context has holes there.
    missing: usize,
    /// Taps of the last window were torn or missing: the rows nearest the anchor are holes, so
    /// the next round drafts nothing (the host runs a plain step) while the context resyncs.
    resync: bool,
    /// Calibration features of the last proposal's drafts (no confidence head), until its
    /// `Commit` says how they fared.
    features: Vec<f32>,
    /// This session's acceptance per confidence feature (drafts without a confidence head):
    /// fresh at every `Open`.
    calibration: Calibration,
}

/// One block's drafts, before the SDK caps them.
#[derive(Debug, Clone)]
pub struct Block {
    /// The drafted ids.
    pub tokens: Vec<u32>,
    /// Their logits `[tokens, draft vocab]`: over the whole vocabulary, or the draft
    /// vocabulary's ids in its order (DSpark: after the Markov correction).
    pub logits: Tensor,
    /// Per drafted id: DSpark's `σ(c_k)`, or without a confidence head the calibrated
    /// probability that it is accepted ([`crate::calibration`]).
    pub confidence: Option<Vec<f32>>,
    /// Without a confidence head: each draft's calibration feature (its probability under the
    /// distribution it was drafted from).
    pub features: Vec<f32>,
    /// `q` rows when sampled.
    pub q: Option<Vec<Vec<f32>>>,
}

/// The DFlash / DSpark drafter.
pub struct DFlash {
    source: WeightsSource,
    options: Options,
    device: Device,
    loaded: Option<Loaded>,
    /// Capabilities known before the target (a `--weights` config), for the Hello.
    early_caps: Option<Capabilities>,
    sessions: HashMap<SessionId, Session>,
    /// Phase times (`DFLASH_PROFILE=1`), logged to stderr every 100 drafting rounds.
    profile: Option<Profile>,
}

/// Accumulated phase times of the drafting rounds, in µs.
#[derive(Debug, Default)]
struct Profile {
    rounds: u64,
    /// Embedding the blocks and the backbone forward (on a device: issuing its ops).
    forward: f64,
    /// The heads and the read-back of the drafts (on a device: waits for the forward).
    block: f64,
    extends: u64,
    /// Appending committed rows to the context (taps to features, upload, K/V).
    extend: f64,
}

impl Profile {
    fn log(&self) {
        let per = |t: f64, n: u64| t / n.max(1) as f64;
        eprintln!(
            "dflash profile: {} rounds: forward {:.0} us, heads+read-back {:.0} us; {} extends: {:.0} us each",
            self.rounds,
            per(self.forward, self.rounds),
            per(self.block, self.rounds),
            self.extends,
            per(self.extend, self.extends)
        );
    }
}

impl DFlash {
    /// A drafter that will load its weights from `source` once it knows the target.
    ///
    /// # Errors
    /// [`Error::Config`] when an explicit weights path has a bad config (found before the
    /// host is even contacted).
    pub fn new(source: WeightsSource, options: Options) -> Result<Self, Error> {
        let early_caps = match &source {
            WeightsSource::Path(dir) => {
                let config = DraftConfig::from_file(&dir.join("config.json"))?;
                let block = block_size(&config, &options)?;
                Some(plan(&config, config.num_target_layers, block).1)
            }
            WeightsSource::Shipped { .. } => None,
        };
        Ok(DFlash {
            source,
            options,
            device: Device::Cpu,
            loaded: None,
            early_caps,
            sessions: HashMap::new(),
            profile: std::env::var_os("DFLASH_PROFILE").map(|_| Profile::default()),
        })
    }

    /// Loads the weights for `target` (done by [`Drafter::accept_target`]).
    ///
    /// # Errors
    /// Every reason this drafter cannot serve the target, as text for the host.
    pub fn load(&mut self, target: &TargetInfo) -> Result<(), Error> {
        let dir = self.source.resolve(target)?;
        let config = DraftConfig::from_file(&dir.join("config.json"))?;
        check_target(&config, target)?;
        let device = self.options.device.open()?;
        // The device path reads f32 projections (the checkpoint's values) and moves them.
        let linears = match device {
            Some(_) => LinearDType::F32,
            None => self.options.linear_dtype,
        };
        let tensors =
            Tensors::read(&dir.join("model.safetensors"), &self.device)?.with_linears(linears);
        let parts = TargetParts::open(target.weights_path.as_ref(), &self.device)
            .map_err(|e| Error::Target(format!("cannot read the target's weights: {e}")))?;
        let tied = parts.config.tie_word_embeddings;
        let block = block_size(&config, &self.options)?;
        let (sources, caps) = plan(&config, target.num_layers as usize, block);
        let max_pos = target.context_len as usize + block + 1;
        let backbone = Backbone::load(&config, &tensors, max_pos)?;
        let d2t = vocab::resolve(&dir, self.options.draft_vocab, config.vocab_size)?;
        let heads = match &config.dspark {
            Some(h) => Some(Heads::load(
                h,
                &tensors,
                config.hidden_size,
                config.vocab_size,
                d2t.as_deref(),
            )?),
            None => None,
        };
        let mut io = io_parts(&config, &tensors, parts, d2t)?;
        let mask_row = match config.mask_token_id {
            Some(id) => io
                .embedding
                .forward(&[id])
                .map_err(|e| Error::Target(format!("mask_token_id {id}: {e}")))?,
            None => tensors
                .get("mask_embedding", &[config.hidden_size])?
                .reshape((1, config.hidden_size))
                .map_err(err)?,
        };
        let masks = (mask_row.repeat((block - 1, 1)).map_err(err)? * config.input_embedding_scale)
            .map_err(err)?;
        let (dev, heads) = match &device {
            None => (None, heads),
            Some(d) => {
                let rope = Rope::new(
                    config.head_dim,
                    max_pos,
                    config.rope_theta,
                    RopeStyle::HalfSplit,
                )
                .map_err(err)?;
                let dev = DeviceBackbone::load(&config, &tensors, &rope, max_pos, d)?;
                io.lm_head = Linear::dense(device_head(&io, tied, d)?, None).map_err(err)?;
                let heads = heads.map(|h| h.to_device(d)).transpose()?;
                let t = std::time::Instant::now();
                let h = dev.warm_up(block)?;
                let logits = io.lm_head.forward(&h).map_err(err)?;
                device::greedy(&logits)?;
                info!(ms = t.elapsed().as_millis() as u64, "device path warmed up");
                (Some(dev), heads)
            }
        };
        info!(
            kind = ?config.kind,
            weights = %dir.display(),
            block,
            taps = ?config.target_layer_ids,
            draft_vocab = io.d2t.as_ref().map_or(config.vocab_size, Vec::len),
            "drafter loaded"
        );
        self.loaded = Some(Loaded {
            config,
            backbone,
            heads,
            io,
            masks,
            block,
            sources,
            caps,
            max_pos,
            threshold: self.options.confidence_threshold,
            dev,
        });
        Ok(())
    }

    /// Drafts for every ask in one backbone forward. Sessions that are not open, or whose block
    /// would run past the context, get an empty block.
    ///
    /// # Errors
    /// [`Error::Forward`] when the forward fails (a bug or bad weights, not a bad request).
    pub fn blocks(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Option<Block>>, Error> {
        let Some(m) = &self.loaded else {
            return Ok(asks.iter().map(|_| None).collect());
        };
        for ask in asks {
            if let Some(s) = self.sessions.get_mut(&ask.session) {
                s.extend_untapped(ask.new_tokens);
            }
        }
        let t0 = std::time::Instant::now();
        let scale = m.config.input_embedding_scale;
        let mut inputs = Vec::new();
        let mut which = Vec::new();
        for (i, ask) in asks.iter().enumerate() {
            let Some(s) = self.sessions.get(&ask.session) else {
                continue;
            };
            if ask.n == 0 || s.pos + m.block > m.max_pos || s.rows() == 0 || s.resync {
                continue;
            }
            let anchor =
                (m.io.embedding.forward(&[s.anchor]).map_err(err)? * scale).map_err(err)?;
            let embeddings = Tensor::cat(&[&anchor, &m.masks], 0).map_err(err)?;
            inputs.push(BlockAsk {
                context: &s.context,
                embeddings,
                pos: s.pos,
            });
            which.push(i);
        }
        let hidden = match &m.dev {
            None => m.backbone.forward(&inputs)?,
            Some(dev) => {
                let mut hidden = Vec::with_capacity(inputs.len());
                for (input, &i) in inputs.iter().zip(&which) {
                    let s = &self.sessions[&asks[i].session];
                    let ctx = s.dev.as_ref().expect("invariant: device sessions have one");
                    hidden.push(dev.forward(ctx, &input.embeddings, input.pos)?);
                }
                hidden
            }
        };
        drop(inputs);
        let t1 = std::time::Instant::now();
        for ask in asks {
            if let Some(s) = self.sessions.get_mut(&ask.session) {
                // One skipped round per hole: later windows land on a context that has them.
                s.resync = false;
            }
        }
        let mut out: Vec<Option<Block>> = asks.iter().map(|_| None).collect();
        let hidden_empty = hidden.is_empty();
        for (h, i) in hidden.into_iter().zip(which) {
            let ask = &asks[i];
            let s = self
                .sessions
                .get_mut(&ask.session)
                .expect("invariant: asked sessions are open");
            let calibration = s.calibration.clone();
            let block = m.block(&h, s, ask.n, &calibration)?;
            s.features.clone_from(&block.features);
            debug!(session = ask.session, pos = s.pos, tokens = ?block.tokens, confidence = ?block.confidence, "draft");
            out[i] = Some(block);
        }
        if let (Some(p), false) = (&mut self.profile, hidden_empty) {
            p.rounds += 1;
            p.forward += (t1 - t0).as_secs_f64() * 1e6;
            p.block += t1.elapsed().as_secs_f64() * 1e6;
            if p.rounds % 100 == 0 {
                p.log();
            }
        }
        Ok(out)
    }

    /// Appends the rows of a tap window to a session's context: `row_ids` are the tokens at
    /// those positions (needed for a DSpark `−1` tap). Missing or bad taps leave a hole.
    fn take_taps(
        &mut self,
        session: SessionId,
        taps: Option<&Taps<'_>>,
        row_ids: &[u32],
        pos: usize,
    ) {
        let (Some(m), Some(s)) = (&self.loaded, self.sessions.get_mut(&session)) else {
            return;
        };
        let rows = row_ids.len();
        if rows == 0 {
            return;
        }
        let t0 = std::time::Instant::now();
        let features = match taps {
            None => Err("no taps".to_string()),
            Some(t) if t.pos as usize != pos => {
                Err(format!("taps start at position {}, expected {pos}", t.pos))
            }
            Some(t) => m.features(t, row_ids),
        };
        let result = features.and_then(|f| {
            match (&m.dev, &mut s.dev) {
                (Some(dev), Some(ctx)) => dev.extend(ctx, &f, pos),
                _ => m.backbone.extend(&mut s.context, &f, pos),
            }
            .map_err(|e| e.to_string())
        });
        if let Some(p) = &mut self.profile {
            p.extends += 1;
            p.extend += t0.elapsed().as_secs_f64() * 1e6;
        }
        if let Err(reason) = result {
            warn!(
                session,
                rows, pos, reason, "taps unusable: context rows left out, next round skipped"
            );
            s.missing += rows;
            s.resync = true;
        }
    }

    /// The capabilities to serve `target` with (after [`DFlash::load`]).
    pub fn capabilities_for_target(&self) -> Option<&Capabilities> {
        self.loaded.as_ref().map(|m| &m.caps)
    }

    /// Context rows cached for `session` and positions missing from it.
    pub fn context_rows(&self, session: SessionId) -> Option<(usize, usize)> {
        self.sessions.get(&session).map(|s| (s.rows(), s.missing))
    }
}

/// The block size to run: the checkpoint's, or shorter (`--block-size`).
fn block_size(config: &DraftConfig, options: &Options) -> Result<usize, Error> {
    let min = match config.kind {
        Kind::DFlash => 2,
        Kind::DSpark => 1,
    };
    match options.block_size {
        None => Ok(config.block_size),
        Some(b) if (min..=config.block_size).contains(&b) => Ok(b),
        Some(b) => Err(Error::Options(format!(
            "--block-size {b} must be in {min}..={} (the checkpoint's block size)",
            config.block_size
        ))),
    }
}

/// Where each reference tap id comes from, and the capabilities that ask for them.
fn plan(config: &DraftConfig, target_layers: usize, block: usize) -> (Vec<Source>, Capabilities) {
    let last = target_layers as i64 - 1;
    let mut tap_layers: Vec<u32> = config
        .target_layer_ids
        .iter()
        .filter(|&&id| id >= 0 && id < last)
        .map(|&id| id as u32)
        .collect();
    tap_layers.dedup();
    let sources = config
        .target_layer_ids
        .iter()
        .map(|&id| match id {
            -1 => Source::Embedding,
            id if id == last => Source::Final,
            id => Source::Layer(
                tap_layers
                    .iter()
                    .position(|&l| i64::from(l) == id)
                    .expect("invariant: every inner id is in tap_layers"),
            ),
        })
        .collect::<Vec<_>>();
    let caps = Capabilities {
        max_draft_len: config.drafts_per_block(block) as u32,
        prefill: PrefillMode::LeaveLastPending,
        tap_layers,
        final_hidden: sources.contains(&Source::Final),
        kv_layers: Vec::new(),
    };
    (sources, caps)
}

/// The draft head `[draft vocab, hidden]` in f32 on `device`: the checkpoint's own copy, or
/// the target's (tied: its embedding table, dequantized), restricted to the draft vocabulary.
fn device_head(io: &Io, tied: bool, device: &Device) -> Result<Tensor, Error> {
    if let Ok((w, _)) = device::dense(&io.lm_head, device) {
        return Ok(w);
    }
    if !tied {
        return Err(Error::Options(
            "--device cuda needs a dense lm_head or one tied to the embedding: this target's \
             is quantized and untied"
                .into(),
        ));
    }
    let table = match &io.embedding {
        Embedding::Dense(t) => t.to_dtype(candle_core::DType::F32).map_err(err)?,
        Embedding::Quantized(q) => q.dequantize(&Device::Cpu).map_err(err)?,
    };
    let table = match &io.d2t {
        Some(ids) => {
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu).map_err(err)?;
            table.index_select(&ids, 0).map_err(err)?
        }
        None => table,
    };
    table.to_device(device).map_err(err)
}

/// Whether the drafter was made for this target.
fn check_target(config: &DraftConfig, target: &TargetInfo) -> Result<(), Error> {
    let bad = |reason: String| Err(Error::Target(reason));
    if config.hidden_size != target.hidden_size as usize {
        return bad(format!(
            "the drafter's hidden size is {}, the target's {}",
            config.hidden_size, target.hidden_size
        ));
    }
    if config.vocab_size != target.vocab_size as usize {
        return bad(format!(
            "the drafter's vocabulary is {}, the target's {}",
            config.vocab_size, target.vocab_size
        ));
    }
    if config.num_target_layers != target.num_layers as usize {
        return bad(format!(
            "the drafter was trained on a target of {} layers, this one has {}",
            config.num_target_layers, target.num_layers
        ));
    }
    if let Some(id) = config.mask_token_id.filter(|&id| id >= target.vocab_size) {
        return bad(format!("mask_token_id {id} is outside the vocabulary"));
    }
    if config.target_layer_ids.contains(&-1)
        && !matches!(target.architecture.as_str(), "llama" | "qwen2" | "qwen3")
    {
        return bad(format!(
            "tap id -1 (the embedding output) is only known for llama, qwen2 and qwen3 targets,              not {}",
            target.architecture
        ));
    }
    Ok(())
}

/// The target's embedding and lm_head, or the checkpoint's own copies when they differ; the
/// head restricted to the draft vocabulary `d2t` when there is one.
fn io_parts(
    config: &DraftConfig,
    tensors: &Tensors,
    parts: TargetParts,
    d2t: Option<Vec<u32>>,
) -> Result<Io, Error> {
    let dims = [config.vocab_size, config.hidden_size];
    let same = |name: &str, target: Result<Option<String>, _>| -> Result<Option<Tensor>, Error> {
        if !tensors.contains(name) {
            return Ok(None);
        }
        let own = tensors.get(name, &dims)?;
        let target: Option<String> =
            target.map_err(|e: specula_models::Error| Error::Target(e.to_string()))?;
        let mine = value_digest(&own).map_err(err)?;
        match target.as_deref() == Some(mine.as_str()) {
            true => Ok(None),
            false => {
                warn!(
                    tensor = name,
                    "the checkpoint's copy differs from the target's: keeping it"
                );
                Ok(Some(own))
            }
        }
    };
    let own_embed = same("embed_tokens.weight", parts.embedding_digest())?;
    let own_head = same("lm_head.weight", parts.lm_head_digest())?;
    let lm_head = match own_head {
        Some(t) => Linear::dense(t, None).map_err(err)?,
        None => parts.lm_head,
    };
    Ok(Io {
        embedding: match own_embed {
            Some(t) => Embedding::Dense(t),
            None => parts.embedding,
        },
        lm_head: match &d2t {
            Some(ids) => vocab::select_rows(&lm_head, ids)?,
            None => lm_head,
        },
        d2t,
    })
}

impl Drafter for DFlash {
    fn info(&self) -> DrafterInfo {
        let version = env!("CARGO_PKG_VERSION");
        // Loaded (an in-process host calls `load` itself): the target's real capabilities.
        let known = self.capabilities_for_target().or(self.early_caps.as_ref());
        match known {
            Some(caps) => DrafterInfo::new("dflash", version, caps.clone()),
            // Placeholder until the weights for the target are found.
            None => DrafterInfo::new("dflash", version, Capabilities::tokens_only(1))
                .with_late_capabilities(),
        }
    }

    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        self.load(target).map_err(|e| e.to_string())?;
        let caps = self.capabilities_for_target().cloned();
        match (&self.early_caps, caps) {
            (Some(early), Some(now)) if *early != now => Err(format!(
                "the weights ask for {now:?} on this target, not the {early:?} announced"
            )),
            _ => Ok(()),
        }
    }

    fn capabilities(&mut self, _target: &TargetInfo) -> Capabilities {
        self.capabilities_for_target()
            .cloned()
            .unwrap_or_else(|| Capabilities::tokens_only(1))
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let Some(&anchor) = args.prompt.last() else {
            return;
        };
        // The host's sampler is seeded with the same request seed: a stream of our own keeps
        // the drafts independent of the uniforms that accept or reject them.
        let seed = args.sampling.seed.unwrap_or(session) ^ DRAFT_SEED_SALT;
        let dev = match self.loaded.as_ref().and_then(|m| m.dev.as_ref()) {
            None => None,
            Some(dev) => match dev.context() {
                Ok(ctx) => Some(ctx),
                Err(e) => {
                    warn!(session, error = %e, "no device context: the session drafts nothing");
                    return;
                }
            },
        };
        let s = Session {
            context: Context::default(),
            dev,
            anchor,
            pos: args.prompt.len() - 1,
            sampling: args.sampling.clone(),
            rng: StdRng::seed_from_u64(seed),
            missing: 0,
            resync: false,
            features: Vec::new(),
            calibration: Calibration::default(),
        };
        self.sessions.insert(session, s);
        let rows = &args.prompt[..args.prompt.len() - 1];
        self.take_taps(session, args.taps.as_ref(), rows, 0);
        if let Some((rows, missing)) = self.context_rows(session) {
            debug!(session, pos = args.prompt.len() - 1, rows, missing, "open");
        }
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        let ask = DraftAsk {
            session,
            new_tokens,
            n,
            donors: None,
        };
        self.draft_batch(&[ask]).pop().unwrap_or_default()
    }

    fn draft_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Proposal> {
        match self.blocks(asks) {
            Ok(blocks) => blocks
                .into_iter()
                .map(|b| match b {
                    None => Proposal::none(),
                    Some(b) => Proposal {
                        tokens: b.tokens,
                        q: b.q,
                        confidence: b.confidence,
                    },
                })
                .collect(),
            Err(e) => {
                warn!(error = %e, "drafting failed; proposing nothing");
                asks.iter().map(|_| Proposal::none()).collect()
            }
        }
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        let pos = self.sessions.get(&session).map(|s| s.pos);
        if let Some(s) = self.sessions.get_mut(&session) {
            let features = std::mem::take(&mut s.features);
            s.calibration
                .observe(&features, args.drafted, args.accepted);
        }
        self.accept(session, args.ids, args.taps.as_ref());
        if let (Some(pos), Some((rows, missing))) = (pos, self.context_rows(session)) {
            debug!(
                session,
                pos,
                drafted = args.drafted,
                accepted = args.accepted,
                rows,
                missing,
                "commit"
            );
        }
    }

    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        // A proposal never verified (late, or dropped by the host) says nothing.
        if let Some(s) = self.sessions.get_mut(&session) {
            s.features.clear();
        }
        self.accept(session, args.ids, args.taps.as_ref());
        Advanced::Taken
    }

    fn close(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }
}

impl DFlash {
    /// Ids committed after the pending one, with the taps of the rows that produced them:
    /// `[pending, ids[..len − 1]]` at the pending position.
    fn accept(&mut self, session: SessionId, ids: &[u32], taps: Option<&Taps<'_>>) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let Some(&last) = ids.last() else {
            return;
        };
        let pos = s.pos;
        let mut row_ids = Vec::with_capacity(ids.len());
        row_ids.push(s.anchor);
        row_ids.extend_from_slice(&ids[..ids.len() - 1]);
        self.take_taps(session, taps, &row_ids, pos);
        let s = self
            .sessions
            .get_mut(&session)
            .expect("invariant: checked above");
        s.pos += ids.len();
        s.anchor = last;
    }
}

impl Loaded {
    /// The drafts of one block from its normed hidden rows `h` `[B, hidden]`.
    fn block(
        &self,
        h: &Tensor,
        s: &mut Session,
        n: usize,
        calibration: &Calibration,
    ) -> Result<Block, Error> {
        let c = &self.config;
        let n = n.min(c.drafts_per_block(self.block));
        let temperature = s.sampling.temperature;
        match c.kind {
            Kind::DFlash => {
                // Mask slot i (row i) predicts the token at anchor + i.
                let rows = h.narrow(0, 1, n).map_err(err)?;
                let logits = self.draft_logits(&rows)?;
                let (picked, features, q) = match temperature > 0.0 {
                    // The device path: ids and features in one read-back.
                    false if self.dev.is_some() => {
                        let (picked, features) = device::greedy(&logits)?;
                        (picked, features, None)
                    }
                    false => {
                        let rows: Vec<Vec<f32>> = logits.to_vec2().map_err(err)?;
                        let picked = argmax_rows(&logits)?;
                        let features = rows
                            .iter()
                            .zip(&picked)
                            .map(|(r, &id)| probability_of(r, id as usize))
                            .collect();
                        (picked, features, None)
                    }
                    true => {
                        let rows: Vec<Vec<f32>> = logits.to_vec2().map_err(err)?;
                        let q: Vec<Vec<f32>> = rows
                            .iter()
                            .map(|r| probs(r, temperature, s.sampling.top_p, s.sampling.top_k))
                            .collect();
                        let picked: Vec<u32> = q.iter().map(|p| sample(p, &mut s.rng)).collect();
                        let features = q
                            .iter()
                            .zip(&picked)
                            .map(|(p, &id)| p[id as usize])
                            .collect();
                        let q = q.into_iter().map(|p| self.full_q(p)).collect();
                        (picked, features, Some(q))
                    }
                };
                Ok(self.calibrated(
                    Block {
                        tokens: self.to_vocab(picked),
                        logits,
                        confidence: None,
                        q,
                        features,
                    },
                    calibration,
                    self.threshold,
                ))
            }
            Kind::DSpark => {
                // Slot k (row k, the anchor's included) predicts the token at anchor + k + 1.
                let heads = self
                    .heads
                    .as_ref()
                    .expect("invariant: DSpark loads its heads");
                let rows = h.narrow(0, 0, n).map_err(err)?;
                // A cut known before drafting spares the lm_head rows after it.
                let width = self.io.d2t.as_ref().map_or(c.vocab_size, Vec::len);
                let rows = match heads.cut_before_drafting(&rows, self.threshold)? {
                    // ℓ = 0: skip drafting this round (the host runs a plain step).
                    Some(0) => {
                        return Ok(Block {
                            tokens: Vec::new(),
                            logits: Tensor::zeros((0, width), candle_core::DType::F32, h.device())
                                .map_err(err)?,
                            confidence: Some(Vec::new()),
                            q: (temperature > 0.0).then(Vec::new),
                            features: Vec::new(),
                        })
                    }
                    Some(len) => rows.narrow(0, 0, len).map_err(err)?,
                    None => rows,
                };
                // One multi-row lm_head for every slot (bit-identical to row by row, and about
                // the cost of one row: the head is read once), even though a confidence cut
                // that depends on the drafts may leave the last rows unused.
                let all = self.draft_logits(&rows)?;
                let base = |k: usize| all.narrow(0, k, 1).map_err(err);
                let mut q_rows = Vec::new();
                let mut features = Vec::new();
                let needs_features = !heads.has_confidence();
                let rng = &mut s.rng;
                let mut pick = |z: &Tensor| -> Result<u32, Error> {
                    let row = match temperature > 0.0 {
                        false => {
                            let id = argmax_rows(z)?[0];
                            if needs_features {
                                let r: Vec<f32> =
                                    z.flatten_all().and_then(|z| z.to_vec1()).map_err(err)?;
                                features.push(probability_of(&r, id as usize));
                            }
                            id
                        }
                        true => {
                            let row: Vec<f32> =
                                z.flatten_all().and_then(|z| z.to_vec1()).map_err(err)?;
                            // DeepSpec logits_to_probs: softmax(z / T), no top-p/top-k.
                            let p = probs(&row, temperature, 1.0, None);
                            let id = sample(&p, rng);
                            features.push(p[id as usize]);
                            q_rows.push(self.full_q(p));
                            id
                        }
                    };
                    Ok(self.to_vocab(vec![row])[0])
                };
                let out = heads.run(&rows, &base, s.anchor, self.threshold, width, &mut pick)?;
                let block = Block {
                    tokens: out.tokens,
                    logits: out.logits,
                    confidence: out.confidence,
                    q: (temperature > 0.0).then_some(q_rows),
                    features: match needs_features {
                        true => features,
                        false => Vec::new(),
                    },
                };
                Ok(match needs_features {
                    // DeepSpec without a confidence head never cuts: no threshold here.
                    true => self.calibrated(block, calibration, 0.0),
                    false => block,
                })
            }
        }
    }

    /// A block without a confidence head: its calibrated confidences, and the cut at the first
    /// below the threshold (as DSpark's head cuts; ℓ = 0: nothing to verify this round).
    fn calibrated(&self, mut block: Block, calibration: &Calibration, threshold: f32) -> Block {
        let conf: Vec<f32> = block
            .features
            .iter()
            .map(|&f| calibration.confidence(f))
            .collect();
        let keep = match threshold > 0.0 {
            true => conf
                .iter()
                .position(|&c| c < threshold)
                .unwrap_or(conf.len()),
            false => conf.len(),
        };
        block.confidence = Some(conf);
        block.truncate(keep);
        block
    }

    /// Draft-head rows → vocabulary ids.
    fn to_vocab(&self, mut rows: Vec<u32>) -> Vec<u32> {
        if let Some(d2t) = &self.io.d2t {
            for r in &mut rows {
                *r = d2t[*r as usize];
            }
        }
        rows
    }

    /// A distribution over the draft head's rows as one over the vocabulary (zero outside the
    /// draft vocabulary): what the host's rejection sampler needs.
    fn full_q(&self, p: Vec<f32>) -> Vec<f32> {
        match &self.io.d2t {
            None => p,
            Some(d2t) => {
                let mut full = vec![0.0; self.config.vocab_size];
                for (&id, x) in d2t.iter().zip(p) {
                    full[id as usize] = x;
                }
                full
            }
        }
    }

    /// `lm_head(rows)` over the draft vocabulary, times `output_multiplier`, softcapped
    /// (`DFlashDraftModel.compute_logits`).
    fn draft_logits(&self, rows: &Tensor) -> Result<Tensor, Error> {
        let mut logits = self.io.lm_head.forward(rows).map_err(err)?;
        let c = &self.config;
        if c.output_multiplier != 1.0 {
            logits = (logits * c.output_multiplier).map_err(err)?;
        }
        if let Some(cap) = c.logit_softcap {
            logits = ((logits / cap).and_then(|l| l.tanh()).map_err(err)? * cap).map_err(err)?;
        }
        Ok(logits)
    }

    /// The concatenated tap features `[rows, n_taps × hidden]` of a window, or why not.
    fn features(&self, taps: &Taps<'_>, row_ids: &[u32]) -> Result<Tensor, String> {
        let rows = taps.rows as usize;
        let hidden = self.config.hidden_size;
        if row_ids.len() != rows {
            return Err(format!("{rows} tap rows for {} positions", row_ids.len()));
        }
        let mut columns = Vec::with_capacity(self.sources.len());
        for source in &self.sources {
            let t = match source {
                Source::Embedding => self
                    .io
                    .embedding
                    .forward(row_ids)
                    .map_err(|e| e.to_string())?,
                Source::Layer(_) | Source::Final => {
                    let view = match source {
                        Source::Layer(i) => taps.layers.get(*i),
                        _ => taps.final_hidden.as_ref(),
                    }
                    .ok_or_else(|| format!("tap {source:?} is missing"))?;
                    if view.numel() != rows * hidden {
                        return Err(format!(
                            "tap {source:?} has {} values, expected {rows} × {hidden}",
                            view.numel()
                        ));
                    }
                    let data = view.to_f32().map_err(|e| e.to_string())?;
                    Tensor::from_vec(data, (rows, hidden), &Device::Cpu)
                        .map_err(|e| e.to_string())?
                }
            };
            columns.push(t);
        }
        Tensor::cat(&columns, 1).map_err(|e| e.to_string())
    }
}

impl Block {
    /// Keeps the first `keep` drafts (their logits rows, confidences, q rows and features).
    fn truncate(&mut self, keep: usize) {
        if keep >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(keep);
        if let Ok(l) = self.logits.narrow(0, 0, keep) {
            self.logits = l;
        }
        if let Some(c) = &mut self.confidence {
            c.truncate(keep);
        }
        if let Some(q) = &mut self.q {
            q.truncate(keep);
        }
        self.features.truncate(keep);
    }
}

impl Session {
    /// Context rows cached (on the host or the device).
    fn rows(&self) -> usize {
        self.dev
            .as_ref()
            .map_or(self.context.rows(), DeviceContext::rows)
    }

    /// Ids committed without taps (a 1.0 host's `new_tokens`): the context gets holes.
    fn extend_untapped(&mut self, ids: &[u32]) {
        if let Some(&last) = ids.last() {
            self.missing += ids.len();
            self.pos += ids.len();
            self.anchor = last;
        }
    }
}
