//! Every message that crosses the process boundary.
//!
//! Two codecs are in play. The handshake payloads ([`Hello`], [`HandshakeReply`]) travel as JSON
//! text inside frozen envelopes ([`Connect`], [`HostMsg::Handshake`]): JSON is self-describing, so a
//! peer of any version can read them, name the versions it was offered, and ignore fields newer
//! than itself. Everything after the handshake is postcard (ipc-channel's codec), which is *not*
//! self-describing: a peer must never receive a message or variant newer than the negotiated
//! version. Each session message therefore knows the version that introduced it ([`Since`]) and
//! [`crate::transport::Sender`] refuses to send it to an older peer.
//!
//! # Invariants
//! - [`HostMsg::Handshake`] and [`DrafterMsg::Goodbye`] are variant 0 of their enums in every
//!   version, and [`Connect`] never changes: they are how peers of different majors still talk.
//! - New variants are appended at the end of an enum; existing variants never change shape.

use ipc_channel::ipc::{IpcSender, IpcSharedMemory};
use serde::{Deserialize, Serialize};

use crate::donor::{DonorBlock, DonorLayout};
use crate::shm::{DType, RegionId, TapViews};
use crate::version::{Version, PROTOCOL_VERSION};

/// Identifies one request (a session) across the host and its drafters.
pub type SessionId = u64;

/// Sequence number of a request; a reply carries the number of its request.
pub type Seq = u64;

/// The first message, drafter → host, on the bootstrap connection. Frozen across all versions.
#[derive(Debug, Serialize, Deserialize)]
pub struct Connect {
    /// The drafter's [`Hello`], as JSON.
    pub hello: String,
    /// Where the host sends its messages.
    pub to_drafter: IpcSender<HostMsg>,
}

/// What a drafter is and what it speaks. Sent once, as JSON, inside [`Connect`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol versions the drafter speaks: per major, the newest minor.
    pub versions: Vec<Version>,
    /// A short name for logs and metrics.
    pub name: String,
    /// The drafter's own version, free text.
    pub drafter_version: String,
    /// What the drafter can do and wants to see.
    pub capabilities: Capabilities,
    /// Whether the drafter states its real capabilities only once it knows the target: after
    /// `Welcome` it sends [`DrafterMsg::Capabilities`], which replace the ones above. A 1.0 host
    /// ignores the field and keeps the ones above. @since protocol v1.1
    #[serde(default)]
    pub late_capabilities: bool,
    /// Whether the drafter wants its `kv_layers` as K/V donor views ([`MapDonors`] and
    /// [`DonorTables`]: the host's KV pool blocks, read in place) rather than as K/V rows copied
    /// into every message's taps. A host at ≥ 1.2 that can export its pool sends `MapDonors`
    /// and leaves `TapViews::kv` empty; otherwise the rows come in the taps, as in 1.1.
    /// @since protocol v1.2
    #[serde(default)]
    pub kv_donor_views: bool,
    /// Whether the drafter takes its requests and sends its replies through a doorbell
    /// ([`MapDoorbell`]: shared-memory rings and a futex) once the host maps one. A host at
    /// ≥ 1.3 then sends `MapDoorbell` on the socket and every later message in the rings; any
    /// other host keeps the socket. @since protocol v1.3
    #[serde(default)]
    pub doorbell: bool,
}

/// What a drafter can do and which target activations it wants after each verify forward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// The most drafts it proposes per row; the host never asks for more.
    pub max_draft_len: u32,
    /// How the drafter treats the prompt at `Open`: informational (logged by the host, which
    /// sends the same `Open` either way; see [`PrefillMode`]).
    pub prefill: PrefillMode,
    /// Hidden-state taps: output of layer `l`, for each listed `l`.
    pub tap_layers: Vec<u32>,
    /// Whether the post-final-norm hidden state is wanted as its own tap.
    pub final_hidden: bool,
    /// Layers whose K/V rows the drafter wants to read.
    pub kv_layers: Vec<u32>,
}

impl Capabilities {
    /// Capabilities of a drafter that needs nothing but token ids.
    pub fn tokens_only(max_draft_len: u32) -> Self {
        Capabilities {
            max_draft_len,
            prefill: PrefillMode::LeaveLastPending,
            tap_layers: Vec::new(),
            final_hidden: false,
            kv_layers: Vec::new(),
        }
    }

    /// Whether any target activation is wanted (then the host maps a shared-memory region).
    pub fn wants_activations(&self) -> bool {
        !self.tap_layers.is_empty() || self.final_hidden || !self.kv_layers.is_empty()
    }
}

/// How a drafter treats the last prompt id at `Open`. Informational: whatever the mode, the
/// host's `Open` carries the whole context with its last id pending (and taps of every position
/// but that one), and the first `Draft` feeds that id; a `FullPrompt` drafter simply runs it
/// early on its own. Kept for the wire format's sake (1.0 peers send it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrefillMode {
    /// The last prompt id is pending, like the target's: it is fed with the first draft step.
    LeaveLastPending,
    /// The drafter runs the whole prompt at `Open`.
    FullPrompt,
}

/// The host's answer to [`Hello`], sent as JSON inside [`HostMsg::Handshake`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HandshakeReply {
    /// The host accepts the drafter and names the version they will talk.
    Welcome(Welcome),
    /// The host refuses the drafter; it should exit non-zero.
    Refused {
        /// Why, for humans (names both version lists on a version mismatch).
        reason: String,
    },
}

/// The negotiated version and what the target is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// The version both peers speak from now on.
    pub version: Version,
    /// The target model the drafter serves.
    pub target: TargetInfo,
}

/// What a drafter needs to know about the target model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// Architecture name, e.g. `qwen2`.
    pub architecture: String,
    /// Size of the target vocabulary: every drafted id must be below it.
    pub vocab_size: u32,
    /// Width of the hidden state (taps are `rows × hidden_size`).
    pub hidden_size: u32,
    /// Number of transformer layers.
    pub num_layers: u32,
    /// Number of K/V heads.
    pub num_kv_heads: u32,
    /// Size of one attention head.
    pub head_dim: u32,
    /// A digest of the tokenizer: a drafter with another tokenizer must refuse the target.
    pub tokenizer_fingerprint: String,
    /// End-of-sequence ids.
    pub eos_ids: Vec<u32>,
    /// Where the target weights live (a drafter may read e.g. the embeddings from them).
    pub weights_path: String,
    /// The target's context length.
    pub context_len: u32,
    /// RoPE base frequency of the target. @since protocol v1.1
    #[serde(default)]
    pub rope_theta: Option<f32>,
    /// How the target pairs the dimensions RoPE rotates. @since protocol v1.1
    #[serde(default)]
    pub rope_layout: Option<RopeLayout>,
    /// The epsilon of the target's RMSNorms. @since protocol v1.1
    #[serde(default)]
    pub rms_norm_eps: Option<f32>,
    /// Whether the target's lm_head is its embedding matrix. @since protocol v1.1
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Element type of the taps and K/V rows the host writes (the target's activation dtype).
    /// `None` (a 1.0 host) means f32. @since protocol v1.1
    #[serde(default)]
    pub tap_dtype: Option<DType>,
}

/// Which dimensions of a head RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeLayout {
    /// Dimension `i` with `i + head_dim/2` (HF `rotate_half`, GPT-NeoX; llama, qwen2, qwen3).
    Halves,
    /// Dimension `2i` with `2i + 1` (GPT-J, the original RoFormer).
    Interleaved,
}

/// Sampling parameters of a session, so a sampling drafter can match the target's distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingSpec {
    /// Softmax temperature; `0` is greedy.
    pub temperature: f32,
    /// Nucleus threshold (`1.0`: off).
    pub top_p: f32,
    /// Keep the `k` most likely tokens (`None`: off).
    pub top_k: Option<u32>,
    /// Drop tokens below `min_p` times the top probability (`0.0`: off).
    pub min_p: f32,
    /// Seed of the session's random stream.
    pub seed: Option<u64>,
}

impl SamplingSpec {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingSpec {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
        }
    }
}

/// Starts a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Open {
    /// The session.
    pub session: SessionId,
    /// The whole context so far; its last id is pending (not yet run by the target).
    pub prompt_ids: Vec<u32>,
    /// How the target samples.
    pub sampling: SamplingSpec,
    /// Activations of the prompt, when the drafter asked for taps and the host has them.
    pub prompt_taps: Option<TapViews>,
}

/// One session's part of a [`Draft`] request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftRow {
    /// The session.
    pub session: SessionId,
    /// Ids committed to the context that the drafter has not heard of yet (usually empty).
    pub new_tokens: Vec<u32>,
    /// The most drafts wanted.
    pub n: u32,
    /// Round number within the session, for logs.
    pub step: u64,
}

/// Asks for drafts, for one or several sessions at once (batched serving).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Draft {
    /// One row per session.
    pub rows: Vec<DraftRow>,
}

/// Ids committed to a session's context *without* a [`Commit`] (a round with no drafts, a missed
/// deadline, a drafter that proposed nothing), with the taps of the target rows that produced
/// them. Sent only to peers at ≥ 1.1; a 1.0 peer gets these ids in [`DraftRow::new_tokens`].
///
/// # Invariants
/// With `Advance` the host guarantees that every committed position's taps reach the drafter
/// exactly once, in order (at `Open`, `Commit` or `Advance`), unless a view is torn.
/// @since protocol v1.1
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advance {
    /// The session.
    pub session: SessionId,
    /// The committed ids, oldest first.
    pub ids: Vec<u32>,
    /// Activations of the rows that were run to produce `ids`: the row of the position that was
    /// pending before, then one per id but the last (which is pending now).
    pub taps: Option<TapViews>,
}

/// One session's drafts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftedRow {
    /// The session.
    pub session: SessionId,
    /// Proposed ids, at most the `n` asked for.
    pub tokens: Vec<u32>,
    /// The drafter's probability row (`vocab_size` entries) per drafted id, when it sampled them.
    pub q: Option<Vec<Vec<f32>>>,
}

/// The reply to [`Draft`]: one row per asked row, in the same order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drafted {
    /// One row per session asked.
    pub rows: Vec<DraftedRow>,
}

/// One session's drafts with the drafter's estimate that each is accepted.
/// @since protocol v1.1
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProposedRow {
    /// The session.
    pub session: SessionId,
    /// Proposed ids, at most the `n` asked for.
    pub tokens: Vec<u32>,
    /// The drafter's probability row (`vocab_size` entries) per drafted id, when it sampled them.
    pub q: Option<Vec<Vec<f32>>>,
    /// Per drafted id, the drafter's estimate (`0..=1`) that the target accepts it given that
    /// every earlier one was accepted (DSpark's confidence head), when it has one.
    pub confidence: Option<Vec<f32>>,
}

/// The 1.1 reply to [`Draft`]: one row per asked row, in the same order.
/// @since protocol v1.1
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposed {
    /// One row per session asked.
    pub rows: Vec<ProposedRow>,
}

impl From<Drafted> for Proposed {
    fn from(d: Drafted) -> Self {
        let rows = d.rows.into_iter().map(|r| ProposedRow {
            session: r.session,
            tokens: r.tokens,
            q: r.q,
            confidence: None,
        });
        Proposed {
            rows: rows.collect(),
        }
    }
}

/// What the target made of the last draft.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Commit {
    /// The session.
    pub session: SessionId,
    /// How many drafts were verified.
    pub drafted: u32,
    /// How many of them the target accepted.
    pub accepted: u32,
    /// Ids committed this round: the accepted drafts, then the target's own (pending) token.
    pub accepted_ids: Vec<u32>,
    /// Activations of the verified rows `[pending, d1..d_accepted]`, when asked for.
    pub taps: Option<TapViews>,
}

/// Ends a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Close {
    /// The session.
    pub session: SessionId,
}

/// Hands the drafter a shared-memory region, once, before any view names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapRegion {
    /// The id views use to name it.
    pub region: RegionId,
    /// The memory itself (a memfd, passed as a file descriptor).
    pub shm: IpcSharedMemory,
}

/// Hands the drafter the K/V donor region (the host's KV pool blocks of the donor layers), once,
/// before any [`DonorTables`]. Sent only to a drafter whose Hello set `kv_donor_views`.
/// @since protocol v1.2
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapDonors {
    /// The id of the region (its own numbering, apart from tap regions).
    pub region: RegionId,
    /// The memory (a memfd), mapped read-only by the drafter.
    pub shm: IpcSharedMemory,
    /// Where the blocks, epochs and layers are.
    pub layout: DonorLayout,
}

/// What changed in one session's donor block table since the last message for it.
/// @since protocol v1.2
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorTable {
    /// The session.
    pub session: SessionId,
    /// Entries of the previous table that stay (the rest is cut; 0 after a (re-)`Open`).
    pub keep: u32,
    /// Entries appended after the kept ones, each with the block's epoch now.
    pub append: Vec<DonorBlock>,
    /// Positions `0..len` hold the target's K/V of the session's committed ids (all but the
    /// pending one); positions past it are never to be read.
    pub len: u64,
}

/// Block-table deltas of the sessions whose donor K/V changed, sent before the `Draft` that
/// may read them (and after every `Open`). @since protocol v1.2
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorTables {
    /// One per session that changed.
    pub tables: Vec<DonorTable>,
}

/// Moves the session messages onto a doorbell (see [`crate::doorbell`]): every request after
/// this one comes through the region's host → drafter ring (those that carry a file descriptor,
/// or do not fit half a ring, on the socket, announced by an empty frame in the ring), and every
/// reply goes into its drafter → host ring. Sent once, on the socket, only to a drafter whose
/// Hello set `doorbell`. @since protocol v1.3
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapDoorbell {
    /// The region (a memfd) holding both rings.
    pub shm: IpcSharedMemory,
    /// How long a side polls its incoming ring before it sleeps on the futex, in µs (the host's
    /// choice: polling through a target forward makes the round trip cheapest, at a core's cost).
    pub spin_us: u32,
}

/// A host request. Only [`Request::Draft`] gets a reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// See [`MapRegion`].
    MapRegion(MapRegion),
    /// See [`Open`].
    Open(Open),
    /// See [`Draft`]; answered by [`Reply::Drafted`].
    Draft(Draft),
    /// See [`Commit`].
    Commit(Commit),
    /// See [`Close`].
    Close(Close),
    /// The drafter exits (status 0).
    Shutdown,
    /// See [`Advance`]. @since protocol v1.1
    Advance(Advance),
    /// See [`MapDonors`]. @since protocol v1.2
    MapDonors(MapDonors),
    /// See [`DonorTables`]. @since protocol v1.2
    DonorTables(DonorTables),
    /// See [`MapDoorbell`]. @since protocol v1.3
    MapDoorbell(MapDoorbell),
}

impl Request {
    /// Whether the request carries a file descriptor: it can only travel on the socket.
    pub fn carries_fd(&self) -> bool {
        matches!(
            self,
            Request::MapRegion(_) | Request::MapDonors(_) | Request::MapDoorbell(_)
        )
    }
}

/// Everything host → drafter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HostMsg {
    /// The [`HandshakeReply`] as JSON. Variant 0 in every version.
    Handshake(String),
    /// A numbered request.
    Request {
        /// Its sequence number.
        seq: Seq,
        /// The request.
        request: Request,
    },
}

/// A drafter's reply to a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// The drafts asked for by a [`Request::Draft`] (a 1.0 drafter's answer).
    Drafted(Drafted),
    /// The drafts asked for, with confidences (a ≥ 1.1 drafter's answer). @since protocol v1.1
    Proposed(Proposed),
}

impl Reply {
    /// The reply in its newest form (a [`Drafted`] gains `confidence: None`).
    pub fn into_proposed(self) -> Proposed {
        match self {
            Reply::Drafted(d) => d.into(),
            Reply::Proposed(p) => p,
        }
    }
}

/// Everything drafter → host (after [`Connect`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DrafterMsg {
    /// The drafter refuses the target or is leaving; it exits next. Variant 0 in every version.
    Goodbye {
        /// Why, for humans.
        reason: String,
    },
    /// The reply to the request numbered `seq`.
    Reply {
        /// The number of the request answered.
        seq: Seq,
        /// The reply.
        reply: Reply,
    },
    /// The drafter's capabilities now that it knows the target; they replace the Hello's. Sent
    /// once, right after `Welcome`, by a drafter whose Hello set `late_capabilities`.
    /// @since protocol v1.1
    Capabilities(Capabilities),
}

/// The protocol version that introduced a message, so a sender can refuse to send it to an older
/// peer (postcard cannot skip what it does not know).
///
/// | message | since |
/// |---|---|
/// | `Handshake`, `Goodbye`, `MapRegion`, `Open`, `Draft`, `Drafted`, `Commit`, `Close`, `Shutdown` | 1.0 |
/// | `Advance`, `Proposed`, `Capabilities` (drafter → host) | 1.1 |
/// | `Open`, `Commit` whose taps hold a bf16 view | 1.1 |
/// | `MapDonors`, `DonorTables` | 1.2 |
/// | `MapDoorbell` | 1.3 |
pub trait Since {
    /// The message's name, for errors.
    fn kind(&self) -> &'static str;
    /// The version that introduced it.
    fn since(&self) -> Version;
}

const V1_0: Version = Version { major: 1, minor: 0 };
const V1_1: Version = Version { major: 1, minor: 1 };
const V1_2: Version = Version { major: 1, minor: 2 };
const V1_3: Version = Version { major: 1, minor: 3 };
const _: () = assert!(PROTOCOL_VERSION.major == V1_0.major);
const _: () = assert!(PROTOCOL_VERSION.minor >= V1_3.minor);

/// bf16 views came with 1.1: a message carrying one needs a 1.1 peer.
fn taps_since(taps: Option<&TapViews>) -> Version {
    match taps.is_some_and(|t| t.dtypes().any(|d| d != DType::F32)) {
        true => V1_1,
        false => V1_0,
    }
}

impl Since for HostMsg {
    fn kind(&self) -> &'static str {
        match self {
            HostMsg::Handshake(_) => "Handshake",
            HostMsg::Request { request, .. } => match request {
                Request::MapRegion(_) => "MapRegion",
                Request::Open(_) => "Open",
                Request::Draft(_) => "Draft",
                Request::Commit(_) => "Commit",
                Request::Close(_) => "Close",
                Request::Shutdown => "Shutdown",
                Request::Advance(_) => "Advance",
                Request::MapDonors(_) => "MapDonors",
                Request::DonorTables(_) => "DonorTables",
                Request::MapDoorbell(_) => "MapDoorbell",
            },
        }
    }

    fn since(&self) -> Version {
        match self {
            HostMsg::Handshake(_) => V1_0,
            HostMsg::Request { request, .. } => match request {
                Request::MapRegion(_)
                | Request::Draft(_)
                | Request::Close(_)
                | Request::Shutdown => V1_0,
                Request::Open(open) => taps_since(open.prompt_taps.as_ref()),
                Request::Commit(commit) => taps_since(commit.taps.as_ref()),
                Request::Advance(_) => V1_1,
                Request::MapDonors(_) | Request::DonorTables(_) => V1_2,
                Request::MapDoorbell(_) => V1_3,
            },
        }
    }
}

impl Since for DrafterMsg {
    fn kind(&self) -> &'static str {
        match self {
            DrafterMsg::Goodbye { .. } => "Goodbye",
            DrafterMsg::Reply {
                reply: Reply::Drafted(_),
                ..
            } => "Drafted",
            DrafterMsg::Reply {
                reply: Reply::Proposed(_),
                ..
            } => "Proposed",
            DrafterMsg::Capabilities(_) => "Capabilities",
        }
    }

    fn since(&self) -> Version {
        match self {
            DrafterMsg::Goodbye { .. }
            | DrafterMsg::Reply {
                reply: Reply::Drafted(_),
                ..
            } => V1_0,
            DrafterMsg::Reply {
                reply: Reply::Proposed(_),
                ..
            }
            | DrafterMsg::Capabilities(_) => V1_1,
        }
    }
}
