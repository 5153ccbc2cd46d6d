//! Starting drafter processes for the server: the one named by `--drafter` and those the admin
//! API swaps in, all through [`DrafterClient`] so every one can report its pid, state and
//! restarts.
//!
//! The client is shared between the proposer slot (where the verify loop drives it) and the
//! admin API (which reads its status), behind one mutex: the verify loop holds it only for the
//! length of a proposer call, bounded by the draft deadline.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use specula_protocol::PROTOCOL_VERSION;

use super::admin::{DrafterStatus, Launched, Launcher};
use crate::drafter::{DrafterClient, DrafterSpec, DrafterState};
use crate::drafter_args::{target_info, DrafterArgs};
use crate::engine::Engine;
use crate::proposer::Shared;

/// A launcher that starts drafters against `engine`'s target with the deadlines of `args`.
pub(crate) fn launcher(engine: &Engine, args: &DrafterArgs) -> Launcher {
    let target = target_info(engine.model(), engine.tokenizer());
    let config = args.client_config();
    Box::new(move |path: &str, args: &[String]| {
        let spec = DrafterSpec::new(path).with_args(args.iter().cloned());
        let client = DrafterClient::start(spec, target.clone(), config.clone())?;
        let (proposer, client) = Shared::new(client);
        // Weak: the status reader must not keep a swapped-out drafter alive.
        let reader: Weak<Mutex<DrafterClient>> = Arc::downgrade(&client);
        Ok(Launched {
            proposer: Box::new(proposer),
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
