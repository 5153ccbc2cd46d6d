//! The one interface between the engine and wherever drafts come from.
//!
//! The engine owns the truth (target model, KV cache, sampler); a [`Proposer`] only ever
//! suggests tokens. Whatever a proposer returns is checked by the engine, so a proposer can
//! change speed, never output.
//!
//! Drafting is batched: every engine step makes at most one [`Proposer::draft`] call with one
//! [`DraftAsk`] per running sequence that speculates, so an out-of-process drafter gets one
//! `Draft` message with a row per session and can run one forward for all of them.
//!
//! # What a proposer is told (the engine is the one owner of this)
//! For one session the calls come in the order `open, (draft?, commit | advance)*, close`:
//! - [`Proposer::open`]: the context so far, its last id pending, with the taps of every
//!   position before the pending one when [`Proposer::wants`] asks for taps;
//! - [`Proposer::commit`]: after a step that verified drafts: the accepted drafts and the
//!   target's own token, with the taps of rows `[pending, d1..d_accepted]`;
//! - [`Proposer::advance`]: ids committed *without* drafts (k = 0, a missed deadline, an empty
//!   draft) and the taps of the rows that produced them. The engine holds them back while the
//!   session does not draft and sends them in one call right before its next draft, so a
//!   session that does not draft costs the proposer nothing.
//!
//! So every committed position's taps reach the proposer exactly once, in order, before the
//! session's next draft. After a hot
//! swap, and after a proposer lost its sessions (a respawned drafter process: a new
//! [`Proposer::incarnation`]), the engine opens every session again with the whole context and
//! the taps of every position before the pending one, and re-reads [`Proposer::wants`].

use std::sync::Arc;
use std::time::Duration;

use specula_models::kv_pool::{DonorBlock, DonorLayout, RegionId, BLOCK_SIZE};
use specula_models::sampling::SamplingParams;

/// Identifies one request (a session) across the engine and its proposer.
pub type SessionId = specula_protocol::wire::SessionId;

/// Which target activations a proposer wants to see after every verify forward.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wants {
    /// Hidden-state taps: output of layer `l`, for each listed `l`.
    pub tap_layers: Vec<usize>,
    /// Whether the post-final-norm hidden is wanted as its own tap.
    pub final_hidden: bool,
    /// Layers whose K/V rows the proposer wants to read.
    pub kv_layers: Vec<usize>,
    /// Whether it reads the `kv_layers` in place from the KV pool ([`TapRows::donor`]) rather
    /// than as copied rows ([`TapRows::kv`]).
    pub kv_views: bool,
}

impl Wants {
    /// Whether nothing is wanted.
    pub fn is_empty(&self) -> bool {
        self.tap_layers.is_empty() && !self.final_hidden && self.kv_layers.is_empty()
    }
}

impl From<&specula_protocol::wire::Capabilities> for Wants {
    fn from(caps: &specula_protocol::wire::Capabilities) -> Self {
        Wants {
            tap_layers: caps.tap_layers.iter().map(|&l| l as usize).collect(),
            final_hidden: caps.final_hidden,
            kv_layers: caps.kv_layers.iter().map(|&l| l as usize).collect(),
            kv_views: false,
        }
    }
}

/// One session's row of a batched draft request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftAsk {
    /// The session.
    pub session: SessionId,
    /// The most drafts wanted (at least 1).
    pub n: usize,
}

/// A batched draft request: one ask per session, and how long the engine waits.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftBatch<'a> {
    /// One row per session, sessions distinct.
    pub asks: &'a [DraftAsk],
    /// How long the engine is willing to wait for the whole batch; a proposer that cannot
    /// answer in time returns empty drafts (the engine then decodes those rows without).
    pub deadline: Duration,
}

/// Drafts proposed for one session, already validated against the vocabulary and `n`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    /// Proposed token ids, at most the `n` asked for.
    pub tokens: Vec<u32>,
    /// The proposer's probability rows for each drafted token (`q`), when it sampled them.
    /// `None` means the drafts were chosen deterministically (`q` is one-hot).
    pub q: Option<Vec<Vec<f32>>>,
    /// The proposer's estimate, per drafted token, of the probability that the target accepts
    /// it (0..1), when it sends one; the speculation controller uses it.
    pub confidence: Option<Vec<f32>>,
}

/// What the engine learned in one round with drafts, handed back to the proposer.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict<'a> {
    /// How many drafts were offered for verification.
    pub drafted: usize,
    /// How many of them the target accepted.
    pub accepted: usize,
    /// The ids committed this round: the accepted drafts plus the target's own next token.
    pub committed: &'a [u32],
    /// Target activations of the verified rows `[pending, d1..d_accepted]`, when asked for.
    pub taps: Option<&'a TapRows>,
}

/// Target activations for a window of positions, row-major `f32`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TapRows {
    /// Absolute position of the first row.
    pub pos: usize,
    /// Number of rows.
    pub rows: usize,
    /// One entry per requested layer tap (same order as [`Wants::tap_layers`]): `rows × hidden`.
    pub layers: Vec<Vec<f32>>,
    /// Post-final-norm hidden, `rows × hidden`, when [`Wants::final_hidden`].
    pub final_hidden: Option<Vec<f32>>,
    /// K and V rows per requested layer (same order as [`Wants::kv_layers`]):
    /// `rows × kv_heads × head_dim` each. Empty when [`Wants::kv_views`]: see `donor`.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// With [`Wants::kv_views`]: where the K/V of positions `0..pos + rows` lie in the KV pool's
    /// donor region (the session's block table, epochs stable), instead of copies.
    pub donor: Option<DonorRef>,
}

/// The KV pool's donor region, as a proposer hands it to a drafter (`MapDonors`).
pub struct DonorRegion {
    /// Its id; a new id is a new region (the pool grew or re-exported).
    pub id: RegionId,
    /// A mapping of the memfd.
    pub shm: ipc_channel::ipc::IpcSharedMemory,
    /// Where blocks, epochs and layers are.
    pub layout: DonorLayout,
}

impl PartialEq for DonorRegion {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl std::fmt::Debug for DonorRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DonorRegion")
            .field("id", &self.id)
            .field("bytes", &self.shm.len())
            .field("layout", &self.layout)
            .finish()
    }
}

/// A session's donor K/V in place: the region and the block table of the positions so far.
#[derive(Debug, Clone, PartialEq)]
pub struct DonorRef {
    /// The region (one for every session).
    pub region: Arc<DonorRegion>,
    /// Blocks holding positions `0..len` (`BLOCK_SIZE` each), with their epochs.
    pub table: Vec<DonorBlock>,
}

impl DonorRef {
    /// The table cut to the blocks of positions `0..len`.
    fn upto(&self, len: usize) -> DonorRef {
        DonorRef {
            region: self.region.clone(),
            table: self.table[..len.div_ceil(BLOCK_SIZE).min(self.table.len())].to_vec(),
        }
    }
}

impl TapRows {
    /// Appends `other` (the rows right after these) to these rows.
    ///
    /// # Panics
    /// When `other` does not start where these rows end or carries other taps (an engine bug).
    pub fn extend(&mut self, other: &TapRows) {
        if self.rows == 0 {
            *self = other.clone();
            return;
        }
        assert_eq!(
            other.pos,
            self.pos + self.rows,
            "invariant: tap rows are appended in position order"
        );
        assert_eq!(
            other.layers.len(),
            self.layers.len(),
            "invariant: same taps"
        );
        assert_eq!(other.kv.len(), self.kv.len(), "invariant: same kv layers");
        self.rows += other.rows;
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            a.extend_from_slice(b);
        }
        if let (Some(a), Some(b)) = (&mut self.final_hidden, &other.final_hidden) {
            a.extend_from_slice(b);
        }
        for ((ak, av), (bk, bv)) in self.kv.iter_mut().zip(&other.kv) {
            ak.extend_from_slice(bk);
            av.extend_from_slice(bv);
        }
        if other.donor.is_some() {
            // The later table covers the earlier rows too.
            self.donor = other.donor.clone();
        }
    }

    /// The first `rows` rows.
    pub fn head(&self, rows: usize) -> TapRows {
        self.window(0, rows)
    }

    /// Rows `start..start + rows` of these (clamped to the rows there are).
    pub fn window(&self, start: usize, rows: usize) -> TapRows {
        let start = start.min(self.rows);
        let rows = rows.min(self.rows - start);
        let cut = |v: &Vec<f32>| match self.rows {
            0 => Vec::new(),
            n => {
                let w = v.len() / n;
                v[start * w..(start + rows) * w].to_vec()
            }
        };
        TapRows {
            pos: self.pos + start,
            rows,
            layers: self.layers.iter().map(cut).collect(),
            final_hidden: self.final_hidden.as_ref().map(cut),
            kv: self.kv.iter().map(|(k, v)| (cut(k), cut(v))).collect(),
            donor: self.donor.as_ref().map(|d| d.upto(self.pos + start + rows)),
        }
    }

    /// Bytes of the K/V rows copied into these taps (none when they carry a donor table).
    pub fn kv_bytes(&self) -> u64 {
        let floats: usize = self.kv.iter().map(|(k, v)| k.len() + v.len()).sum();
        (floats * std::mem::size_of::<f32>()) as u64
    }

    /// Bytes of payload.
    pub fn bytes(&self) -> usize {
        let f = self.layers.iter().map(Vec::len).sum::<usize>()
            + self.final_hidden.as_ref().map_or(0, Vec::len)
            + self
                .kv
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        f * std::mem::size_of::<f32>()
    }
}

/// What reached a drafter, for reports: the K/V donor goal is no K/V bytes copied per round.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Transfer {
    /// Rounds reported (commits and advances).
    pub rounds: u64,
    /// Bytes of K/V rows copied for it (into taps; 0 when it reads donor views).
    pub kv_copied_bytes: u64,
    /// Bytes of donor block-table entries sent instead.
    pub donor_table_bytes: u64,
    /// Donor regions handed to it.
    pub donor_maps: u64,
}

impl Transfer {
    /// K/V bytes copied per round.
    pub fn kv_bytes_per_round(&self) -> f64 {
        self.kv_copied_bytes as f64 / self.rounds.max(1) as f64
    }
}

/// How a proposer is doing, as `/health` reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Health {
    /// Answering in time.
    #[default]
    Healthy,
    /// Missing deadlines or restarting: the engine drafts less with it (or not at all) until
    /// it answers in time again.
    Degraded,
    /// It panicked: the engine drafts without it until another proposer is installed.
    Failed,
}

/// Where drafts come from, as the engine sees it. Implemented by the out-of-process drafter
/// client ([`crate::drafter`]) and by in-process adapters used for benchmarks and tests.
///
/// A proposer that fails returns empty drafts: the engine then decodes without speculation.
pub trait Proposer: Send {
    /// A short name for logs and metrics.
    fn name(&self) -> &str;
    /// What the proposer wants to see; re-read by the engine after every hot swap.
    fn wants(&self) -> Wants;
    /// Starts (or restarts) a session whose context is `context`, its last id pending. `taps`,
    /// when [`Proposer::wants`] asked for any, cover positions `0..context.len() - 1`.
    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    );
    /// Drafts for every ask of `batch`: one [`Draft`] per ask, in order (empty on failure).
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft>;
    /// Reports how a session's drafts fared.
    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>);
    /// Reports ids committed to a session without drafts, with the taps of their rows.
    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>);
    /// Ends a session.
    fn close(&mut self, session: SessionId);
    /// How the proposer is doing (default: always healthy).
    fn health(&self) -> Health {
        Health::Healthy
    }
    /// Bumped whenever the proposer forgot its sessions (a drafter process that was respawned);
    /// the engine then opens every session on it again, with its taps. Default: never. A proposer
    /// that wraps another must forward it.
    fn incarnation(&self) -> u64 {
        0
    }
    /// What reached the proposer so far (default: nothing counted). Wrappers forward it.
    fn transfer(&self) -> Transfer {
        Transfer::default()
    }
}

/// The proposer currently in use, swappable while requests run (hot-swap).
///
/// The engine opens each session on whatever proposer is current; before every draft it
/// compares the slot's epoch with the one the session opened on and, after a swap, opens the
/// session again on the new proposer with the whole context so far.
#[derive(Default)]
pub struct ProposerSlot {
    inner: std::sync::Mutex<Current>,
}

/// The slot's content: the current proposer and the epoch it was installed at. Read through
/// [`ProposerSlot::lock`]; only [`ProposerSlot::replace`] changes the epoch.
#[derive(Default)]
pub struct Current {
    epoch: u64,
    proposer: Option<Fused>,
}

impl Current {
    /// Bumped by every [`ProposerSlot::replace`].
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The proposer, or `None` when there is none or it has failed (panicked).
    pub fn proposer(&mut self) -> Option<&mut (dyn Proposer + 'static)> {
        match &mut self.proposer {
            Some(p) if !p.blown() => Some(p),
            _ => None,
        }
    }

    /// Whether a working proposer is installed.
    pub fn is_some(&self) -> bool {
        self.proposer.as_ref().is_some_and(|p| !p.blown())
    }

    /// Which proposer, and which life of it, a session is open on: the slot's epoch and the
    /// proposer's [`Proposer::incarnation`]. Sessions opened under another identity are opened
    /// again before their next draft.
    pub fn identity(&self) -> (u64, u64) {
        let life = self.proposer.as_ref().map_or(0, |p| p.incarnation());
        (self.epoch, life)
    }
}

/// A proposer behind a fuse: a panic in any of its calls is caught at the call, logged, and
/// blows the fuse, so the step goes on without drafts (a drafter bug costs speed, never a
/// request) and the proposer is never called again. Its state after a panic is unknown, so
/// it is only dropped.
struct Fused {
    inner: Box<dyn Proposer>,
    name: String,
    /// Why the fuse blew (set once; `wants` takes `&self`, so it can blow it too).
    failed: std::sync::OnceLock<String>,
}

/// The text of a caught panic's payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

impl Fused {
    fn new(inner: Box<dyn Proposer>) -> Fused {
        let name = inner.name().to_string();
        Fused {
            inner,
            name,
            failed: std::sync::OnceLock::new(),
        }
    }

    fn blown(&self) -> bool {
        self.failed.get().is_some()
    }

    /// The value of a guarded call, or `fallback` after blowing the fuse if it panicked.
    fn caught<R>(&self, what: &str, fallback: R, run: std::thread::Result<R>) -> R {
        run.unwrap_or_else(|panic| {
            let why = panic_message(&*panic);
            tracing::error!(
                drafter = %self.name,
                "the drafter panicked in {what} ({why}): drafting without it until another is installed"
            );
            let _ = self.failed.set(why.to_string());
            fallback
        })
    }

    /// Runs `call` on the proposer unless the fuse has blown.
    fn guard<R>(
        &mut self,
        what: &str,
        fallback: R,
        call: impl FnOnce(&mut dyn Proposer) -> R,
    ) -> R {
        if self.blown() {
            return fallback;
        }
        let inner = &mut *self.inner;
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(inner)));
        self.caught(what, fallback, run)
    }
}

impl Proposer for Fused {
    fn name(&self) -> &str {
        &self.name
    }
    fn wants(&self) -> Wants {
        if self.blown() {
            return Wants::default();
        }
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.inner.wants()));
        self.caught("wants", Wants::default(), run)
    }
    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        self.guard("open", (), |p| p.open(session, context, sampling, taps))
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        let none = vec![Draft::default(); batch.asks.len()];
        self.guard("draft", none, |p| p.draft(batch))
    }
    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.guard("commit", (), |p| p.commit(session, verdict))
    }
    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        self.guard("advance", (), |p| p.advance(session, ids, taps))
    }
    fn close(&mut self, session: SessionId) {
        self.guard("close", (), |p| p.close(session))
    }
    fn health(&self) -> Health {
        match self.blown() {
            true => Health::Failed,
            false => self.inner.health(),
        }
    }
    fn incarnation(&self) -> u64 {
        self.inner.incarnation()
    }
    fn transfer(&self) -> Transfer {
        self.inner.transfer()
    }
}

impl ProposerSlot {
    /// A slot holding `proposer`.
    pub fn new(proposer: Option<Box<dyn Proposer>>) -> Self {
        ProposerSlot {
            inner: std::sync::Mutex::new(Current {
                epoch: 0,
                proposer: proposer.map(Fused::new),
            }),
        }
    }

    /// Installs `proposer` and returns the previous one, which the caller shuts down (by
    /// dropping it) outside the lock.
    pub fn replace(&self, proposer: Option<Box<dyn Proposer>>) -> Option<Box<dyn Proposer>> {
        let mut cur = self.lock();
        cur.epoch += 1;
        std::mem::replace(&mut cur.proposer, proposer.map(Fused::new)).map(|f| f.inner)
    }

    /// The current proposer's health (`None` without a proposer).
    pub fn health(&self) -> Option<Health> {
        self.lock().proposer.as_ref().map(|p| p.health())
    }

    /// Locks the slot. Hold it only across proposer calls, never across a target forward.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        // A panic while holding the lock leaves a proposer in an unknown state, but the slot
        // itself (epoch + box) is always consistent, so poisoning is not an error here.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A proposer shared between the slot (where the engine drives it) and an observer that reads
/// its status or counters (the admin API, a benchmark). Calls lock it for their length.
pub struct Shared<P> {
    inner: std::sync::Arc<std::sync::Mutex<P>>,
    name: String,
}

impl<P: Proposer> Shared<P> {
    /// Shares `proposer`; the returned handle observes it.
    pub fn new(proposer: P) -> (Self, std::sync::Arc<std::sync::Mutex<P>>) {
        let name = proposer.name().to_string();
        let inner = std::sync::Arc::new(std::sync::Mutex::new(proposer));
        (
            Shared {
                inner: inner.clone(),
                name,
            },
            inner,
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, P> {
        // Proposer state stays usable after a panic in another holder: every call is
        // self-contained, and a broken drafter only costs speed.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<P: Proposer> Proposer for Shared<P> {
    fn name(&self) -> &str {
        &self.name
    }
    fn wants(&self) -> Wants {
        self.lock().wants()
    }
    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        self.lock().open(session, context, sampling, taps);
    }
    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        self.lock().draft(batch)
    }
    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        self.lock().commit(session, verdict);
    }
    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        self.lock().advance(session, ids, taps);
    }
    fn close(&mut self, session: SessionId) {
        self.lock().close(session);
    }
    fn health(&self) -> Health {
        self.lock().health()
    }
    fn incarnation(&self) -> u64 {
        self.lock().incarnation()
    }
    fn transfer(&self) -> Transfer {
        self.lock().transfer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(pos: usize, n: usize) -> TapRows {
        TapRows {
            pos,
            rows: n,
            layers: vec![(0..n * 2).map(|i| (pos * 2 + i) as f32).collect()],
            final_hidden: None,
            kv: vec![],
            donor: None,
        }
    }

    #[test]
    fn tap_rows_extend_and_cut_by_row() {
        let mut a = rows(0, 2);
        a.extend(&rows(2, 3));
        assert_eq!(a, rows(0, 5));
        assert_eq!(a.head(1), rows(0, 1));
        assert_eq!(a.window(2, 2), rows(2, 2));
        assert_eq!(a.window(4, 9), rows(4, 1), "clamped to the rows there are");
        assert_eq!(a.bytes(), 10 * 4);
        let mut empty = TapRows::default();
        empty.extend(&rows(4, 1));
        assert_eq!(empty, rows(4, 1));
    }

    #[test]
    #[should_panic(expected = "position order")]
    fn tap_rows_refuse_a_gap() {
        rows(0, 2).extend(&rows(3, 1));
    }
}
