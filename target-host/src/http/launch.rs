//! Starting drafter processes for the server: the one named by `--drafter` and those the admin
//! API swaps in, all through [`DrafterClient`] so every one can report its pid, state and
//! restarts.
//!
//! The client is shared between the proposer slot (where the verify loop drives it) and the
//! admin API (which reads its status), behind one mutex: the verify loop holds it only for the
//! length of a proposer call, bounded by the draft deadline.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use specula_models::sampling::SamplingParams;
use specula_protocol::wire::TargetInfo;
use specula_protocol::PROTOCOL_VERSION;

use super::admin::{DrafterStatus, Launched, Launcher};
use crate::drafter::{ClientConfig, DrafterClient, DrafterSpec, DrafterState};
use crate::drafter_args::DrafterArgs;
use crate::engine::Engine;
use crate::proposer::{Draft, Proposer, SessionId, TapRows, Verdict, Wants};

/// What a drafter learns about the engine's target in the handshake.
pub(crate) fn target_info(engine: &Engine) -> TargetInfo {
    let model = engine.model();
    let config = model.config();
    let tokenizer = engine.tokenizer();
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
    }
}

/// A launcher that starts drafters against `engine`'s target with the deadlines of `args`.
pub(crate) fn launcher(engine: &Engine, args: &DrafterArgs) -> Launcher {
    let target = target_info(engine);
    let config = ClientConfig {
        draft_deadline: Duration::from_millis(args.draft_deadline_ms),
        ..ClientConfig::default()
    };
    Box::new(move |path: &str, args: &[String]| {
        let spec = DrafterSpec::new(path).with_args(args.iter().cloned());
        let client = DrafterClient::start(spec, target.clone(), config.clone())?;
        let name = client.name().to_string();
        let client = Arc::new(Mutex::new(client));
        // Weak: the status reader must not keep a swapped-out drafter alive.
        let reader: Weak<Mutex<DrafterClient>> = Arc::downgrade(&client);
        Ok(Launched {
            proposer: Box::new(Shared { client, name }),
            status: Box::new(move || match reader.upgrade() {
                Some(client) => status(&mut lock(&client)),
                None => DrafterStatus {
                    state: "stopped".into(),
                    ..DrafterStatus::default()
                },
            }),
        })
    })
}

fn lock(client: &Mutex<DrafterClient>) -> MutexGuard<'_, DrafterClient> {
    // A panic inside a proposer call is already contained by the verify loop's own lock.
    client.lock().unwrap_or_else(|e| e.into_inner())
}

fn status(client: &mut DrafterClient) -> DrafterStatus {
    let state = client.poll();
    DrafterStatus {
        // The client does not expose the negotiated version; a handshake only succeeds at or
        // below this host's version, and the host speaks exactly one (1.0).
        protocol_version: Some(PROTOCOL_VERSION.to_string()),
        pid: client.pid(),
        state: state_name(state).into(),
        restarts: client.stats().restarts,
    }
}

fn state_name(s: DrafterState) -> &'static str {
    match s {
        DrafterState::Starting => "starting",
        DrafterState::Ready => "ready",
        DrafterState::Backoff => "backoff",
        DrafterState::Failed => "failed",
        DrafterState::Stopped => "stopped",
    }
}

/// A [`DrafterClient`] shared with the admin API.
struct Shared {
    client: Arc<Mutex<DrafterClient>>,
    name: String,
}

impl Proposer for Shared {
    fn name(&self) -> &str {
        &self.name
    }

    fn wants(&self) -> Wants {
        lock(&self.client).wants()
    }

    fn open(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        lock(&self.client).open(session, prompt, sampling, taps);
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Draft {
        lock(&self.client).draft(session, new_tokens, n)
    }

    fn verdict(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        lock(&self.client).verdict(session, verdict);
    }

    fn close(&mut self, session: SessionId) {
        lock(&self.client).close(session);
    }
}
