//! `GET /metrics`: counters, gauges and histograms through `prometheus-client` (the official
//! OpenMetrics client), in the OpenMetrics text format Prometheus scrapes.
//!
//! Every series is registered once in one [`Registry`] and labelled through typed label sets, so
//! a name with given labels is one series by construction. Drafter series carry the drafter's
//! `name` and its `instance` (its id in the admin registry): the same drafter swapped in twice is
//! two instances, never two copies of one series. Drafter series are fed by [`Metered`], a
//! [`Proposer`] wrapper the server puts around every drafter it installs, so all drafter kinds
//! (process, in-process) are measured the same way. Process metrics (`process_*`) are read from
//! `/proc/self` at each scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use specula_models::sampling::SamplingParams;

use super::AppState;
use crate::engine::{EngineCounters, EngineSeries, SeriesKind};
use crate::proposer::{
    Draft, DraftBatch, Health, Proposer, SessionId, TapRows, Transfer, Verdict, Wants,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    status: String,
}

/// Labels of a drafter series: its name and its instance id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DrafterLabels {
    /// The drafter's name (`ngram`).
    pub drafter: String,
    /// Its id in the admin registry (1, 2, ... in installation order).
    pub instance: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn rtt_histogram() -> Histogram {
    // 50 µs .. ~1.6 s.
    Histogram::new(exponential_buckets(0.00005, 2.0, 16))
}

fn request_buckets() -> impl Iterator<Item = f64> {
    // 10 ms .. ~5 min.
    exponential_buckets(0.01, 2.0, 15)
}

/// Counters of one drafter instance.
pub struct DrafterMeter {
    /// Drafts offered to the target.
    pub drafted: AtomicU64,
    /// Drafts accepted.
    pub accepted: AtomicU64,
    labels: DrafterLabels,
    metrics: Arc<Inner>,
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

    fn round(&self, drafted: usize, accepted: usize) {
        self.drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted.fetch_add(accepted as u64, Ordering::Relaxed);
        let m = &self.metrics;
        m.drafted.get_or_create(&self.labels).inc_by(drafted as u64);
        m.accepted
            .get_or_create(&self.labels)
            .inc_by(accepted as u64);
        m.rounds.get_or_create(&self.labels).inc();
        m.acceptance
            .get_or_create(&self.labels)
            .set(self.acceptance_rate());
    }
}

struct Inner {
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    cancelled: Counter,
    queue_depth: Gauge,
    ttft: Histogram,
    tpot: Histogram,
    duration: Histogram,
    drafted: Family<DrafterLabels, Counter>,
    accepted: Family<DrafterLabels, Counter>,
    rounds: Family<DrafterLabels, Counter>,
    acceptance: Family<DrafterLabels, Gauge<f64, AtomicU64>>,
    round_trip: HistogramFamily<DrafterLabels>,
    restarts: Family<DrafterLabels, Counter>,
    kv_copied: Family<DrafterLabels, Counter>,
    cpu_seconds: Counter<f64, AtomicU64>,
    resident_bytes: Gauge,
    open_fds: Gauge,
    start_time: Gauge<f64, AtomicU64>,
    /// The engine's series by name, in [`EngineCounters::series`] order.
    engine_gauges: Vec<Gauge<f64, AtomicU64>>,
    engine_counters: Vec<Counter<f64, AtomicU64>>,
}

/// Everything `/metrics` reports.
pub struct Metrics {
    inner: Arc<Inner>,
    registry: Registry,
    restarts: Mutex<Option<RestartSource>>,
}

/// Reads the supervisors' restart counts: (labels, restarts) per drafter instance.
pub type RestartSource = Box<dyn Fn() -> Vec<(DrafterLabels, u64)> + Send>;

impl Default for Metrics {
    fn default() -> Self {
        let inner = Arc::new(Inner {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            cancelled: Counter::default(),
            queue_depth: Gauge::default(),
            ttft: Histogram::new(request_buckets()),
            // 1 ms .. ~2 s per token.
            tpot: Histogram::new(exponential_buckets(0.001, 2.0, 12)),
            duration: Histogram::new(request_buckets()),
            drafted: Family::default(),
            accepted: Family::default(),
            rounds: Family::default(),
            acceptance: Family::default(),
            round_trip: Family::new_with_constructor(rtt_histogram),
            restarts: Family::default(),
            kv_copied: Family::default(),
            cpu_seconds: Counter::default(),
            resident_bytes: Gauge::default(),
            open_fds: Gauge::default(),
            start_time: Gauge::default(),
            engine_gauges: engine_series(SeriesKind::Gauge)
                .map(|_| Gauge::default())
                .collect(),
            engine_counters: engine_series(SeriesKind::Counter)
                .map(|_| Counter::default())
                .collect(),
        });
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        inner.start_time.set(started);
        let mut r = Registry::default();
        let i = &inner;
        for ((name, _, help, _), g) in engine_series(SeriesKind::Gauge).zip(&i.engine_gauges) {
            r.register(name, help, g.clone());
        }
        for ((name, _, help, _), c) in engine_series(SeriesKind::Counter).zip(&i.engine_counters) {
            // prometheus-client appends `_total` to counters itself.
            r.register(name.trim_end_matches("_total"), help, c.clone());
        }
        r.register(
            "specula_requests",
            "HTTP API requests by endpoint and status",
            i.requests.clone(),
        );
        r.register(
            "specula_prompt_tokens",
            "Prompt tokens of finished generations",
            i.prompt_tokens.clone(),
        );
        r.register(
            "specula_generation_tokens",
            "Tokens generated",
            i.generation_tokens.clone(),
        );
        r.register(
            "specula_cancelled_requests",
            "Generations cancelled by a client disconnect",
            i.cancelled.clone(),
        );
        r.register(
            "specula_queue_depth",
            "Requests waiting or running in the engine",
            i.queue_depth.clone(),
        );
        let seconds = |r: &mut Registry, name: &str, help: &str, m: Histogram| {
            r.register_with_unit(name, help, Unit::Seconds, m);
        };
        seconds(
            &mut r,
            "specula_time_to_first_token",
            "Time from request to first token",
            i.ttft.clone(),
        );
        seconds(
            &mut r,
            "specula_time_per_output_token",
            "Mean time between output tokens of a request, after the first",
            i.tpot.clone(),
        );
        seconds(
            &mut r,
            "specula_request_duration",
            "Time from request to last token",
            i.duration.clone(),
        );
        r.register(
            "specula_drafted_tokens",
            "Draft tokens offered to the target",
            i.drafted.clone(),
        );
        r.register(
            "specula_accepted_tokens",
            "Draft tokens the target accepted",
            i.accepted.clone(),
        );
        r.register(
            "specula_draft_rounds",
            "Verify rounds that had drafts",
            i.rounds.clone(),
        );
        r.register(
            "specula_acceptance_rate",
            "Accepted / drafted tokens",
            i.acceptance.clone(),
        );
        r.register_with_unit(
            "specula_drafter_round_trip",
            "Time of one draft request to the drafter",
            Unit::Seconds,
            i.round_trip.clone(),
        );
        r.register(
            "specula_drafter_restarts",
            "Drafter process restarts by the supervisor",
            i.restarts.clone(),
        );
        r.register_with_unit(
            "specula_drafter_kv_copied",
            "K/V rows copied into taps for the drafter (0 when it reads the KV pool in place)",
            Unit::Bytes,
            i.kv_copied.clone(),
        );
        r.register_with_unit(
            "process_cpu",
            "User and system CPU time of the server process",
            Unit::Seconds,
            i.cpu_seconds.clone(),
        );
        r.register_with_unit(
            "process_resident_memory",
            "Resident memory of the server process",
            Unit::Bytes,
            i.resident_bytes.clone(),
        );
        r.register(
            "process_open_fds",
            "Open file descriptors",
            i.open_fds.clone(),
        );
        r.register_with_unit(
            "process_start_time",
            "Start time of the process since the Unix epoch",
            Unit::Seconds,
            i.start_time.clone(),
        );
        Metrics {
            inner,
            registry: r,
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
        self.inner
            .requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.into(),
                status: status.to_string(),
            })
            .inc();
    }

    /// Counts a finished generation that started at `started` and showed its first token at
    /// `first_token` (if it had any).
    pub fn generation(
        &self,
        prompt_tokens: usize,
        generated: usize,
        started: Instant,
        first_token: Option<Instant>,
    ) {
        self.inner.prompt_tokens.inc_by(prompt_tokens as u64);
        self.inner.generation_tokens.inc_by(generated as u64);
        self.inner.duration.observe(started.elapsed().as_secs_f64());
        if let Some(first) = first_token.filter(|_| generated > 1) {
            let per = first.elapsed().as_secs_f64() / (generated - 1) as f64;
            self.inner.tpot.observe(per);
        }
    }

    /// Counts a generation the client walked away from.
    pub fn cancelled(&self) {
        self.inner.cancelled.inc();
    }

    /// Records a time to first token.
    pub fn first_token(&self, started: Instant) {
        self.inner.ttft.observe(started.elapsed().as_secs_f64());
    }

    /// The meter of drafter instance `instance` named `name`.
    pub fn drafter(&self, name: &str, instance: u64) -> Arc<DrafterMeter> {
        Arc::new(DrafterMeter {
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            labels: DrafterLabels {
                drafter: name.to_string(),
                instance: instance.to_string(),
            },
            metrics: self.inner.clone(),
        })
    }

    /// Sets where drafter restart counts come from.
    pub fn set_restart_source(&self, source: RestartSource) {
        *lock(&self.restarts) = Some(source);
    }

    /// The OpenMetrics text, with the engine's `queue_depth` and `engine` counters.
    pub fn render(&self, queue_depth: usize, engine: &EngineCounters) -> String {
        let i = &self.inner;
        i.queue_depth.set(queue_depth as i64);
        let series = engine.series();
        let of = |kind| series.iter().filter(move |s| s.1 == kind);
        for ((_, _, _, v), g) in of(SeriesKind::Gauge).zip(&i.engine_gauges) {
            g.set(*v);
        }
        for ((_, _, _, v), c) in of(SeriesKind::Counter).zip(&i.engine_counters) {
            // Counters only go up: add what the engine counted since the last scrape.
            c.inc_by((v - c.get()).max(0.0));
        }
        if let Some(source) = lock(&self.restarts).as_ref() {
            for (labels, n) in source() {
                let c = i.restarts.get_or_create(&labels);
                // Counters only go up: add what the supervisor counted since the last scrape.
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
        if let Some(p) = ProcessStats::read() {
            i.cpu_seconds
                .inc_by((p.cpu_seconds - i.cpu_seconds.get()).max(0.0));
            i.resident_bytes.set(p.resident_bytes as i64);
            i.open_fds.set(p.open_fds as i64);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("invariant: encoding into a String cannot fail");
        out
    }
}

/// The engine's series of one kind, in [`EngineCounters::series`] order.
fn engine_series(kind: SeriesKind) -> impl Iterator<Item = EngineSeries> {
    EngineCounters::default()
        .series()
        .into_iter()
        .filter(move |s| s.1 == kind)
}

/// What `/proc/self` says about this process.
struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: u64,
    open_fds: usize,
}

impl ProcessStats {
    /// `None` where `/proc` is not mounted.
    fn read() -> Option<ProcessStats> {
        // Linux reports times in USER_HZ, which the kernel ABI fixes at 100.
        const TICKS: f64 = 100.0;
        const PAGE: u64 = 4096;
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the parenthesised command (which may contain spaces).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after `)`.
        let ticks: f64 =
            fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
        Some(ProcessStats {
            cpu_seconds: ticks / TICKS,
            resident_bytes: pages * PAGE,
            open_fds,
        })
    }
}

/// `GET /metrics`.
pub async fn handler(State(state): State<Arc<AppState>>) -> Response {
    state.metrics.request("metrics", 200);
    // Restart counts come from drafter clients, which answer between proposer calls.
    let render = tokio::task::spawn_blocking(move || {
        let engine = state.engine.counters();
        state.metrics.render(state.engine.queue_depth(), &engine)
    });
    match render.await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
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
    /// The inner proposer's copied K/V bytes already counted.
    kv_copied_seen: u64,
}

impl Metered {
    /// Wraps `inner`, counting into `meter`.
    pub fn new(inner: Box<dyn Proposer>, meter: Arc<DrafterMeter>) -> Self {
        Metered {
            inner,
            meter,
            kv_copied_seen: 0,
        }
    }
}

impl Metered {
    /// Adds the K/V bytes the inner proposer copied since the last call to the metric.
    fn count_copies(&mut self) {
        let now = self.inner.transfer().kv_copied_bytes;
        let new = now.saturating_sub(self.kv_copied_seen);
        self.kv_copied_seen = now;
        if new > 0 {
            let m = &self.meter.metrics;
            m.kv_copied.get_or_create(&self.meter.labels).inc_by(new);
        }
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
        self.meter
            .metrics
            .round_trip
            .get_or_create(&self.meter.labels)
            .observe(started.elapsed().as_secs_f64());
        drafts
    }

    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.meter.round(verdict.drafted, verdict.accepted);
        self.inner.commit(session, verdict);
        self.count_copies();
    }

    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        self.inner.advance(session, ids, taps);
        self.count_copies();
    }

    fn transfer(&self) -> Transfer {
        self.inner.transfer()
    }

    fn health(&self) -> Health {
        self.inner.health()
    }

    // Without this the engine never sees a respawn behind the meter and keeps drafting for
    // sessions the new process does not know.
    fn incarnation(&self) -> u64 {
        self.inner.incarnation()
    }

    fn close(&mut self, session: SessionId) {
        self.inner.close(session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_reports_requests_tokens_drafters_and_process() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("completions", 400);
        m.generation(7, 3, Instant::now(), Some(Instant::now()));
        let d = m.drafter("ngram", 1);
        d.round(10, 4);
        // A second instance of the same drafter is its own series.
        m.drafter("ngram", 2).round(2, 2);
        m.set_restart_source(Box::new(|| {
            vec![(
                DrafterLabels {
                    drafter: "ngram".into(),
                    instance: "1".into(),
                },
                3,
            )]
        }));
        let text = m.render(2, &EngineCounters::default());
        for line in [
            "specula_requests_total{endpoint=\"chat\",status=\"200\"} 2\n",
            "specula_requests_total{endpoint=\"completions\",status=\"400\"} 1\n",
            "specula_prompt_tokens_total 7\n",
            "specula_generation_tokens_total 3\n",
            "specula_queue_depth 2\n",
            "specula_acceptance_rate{drafter=\"ngram\",instance=\"1\"} 0.4\n",
            "specula_acceptance_rate{drafter=\"ngram\",instance=\"2\"} 1.0\n",
            "specula_drafter_restarts_total{drafter=\"ngram\",instance=\"1\"} 3\n",
            "specula_time_per_output_token_seconds_count 1\n",
        ] {
            assert!(text.contains(line), "{line:?} missing:\n{text}");
        }
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Scraping again neither duplicates nor double counts.
        let again = m.render(2, &EngineCounters::default());
        assert!(
            again.contains("specula_drafter_restarts_total{drafter=\"ngram\",instance=\"1\"} 3\n")
        );
        assert_eq!(again.matches("specula_drafter_restarts_total{").count(), 1);
    }
}
