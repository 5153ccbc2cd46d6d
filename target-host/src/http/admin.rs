//! The drafter admin API: list drafters, hot-swap a new one in, turn speculation off.
//!
//! | route | effect |
//! |---|---|
//! | `GET /admin/drafters` | every drafter this server ran: name, protocol version, pid, state, restarts, acceptance |
//! | `POST /admin/drafters {"path", "args"}` | spawn + handshake (off the async threads), make it current, shut the old one down |
//! | `DELETE /admin/drafters/current` | no drafter: requests decode without speculation |
//!
//! In-flight requests move to the new drafter at their next round boundary (the verify loop
//! re-opens their session on it with the whole context), so a swap never changes output. A
//! drafter that fails to start leaves the current one in place.
//!
//! Access: over TCP the admin API is off (403) unless an admin token is configured, and then
//! every route needs `Authorization: Bearer TOKEN`; on `--admin-socket` (a 0600 Unix socket) the
//! file mode is the access control. Only registered drafters can be started
//! ([`DrafterPolicy`]): a path outside the drafter directories is a 403 and spawns nothing.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::auth::{credential, unauthorized, DrafterPolicy, Secrets};
use super::error::{parse_value, ApiError, ApiJson};
use super::metrics::{DrafterLabels, DrafterMeter, Metered, Metrics};
use super::AppState;
use crate::proposer::Proposer;

/// Live status of a running drafter, as its supervisor reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DrafterStatus {
    /// Negotiated protocol version (`major.minor`).
    pub protocol_version: Option<String>,
    /// Process id of the drafter process, when it is one and it is running.
    pub pid: Option<u32>,
    /// Supervisor state (`starting`, `ready`, `backoff`, `failed`, `stopped`).
    pub state: String,
    /// Restarts by the supervisor.
    pub restarts: u64,
}

/// A started drafter: the proposer to install and a way to read its status later.
pub struct Launched {
    /// The proposer.
    pub proposer: Box<dyn Proposer>,
    /// Reads the drafter's live status (called on `GET /admin/drafters` and `/metrics`).
    pub status: Box<dyn Fn() -> DrafterStatus + Send + Sync>,
}

/// Spawns and handshakes the drafter at `path` with `args` (blocking).
pub type Launcher = Box<dyn Fn(&str, &[String]) -> anyhow::Result<Launched> + Send + Sync>;

/// `POST /admin/drafters` body.
#[derive(Debug, Deserialize)]
pub struct InstallRequest {
    /// Drafter executable: a path, or a name found next to `target-host`.
    pub path: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
}

/// One drafter in `GET /admin/drafters`.
#[derive(Debug, Clone, Serialize)]
pub struct DrafterView {
    /// Registry id (1, 2, ... in installation order).
    pub id: u64,
    /// The drafter's name.
    pub name: String,
    /// Executable, when known.
    pub path: Option<String>,
    /// Its arguments.
    pub args: Vec<String>,
    /// Whether requests draft with it now.
    pub current: bool,
    /// Live status (`state` is `stopped` once swapped out).
    #[serde(flatten)]
    pub status: DrafterStatus,
    /// Drafts this instance offered.
    pub drafted: u64,
    /// Drafts accepted.
    pub accepted: u64,
    /// `accepted / drafted`.
    pub acceptance_rate: f64,
}

struct Record {
    id: u64,
    name: String,
    path: Option<String>,
    args: Vec<String>,
    meter: Arc<DrafterMeter>,
    /// `None` once stopped.
    status: Option<Box<dyn Fn() -> DrafterStatus + Send + Sync>>,
    last: DrafterStatus,
}

impl Record {
    fn view(&self, current: bool) -> DrafterView {
        let status = match &self.status {
            Some(read) => read(),
            None => self.last.clone(),
        };
        DrafterView {
            id: self.id,
            name: self.name.clone(),
            path: self.path.clone(),
            args: self.args.clone(),
            current,
            status,
            drafted: self.meter.drafted.load(Ordering::Relaxed),
            accepted: self.meter.accepted.load(Ordering::Relaxed),
            acceptance_rate: self.meter.acceptance_rate(),
        }
    }

    fn stop(&mut self) {
        if let Some(read) = self.status.take() {
            self.last = read();
        }
        self.last.state = "stopped".into();
        self.last.pid = None;
    }
}

#[derive(Default)]
struct Registry {
    records: Vec<Record>,
    current: Option<u64>,
}

/// Drafter hot-swap state and the admin API's access rules.
pub struct Admin {
    token: Secrets,
    policy: DrafterPolicy,
    launcher: Launcher,
    registry: Arc<Mutex<Registry>>,
    /// One swap at a time: two concurrent installs must not both think they replaced the other.
    swapping: tokio::sync::Mutex<()>,
}

fn lock(m: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Admin {
    /// Admin state: `token` guards the TCP routes (none configured: they are off), `policy`
    /// says which drafters may be started, `launcher` starts them. Restart counts are reported
    /// to `metrics`.
    pub fn new(
        token: Secrets,
        policy: DrafterPolicy,
        launcher: Launcher,
        metrics: &Metrics,
    ) -> Admin {
        let registry: Arc<Mutex<Registry>> = Arc::default();
        let source = registry.clone();
        metrics.set_restart_source(Box::new(move || {
            lock(&source)
                .records
                .iter()
                .map(|r| {
                    let labels = DrafterLabels {
                        drafter: r.name.clone(),
                        instance: r.id.to_string(),
                    };
                    (labels, r.view(false).status.restarts)
                })
                .collect()
        }));
        Admin {
            token,
            policy,
            launcher,
            registry,
            swapping: tokio::sync::Mutex::new(()),
        }
    }

    /// Records `launched` as the current drafter and returns the proposer to install, metered.
    pub fn register(
        &self,
        launched: Launched,
        path: Option<String>,
        args: Vec<String>,
        metrics: &Metrics,
    ) -> (Box<dyn Proposer>, DrafterView) {
        let name = launched.proposer.name().to_string();
        let mut reg = lock(&self.registry);
        let id = reg.records.len() as u64 + 1;
        let meter = metrics.drafter(&name, id);
        let metered = Metered::new(launched.proposer, meter.clone());
        let record = Record {
            id,
            meter,
            name,
            path,
            args,
            status: Some(launched.status),
            last: DrafterStatus::default(),
        };
        let view = record.view(true);
        reg.records.push(record);
        if let Some(old) = reg.current.replace(id) {
            reg.records[old as usize - 1].stop();
        }
        (Box::new(metered), view)
    }

    /// Marks the current drafter stopped; returns its view.
    fn unregister(&self) -> Option<DrafterView> {
        let mut reg = lock(&self.registry);
        let id = reg.current.take()?;
        let record = &mut reg.records[id as usize - 1];
        record.stop();
        Some(record.view(false))
    }

    /// Name of the current drafter.
    pub fn current_name(&self) -> Option<String> {
        let reg = lock(&self.registry);
        reg.current
            .map(|id| reg.records[id as usize - 1].name.clone())
    }

    fn views(&self) -> Vec<DrafterView> {
        let reg = lock(&self.registry);
        reg.records
            .iter()
            .map(|r| r.view(reg.current == Some(r.id)))
            .collect()
    }
}

/// Access rule of every admin route served over TCP (a `route_layer`): off unless an admin
/// token is configured, then `Authorization: Bearer TOKEN` (the Unix socket, whose 0600 mode is
/// its access control, is served without this layer).
pub async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let token = &state.admin.token;
    if !token.is_configured() {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "admin_disabled",
            "the admin API is off: configure an admin token (--admin-token-file, \
             SPECULA_ADMIN_TOKEN) or use --admin-socket",
        )
        .into_response();
    }
    match credential(req.headers()) {
        Some(given) if token.accepts(given) => next.run(req).await,
        _ => unauthorized(
            "invalid_admin_token",
            "the admin API needs `Authorization: Bearer <admin token>`",
        ),
    }
}

/// `GET /admin/drafters`.
pub async fn list(State(state): State<Arc<AppState>>) -> Result<Json<serde_json::Value>, ApiError> {
    // Reading a drafter's status waits for its current proposer call (bounded by the deadline).
    let views = tokio::task::spawn_blocking(move || state.admin.views())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let current = views.iter().find(|v| v.current).map(|v| v.id);
    Ok(Json(
        serde_json::json!({ "current": current, "drafters": views }),
    ))
}

/// `POST /admin/drafters`: starts the drafter, then swaps it in.
///
/// # Errors
/// 400 for a bad body, 422 with the reason when the drafter fails to start or to handshake (the
/// current drafter stays).
pub async fn install(
    State(state): State<Arc<AppState>>,
    body: Result<ApiJson, ApiError>,
) -> Result<(StatusCode, Json<DrafterView>), ApiError> {
    let ApiJson(body) = body?;
    let req: InstallRequest = parse_value(&body)?;
    if req.path.is_empty() {
        return Err(ApiError::invalid("path", "path must not be empty"));
    }
    // Before anything is spawned: only registered drafters, never an arbitrary executable.
    let path = state.admin.policy.check(&req.path)?;
    let _one_at_a_time = state.admin.swapping.lock().await;
    let launch_state = state.clone();
    let args = req.args.clone();
    let launched = tokio::task::spawn_blocking(move || (launch_state.admin.launcher)(&path, &args))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let launched = launched.map_err(|e| {
        tracing::warn!(path = %req.path, "drafter failed to start: {e:#}");
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: format!("drafter {} failed to start: {e:#}", req.path),
            param: Some("path".into()),
            code: "drafter_failed",
        }
    })?;
    let (proposer, view) = state
        .admin
        .register(launched, Some(req.path), req.args, &state.metrics);
    swap_in(&state, Some(proposer)).await;
    tracing::info!(drafter = %view.name, id = view.id, "drafter swapped in");
    Ok((StatusCode::CREATED, Json(view)))
}

/// `DELETE /admin/drafters/current`: speculation off until a new drafter is installed.
pub async fn remove(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let _one_at_a_time = state.admin.swapping.lock().await;
    let stopped = state.admin.unregister();
    swap_in(&state, None).await;
    tracing::info!("drafter removed: speculation off");
    Json(serde_json::json!({ "current": null, "stopped": stopped }))
}

/// Installs `proposer` and shuts the old one down off the async threads (dropping a drafter
/// client waits for its process to exit).
async fn swap_in(state: &AppState, proposer: Option<Box<dyn Proposer>>) {
    let slot = state.engine.slot().clone();
    let done = tokio::task::spawn_blocking(move || {
        let old = slot.replace(proposer);
        drop(old);
    })
    .await;
    if let Err(e) = done {
        tracing::error!("shutting the old drafter down panicked: {e}");
    }
}
