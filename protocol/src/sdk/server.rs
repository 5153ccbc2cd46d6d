//! The SDK's request loop: maps regions, keeps the open sessions (and the ids an `Advance` left
//! for the next draft), turns views into borrowed [`Taps`], caps proposals and answers in the
//! form the negotiated version reads. Once the host maps a doorbell (1.3), requests come from
//! its ring (the socket only where the ring says so) and replies go into the other ring.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use ipc_channel::ipc::IpcReceiver;
use ipc_channel::{IpcError, TryRecvError};
use tracing::{debug, warn};

use super::{
    AdvanceArgs, Advanced, CommitArgs, DraftAsk, Drafter, OpenArgs, Outcome, Proposal, Taps,
};
use crate::donor::{DonorBlock, DonorReader, DonorRows};
use crate::doorbell::{decode, encode, Doorbell, Frame, SLICE};
use crate::error::{Error, Result};
use crate::shm::{RegionId, ShmReader, TapViews, TensorView};
use crate::transport::{check, Sender};
use crate::version::Version;
use crate::wire::{
    Draft, Drafted, DraftedRow, DrafterMsg, HostMsg, Proposed, ProposedRow, Reply, Request,
    SessionId,
};

/// The version that brought [`Reply::Proposed`].
const PROPOSED: Version = Version { major: 1, minor: 1 };

/// How long a reply waits for room in a full doorbell ring before the drafter gives up.
const RING_FULL: Duration = Duration::from_secs(1);

pub(super) struct Server<D> {
    drafter: D,
    max_draft_len: usize,
    to_host: Sender<DrafterMsg>,
    regions: HashMap<RegionId, ShmReader>,
    /// The K/V donor region, once mapped (1.2).
    donors: Option<DonorReader>,
    sessions: HashMap<SessionId, Session>,
    /// The doorbell, once the host mapped one (1.3).
    bell: Option<Doorbell>,
    /// Socket messages read while the ring was quiet, before the frame that announces them.
    early: VecDeque<HostMsg>,
}

/// An open session as the SDK tracks it.
#[derive(Debug, Default)]
struct Session {
    /// Ids an `Advance` left for the next draft.
    pending: Vec<u32>,
    /// The donor block table, as the host's `DonorTables` built it.
    donor_table: Vec<DonorBlock>,
    /// Donor positions readable.
    donor_len: usize,
}

impl<D: Drafter> Server<D> {
    pub(super) fn new(drafter: D, max_draft_len: usize, to_host: Sender<DrafterMsg>) -> Self {
        Server {
            drafter,
            max_draft_len,
            to_host,
            regions: HashMap::new(),
            donors: None,
            sessions: HashMap::new(),
            bell: None,
            early: VecDeque::new(),
        }
    }

    pub(super) fn serve(mut self, from_host: &IpcReceiver<HostMsg>) -> Result<Outcome> {
        loop {
            let Some(msg) = self.next(from_host)? else {
                return Ok(Outcome::HostGone);
            };
            let HostMsg::Request { seq, request } = msg else {
                return Err(Error::Violation {
                    reason: "a second handshake reply".to_string(),
                });
            };
            if let Request::Shutdown = request {
                return Ok(Outcome::Shutdown);
            }
            match self.handle(seq, request) {
                // The host went away while we answered: a normal end.
                Err(Error::Transport { .. }) => return Ok(Outcome::HostGone),
                other => other?,
            }
        }
    }

    /// The next request: from the socket, or from the doorbell's ring once there is one. `None`
    /// when the host is gone.
    fn next(&mut self, from_host: &IpcReceiver<HostMsg>) -> Result<Option<HostMsg>> {
        let Some(bell) = &self.bell else {
            return from_socket(from_host);
        };
        loop {
            match bell.recv(SLICE)? {
                Some(Frame::Message(bytes)) => return decode(&bytes).map(Some),
                Some(Frame::OnSocket) => match self.early.pop_front() {
                    Some(msg) => return Ok(Some(msg)),
                    None => return from_socket(from_host),
                },
                // A quiet ring: a host that died never rings, but its socket says so.
                None => match from_host.try_recv() {
                    Ok(msg) => self.early.push_back(msg),
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::IpcError(IpcError::Disconnected)) => return Ok(None),
                    Err(TryRecvError::IpcError(source)) => {
                        return Err(Error::Transport {
                            op: "receive a request",
                            source,
                        })
                    }
                },
            }
        }
    }

    /// Sends a reply: into the doorbell's ring when there is one (on the socket, announced in
    /// the ring, when it does not fit), else on the socket.
    fn send(&self, msg: DrafterMsg) -> Result<()> {
        let Some(bell) = &self.bell else {
            return self.to_host.send(msg);
        };
        check(&msg, self.to_host.version())?;
        let bytes = encode(&msg)?;
        match bytes.len() <= bell.max_frame() {
            true => bell.send(&bytes, RING_FULL),
            false => {
                self.to_host.send(msg)?;
                bell.send(&[], RING_FULL)
            }
        }
    }

    fn handle(&mut self, seq: u64, request: Request) -> Result<()> {
        match request {
            Request::MapRegion(map) => {
                let reader = ShmReader::new(map.region, map.shm)?;
                self.regions.insert(map.region, reader);
            }
            Request::Open(open) => {
                if self
                    .sessions
                    .insert(open.session, Session::default())
                    .is_some()
                {
                    // A re-open replaces the session (e.g. the host resent its context).
                    self.drafter.close(open.session);
                }
                let args = OpenArgs {
                    prompt: &open.prompt_ids,
                    sampling: &open.sampling,
                    taps: read_taps(&self.regions, open.prompt_taps.as_ref()),
                };
                self.drafter.open(open.session, args);
            }
            Request::Draft(draft) => self.draft(seq, &draft)?,
            Request::Commit(commit) => {
                if self.sessions.contains_key(&commit.session) {
                    let args = CommitArgs {
                        drafted: commit.drafted as usize,
                        accepted: commit.accepted as usize,
                        ids: &commit.accepted_ids,
                        taps: read_taps(&self.regions, commit.taps.as_ref()),
                    };
                    self.drafter.commit(commit.session, args);
                }
            }
            Request::Advance(advance) => {
                if let Some(session) = self.sessions.get_mut(&advance.session) {
                    let args = AdvanceArgs {
                        ids: &advance.ids,
                        taps: read_taps(&self.regions, advance.taps.as_ref()),
                    };
                    match self.drafter.advance(advance.session, args) {
                        Advanced::Taken => {}
                        Advanced::AsNewTokens => session.pending.extend_from_slice(&advance.ids),
                    }
                }
            }
            Request::Close(close) => {
                if self.sessions.remove(&close.session).is_some() {
                    self.drafter.close(close.session);
                }
            }
            Request::MapDonors(map) => {
                self.donors = Some(DonorReader::new(map.region, map.shm, map.layout)?);
            }
            Request::DonorTables(tables) => {
                for t in tables.tables {
                    let Some(session) = self.sessions.get_mut(&t.session) else {
                        continue;
                    };
                    let keep = (t.keep as usize).min(session.donor_table.len());
                    session.donor_table.truncate(keep);
                    session.donor_table.extend_from_slice(&t.append);
                    session.donor_len = t.len as usize;
                }
            }
            Request::MapDoorbell(map) => {
                let spin = Duration::from_micros(map.spin_us.into());
                self.bell = Some(Doorbell::drafter(map.shm, spin)?);
            }
            Request::Shutdown => unreachable!("invariant: handled by the caller"),
        }
        Ok(())
    }

    /// Answers a `Draft`: one batched call for the rows of open sessions, nothing for others.
    fn draft(&mut self, seq: u64, draft: &Draft) -> Result<()> {
        // Ids left by `Advance` go first: they were committed before this row's own.
        let mut new_tokens: Vec<Vec<u32>> = Vec::with_capacity(draft.rows.len());
        let mut open = Vec::with_capacity(draft.rows.len());
        for row in &draft.rows {
            match self.sessions.get_mut(&row.session) {
                Some(session) => {
                    let mut ids = std::mem::take(&mut session.pending);
                    ids.extend_from_slice(&row.new_tokens);
                    new_tokens.push(ids);
                    open.push(true);
                }
                None => {
                    warn!(
                        session = row.session,
                        "draft for a session that is not open"
                    );
                    new_tokens.push(Vec::new());
                    open.push(false);
                }
            }
        }
        let asks: Vec<DraftAsk<'_>> = draft
            .rows
            .iter()
            .zip(&new_tokens)
            .zip(&open)
            .filter(|(_, &open)| open)
            .map(|((row, ids), _)| DraftAsk {
                session: row.session,
                new_tokens: ids,
                n: (row.n as usize).min(self.max_draft_len),
                donors: donor_rows(self.donors.as_ref(), self.sessions.get(&row.session)),
            })
            .collect();
        let mut proposals = match asks.is_empty() {
            true => Vec::new(),
            false => self.drafter.draft_batch(&asks),
        };
        if proposals.len() != asks.len() {
            warn!(
                got = proposals.len(),
                asked = asks.len(),
                "draft_batch returned the wrong number of proposals; drafting nothing"
            );
            proposals = vec![Proposal::none(); asks.len()];
        }
        let mut proposals = proposals.into_iter().zip(asks);
        let rows = draft.rows.iter().zip(&open).map(|(row, &open)| {
            let p = match open {
                true => {
                    let (mut p, ask) = proposals.next().expect("invariant: one per open row");
                    p.truncate(ask.n);
                    p
                }
                false => Proposal::none(),
            };
            ProposedRow {
                session: row.session,
                tokens: p.tokens,
                q: p.q,
                confidence: p.confidence,
            }
        });
        let proposed = Proposed {
            rows: rows.collect(),
        };
        let reply = match self.to_host.version() >= PROPOSED {
            true => Reply::Proposed(proposed),
            false => Reply::Drafted(drafted(proposed)),
        };
        self.send(DrafterMsg::Reply { seq, reply })
    }
}

fn from_socket(from_host: &IpcReceiver<HostMsg>) -> Result<Option<HostMsg>> {
    match from_host.recv() {
        Ok(msg) => Ok(Some(msg)),
        Err(IpcError::Disconnected) => Ok(None),
        Err(source) => Err(Error::Transport {
            op: "receive a request",
            source,
        }),
    }
}

/// The 1.0 form of a reply: confidences are dropped.
fn drafted(p: Proposed) -> Drafted {
    let rows = p.rows.into_iter().map(|r| DraftedRow {
        session: r.session,
        tokens: r.tokens,
        q: r.q,
    });
    Drafted {
        rows: rows.collect(),
    }
}

/// A session's donor rows, when the region is mapped and the host announced its table; a table
/// that does not fit the region is dropped (logged) and the drafter goes without.
fn donor_rows<'a>(
    reader: Option<&'a DonorReader>,
    session: Option<&'a Session>,
) -> Option<DonorRows<'a>> {
    let (reader, session) = (reader?, session?);
    reader
        .rows(&session.donor_table, session.donor_len)
        .map_err(|e| warn!(error = %e, "donor table dropped"))
        .ok()
}

/// Borrows every view; any torn or bad view drops the whole set (a partial set would misalign).
fn read_taps<'a>(
    regions: &'a HashMap<RegionId, ShmReader>,
    views: Option<&TapViews>,
) -> Option<Taps<'a>> {
    let views = views?;
    let view = |v: &TensorView| {
        let reader = regions.get(&v.region).ok_or_else(|| Error::BadView {
            reason: format!("region {} was never mapped", v.region),
        })?;
        reader.view(v)
    };
    let taps = (|| -> Result<Taps<'a>> {
        Ok(Taps {
            pos: views.pos,
            rows: views.rows,
            layers: views.layers.iter().map(view).collect::<Result<_>>()?,
            final_hidden: views.final_hidden.as_ref().map(view).transpose()?,
            kv: views
                .kv
                .iter()
                .map(|kv| Ok((view(&kv.k)?, view(&kv.v)?)))
                .collect::<Result<_>>()?,
        })
    })();
    match taps {
        Ok(taps) => Some(taps),
        Err(e) => {
            debug!(error = %e, "taps dropped");
            None
        }
    }
}
