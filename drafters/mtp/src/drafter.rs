//! [`MtpDrafter`]: the loaded MTP module and its sessions behind the SDK's [`Drafter`].
//!
//! It asks for the `final_hidden` tap only (late capabilities: the draft depth depends on the
//! layout found). Every `Open`, `Commit` and `Advance` is a verified window: its rows
//! `(h_i, t_{i+1})` rebuild the session's MTP cache ([`crate::state`]); a `Draft` chains up to
//! `k` steps from the last row and cuts the drafted rows off again.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use specula_models::drafter_support::draft_vocab::{self, DraftVocab, VocabChoice};
use specula_models::drafter_support::TargetParts;
use specula_models::sampling::{argmax, Sampler, SamplingParams};
use specula_protocol::sdk::{
    AdvanceArgs, Advanced, CommitArgs, Drafter, DrafterInfo, OpenArgs, Proposal, Taps,
};
use specula_protocol::wire::{Capabilities, PrefillMode, SamplingSpec, SessionId, TargetInfo};
use tracing::{debug, info, warn};

use crate::config::MtpConfig;
use crate::model::{LinearDType, Mtp};
use crate::state::{Core, Session};
use crate::weights::{self, WeightsSource};
use crate::{fwd, Error};

/// How the drafter runs (command-line options).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The most drafts per round (`--max-draft`; MiMo: 1 whatever this says).
    pub max_draft: usize,
    /// How the module's own projections are kept (`--linear-dtype`).
    pub linear_dtype: LinearDType,
    /// The ids drafts are picked from (`--draft-vocab`; default: the shipped list, which
    /// reads 16384 of SmolLM2's 49152 head rows).
    pub draft_vocab: VocabChoice,
    /// Each proposed draft carries its own probability as its confidence, and the host cuts
    /// the draft where their product stops paying for a verify row (one rule, the host's:
    /// it knows the verify cost; a fixed k is verified uncut). This opt-in floor
    /// (`--min-confidence`; 0, the default, proposes whatever is asked) stops the chain in
    /// the drafter too, so no deeper block step runs for drafts the host would cut.
    pub min_confidence: f32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_draft: 4,
            linear_dtype: LinearDType::Q8_0,
            draft_vocab: VocabChoice::Shipped,
            min_confidence: 0.0,
        }
    }
}

/// A module loaded for one target.
struct Loaded {
    core: Core,
    caps: Capabilities,
    max_pos: usize,
    hidden: usize,
}

/// One session: the MTP state and how the target samples.
struct Entry {
    state: Session,
    sampler: Sampler,
}

/// The MTP drafter.
pub struct MtpDrafter {
    source: WeightsSource,
    options: Options,
    loaded: Option<Loaded>,
    sessions: HashMap<SessionId, Entry>,
}

impl MtpDrafter {
    /// A drafter that loads its module from `source` once it knows the target.
    ///
    /// # Errors
    /// [`Error::Options`] for `max_draft` 0 or a `min_confidence` outside `0..=1`.
    pub fn new(source: WeightsSource, options: Options) -> Result<Self, Error> {
        if options.max_draft == 0 {
            return Err(Error::Options("--max-draft must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&options.min_confidence) {
            return Err(Error::Options(format!(
                "--min-confidence must be in 0..=1, got {}",
                options.min_confidence
            )));
        }
        Ok(MtpDrafter {
            source,
            options,
            loaded: None,
            sessions: HashMap::new(),
        })
    }

    /// Loads the module for `target` (done by [`Drafter::accept_target`]).
    ///
    /// # Errors
    /// Every reason this drafter cannot serve the target.
    pub fn load(&mut self, target: &TargetInfo) -> Result<(), Error> {
        let dir = self.source.resolve(target)?;
        let mut weights = weights::open(&dir)?;
        let config = MtpConfig::for_checkpoint(&dir, &weights, &target.architecture)?;
        if config.hidden_size != target.hidden_size as usize {
            return Err(Error::Target(format!(
                "the MTP module's hidden size is {}, the target's {}",
                config.hidden_size, target.hidden_size
            )));
        }
        if config.vocab_size != target.vocab_size as usize {
            return Err(Error::Target(format!(
                "the MTP module's vocabulary is {}, the target's {}",
                config.vocab_size, target.vocab_size
            )));
        }
        let depth = config
            .max_depth
            .map_or(self.options.max_draft, |d| d.min(self.options.max_draft));
        let max_pos = target.context_len as usize + depth + 2;
        let parts = TargetParts::open(target.weights_path.as_ref(), &Device::Cpu)
            .map_err(|e| Error::Target(format!("cannot read the target's weights: {e}")))?;
        info!(
            weights = %dir.display(),
            layout = ?config.layout,
            block = config.block.name,
            recycle = ?config.recycle,
            depth,
            "MTP module loaded"
        );
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let d2t = draft_vocab::resolve(&dir, self.options.draft_vocab, vocab)?
            .map(|ids| DraftVocab::new(ids, vocab))
            .transpose()?;
        info!(
            draft_vocab = d2t.as_ref().map_or(vocab, DraftVocab::len),
            min_confidence = self.options.min_confidence,
            "MTP draft head"
        );
        let mtp = Mtp::load(config, &mut weights, max_pos, self.options.linear_dtype)?;
        self.loaded = Some(Loaded {
            core: Core::new(mtp, parts.embedding, parts.lm_head, d2t)?,
            caps: Capabilities {
                max_draft_len: depth as u32,
                prefill: PrefillMode::LeaveLastPending,
                tap_layers: Vec::new(),
                final_hidden: true,
                kv_layers: Vec::new(),
            },
            max_pos,
            hidden,
        });
        Ok(())
    }

    /// Cached rows of `session` and rows missing from its cache.
    pub fn rows(&self, session: SessionId) -> Option<(usize, usize)> {
        self.sessions.get(&session).map(|e| e.state.rows())
    }

    /// Commits `ids` to `session` with the taps of the rows that produced them.
    fn accept(&mut self, session: SessionId, ids: &[u32], taps: Option<&Taps<'_>>) {
        let (Some(m), Some(e)) = (&self.loaded, self.sessions.get_mut(&session)) else {
            return;
        };
        let hidden = match m.hidden_rows(taps, e.state.pos(), ids.len()) {
            Ok(h) => Some(h),
            Err(reason) => {
                debug!(
                    session,
                    rows = ids.len(),
                    reason,
                    "no hiddens: a hole in the MTP cache"
                );
                None
            }
        };
        if let Err(err) = e.state.extend(&m.core, hidden.as_ref(), ids) {
            warn!(session, error = %err, "MTP window failed: a hole in the cache");
        }
    }
}

impl Loaded {
    /// The `final_hidden` rows of a tap window, checked to start at `pos` with `rows` rows.
    fn hidden_rows(
        &self,
        taps: Option<&Taps<'_>>,
        pos: usize,
        rows: usize,
    ) -> Result<Tensor, String> {
        let taps = taps.ok_or("no taps")?;
        if taps.pos as usize != pos || taps.rows as usize != rows {
            return Err(format!(
                "taps of {} rows at {}, expected {rows} at {pos}",
                taps.rows, taps.pos
            ));
        }
        let view = taps.final_hidden.as_ref().ok_or("no final_hidden tap")?;
        if view.numel() != rows * self.hidden {
            return Err(format!(
                "final_hidden has {} values, expected {rows} × {}",
                view.numel(),
                self.hidden
            ));
        }
        let data = view.to_f32().map_err(|e| e.to_string())?;
        Tensor::from_vec(data, (rows, self.hidden), &Device::Cpu).map_err(|e| e.to_string())
    }
}

/// `softmax(row)[id]`, in f64 (the draft's own probability: its confidence).
fn softmax_at(row: &[f32], id: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    (f64::from(row[id as usize] - max).exp() / sum) as f32
}

/// Mixed into the request seed: the host's sampler is seeded with the same seed, and drafts
/// drawn from the same stream as the host's accept/reject uniforms would be correlated with
/// them (rejection sampling needs them independent).
const DRAFT_SEED_SALT: u64 = 0x6d74_705f_6472_6166;

/// The target's sampling parameters, as a sampler the drafts are drawn with (its own stream).
fn sampler(spec: &SamplingSpec, session: SessionId) -> Sampler {
    Sampler::new(SamplingParams {
        temperature: spec.temperature,
        top_p: spec.top_p,
        top_k: spec.top_k.map(|k| k as usize),
        min_p: spec.min_p,
        seed: Some(spec.seed.unwrap_or(session) ^ DRAFT_SEED_SALT),
        ..SamplingParams::default()
    })
}

impl Drafter for MtpDrafter {
    fn info(&self) -> DrafterInfo {
        // Placeholder until the module is found: its layout sets the depth.
        DrafterInfo::new(
            "mtp",
            env!("CARGO_PKG_VERSION"),
            Capabilities::tokens_only(1),
        )
        .with_late_capabilities()
    }

    fn accept_target(&mut self, target: &TargetInfo) -> Result<(), String> {
        self.load(target).map_err(|e| e.to_string())
    }

    fn capabilities(&mut self, _target: &TargetInfo) -> Capabilities {
        self.loaded
            .as_ref()
            .map_or_else(|| Capabilities::tokens_only(1), |m| m.caps.clone())
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        if args.prompt.is_empty() {
            return;
        }
        let entry = Entry {
            state: Session::new(),
            sampler: sampler(args.sampling, session),
        };
        self.sessions.insert(session, entry);
        // The prompt's pairs (h_i, t_{i+1}) for i in 0..p: taps of rows 0..p-1, ids 1..=p.
        self.accept(session, &args.prompt[1..], args.taps.as_ref());
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        let (Some(m), Some(e)) = (&self.loaded, self.sessions.get_mut(&session)) else {
            return Proposal::none();
        };
        e.state.extend_blind(new_tokens);
        let sampled = !e.sampler.params().is_greedy();
        let (mut q, mut confidence) = (Vec::new(), Vec::new());
        let core = &m.core;
        let (sampler, floor) = (&mut e.sampler, self.options.min_confidence);
        let mut reach = 1.0f32;
        let mut pick = |logits: &Tensor| -> Result<Option<u32>, Error> {
            let row: Vec<f32> = logits
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(fwd)?;
            let (id, p, dist) = match sampled {
                false => {
                    let id = argmax(&row);
                    (id, softmax_at(&row, id), None)
                }
                true => {
                    let dist = sampler.distribution(&row, &[]);
                    let id = sampler.draw(&dist);
                    (id, dist.prob(id), Some(dist))
                }
            };
            reach *= p;
            if reach < floor {
                return Ok(None);
            }
            if let Some(dist) = dist {
                let dense = dist.to_dense(row.len());
                q.push(match core.vocab() {
                    Some(v) => v.scatter(&dense),
                    None => dense,
                });
            }
            confidence.push(p.clamp(0.0, 1.0));
            Ok(Some(id))
        };
        let result = e.state.draft(core, n, m.max_pos, &mut pick);
        match result {
            Ok(d) => Proposal {
                tokens: d,
                q: sampled.then_some(q),
                confidence: Some(confidence),
            },
            Err(err) => {
                warn!(session, error = %err, "drafting failed; proposing nothing");
                Proposal::none()
            }
        }
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        debug!(
            session,
            drafted = args.drafted,
            accepted = args.accepted,
            "commit"
        );
        self.accept(session, args.ids, args.taps.as_ref());
    }

    fn advance(&mut self, session: SessionId, args: AdvanceArgs<'_>) -> Advanced {
        self.accept(session, args.ids, args.taps.as_ref());
        Advanced::Taken
    }

    fn close(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }
}
