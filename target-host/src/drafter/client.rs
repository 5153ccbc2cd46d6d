//! [`DrafterClient`]: a drafter process behind the [`Proposer`] trait.
//!
//! One `Draft` message per engine step carries a row per session (batched drafting). Every
//! call is synchronous and bounded: `draft` waits for the reply until the engine's deadline
//! (a few target steps, capped by [`ClientConfig::draft_deadline`]) and returns empty drafts
//! when it misses it; a reply that comes later carries a stale sequence number and is dropped.
//! Misses lower the drafter's budget ([`Pace`]): fewer drafts, then none but a probe that
//! nobody waits for, until it answers in time again; meanwhile [`Proposer::health`] says
//! degraded.
//!
//! **Respawn.** A respawned drafter knows no session. The client forgets them too and bumps
//! its [`Proposer::incarnation`]; the engine, which holds every session's context and taps,
//! opens them again before their next draft (one owner of what a drafter is told).
//!
//! **Large tap windows.** An `Open` whose taps do not fit half the shared ring is split: an
//! `Open` with the first rows, then `Advance`s with the rest, each written only after a ping
//! (`Draft { rows: [] }`, answered in order) shows the drafter has read the one before, so no
//! window overwrites another that is still unread. Drafts are capped so that a `Commit`'s
//! `accepted + 1` rows always fit. An `Advance` of rounds the engine held back (many rounds
//! without drafts, told at once) is split into windows the same way.
//!
//! **K/V donor views (1.2).** A drafter whose Hello set `kv_donor_views` reads its `kv_layers`
//! in place from the KV pool's donor region: the taps then carry each session's block table
//! ([`crate::proposer::DonorRef`]) instead of K/V rows. The client sends `MapDonors` once per
//! region and drafter process (again after a respawn, or when the pool's region grew), and after
//! every `Open`, `Commit` or `Advance` a `DonorTables` delta (the entries kept, those appended,
//! the committed length), so the `Draft` that follows reads the rows committed so far. An older
//! drafter gets the rows copied into its taps, as before; [`DrafterStats::kv_copied_bytes`]
//! counts those bytes either way.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ipc_channel::TryRecvError;
use specula_models::sampling::SamplingParams;
use specula_protocol::donor::DonorBlock;
use specula_protocol::shm::{KvView, RegionId, ShmWriter, TapViews};
use specula_protocol::version::Version;
use specula_protocol::wire::{
    Advance, Capabilities, Close, Commit, DonorTable, DonorTables, Draft as DraftRequest, DraftRow,
    DrafterMsg, MapDonors, Open, Proposed, Request, SamplingSpec, TargetInfo,
};
use tracing::{debug, warn};

use super::handshake::Connection;
use super::pace::Pace;
use super::supervisor::Supervisor;
use super::validate::validate_rows;
use super::{ClientConfig, DrafterError, DrafterSpec, DrafterState, DrafterStats};
use crate::proposer::{Draft, DraftBatch, Health, Proposer, SessionId, TapRows, Verdict, Wants};

/// The version that brought `Advance`.
const ADVANCE: Version = Version { major: 1, minor: 1 };

/// The version that brought K/V donor views (`MapDonors`, `DonorTables`).
const DONOR_VIEWS: Version = Version { major: 1, minor: 2 };

/// What the client tracks of an open session.
#[derive(Debug)]
struct Mirror {
    step: u64,
    /// Ids committed without drafts that the drafter has not heard of yet (sent as the next
    /// row's `new_tokens`).
    unheard: Vec<u32>,
    /// The donor block table as the drafter holds it (views only).
    donor_table: Vec<DonorBlock>,
}

/// A drafter process, supervised, as a [`Proposer`].
#[derive(Debug)]
pub struct DrafterClient {
    sup: Supervisor,
    target: TargetInfo,
    config: ClientConfig,
    name: String,
    caps: Capabilities,
    sessions: HashMap<SessionId, Mirror>,
    stats: DrafterStats,
    bad_in_row: u32,
    pace: Pace,
    /// Whether the running drafter reads its `kv_layers` as donor views.
    kv_views: bool,
    /// The donor region the running drafter process has mapped.
    donor_mapped: Option<RegionId>,
}

/// The protocol's form of the sampling parameters.
pub(super) fn sampling_spec(p: &SamplingParams) -> SamplingSpec {
    SamplingSpec {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.map(|k| k.min(u32::MAX as usize) as u32),
        min_p: p.min_p,
        seed: p.seed,
    }
}

impl DrafterClient {
    /// Spawns the drafter and waits until it is ready.
    ///
    /// # Errors
    /// Every way a drafter can fail to start ([`DrafterError`]): missing or non-executable path,
    /// exit or timeout during the handshake, no common protocol version, refused target.
    pub fn start(
        spec: DrafterSpec,
        target: TargetInfo,
        config: ClientConfig,
    ) -> Result<Self, DrafterError> {
        let mut sup = Supervisor::start(spec, target.clone(), config.clone())?;
        let conn = sup
            .connection()
            .expect("invariant: a started supervisor is ready");
        let (name, caps) = (conn.hello.name.clone(), conn.hello.capabilities.clone());
        let kv_views = reads_donor_views(conn);
        let mut client = DrafterClient {
            sup,
            target,
            config,
            name,
            caps,
            sessions: HashMap::new(),
            stats: DrafterStats::default(),
            bad_in_row: 0,
            pace: Pace::new(0),
            kv_views,
            donor_mapped: None,
        };
        client.pace = Pace::new(client.max_draft());
        Ok(client)
    }

    /// Where the drafter is in its lifecycle.
    pub fn state(&self) -> DrafterState {
        self.sup.state()
    }

    /// The counters so far.
    pub fn stats(&self) -> DrafterStats {
        DrafterStats {
            restarts: self.sup.restarts(),
            ..self.stats.clone()
        }
    }

    /// The drafter's capabilities, as it announced them.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// Whether the running drafter's messages travel through a doorbell (protocol ≥ 1.3, both
    /// sides willing) rather than the socket.
    pub fn doorbell(&mut self) -> bool {
        self.sup.connection().is_some_and(|c| c.has_doorbell())
    }

    /// The drafter's process id, when one is running and ready.
    pub fn pid(&mut self) -> Option<u32> {
        self.sup.connection().map(|c| c.child.pid())
    }

    /// Moves a pending respawn along (also done by every `Proposer` call); returns the state.
    /// A fresh drafter knows no session: they are forgotten here and the engine, seeing a new
    /// [`Proposer::incarnation`], opens them again with their context and taps.
    pub fn poll(&mut self) -> DrafterState {
        if self.sup.poll() {
            self.sessions.clear();
            // A new process has mapped nothing.
            self.donor_mapped = None;
            if let Some(conn) = self.sup.connection() {
                self.kv_views = reads_donor_views(conn);
            }
            self.pace = Pace::new(self.max_draft());
        }
        self.sup.state()
    }

    /// Bytes of one position's taps (every tap layer, the final hidden, K and V per KV layer).
    fn tap_row_bytes(&self) -> usize {
        let hidden = self.target.hidden_size as usize;
        let kv = (self.target.num_kv_heads * self.target.head_dim) as usize;
        let floats = hidden * (self.caps.tap_layers.len() + usize::from(self.caps.final_hidden))
            + 2 * kv * self.copied_kv_layers();
        floats * std::mem::size_of::<f32>()
    }

    /// K/V layers whose rows travel in the taps (none with donor views).
    fn copied_kv_layers(&self) -> usize {
        match self.kv_views {
            true => 0,
            false => self.caps.kv_layers.len(),
        }
    }

    /// Tells the drafter where `session`'s donor K/V are now (views only): `MapDonors` for a
    /// region it has not mapped, then the table delta and the committed length. Counts the K/V
    /// bytes that were copied into the taps instead, when there were any.
    fn donor_update(&mut self, session: SessionId, taps: Option<&TapRows>) {
        let Some(taps) = taps else {
            return;
        };
        self.stats.kv_copied_bytes += taps.kv_bytes();
        let Some(donor) = taps.donor.as_ref().filter(|_| self.kv_views) else {
            return;
        };
        if self.donor_mapped != Some(donor.region.id) {
            let map = MapDonors {
                region: donor.region.id,
                shm: donor.region.shm.clone(),
                layout: donor.region.layout.clone(),
            };
            self.send(|_, _| Request::MapDonors(map));
            self.donor_mapped = Some(donor.region.id);
            self.stats.donor_maps += 1;
        }
        let Some(mirror) = self.sessions.get_mut(&session) else {
            return;
        };
        let keep = mirror
            .donor_table
            .iter()
            .zip(&donor.table)
            .take_while(|(a, b)| a == b)
            .count();
        let append = donor.table[keep..].to_vec();
        mirror.donor_table.clone_from(&donor.table);
        // A table entry is a block id and an epoch: 12 bytes of a postcard message.
        self.stats.donor_table_bytes += 12 * append.len() as u64;
        let table = DonorTable {
            session,
            keep: keep as u32,
            append,
            len: (taps.pos + taps.rows) as u64,
        };
        self.send(|_, _| {
            Request::DonorTables(DonorTables {
                tables: vec![table],
            })
        });
    }

    /// The most tap rows one message may carry: half the ring (so that the window before it,
    /// possibly unread, is never overwritten), less each tensor's alignment.
    fn rows_per_message(&self) -> usize {
        let tensors = self.caps.tap_layers.len()
            + usize::from(self.caps.final_hidden)
            + 2 * self.copied_kv_layers();
        let room = (self.config.region_bytes / 2).saturating_sub(tensors * SHM_ALIGN);
        room / self.tap_row_bytes().max(1)
    }

    /// The most drafts per row: the drafter's own limit, and what a `Commit`'s taps can carry.
    fn max_draft(&self) -> usize {
        let max = self.caps.max_draft_len as usize;
        match self.caps.wants_activations() {
            true => max.min(self.rows_per_message().saturating_sub(1)),
            false => max,
        }
    }

    /// Sends an `Open` with `taps`, split into `Open` + `Advance`s when they do not fit one
    /// message (see the module docs).
    fn open_split(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: SamplingSpec,
        taps: &TapRows,
    ) {
        let per = self.rows_per_message().max(1);
        let first = taps.rows.min(per);
        let head = taps.head(first);
        self.send(|conn, target| {
            let region = conn.region.as_mut().expect("invariant: taps need a region");
            Request::Open(Open {
                session,
                prompt_ids: context[..=first].to_vec(),
                sampling,
                prompt_taps: write_taps(region, &head, target),
            })
        });
        if first < taps.rows {
            let rest = taps.window(first, taps.rows - first);
            self.advance_windows(session, &context[first + 1..=taps.rows], &rest, true);
            self.stats.split_opens += 1;
        }
    }

    /// Sends `ids` with `taps` (row `i` is the position before `ids[i]`) as `Advance`s of at
    /// most [`Self::rows_per_message`] rows, pinging before each (the first too when
    /// `ping_first`) so that no window overwrites one still unread. Returns whether the
    /// drafter answered every ping.
    fn advance_windows(
        &mut self,
        session: SessionId,
        ids: &[u32],
        taps: &TapRows,
        ping_first: bool,
    ) -> bool {
        let per = self.rows_per_message().max(1);
        let mut at = 0;
        while at < taps.rows {
            if (at > 0 || ping_first) && !self.barrier() {
                return false;
            }
            let rows = (taps.rows - at).min(per);
            let window = taps.window(at, rows);
            let ids = ids[at..at + rows].to_vec();
            self.send(|conn, target| {
                let region = conn.region.as_mut().expect("invariant: taps need a region");
                Request::Advance(Advance {
                    session,
                    ids,
                    taps: write_taps(region, &window, target),
                })
            });
            at += rows;
        }
        true
    }

    /// Pings the drafter and waits for the answer, which comes after it handled every earlier
    /// message (and read their taps). A drafter that does not answer within the handshake
    /// timeout is restarted. Returns whether it answered.
    pub fn barrier(&mut self) -> bool {
        let seq = match self.sup.connection() {
            Some(conn) => conn.send(Request::Draft(DraftRequest { rows: Vec::new() })),
            None => return false,
        };
        let seq = match seq {
            Ok(seq) => seq,
            Err(e) => {
                self.sup.restart(&e.to_string());
                return false;
            }
        };
        let until = Instant::now() + self.config.handshake_timeout;
        if self.recv(seq, until).is_some() {
            return true;
        }
        if self.sup.connection().is_some() {
            self.sup
                .restart("the drafter did not read its taps within the handshake timeout");
        }
        false
    }

    /// Sends a one-way request; a failure means the drafter is gone.
    fn send(&mut self, make: impl FnOnce(&mut Connection, &TargetInfo) -> Request) {
        let Some(conn) = self.sup.connection() else {
            return;
        };
        let request = make(conn, &self.target);
        if let Err(e) = conn.send(request) {
            self.sup.restart(&e.to_string());
        }
    }

    fn discard(&mut self, reason: &str) {
        self.stats.discarded += 1;
        self.bad_in_row += 1;
        debug!(drafter = %self.name, reason, "draft discarded");
        if self.bad_in_row >= self.config.max_bad_replies {
            self.bad_in_row = 0;
            self.sup.restart(&format!(
                "{} bad replies in a row, the last: {reason}",
                self.config.max_bad_replies
            ));
        }
    }

    fn record_rtt(&mut self, since: Instant) {
        let us = since.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        if self.stats.rtt_us.len() >= self.config.rtt_samples {
            self.stats.rtt_us.pop_front();
        }
        self.stats.rtt_us.push_back(us);
    }
}

/// Whether the drafter on `conn` reads its `kv_layers` as donor views: it asked, it wants K/V,
/// and the negotiated protocol has the messages.
fn reads_donor_views(conn: &Connection) -> bool {
    conn.hello.kv_donor_views
        && !conn.hello.capabilities.kv_layers.is_empty()
        && conn.tx.version() >= DONOR_VIEWS
}

/// Alignment of every tensor in the shared ring (`specula_protocol::shm`).
const SHM_ALIGN: usize = 64;

/// Writes a window of activations into the region. The client sizes every window to fit
/// ([`DrafterClient::rows_per_message`]); a write that fails anyway is logged, and the
/// drafter then sees a message without taps (a hole it recovers from at the next `Open`).
fn write_taps(region: &mut ShmWriter, taps: &TapRows, target: &TargetInfo) -> Option<TapViews> {
    let rows = u32::try_from(taps.rows).ok().filter(|&r| r > 0)?;
    let mut write = |data: &[f32], inner: &[u32]| {
        let want: usize = inner.iter().map(|&d| d as usize).product::<usize>() * rows as usize;
        let shape: Vec<u32> = match data.len() == want {
            true => std::iter::once(rows).chain(inner.iter().copied()).collect(),
            false => vec![rows, (data.len() / rows as usize) as u32],
        };
        region.write_f32(data, &shape)
    };
    let hidden = [target.hidden_size];
    let head = [target.num_kv_heads, target.head_dim];
    let views = (|| -> specula_protocol::Result<TapViews> {
        Ok(TapViews {
            pos: taps.pos as u64,
            rows,
            layers: taps
                .layers
                .iter()
                .map(|l| write(l, &hidden))
                .collect::<Result<_, _>>()?,
            final_hidden: taps
                .final_hidden
                .as_deref()
                .map(|h| write(h, &hidden))
                .transpose()?,
            kv: taps
                .kv
                .iter()
                .map(|(k, v)| {
                    Ok(KvView {
                        k: write(k, &head)?,
                        v: write(v, &head)?,
                    })
                })
                .collect::<specula_protocol::Result<_>>()?,
        })
    })();
    views
        .map_err(|e| warn!(error = %e, bytes = taps.bytes(), "taps not delivered"))
        .ok()
}

impl Proposer for DrafterClient {
    fn name(&self) -> &str {
        &self.name
    }

    fn wants(&self) -> Wants {
        Wants {
            kv_views: self.kv_views,
            ..Wants::from(&self.caps)
        }
    }

    fn open(
        &mut self,
        session: SessionId,
        context: &[u32],
        sampling: &SamplingParams,
        taps: Option<&TapRows>,
    ) {
        self.poll();
        let sampling = sampling_spec(sampling);
        let mirror = Mirror {
            step: 0,
            unheard: Vec::new(),
            donor_table: Vec::new(),
        };
        self.sessions.insert(session, mirror);
        let region = self.sup.connection().is_some_and(|c| c.region.is_some());
        let speaks_advance = self
            .sup
            .connection()
            .is_some_and(|c| c.tx.version() >= ADVANCE);
        match taps.filter(|t| t.rows > 0 && region) {
            // Taps of the context before the pending id: `context[..=rows]` ends at it.
            Some(taps) if taps.rows + 1 == context.len() && speaks_advance => {
                self.open_split(session, context, sampling, taps)
            }
            taps => {
                if taps.is_some_and(|t| t.rows > self.rows_per_message()) {
                    // A 1.0 peer has no `Advance` to carry the rest (catch-up rule 2).
                    self.stats.taps_undelivered += 1;
                }
                self.send(|conn, target| {
                    let prompt_taps = match (&mut conn.region, taps) {
                        (Some(region), Some(taps)) => write_taps(region, taps, target),
                        _ => None,
                    };
                    Request::Open(Open {
                        session,
                        prompt_ids: context.to_vec(),
                        sampling,
                        prompt_taps,
                    })
                })
            }
        }
        // After the `Open` (which starts the drafter's table afresh): the whole table.
        self.donor_update(session, taps);
    }

    fn draft(&mut self, batch: &DraftBatch<'_>) -> Vec<Draft> {
        self.poll();
        let empty = vec![Draft::default(); batch.asks.len()];
        if self.sup.connection().is_none() {
            return empty;
        }
        self.check_probe();
        let budget = self.pace.budget();
        let probing = budget == 0;
        if probing && self.pace.probing() {
            // A probe is out: wait for it (never for longer than now) before asking again.
            return empty;
        }
        let max = self.max_draft();
        let mut rows = Vec::with_capacity(batch.asks.len());
        let mut asked = Vec::with_capacity(batch.asks.len());
        for ask in batch.asks {
            let n = match probing {
                true => 1,
                false => ask.n.min(max).min(budget),
            };
            let Some(mirror) = self.sessions.get_mut(&ask.session) else {
                warn!(
                    session = ask.session,
                    "draft for a session that is not open"
                );
                asked.push(0);
                continue;
            };
            let step = mirror.step;
            mirror.step += 1;
            rows.push(DraftRow {
                session: ask.session,
                new_tokens: std::mem::take(&mut mirror.unheard),
                n: n as u32,
                step,
            });
            asked.push(n);
        }
        if rows.is_empty() {
            return empty;
        }
        let sent_at = Instant::now();
        let seq = {
            let conn = self.sup.connection().expect("invariant: checked above");
            conn.send(Request::Draft(DraftRequest { rows: rows.clone() }))
        };
        let seq = match seq {
            Ok(seq) => seq,
            Err(e) => {
                self.sup.restart(&e.to_string());
                return empty;
            }
        };
        self.stats.requests += 1;
        let deadline = batch.deadline.min(self.config.draft_deadline);
        if probing {
            // Nobody waits for a probe: its round trip, read on a later step, decides whether
            // the drafter is back in time.
            self.pace.probe_sent(seq, sent_at, deadline);
            return empty;
        }
        let Some(drafted) = self.recv(seq, sent_at + deadline) else {
            self.pace.missed();
            return empty;
        };
        self.record_rtt(sent_at);
        self.pace.answered(max);
        // Rows come back in the order asked; asks for unknown sessions were not sent.
        let sent: Vec<(SessionId, usize)> = batch
            .asks
            .iter()
            .zip(&asked)
            .filter(|(_, &n)| n > 0)
            .map(|(a, &n)| (a.session, n))
            .collect();
        let rows = match validate_rows(drafted, &sent, self.target.vocab_size) {
            Ok(rows) => rows,
            Err(reason) => {
                self.discard(&reason);
                return empty;
            }
        };
        let mut rows = rows.into_iter();
        let mut out = Vec::with_capacity(batch.asks.len());
        for &n in &asked {
            if n == 0 {
                out.push(Draft::default());
                continue;
            }
            match rows
                .next()
                .expect("invariant: one checked row per sent row")
            {
                Ok(row) => {
                    self.bad_in_row = 0;
                    self.stats.drafted += row.tokens.len() as u64;
                    out.push(Draft {
                        tokens: row.tokens,
                        q: row.q,
                        confidence: row.confidence,
                    });
                }
                Err(reason) => {
                    self.discard(&reason);
                    out.push(Draft::default());
                }
            }
        }
        out
    }

    fn commit(&mut self, session: SessionId, verdict: &Verdict<'_>) {
        if !self.sessions.contains_key(&session) {
            return;
        }
        self.stats.accepted += verdict.accepted as u64;
        self.send(|conn, target| {
            let taps = match (&mut conn.region, verdict.taps) {
                (Some(region), Some(taps)) => write_taps(region, taps, target),
                _ => None,
            };
            Request::Commit(Commit {
                session,
                drafted: verdict.drafted as u32,
                accepted: verdict.accepted as u32,
                accepted_ids: verdict.committed.to_vec(),
                taps,
            })
        });
        self.stats.rounds += 1;
        self.donor_update(session, verdict.taps);
    }

    fn advance(&mut self, session: SessionId, ids: &[u32], taps: Option<&TapRows>) {
        let Some(mirror) = self.sessions.get_mut(&session) else {
            return;
        };
        let speaks_advance = self
            .sup
            .connection()
            .is_some_and(|c| c.tx.version() >= ADVANCE);
        if !speaks_advance {
            // A protocol 1.0 peer hears these ids as the `new_tokens` of its next draft row;
            // the taps of their rows have no message to travel in.
            mirror.unheard.extend_from_slice(ids);
            if taps.is_some() && self.caps.wants_activations() {
                self.stats.taps_undelivered += 1;
            }
            return;
        }
        match taps {
            // Rounds held back by the engine can add up to more rows than one window holds.
            Some(t) if t.rows == ids.len() && t.rows > self.rows_per_message().max(1) => {
                if !self.advance_windows(session, ids, t, false) {
                    return;
                }
                self.stats.split_advances += 1;
            }
            _ => self.send(|conn, target| {
                let taps = match (&mut conn.region, taps) {
                    (Some(region), Some(taps)) => write_taps(region, taps, target),
                    _ => None,
                };
                Request::Advance(Advance {
                    session,
                    ids: ids.to_vec(),
                    taps,
                })
            }),
        }
        self.stats.rounds += 1;
        self.donor_update(session, taps);
    }

    fn close(&mut self, session: SessionId) {
        if self.sessions.remove(&session).is_some() {
            self.send(|_, _| Request::Close(Close { session }));
        }
    }

    fn health(&self) -> Health {
        match self.sup.state() == DrafterState::Ready && !self.pace.degraded(self.max_draft()) {
            true => Health::Healthy,
            false => Health::Degraded,
        }
    }

    fn incarnation(&self) -> u64 {
        self.sup.restarts()
    }

    fn transfer(&self) -> crate::proposer::Transfer {
        self.stats.transfer()
    }
}

impl DrafterClient {
    /// Waits until `deadline` for the reply to `seq`; handles whatever else arrives (late
    /// replies, the probe's reply, a goodbye, a broken channel).
    fn recv(&mut self, seq: u64, deadline: Instant) -> Option<Proposed> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let conn = self.sup.connection()?;
            match conn.try_recv_timeout(left) {
                Ok(DrafterMsg::Reply { seq: got, reply }) if got == seq => {
                    return Some(reply.into_proposed())
                }
                Ok(DrafterMsg::Reply { seq: got, .. }) => self.late(got),
                Ok(DrafterMsg::Capabilities(_)) => {
                    self.sup
                        .restart("the drafter sent capabilities after the handshake");
                    return None;
                }
                Ok(DrafterMsg::Goodbye { reason }) => {
                    self.sup
                        .restart(&format!("the drafter said goodbye: {reason}"));
                    return None;
                }
                Err(TryRecvError::Empty) => {
                    self.stats.deadline_misses += 1;
                    return None;
                }
                Err(TryRecvError::IpcError(e)) => {
                    self.sup
                        .restart(&format!("the drafter's channel failed: {e}"));
                    return None;
                }
            }
        }
    }

    /// A reply that came after its deadline; the probe's decides whether the drafter recovers.
    fn late(&mut self, seq: u64) {
        match self.pace.reply(seq) {
            true if self.pace.budget() > 0 => {
                debug!(drafter = %self.name, "probe answered in time; drafting again")
            }
            true => {}
            false => self.stats.late_replies += 1,
        }
    }

    /// Reads replies that arrived since the last call without waiting (a probe's answer).
    fn check_probe(&mut self) {
        while self.pace.probing() {
            let Some(conn) = self.sup.connection() else {
                return;
            };
            match conn.try_recv_timeout(Duration::ZERO) {
                Ok(DrafterMsg::Reply { seq, .. }) => self.late(seq),
                Ok(DrafterMsg::Capabilities(_)) => {
                    self.sup
                        .restart("the drafter sent capabilities after the handshake");
                    return;
                }
                Ok(DrafterMsg::Goodbye { reason }) => {
                    self.sup
                        .restart(&format!("the drafter said goodbye: {reason}"));
                    return;
                }
                Err(TryRecvError::Empty) => {
                    self.pace.no_reply(Instant::now());
                    return;
                }
                Err(TryRecvError::IpcError(e)) => {
                    self.sup
                        .restart(&format!("the drafter's channel failed: {e}"));
                    return;
                }
            }
        }
    }
}

impl Drop for DrafterClient {
    fn drop(&mut self) {
        self.sup.stop();
    }
}
