//! The OpenAI-compatible HTTP server (`target-host serve`), its drafter admin API and its
//! Prometheus metrics, on tokio + axum.
//!
//! | route | handler |
//! |---|---|
//! | `POST /v1/completions` | [`completions`] |
//! | `POST /v1/chat/completions` | [`chat`] |
//! | `GET /v1/models`, `GET /health` | [`models`] |
//! | `GET /metrics` | [`metrics`] |
//! | `GET/POST /admin/drafters`, `DELETE /admin/drafters/current` | [`admin`] |
//!
//! Requests go to the [`Engine`], which runs them one at a time in arrival order; a client that
//! disconnects drops its event receiver, which cancels its generation. Wire shapes follow
//! OpenAI's API reference; the Specula extensions are documented in [`openai_types`].

pub mod admin;
mod admission;
pub mod chat;
pub mod completions;
pub mod error;
mod launch;
pub mod metrics;
pub mod models;
pub mod openai_types;
pub mod request;
pub mod stream;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use clap::Args;
use specula_models::tokenizer::{Special, Tokenizer};

use self::admin::Admin;
use self::error::ApiError;
use self::metrics::Metrics;
use crate::drafter::DrafterError;
use crate::drafter_args::DrafterArgs;
use crate::engine::Engine;
use crate::generation::Speculation;
use crate::models::{load_model, ModelArgs};

/// Largest request body accepted (bigger → 413).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Most drafts per round a request may ask for.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// Options of `target-host serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    /// The target model.
    pub model: ModelArgs,
    #[command(flatten)]
    /// The drafter started with the server (more can be swapped in through the admin API).
    pub drafter: DrafterArgs,
    #[command(flatten)]
    /// Batching limits: running sequences, queue, step budget, KV pool.
    pub engine: crate::engine::EngineConfig,
    /// Address to bind. Loopback by default; on any other address the admin API needs
    /// `--admin-token`.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to bind (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Bearer token the admin API requires.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// Model name reported by `/v1/models` (default: the weights' file name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seconds to let in-flight requests finish after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// What every handler shares.
pub struct AppState {
    /// The engine (model, queue, drafter slot).
    pub engine: Engine,
    /// Name clients use in `model`.
    pub model_name: String,
    /// Speculation of requests that don't set `speculative`.
    pub speculation: Speculation,
    /// Drafts per round when a request enables speculation without saying how many.
    pub default_num_draft_tokens: usize,
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Drafter hot-swap state.
    pub admin: Admin,
    /// Unix seconds at start.
    pub started: u64,
}

/// Runs `target-host serve` until SIGINT/SIGTERM.
///
/// # Errors
/// The model or the first drafter failing to load, or the address failing to bind.
pub fn serve(args: ServeArgs) -> Result<()> {
    let loaded = load_model(&args.model)?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        let path = loaded.model.weights_path();
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string())
    });
    let metrics = Arc::new(Metrics::default());
    let engine_config = crate::engine::EngineConfig {
        draft_deadline_cap: args.drafter.client_config().draft_deadline,
        ..args.engine.clone()
    };
    let engine = Engine::start(loaded, None, engine_config)?;
    let launcher = launch::launcher(&engine, &args.drafter);
    let first = match (&args.drafter.drafter, args.drafter.no_speculation) {
        (Some(path), false) => match launcher(path, &args.drafter.drafter_args) {
            Ok(launched) => Some((path.clone(), launched)),
            Err(e)
                if e.downcast_ref::<DrafterError>()
                    .is_some_and(DrafterError::is_handshake_failure) =>
            {
                tracing::warn!("{e}; serving without speculation");
                None
            }
            Err(e) => return Err(e.context(format!("starting drafter {path}"))),
        },
        _ => None,
    };
    let admin = Admin::new(
        args.admin_token.clone(),
        args.host.is_loopback(),
        launcher,
        &metrics,
    );
    if let Some((path, launched)) = first {
        let (proposer, view) = admin.register(
            launched,
            Some(path),
            args.drafter.drafter_args.clone(),
            &metrics,
        );
        tracing::info!(drafter = %view.name, pid = ?view.status.pid, "drafter ready");
        engine.slot().replace(Some(proposer));
    }
    let speculation = if args.drafter.no_speculation {
        Speculation::Off
    } else {
        // Speculate even without a drafter: one may be swapped in later, and with an empty
        // slot a round simply has no drafts.
        args.drafter.speculation()
    };
    let state = Arc::new(AppState {
        engine: engine.clone(),
        model_name,
        speculation,
        default_num_draft_tokens: args.drafter.num_draft_tokens,
        metrics,
        admin,
        started: unix_now(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("http")
        .build()
        .context("starting the tokio runtime")?;
    let addr = SocketAddr::new(args.host, args.port);
    let grace = Duration::from_secs(args.shutdown_timeout);
    let served = runtime.block_on(run(state, addr, grace));
    // Dropping the runtime drops every connection still open, and with them their receivers:
    // the engine cancels what is left.
    runtime.shutdown_timeout(Duration::from_secs(1));
    // Kill the drafter processes and free their shared memory.
    drop(engine.slot().replace(None));
    served
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let admin_routes = Router::new()
        .route("/admin/drafters", get(admin::list).post(admin::install))
        .route("/admin/drafters/current", delete(admin::remove))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admin::guard,
        ));
    Router::new()
        .route("/v1/completions", post(completions::handler))
        .route("/v1/chat/completions", post(chat::handler))
        .route("/v1/models", get(models::list))
        .route("/health", get(models::health))
        .route("/metrics", get(metrics::handler))
        .merge(admin_routes)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn run(state: Arc<AppState>, addr: SocketAddr, grace: Duration) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("listening on http://{local}");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(async move {
        let _ = stop_rx.changed().await;
    });
    let mut server = tokio::spawn(async move { server.await });
    tokio::select! {
        r = &mut server => return r.context("the server task failed")?.context("serving"),
        signal = shutdown_signal() => {
            tracing::info!(
                "{signal}: no new connections; waiting up to {}s for {} request(s)",
                grace.as_secs(),
                state.engine.queue_depth()
            );
        }
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(grace, &mut server).await {
        Ok(r) => r.context("the server task failed")?.context("serving")?,
        Err(_) => {
            tracing::warn!("shutdown grace period over: cancelling the requests left");
            server.abort();
        }
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM, naming it.
async fn shutdown_signal() -> &'static str {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            // Without a SIGTERM handler only Ctrl-C stops the server.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term => "SIGTERM",
    }
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {}", uri.path()),
    )
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// The response of a generation endpoint: `result`, or its error counted under `endpoint`
/// (successes are counted when their stream ends).
pub fn respond(
    state: &AppState,
    endpoint: &'static str,
    result: Result<Response, ApiError>,
) -> Response {
    result.unwrap_or_else(|e| {
        state.metrics.request(endpoint, e.status.as_u16());
        e.into_response()
    })
}

/// Tokenizes a prompt off the async threads (a 4 MiB prompt takes a while).
///
/// # Errors
/// 400 naming `param` when the tokenizer fails.
pub async fn encode(state: &AppState, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    let engine = state.engine.clone();
    let text = text.to_string();
    // Parse special tokens, as Hugging Face and `target-host generate` do.
    let ids = tokio::task::spawn_blocking(move || engine.tokenizer().encode(&text, Special::Parse))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    ids.map_err(|e| ApiError::invalid(param, format!("could not tokenize: {e}")))
}

/// The text of one token as logprobs report it.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id]).unwrap_or_default()
}

/// A fresh response id such as `chatcmpl-5f0c…`.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
