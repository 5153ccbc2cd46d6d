//! The OpenAI-compatible HTTP server (`target-host serve`), its drafter admin API and its
//! Prometheus metrics, on tokio + axum.
//!
//! | route | handler |
//! |---|---|
//! | `POST /v1/completions` | [`completions`] |
//! | `POST /v1/chat/completions` | [`chat`] |
//! | `POST /v1/messages` (Anthropic) | [`anthropic`] |
//! | `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` | [`models`] |
//! | `POST /tokenize`, `POST /detokenize`, `GET /version` | [`tokenize`] |
//! | `GET /metrics` | [`metrics`] |
//! | `GET/POST /admin/drafters`, `DELETE /admin/drafters/current` | [`admin`] |
//!
//! Access rules (API keys, admin token, cross-origin refusal, JSON-only bodies) are in
//! [`auth`]. Requests go to the [`Engine`], which runs them one at a time in arrival order; a client that
//! disconnects drops its event receiver, which cancels its generation. Wire shapes follow
//! OpenAI's API reference; the Specula extensions are documented in [`openai_types`].

pub mod admin;
mod admission;
pub mod anthropic;
pub mod auth;
pub mod chat;
pub mod completions;
pub mod error;
#[cfg(test)]
mod fuzz;
mod launch;
pub mod metrics;
pub mod models;
pub mod openai_types;
pub mod request;
pub mod stream;
pub mod tokenize;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use clap::Args;
use specula_models::chat::RenderedPrompt;
use specula_models::tokenizer::{Special, Tokenizer};

use self::admin::Admin;
use self::auth::{Access, Cors, DrafterPolicy, Secrets};
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
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to bind (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Bearer token of the admin API over TCP (without one the admin API is off there). Visible
    /// in `ps`: prefer `--admin-token-file` or the environment variable SPECULA_ADMIN_TOKEN.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// File holding the admin token (one line).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Also serve the admin API (without a token) on this Unix socket, created with mode 0600.
    #[arg(long)]
    pub admin_socket: Option<PathBuf>,
    /// Folder whose executables the admin API may start as drafters (repeatable); besides these
    /// only the built-in drafter names and the `--drafter` given here are accepted.
    #[arg(long = "drafter-dir")]
    pub drafter_dirs: Vec<PathBuf>,
    /// API key required on `/v1/*`, `/tokenize` and `/detokenize` (repeatable; also the
    /// environment variable SPECULA_API_KEY and `--api-key-file`).
    #[arg(long = "api-key")]
    pub api_keys: Vec<String>,
    /// File of API keys, one per line (`#` comments allowed).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Require the API key on `/health` and `/metrics` too.
    #[arg(long)]
    pub protect_health_metrics: bool,
    /// Web origin allowed to call the API from a browser (repeatable; `*` for any). Without it
    /// every cross-origin request is refused.
    #[arg(long = "cors-allow-origin")]
    pub cors_allow_origins: Vec<String>,
    /// Parse special-token text (`<|im_start|>`) inside chat message content as control tokens.
    /// Off by default, so a user cannot open or close turns; for trusted callers only.
    #[arg(long)]
    pub trust_special_tokens: bool,
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
    /// API keys and the cross-origin policy.
    pub access: Access,
    /// How special-token text in chat content is tokenized.
    pub content_special: Special,
    /// Unix seconds at start.
    pub started: u64,
}

/// Runs `target-host serve` until SIGINT/SIGTERM.
///
/// # Errors
/// The model or the first drafter failing to load, or the address failing to bind.
pub fn serve(args: ServeArgs) -> Result<()> {
    let from_env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if args.admin_token.is_some() {
        tracing::warn!(
            "--admin-token is visible in `ps`: prefer --admin-token-file or SPECULA_ADMIN_TOKEN"
        );
    }
    let admin_token = Secrets::load(
        &[args.admin_token.clone(), from_env("SPECULA_ADMIN_TOKEN")]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>(),
        args.admin_token_file.as_deref(),
        "admin token",
    )?;
    let mut keys = args.api_keys.clone();
    keys.extend(from_env("SPECULA_API_KEY"));
    let access = Access {
        api_keys: Secrets::load(&keys, args.api_key_file.as_deref(), "API key")?,
        protect_health_metrics: args.protect_health_metrics,
        cors: Cors {
            allowed: args.cors_allow_origins.clone(),
        },
    };
    let policy = DrafterPolicy::new(&args.drafter_dirs, args.drafter.drafter.as_deref())?;
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
    // Build the grammar vocabulary now, off the request path (the first response_format
    // request would otherwise wait for it).
    let warm = engine.clone();
    std::thread::spawn(move || crate::grammar::Vocab::of(warm.tokenizer()).map(drop));
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
    let admin = Admin::new(admin_token, policy, launcher, &metrics);
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
        access,
        content_special: match args.trust_special_tokens {
            true => Special::Parse,
            false => Special::Plain,
        },
        started: unix_now(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("http")
        .build()
        .context("starting the tokio runtime")?;
    let addr = SocketAddr::new(args.host, args.port);
    let grace = Duration::from_secs(args.shutdown_timeout);
    let served = runtime.block_on(run(state, addr, args.admin_socket.as_deref(), grace));
    // Dropping the runtime drops every connection still open, and with them their receivers:
    // the engine cancels what is left.
    runtime.shutdown_timeout(Duration::from_secs(1));
    // Kill the drafter processes and free their shared memory.
    drop(engine.slot().replace(None));
    served
}

fn admin_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/drafters", get(admin::list).post(admin::install))
        .route("/admin/drafters/current", delete(admin::remove))
}

/// The TCP router over `state`: the public API behind the API key, the admin API behind the
/// admin token, and every route behind the cross-origin rule.
pub fn router(state: Arc<AppState>) -> Router {
    let key = || axum::middleware::from_fn_with_state(state.clone(), auth::api_key_guard);
    let api = Router::new()
        .route("/v1/completions", post(completions::handler))
        .route("/v1/chat/completions", post(chat::handler))
        .route("/v1/messages", post(anthropic::handler))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::retrieve))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(key());
    let mut ops = Router::new()
        .route("/health", get(models::health))
        .route("/metrics", get(metrics::handler))
        .route("/version", get(tokenize::version));
    if state.access.protect_health_metrics {
        ops = ops.route_layer(key());
    }
    let admin = admin_routes().route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        admin::guard,
    ));
    Router::new()
        .merge(api)
        .merge(ops)
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::origin_guard,
        ))
        .with_state(state)
}

/// The admin API alone, for the Unix socket (whose file mode is its access control).
fn admin_router(state: Arc<AppState>) -> Router {
    admin_routes()
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Binds a Unix socket at `path` that only this user can connect to. The socket is created in
/// a fresh 0700 folder, made 0600, then renamed into place, so it is never reachable with
/// looser permissions.
fn bind_private_socket(path: &Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        anyhow::ensure!(
            meta.file_type().is_socket(),
            "--admin-socket {}: exists and is not a socket",
            path.display()
        );
        // A stale socket from an earlier run.
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = parent.join(format!(".specula-admin-{}", std::process::id()));
    std::fs::create_dir(&staging).with_context(|| format!("creating {}", staging.display()))?;
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o700))?;
    let tmp = staging.join("sock");
    let bound = (|| -> Result<tokio::net::UnixListener> {
        let listener = tokio::net::UnixListener::bind(&tmp)
            .with_context(|| format!("binding {}", tmp.display()))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("moving the socket to {}", path.display()))?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    bound
}

async fn run(
    state: Arc<AppState>,
    addr: SocketAddr,
    admin_socket: Option<&Path>,
    grace: Duration,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let socket = match admin_socket {
        Some(path) => {
            let unix = bind_private_socket(path)?;
            let mut stop = stop_rx.clone();
            let admin =
                axum::serve(unix, admin_router(state.clone())).with_graceful_shutdown(async move {
                    let _ = stop.changed().await;
                });
            eprintln!("admin API on unix:{}", path.display());
            Some((tokio::spawn(async move { admin.await }), path.to_path_buf()))
        }
        None => None,
    };
    eprintln!("listening on http://{local}");
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(async move {
        let _ = stop_rx.changed().await;
    });
    let mut server = tokio::spawn(async move { server.await });
    let result = serve_until_signal(&state, &mut server, stop_tx, grace).await;
    if let Some((task, path)) = socket {
        task.abort();
        let _ = std::fs::remove_file(path);
    }
    result
}

async fn serve_until_signal(
    state: &AppState,
    server: &mut tokio::task::JoinHandle<std::io::Result<()>>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    grace: Duration,
) -> Result<()> {
    tokio::select! {
        r = &mut *server => return r.context("the server task failed")?.context("serving"),
        signal = shutdown_signal() => {
            tracing::info!(
                "{signal}: no new connections; waiting up to {}s for {} request(s)",
                grace.as_secs(),
                state.engine.queue_depth()
            );
        }
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(grace, &mut *server).await {
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

/// Refuses a prompt that cannot fit the context before the whole of it is tokenized
/// (megabytes take seconds): a long text's head is tokenized first, and when the head alone
/// overflows the context the prompt is refused.
///
/// # Errors
/// 400 `context_length_exceeded` naming `param`.
pub async fn check_prompt_size(state: &AppState, text: &str, param: &str) -> Result<(), ApiError> {
    /// Head size in bytes per context token: heads of ordinary text have 3-5 bytes a token.
    const HEAD_BYTES_PER_TOKEN: usize = 16;
    let context = state.engine.model().context_len();
    let head_len = context.saturating_mul(HEAD_BYTES_PER_TOKEN);
    if text.len() <= head_len {
        return Ok(());
    }
    let mut cut = head_len;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let head = text[..cut].to_string();
    let engine = state.engine.clone();
    let n = tokio::task::spawn_blocking(move || engine.tokenizer().encode(&head, Special::Plain))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(|e| ApiError::invalid(param, format!("could not tokenize: {e}")))?
        .len();
    // One token of slack for a token the cut may have split in two.
    if n > context {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "the prompt is {} bytes; its first {cut} bytes alone are {n} tokens, and the \
                 model's context is {context} tokens",
                text.len()
            ),
            param: Some(param.into()),
            code: "context_length_exceeded",
        });
    }
    Ok(())
}

/// Tokenizes a raw prompt off the async threads (a 4 MiB prompt takes a while). Special-token
/// text is parsed: a raw prompt is the caller's whole prompt, template tokens included.
///
/// # Errors
/// 400 naming `param` when the tokenizer fails.
pub async fn encode(state: &AppState, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    let prompt = RenderedPrompt {
        segments: vec![(text.to_string(), Special::Parse)],
    };
    encode_rendered(state, prompt, param).await
}

/// Tokenizes a rendered chat prompt off the async threads.
///
/// # Errors
/// 400 naming `param` when the tokenizer fails.
pub async fn encode_rendered(
    state: &AppState,
    prompt: RenderedPrompt,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    let engine = state.engine.clone();
    let ids = tokio::task::spawn_blocking(move || prompt.encode(engine.tokenizer()))
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
