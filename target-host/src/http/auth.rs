//! Who may call what: API keys for the public API, the admin token, cross-origin refusal and
//! the JSON-only rule — the server's defaults are the safe ones.
//!
//! | layer | applies to | without configuration |
//! |---|---|---|
//! | [`origin_guard`] | every route | any request with an `Origin` (or `Sec-Fetch-Site: cross-site`) is refused, 403 |
//! | [`api_key_guard`] | `/v1/*`, `/tokenize`, `/detokenize` (and `/health`, `/metrics` with `--protect-health-metrics`) | open |
//! | `admin::guard` | `/admin/*` over TCP | off (403) unless an admin token is configured |
//!
//! Secrets come from a file or an environment variable as well as the command line, so they need
//! not show in `ps`. Keys are compared through their SHA-256 digests in constant time, so
//! neither the position of the first wrong byte nor the key's length leaks through timing.
//! POST bodies must be `application/json` (see [`super::error::ApiJson`]): with the origin rule
//! that closes the "simple request" path by which any web page could otherwise post to a local
//! server.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;

/// A set of accepted secrets, stored as digests.
#[derive(Clone, Default)]
pub struct Secrets {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} configured)", self.digests.len())
    }
}

impl Secrets {
    /// Secrets from every source: values given directly (command line, environment) and the
    /// lines of `file` (blank lines and `#` comments skipped).
    ///
    /// # Errors
    /// The file cannot be read, or a secret is empty or has surrounding whitespace.
    pub fn load(values: &[String], file: Option<&Path>, what: &str) -> Result<Secrets> {
        let mut all: Vec<String> = values.to_vec();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the {what} file {}", path.display()))?;
            all.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            );
        }
        let mut digests = Vec::with_capacity(all.len());
        for s in &all {
            anyhow::ensure!(!s.is_empty(), "an empty {what} is not allowed");
            anyhow::ensure!(
                s.trim() == s,
                "the {what} has leading or trailing whitespace"
            );
            digests.push(digest(s.as_bytes()));
        }
        Ok(Secrets { digests })
    }

    /// Whether any secret is configured.
    pub fn is_configured(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Whether `given` is one of the secrets (constant time in the secret's content).
    pub fn accepts(&self, given: &str) -> bool {
        let d = digest(given.as_bytes());
        // Check every key, not stopping at a match: the time depends only on the key count.
        self.digests
            .iter()
            .fold(false, |hit, k| hit | constant_time_eq(k, &d))
    }
}

fn digest(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// Compares two byte strings without an early exit.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The credentials of a request: `Authorization: Bearer X` (scheme case-insensitive, as RFC
/// 7235 says) or Anthropic's `x-api-key: X`.
pub fn credential(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let (scheme, rest) = v.trim().split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| rest.trim_start());
    }
    headers.get("x-api-key").and_then(|v| v.to_str().ok())
}

/// 401 with `WWW-Authenticate: Bearer`.
pub fn unauthorized(code: &'static str, message: &str) -> Response {
    with_challenge(ApiError::new(StatusCode::UNAUTHORIZED, code, message).into_response())
}

fn with_challenge(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// Requires one of the API keys on the routes it layers (a `route_layer`); open when none is
/// configured.
pub async fn api_key_guard(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let keys = &state.access.api_keys;
    if !keys.is_configured() || credential(req.headers()).is_some_and(|k| keys.accepts(k)) {
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_api_key",
        "this server needs an API key: `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
    );
    // Each API's clients parse errors in their own shape.
    match req.uri().path() == "/v1/messages" {
        true => with_challenge(
            (e.status, axum::Json(super::anthropic::anthropic_error(&e))).into_response(),
        ),
        false => with_challenge(e.into_response()),
    }
}

/// Cross-origin policy of the whole server.
#[derive(Debug, Clone, Default)]
pub struct Cors {
    /// Origins allowed to call the API from a browser (`*`: any). Empty: none.
    pub allowed: Vec<String>,
}

impl Cors {
    fn allows(&self, origin: &str) -> bool {
        self.allowed.iter().any(|a| a == "*" || a == origin)
    }
}

/// Refuses requests from web pages unless their origin is allowed (`--cors-allow-origin`), and
/// answers CORS preflights and headers for the allowed ones.
///
/// A browser marks every cross-origin request with `Origin` (and modern ones with
/// `Sec-Fetch-Site`); API clients (curl, SDKs) send neither, so refusing them costs no
/// legitimate caller anything and stops a page from driving a local server.
pub async fn origin_guard(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let cors = &state.access.cors;
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("").to_string());
    let cross_site = req
        .headers()
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("cross-site"));
    let Some(origin) = origin else {
        if cross_site {
            return forbidden_origin("(none)");
        }
        return next.run(req).await;
    };
    if !cors.allows(&origin) {
        return forbidden_origin(&origin);
    }
    let allow = |resp: &mut Response| {
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&origin) {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        }
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    };
    if req.method() == Method::OPTIONS {
        let mut resp = StatusCode::NO_CONTENT.into_response();
        allow(&mut resp);
        let h = resp.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type, x-api-key, anthropic-version"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        return resp;
    }
    let mut resp = next.run(req).await;
    allow(&mut resp);
    resp
}

fn forbidden_origin(origin: &str) -> Response {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "cross_origin_refused",
        format!(
            "cross-origin request from {origin} refused: start the server with \
             --cors-allow-origin to allow a web origin"
        ),
    )
    .into_response()
}

/// Everything the access layers read, built from the command line.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Keys for the public API.
    pub api_keys: Secrets,
    /// `/health` and `/metrics` need an API key too.
    pub protect_health_metrics: bool,
    /// Cross-origin policy.
    pub cors: Cors,
}

/// The drafters the admin API may start: names registered by the operator (built-in drafters
/// next to `target-host`, the one given with `--drafter`) and executables inside the
/// configured drafter directories. Anything else is refused before a process is spawned.
#[derive(Debug, Clone, Default)]
pub struct DrafterPolicy {
    /// Bare names accepted as they are.
    pub names: Vec<String>,
    /// Canonical directories whose executables are accepted.
    pub dirs: Vec<PathBuf>,
    /// Exact executables the operator started (by path).
    pub paths: Vec<PathBuf>,
}

/// Drafters that ship with Specula, found next to `target-host`.
pub const BUILTIN_DRAFTERS: &[&str] = &[
    "ngram",
    "two-model",
    "dflash",
    "mtp",
    "assistant",
    "echo-drafter",
];

impl DrafterPolicy {
    /// The policy for `dirs` plus the operator's own `--drafter` (a name or a path).
    ///
    /// # Errors
    /// A drafter directory that does not exist.
    pub fn new(dirs: &[PathBuf], operator: Option<&str>) -> Result<DrafterPolicy> {
        let mut policy = DrafterPolicy {
            names: BUILTIN_DRAFTERS.iter().map(|s| s.to_string()).collect(),
            ..DrafterPolicy::default()
        };
        for d in dirs {
            let canon = d
                .canonicalize()
                .with_context(|| format!("--drafter-dir {}", d.display()))?;
            anyhow::ensure!(
                canon.is_dir(),
                "--drafter-dir {} is not a folder",
                d.display()
            );
            policy.dirs.push(canon);
        }
        match operator {
            Some(op) if is_bare(op) => policy.names.push(op.to_string()),
            Some(op) => {
                if let Ok(p) = Path::new(op).canonicalize() {
                    policy.paths.push(p);
                }
            }
            None => {}
        }
        Ok(policy)
    }

    /// Checks that `path` (as the admin API received it) names an allowed drafter, and returns
    /// what to spawn: a bare name resolves next to `target-host` or in the first drafter
    /// directory holding it.
    ///
    /// # Errors
    /// 403 naming the path when it is not a registered name and not inside a drafter directory.
    pub fn check(&self, path: &str) -> Result<String, ApiError> {
        if is_bare(path) {
            if self.names.iter().any(|n| n == path) {
                return Ok(path.to_string());
            }
            if let Some(found) = self.dirs.iter().map(|d| d.join(path)).find(|p| p.is_file()) {
                return Ok(found.display().to_string());
            }
        } else if let Ok(canon) = Path::new(path).canonicalize() {
            // Canonical: `..` and symlinks cannot lead out of a drafter directory.
            if self.paths.contains(&canon) || self.dirs.iter().any(|d| canon.starts_with(d)) {
                return Ok(canon.display().to_string());
            }
        }
        Err(ApiError {
            status: StatusCode::FORBIDDEN,
            message: format!(
                "drafter `{path}` is not allowed: use a registered drafter name ({}) or an \
                 executable inside a --drafter-dir",
                self.names.join(", ")
            ),
            param: Some("path".into()),
            code: "drafter_not_allowed",
        })
    }
}

fn is_bare(path: &str) -> bool {
    !path.is_empty() && !path.contains('/') && path != "." && path != ".."
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_digest_from_every_source() {
        let dir = tempdir();
        let file = dir.join("keys");
        std::fs::write(&file, "# keys\nfile-key\n\n  other  \n").unwrap();
        let s = Secrets::load(&["argv-key".into()], Some(&file), "API key").unwrap();
        for k in ["argv-key", "file-key", "other"] {
            assert!(s.accepts(k), "{k}");
        }
        for k in ["argv-ke", "argv-key2", "", "Argv-key"] {
            assert!(!s.accepts(k), "{k}");
        }
        assert!(!Secrets::default().is_configured());
        assert!(Secrets::load(&[String::new()], None, "API key").is_err());
        assert!(Secrets::load(&[], Some(&dir.join("missing")), "API key").is_err());
        assert!(constant_time_eq(b"ab", b"ab") && !constant_time_eq(b"ab", b"aB"));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k", "bearer k", "BEARER  k"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            assert_eq!(credential(&h), Some("k"), "{v}");
        }
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k"));
        assert_eq!(credential(&h), None);
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k"));
        assert_eq!(credential(&h), Some("k"));
    }

    #[test]
    fn drafter_paths_must_be_registered_or_in_a_drafter_dir() {
        let dir = tempdir();
        let inside = dir.join("mine");
        std::fs::write(&inside, "").unwrap();
        let policy = DrafterPolicy::new(std::slice::from_ref(&dir), Some("custom")).unwrap();
        assert_eq!(policy.check("ngram").unwrap(), "ngram");
        assert_eq!(policy.check("custom").unwrap(), "custom");
        let canon = dir.canonicalize().unwrap().join("mine");
        assert_eq!(policy.check("mine").unwrap(), canon.display().to_string());
        assert_eq!(
            policy.check(inside.to_str().unwrap()).unwrap(),
            canon.display().to_string()
        );
        for bad in [
            "/usr/bin/touch",
            "target-host",
            "sh",
            "..",
            &format!("{}/../../usr/bin/touch", dir.display()),
        ] {
            let e = policy.check(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::FORBIDDEN, "{bad}");
            assert_eq!(e.code, "drafter_not_allowed");
        }
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "specula-auth-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
