//! The assistant as an SDK [`Drafter`]: per session it keeps the context, the target's
//! final-norm hidden state of the last committed position and — unless the host maps its KV
//! pool as donor views (protocol 1.2) — the donor layers' K/V rows the host sends in its taps.
//!
//! A round at pending position `P` runs `k` assistant steps at position `P` (transformers'
//! `Gemma4AssistantCandidateGenerator`, which vLLM follows; optiq's `P + k` is not used) over
//! the donor rows `0..P`. A session whose taps went missing (torn, or ids that arrived without
//! them) drafts nothing until the host re-opens it: a drafter changes speed, never output.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use dflash::sampling::{probs, sample};
use dflash::WeightsSource;
use rand::rngs::StdRng;
use rand::SeedableRng;
use specula_models::config::{LayerType, ModelConfig};
use specula_models::drafter_support::TargetParts;
use specula_protocol::donor::DonorRows;
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk, Drafter, DrafterInfo, OpenArgs, Proposal, Taps,
};
use specula_protocol::version::{Version, PROTOCOL_VERSION};
use specula_protocol::wire::{
    Capabilities, PrefillMode, RopeLayout, SamplingSpec, SessionId, TargetInfo,
};
use tracing::{debug, warn};

use crate::{Assistant, Donor, DonorKv, LoadFor};

/// The most drafts per round this drafter offers.
pub const MAX_DRAFT_LEN: u32 = 8;

/// The drafter, before and after it knows its target.
#[derive(Debug)]
pub struct AssistantDrafter {
    source: WeightsSource,
    loaded: Option<Loaded>,
    sessions: HashMap<SessionId, Session>,
    /// Whether it asks to read the donor K/V in place (protocol 1.2 donor views).
    views: bool,
    /// The newest protocol version it speaks.
    protocol: Version,
}

#[derive(Debug)]
struct Loaded {
    net: Assistant,
    parts: TargetParts,
    /// What the target multiplies its embeddings by (Gemma: √H; llama: 1).
    embed_scale: f64,
    /// The target layers asked for as `kv_layers`.
    kv_layers: Vec<u32>,
    /// Per draft-layer kind, the index of its donor in `kv_layers`.
    donor_of: Vec<(LayerType, usize)>,
}

#[derive(Debug)]
struct Session {
    /// Every id so far; the last is pending.
    context: Vec<u32>,
    /// The target's final-norm hidden state of position `context.len() - 2`.
    hidden: Option<Vec<f32>>,
    /// Donor K and V rows `0..kv_rows`, per `kv_layers` entry (empty with donor views).
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    kv_rows: usize,
    /// Taps went missing: draft nothing until re-opened.
    broken: bool,
    sampling: SamplingSpec,
    rng: StdRng,
}

impl AssistantDrafter {
    /// A drafter that loads its weights from `source` once the host names the target.
    pub fn new(source: WeightsSource) -> Self {
        AssistantDrafter {
            source,
            loaded: None,
            sessions: HashMap::new(),
            views: true,
            protocol: PROTOCOL_VERSION,
        }
    }

    /// The same, asking for the donor K/V as rows copied into the taps (what an older host
    /// sends anyway): the copy path, for comparisons.
    pub fn with_copies(self) -> Self {
        AssistantDrafter {
            views: false,
            ..self
        }
    }

    /// The same, speaking protocol `version` at most (an older drafter, for skew tests): below
    /// 1.2 it gets the donor K/V copied into its taps.
    ///
    /// # Errors
    /// A version of another major, or newer than this build speaks.
    pub fn speaking(self, version: Version) -> Result<Self, String> {
        if version.major != PROTOCOL_VERSION.major || version > PROTOCOL_VERSION {
            return Err(format!(
                "protocol {version}: this drafter speaks {}.0 to {PROTOCOL_VERSION}",
                PROTOCOL_VERSION.major
            ));
        }
        Ok(AssistantDrafter {
            protocol: version,
            ..self
        })
    }

    /// A drafter already fitted to `target` (what the SDK does after `Welcome`), for running it
    /// in process.
    ///
    /// # Errors
    /// Why it cannot serve `target`.
    pub fn for_target(source: WeightsSource, target: &TargetInfo) -> Result<Self, String> {
        let mut d = Self::new(source);
        d.accept_target(target)?;
        Ok(d)
    }

    fn load(&self, target: &TargetInfo) -> Result<Loaded, String> {
        let dir = self.source.resolve(target).map_err(|e| e.to_string())?;
        let weights = PathBuf::from(&target.weights_path);
        let parts = TargetParts::open(&weights, &Device::Cpu)
            .map_err(|e| format!("cannot open the target's weights: {e}"))?;
        let gguf = weights.extension().is_some_and(|e| e == "gguf");
        let layout = target.rope_layout.unwrap_or(
            match gguf && matches!(target.architecture.as_str(), "llama" | "mistral") {
                true => RopeLayout::Interleaved,
                false => RopeLayout::Halves,
            },
        );
        let fit = LoadFor {
            interleaved_k: layout == RopeLayout::Interleaved,
            target_head: Some(parts.lm_head.clone()),
        };
        let net = Assistant::load_for(&dir, &fit).map_err(|e| e.to_string())?;
        let cfg = &parts.config;
        if net.backbone() != cfg.hidden_size || net.vocab() != cfg.vocab_size {
            return Err(format!(
                "{}: drafts for hidden {} / vocab {}, the target has {} / {}",
                dir.display(),
                net.backbone(),
                net.vocab(),
                cfg.hidden_size,
                cfg.vocab_size
            ));
        }
        let donors = donor_layers(cfg)?;
        let mut kv_layers = Vec::new();
        let mut donor_of = Vec::new();
        for (kind, shape) in net.layer_shapes() {
            let Some(&(layer, heads, hd)) = donors.iter().find(|d| d.0 == kind).map(|d| &d.1)
            else {
                return Err(format!("the target has no {kind:?} layer to lend its K/V"));
            };
            if (heads, hd) != shape {
                return Err(format!(
                    "a {kind:?} draft layer reads {} K/V heads of {}, the target's layer {layer} \
                     has {heads} of {hd}",
                    shape.0, shape.1
                ));
            }
            let index = match kv_layers.iter().position(|&l| l == layer as u32) {
                Some(i) => i,
                None => {
                    kv_layers.push(layer as u32);
                    kv_layers.len() - 1
                }
            };
            if !donor_of.iter().any(|d: &(LayerType, usize)| d.0 == kind) {
                donor_of.push((kind, index));
            }
        }
        let embed_scale = match cfg.model_type.as_str() {
            // PyTorch: embed_scale = hidden_size**0.5 as a float32 buffer.
            t if t.starts_with("gemma") => (cfg.hidden_size as f64).sqrt() as f32 as f64,
            _ => 1.0,
        };
        Ok(Loaded {
            net,
            parts,
            embed_scale,
            kv_layers,
            donor_of,
        })
    }

    fn capabilities_now(&self) -> Capabilities {
        Capabilities {
            max_draft_len: MAX_DRAFT_LEN,
            prefill: PrefillMode::LeaveLastPending,
            tap_layers: Vec::new(),
            final_hidden: true,
            kv_layers: self
                .loaded
                .as_ref()
                .map_or_else(Vec::new, |l| l.kv_layers.clone()),
        }
    }

    /// Takes committed `ids` and the taps of the rows that produced them.
    fn absorb(&mut self, session: SessionId, ids: &[u32], taps: Option<&Taps<'_>>) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let before = s.context.len().saturating_sub(1);
        s.context.extend_from_slice(ids);
        if s.broken {
            return;
        }
        let rows = s.context.len() - 1 - before;
        if rows == 0 {
            return;
        }
        let taken = match taps {
            Some(t) => take_rows(s, before, rows, t),
            None => Err("no taps".to_string()),
        };
        if let Err(reason) = taken {
            debug!(session, %reason, "session drafts nothing until re-opened");
            s.broken = true;
        }
    }

    /// Proposes for one session: `k` steps at the pending position over its donor rows.
    fn propose(
        &mut self,
        session: SessionId,
        new_tokens: &[u32],
        n: usize,
        donors: Option<DonorRows<'_>>,
    ) -> Proposal {
        let Some(loaded) = self.loaded.as_ref() else {
            return Proposal::none();
        };
        let Some(s) = self.sessions.get_mut(&session) else {
            return Proposal::none();
        };
        if !new_tokens.is_empty() {
            // Ids without their taps (a 1.0 host): their hidden state and K/V are unknown.
            s.context.extend_from_slice(new_tokens);
            s.broken = true;
        }
        let pos = s.context.len() - 1;
        let ready = match (&s.hidden, donors) {
            _ if s.broken || n == 0 || pos == 0 => false,
            (None, _) => false,
            (Some(_), Some(d)) if s.kv.is_empty() => d.len() == pos,
            (Some(_), _) => s.kv_rows == pos && !s.kv.is_empty(),
        };
        if !ready {
            return Proposal::none();
        }
        match draft_steps(loaded, s, pos, n, donors) {
            Ok(p) => p,
            Err(e) => {
                warn!(session, error = %e, "draft failed; drafting nothing");
                Proposal::none()
            }
        }
    }
}

/// Copies the final hidden of the last row and the K/V rows of a tap window at `pos`.
fn take_rows(s: &mut Session, pos: usize, rows: usize, taps: &Taps<'_>) -> Result<(), String> {
    if taps.pos as usize != pos || taps.rows as usize != rows {
        return Err(format!(
            "taps of rows {}..+{} for positions {pos}..+{rows}",
            taps.pos, taps.rows
        ));
    }
    let hidden = taps.final_hidden.as_ref().ok_or("no final hidden")?;
    let width = hidden.numel() / rows;
    let mut last = Vec::with_capacity(width);
    hidden
        .extend_f32((rows - 1) * width..rows * width, &mut last)
        .map_err(|e| e.to_string())?;
    if !taps.kv.is_empty() {
        if s.kv.is_empty() {
            s.kv = vec![(Vec::new(), Vec::new()); taps.kv.len()];
        }
        if s.kv.len() != taps.kv.len() || s.kv_rows != pos {
            return Err(format!("K/V rows {} before position {pos}", s.kv_rows));
        }
        for ((k, v), (tk, tv)) in s.kv.iter_mut().zip(&taps.kv) {
            tk.extend_f32(0..tk.numel(), k).map_err(|e| e.to_string())?;
            tv.extend_f32(0..tv.numel(), v).map_err(|e| e.to_string())?;
        }
        s.kv_rows = pos + rows;
    }
    s.hidden = Some(last);
    Ok(())
}

fn draft_steps(
    loaded: &Loaded,
    s: &mut Session,
    pos: usize,
    n: usize,
    donors: Option<DonorRows<'_>>,
) -> crate::Result<Proposal> {
    let dev = Device::Cpu;
    let mut hidden = Tensor::new(s.hidden.as_deref().unwrap_or_default(), &dev)?;
    let mut tok = *s.context.last().expect("invariant: a context");
    let in_place = s.kv.is_empty();
    let kv = &s.kv;
    let donor = |kind: LayerType| {
        let &(_, i) = loaded.donor_of.iter().find(|d| d.0 == kind)?;
        Some(match (in_place, donors) {
            (true, Some(rows)) => Donor::Blocks { rows, layer: i },
            _ => Donor::Rows(DonorKv {
                k: &kv[i].0,
                v: &kv[i].1,
                rows: pos,
            }),
        })
    };
    let sampled = s.sampling.temperature > 0.0;
    let (mut tokens, mut q) = (Vec::with_capacity(n), Vec::new());
    for _ in 0..n {
        let embed = (loaded.parts.embedding.forward(&[tok])? * loaded.embed_scale)?;
        let out = loaded
            .net
            .step(&embed.flatten_all()?, &hidden, pos, donor)?;
        tok = match sampled {
            false => argmax(&out.logits),
            true => {
                let p = probs(
                    &out.logits,
                    s.sampling.temperature,
                    s.sampling.top_p,
                    s.sampling.top_k,
                );
                let t = sample(&p, &mut s.rng);
                q.push(p);
                t
            }
        };
        tokens.push(tok);
        hidden = out.projected;
    }
    if let (true, Some(rows)) = (in_place, donors) {
        if let Err(e) = rows.check() {
            debug!(error = %e, "donor blocks reused while drafting; drafting nothing");
            return Ok(Proposal::none());
        }
    }
    Ok(Proposal {
        tokens,
        q: sampled.then_some(q),
        confidence: None,
    })
}

fn argmax(logits: &[f32]) -> u32 {
    (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
        .unwrap_or(0) as u32
}

/// A layer kind and the target layer lending its K/V: `(kind, (layer, kv_heads, head_dim))`.
type Lender = (LayerType, (usize, usize, usize));

/// Per layer kind the target layer that lends its K/V: the last layer of that kind that owns
/// K/V, with its K/V heads and head width. A model without layer kinds (llama, qwen) has only
/// global layers; its donor is its last layer.
fn donor_layers(cfg: &ModelConfig) -> Result<Vec<Lender>, String> {
    use specula_models::config::KvSource;
    let layers: Vec<(LayerType, usize, usize, bool)> = if cfg.is_gemma4() {
        let p = cfg.gemma4()?;
        p.layers
            .iter()
            .map(|l| (l.kind, l.kv_heads, l.head_dim, l.kv == KvSource::Own))
            .collect()
    } else if cfg.model_type.starts_with("gemma3") {
        let p = cfg.gemma3()?;
        p.layer_types
            .iter()
            .map(|&k| (k, cfg.kv_heads(), cfg.head_dim(), true))
            .collect()
    } else {
        (0..cfg.num_hidden_layers)
            .map(|_| {
                (
                    LayerType::FullAttention,
                    cfg.kv_heads(),
                    cfg.head_dim(),
                    true,
                )
            })
            .collect()
    };
    let mut out = Vec::new();
    for kind in [LayerType::SlidingAttention, LayerType::FullAttention] {
        if let Some(l) = layers.iter().rposition(|l| l.0 == kind && l.3) {
            out.push((kind, (l, layers[l].1, layers[l].2)));
        }
    }
    Ok(out)
}

impl Drafter for AssistantDrafter {
    fn info(&self) -> DrafterInfo {
        let mut info = DrafterInfo::new(
            "assistant",
            env!("CARGO_PKG_VERSION"),
            self.capabilities_now(),
        )
        .with_late_capabilities();
        info.versions = vec![self.protocol];
        match self.views {
            true => info.with_kv_donor_views(),
            false => info,
        }
    }

    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        if self.loaded.is_none() {
            self.loaded = Some(self.load(target)?);
        }
        Ok(())
    }

    fn capabilities(&mut self, _target: &TargetInfo) -> Capabilities {
        self.capabilities_now()
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let Some((&first, rest)) = args.prompt.split_first() else {
            return;
        };
        let seed = args.sampling.seed.unwrap_or(0) ^ session.rotate_left(32);
        self.sessions.insert(
            session,
            Session {
                context: vec![first],
                hidden: None,
                kv: Vec::new(),
                kv_rows: 0,
                broken: false,
                sampling: args.sampling.clone(),
                rng: StdRng::seed_from_u64(seed ^ 0x5eed_a551_57a7),
            },
        );
        // The prompt's taps are the rows of every id but the pending one: positions 0..p.
        if !rest.is_empty() {
            self.absorb(session, rest, args.taps.as_ref());
        }
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        self.propose(session, new_tokens, n, None)
    }

    fn draft_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Proposal> {
        asks.iter()
            .map(|a| self.propose(a.session, a.new_tokens, a.n, a.donors))
            .collect()
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        self.absorb(session, args.ids, args.taps.as_ref());
    }

    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        self.absorb(session, args.ids, args.taps.as_ref());
        Advanced::Taken
    }

    fn close(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }
}
