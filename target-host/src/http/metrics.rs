//! `GET /metrics`: counters in the Prometheus text format (version 0.0.4), hand-written because
//! a dozen series do not justify a metrics framework.
//!
//! Drafter series are labelled by the drafter's name and fed by [`Metered`], a [`Proposer`]
//! wrapper the server puts around every drafter it installs, so all drafter kinds (process,
//! in-process) are measured the same way.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use specula_models::sampling::SamplingParams;

use super::AppState;
use crate::proposer::{Draft, DraftBatch, Health, Proposer, SessionId, TapRows, Verdict, Wants};

/// A latency histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

/// Bounds for drafter round trips: 50 µs .. 1 s.
const RTT_BOUNDS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Bounds for request-level latencies: 10 ms .. 5 min.
const REQUEST_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| s <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let braced = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braced} {sum}");
        let _ = writeln!(out, "{name}_count{braced} {count}");
    }
}

/// Counters of one drafter name.
pub struct DrafterMeter {
    /// Drafts offered to the target.
    pub drafted: AtomicU64,
    /// Drafts accepted.
    pub accepted: AtomicU64,
    /// Rounds with drafts.
    pub rounds: AtomicU64,
    /// Time of each draft call (request → drafts back).
    pub round_trip: Histogram,
}

impl DrafterMeter {
    /// `accepted / drafted`, 0 before any draft.
    pub fn acceptance_rate(&self) -> f64 {
        let d = self.drafted.load(Ordering::Relaxed);
        if d == 0 {
            0.0
        } else {
            self.accepted.load(Ordering::Relaxed) as f64 / d as f64
        }
    }
}

/// Everything `/metrics` reports.
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    cancelled: AtomicU64,
    ttft: Histogram,
    duration: Histogram,
    drafters: Mutex<BTreeMap<String, Arc<DrafterMeter>>>,
    restarts: Mutex<Option<RestartSource>>,
}

/// Reads the supervisor's restart count of the current drafter.
pub type RestartSource = Box<dyn Fn() -> Vec<(String, u64)> + Send>;

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            ttft: Histogram::new(REQUEST_BOUNDS),
            duration: Histogram::new(REQUEST_BOUNDS),
            drafters: Mutex::default(),
            restarts: Mutex::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Counters stay meaningful after a panic elsewhere; never poison the metrics endpoint.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *lock(&self.requests).entry((endpoint, status)).or_default() += 1;
    }

    /// Counts a finished generation.
    pub fn generation(&self, prompt_tokens: usize, generated: usize, started: Instant) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        self.duration.observe(started.elapsed());
    }

    /// Counts a generation the client walked away from.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a time to first token.
    pub fn first_token(&self, started: Instant) {
        self.ttft.observe(started.elapsed());
    }

    /// The meter of drafter `name` (created on first use; a name swapped in twice keeps
    /// counting where it left off, as Prometheus counters must).
    pub fn drafter(&self, name: &str) -> Arc<DrafterMeter> {
        lock(&self.drafters)
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(DrafterMeter {
                    drafted: AtomicU64::new(0),
                    accepted: AtomicU64::new(0),
                    rounds: AtomicU64::new(0),
                    round_trip: Histogram::new(RTT_BOUNDS),
                })
            })
            .clone()
    }

    /// Sets where drafter restart counts come from.
    pub fn set_restart_source(&self, source: RestartSource) {
        *lock(&self.restarts) = Some(source);
    }

    /// The Prometheus text.
    pub fn render(&self, queue_depth: usize) -> String {
        let mut out = String::new();
        let mut family = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(
            &mut out,
            "specula_requests_total",
            "counter",
            "HTTP API requests by endpoint and status.",
        );
        for ((endpoint, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "specula_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let counters = [
            (
                "specula_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "specula_generation_tokens_total",
                "Tokens generated.",
                &self.generation_tokens,
            ),
            (
                "specula_cancelled_requests_total",
                "Generations cancelled by a client disconnect.",
                &self.cancelled,
            ),
        ];
        for (name, help, v) in counters {
            family(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        }
        family(
            &mut out,
            "specula_queue_depth",
            "gauge",
            "Requests waiting or running in the engine.",
        );
        let _ = writeln!(out, "specula_queue_depth {queue_depth}");
        family(
            &mut out,
            "specula_time_to_first_token_seconds",
            "histogram",
            "Time from request to first token.",
        );
        self.ttft
            .render(&mut out, "specula_time_to_first_token_seconds", "");
        family(
            &mut out,
            "specula_request_duration_seconds",
            "histogram",
            "Time from request to last token.",
        );
        self.duration
            .render(&mut out, "specula_request_duration_seconds", "");
        self.render_drafters(&mut out, &mut family);
        out
    }

    fn render_drafters(
        &self,
        out: &mut String,
        family: &mut dyn FnMut(&mut String, &str, &str, &str),
    ) {
        let drafters = lock(&self.drafters);
        type Series = (&'static str, &'static str, fn(&DrafterMeter) -> String);
        let series: [Series; 4] = [
            (
                "specula_drafted_tokens_total",
                "Draft tokens offered to the target.",
                |m| m.drafted.load(Ordering::Relaxed).to_string(),
            ),
            (
                "specula_accepted_tokens_total",
                "Draft tokens the target accepted.",
                |m| m.accepted.load(Ordering::Relaxed).to_string(),
            ),
            (
                "specula_draft_rounds_total",
                "Verify rounds that had drafts.",
                |m| m.rounds.load(Ordering::Relaxed).to_string(),
            ),
            (
                "specula_acceptance_rate",
                "Accepted / drafted tokens.",
                |m| m.acceptance_rate().to_string(),
            ),
        ];
        for (name, help, value) in series {
            let kind = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            family(out, name, kind, help);
            for (drafter, m) in drafters.iter() {
                let _ = writeln!(
                    out,
                    "{name}{{drafter=\"{}\"}} {}",
                    escape(drafter),
                    value(m)
                );
            }
        }
        let name = "specula_drafter_round_trip_seconds";
        family(
            out,
            name,
            "histogram",
            "Time of one draft request to the drafter.",
        );
        for (drafter, m) in drafters.iter() {
            m.round_trip
                .render(out, name, &format!("drafter=\"{}\"", escape(drafter)));
        }
        drop(drafters);
        family(
            out,
            "specula_drafter_restarts_total",
            "counter",
            "Drafter process restarts by the supervisor.",
        );
        if let Some(source) = lock(&self.restarts).as_ref() {
            for (drafter, n) in source() {
                let _ = writeln!(
                    out,
                    "specula_drafter_restarts_total{{drafter=\"{}\"}} {n}",
                    escape(&drafter)
                );
            }
        }
    }
}

/// Escapes a Prometheus label value.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `GET /metrics`.
pub async fn handler(State(state): State<Arc<AppState>>) -> Response {
    state.metrics.request("metrics", 200);
    // Restart counts come from drafter clients, which answer between proposer calls.
    let render = tokio::task::spawn_blocking(move || {
        // The engine's own series (running/waiting, pool, batch rows, chosen k, prefix
        // cache) are rendered by the engine.
        let mut text = state.metrics.render(state.engine.queue_depth());
        state.engine.counters().render(&mut text);
        text
    });
    match render.await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A [`Proposer`] that counts what passes through it into a [`DrafterMeter`].
pub struct Metered {
    inner: Box<dyn Proposer>,
    meter: Arc<DrafterMeter>,
}

impl Metered {
    /// Wraps `inner`, counting into the meter of its name.
    pub fn new(inner: Box<dyn Proposer>, metrics: &Metrics) -> Self {
        let meter = metrics.drafter(inner.name());
        Metered { inner, meter }
    }
}

impl Proposer for Metered {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn wants(&self) -> Wants {
        self.inner.wants()
    }

    fn open(
        &mut self,
        session: SessionId,
        prompt: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        self.inner.open(session, prompt, sampling, taps);
    }

    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let started = Instant::now();
        let drafts = self.inner.draft(batch);
        self.meter.round_trip.observe(started.elapsed());
        drafts
    }

    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.meter
            .drafted
            .fetch_add(verdict.drafted as u64, Ordering::Relaxed);
        self.meter
            .accepted
            .fetch_add(verdict.accepted as u64, Ordering::Relaxed);
        self.meter.rounds.fetch_add(1, Ordering::Relaxed);
        self.inner.commit(session, verdict);
    }

    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        self.inner.advance(session, ids, taps);
    }

    fn health(&self) -> Health {
        self.inner.health()
    }

    fn close(&mut self, session: SessionId) {
        self.inner.close(session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let mut out = String::new();
        h.render(&mut out, "x", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.01\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 3\n"), "{out}");
    }

    #[test]
    fn render_reports_requests_tokens_and_drafters() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("completions", 400);
        m.generation(7, 3, Instant::now());
        let d = m.drafter("ngram");
        d.drafted.fetch_add(10, Ordering::Relaxed);
        d.accepted.fetch_add(4, Ordering::Relaxed);
        let text = m.render(2);
        assert!(text.contains("specula_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(
            text.contains("specula_requests_total{endpoint=\"completions\",status=\"400\"} 1\n")
        );
        assert!(text.contains("specula_prompt_tokens_total 7\n"));
        assert!(text.contains("specula_generation_tokens_total 3\n"));
        assert!(text.contains("specula_queue_depth 2\n"));
        assert!(text.contains("specula_acceptance_rate{drafter=\"ngram\"} 0.4\n"));
        assert!(
            Arc::ptr_eq(&d, &m.drafter("ngram")),
            "a name keeps its meter"
        );
    }
}
