//! The paged KV pool: K (after rope) and V of every sequence in fixed-size blocks of one arena,
//! per-sequence block tables, O(1) rollback by length, blocks shared by reference count and a
//! prefix index over full blocks (vLLM's automatic prefix caching, PagedAttention's layout).
//!
//! ```text
//!  arena (f32, host memory):  block 0 | block 1 | block 2 | ...        (BLOCK_SIZE positions each)
//!  one block:   slot 0: K [kv_heads][head_dim][BLOCK_SIZE]   V [kv_heads][BLOCK_SIZE][head_dim]
//!               slot 1: K ...                                 V ...
//!
//!  seq A: table [4, 0, 7]  len 70  -> positions 0..32 in block 4, 32..64 in 0, 64..70 in 7
//!  seq B: table [4, 2]     len 40  -> block 4 shared (refs 2): A and B have the same first 32 tokens
//! ```
//!
//! K is stored transposed inside a block so that the attention kernel scores a query against
//! the block's keys with one broadcast multiply-add per head dimension (no horizontal sums);
//! V is row-major so that the weighted sum runs along `head_dim`.
//!
//! **Slots.** A slot is one stored K/V layer. Most architectures store one slot per layer;
//! layers that reuse an earlier layer's K/V (Gemma 3n/4 KV sharing) read that layer's slot and
//! write none, so the arena holds only the distinct ones. Slots may differ in `kv_heads` and
//! `head_dim` (Gemma 4's global and local layers do). Sliding-window layers (Gemma 3/4 local
//! attention) are stored like global ones and the kernel only reads the last `window`
//! positions; giving them a block table of their own that frees blocks older than the window
//! (vLLM's hybrid allocator groups) is the memory optimisation that layout allows later.
//!
//! **Rollback and sharing.** [`KvPool::truncate`] only shortens the table and drops the tail
//! blocks' references. A block is written only by a sequence that holds its sole reference and
//! whose content nobody else may look up: a write into a shared block copies it first, and a
//! write into an indexed block takes it out of the prefix index.
//!
//! **Prefix index.** A full block's key is `sha256(parent key, its tokens)`, so one key names a
//! whole prefix. [`KvPool::adopt_prefix`] walks a new sequence's tokens block by block and
//! takes the longest chain found. Blocks nobody references but the index still names stay
//! cached; allocation takes free blocks first and then evicts the least recently released
//! cached one. A full pool is [`Error::KvPoolFull`], never a panic. At most
//! [`KvPool::set_cache_budget`] blocks stay cached: a block released past that budget sends the
//! least recently released one back to the free list, so the arena (which only grows) stops
//! growing once it holds the running sequences' peak plus the budget, however many distinct
//! prompts go by.
//!
//! **Three users, one layout.**
//! - *Batching* (the engine): many sequences in one pool, admission by
//!   [`KvPool::blocks_needed`] / [`KvPool::stats`], rollback of rejected drafts by
//!   [`KvPool::truncate`], forking of a common prefix by [`KvPool::fork`].
//! - *K/V donor views* (the assistant drafter): [`KvPool::export_donors`] moves the storage of
//!   the donor slots into a memfd region the drafter maps read-only (layout and epochs of
//!   `specula_protocol::donor`; see [`donor`]); the forward writes and attention reads them
//!   there, and [`KvPool::donor_table`] gives a sequence's block table with stable epochs to
//!   announce. A reader needs nothing else: no K/V row is copied per round. A block is never
//!   rewritten while another sequence references it, positions below a committed length are
//!   never rewritten, and a block changes owner only through allocation, which claims its
//!   epoch first.
//! - *A graph-captured GPU step*: the arena, block tables and lengths are plain arrays whose
//!   shapes do not change between steps when the pool is created at its full capacity (a
//!   device pool allocates it up front; this host pool grows its arena lazily up to the
//!   capacity). Today every device attends over this host pool (see `layers::attention`).
//!
//! The element type is f32; a bf16 arena changes only the storage and the kernel's loads.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

mod donor;

pub use specula_protocol::donor::{DonorBlock, DonorLayout};
pub use specula_protocol::shm::RegionId;

/// A donor region to hand a drafter: its id, a handle (a new mapping of the memfd) and its
/// layout.
pub type DonorShare = (RegionId, ipc_channel::ipc::IpcSharedMemory, DonorLayout);

/// Positions per block. 32 keeps the kernel's score vector at two AVX-512 registers and the
/// per-block softmax merge cheap relative to the block's dot products.
pub const BLOCK_SIZE: usize = 32;

/// The shape of one stored K/V layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotShape {
    /// Number of K/V heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// What every block holds: one K/V slot per stored layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// The stored layers, in slot order.
    pub slots: Vec<SlotShape>,
}

impl KvLayout {
    /// `slots` identical slots.
    pub fn uniform(slots: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            slots: vec![SlotShape { kv_heads, head_dim }; slots],
        }
    }

    /// Floats of one slot's K (or V) in a block.
    fn half(s: &SlotShape) -> usize {
        s.kv_heads * s.head_dim * BLOCK_SIZE
    }
}

/// A sequence in a [`KvPool`]. Handles of released sequences are rejected, also after their
/// index is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId {
    index: u32,
    generation: u32,
}

/// A block of the arena.
pub type BlockId = u32;

/// The key of a full block: a hash of the whole prefix up to and including it.
pub type BlockKey = [u8; 16];

/// The keys of the full blocks of `tokens` (a prompt), in order: what [`KvPool::adopt_prefix`]
/// would look up. The engine keys its cache of drafter taps by them.
pub fn chain_keys(tokens: &[u32]) -> Vec<BlockKey> {
    let mut parent = None;
    tokens
        .chunks_exact(BLOCK_SIZE)
        .map(|chunk| {
            let key = block_key(parent.as_ref(), chunk);
            parent = Some(key);
            key
        })
        .collect()
}

/// Usage counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks the pool may hold.
    pub capacity_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Unreferenced blocks kept for the prefix index (evictable).
    pub cached_blocks: usize,
    /// Blocks the arena has materialised (host memory held; it never shrinks).
    pub arena_blocks: usize,
    /// Live sequences.
    pub sequences: usize,
    /// Tokens offered to [`KvPool::adopt_prefix`] in full blocks.
    pub prefix_query_tokens: u64,
    /// Of those, tokens found in the index.
    pub prefix_hit_tokens: u64,
}

#[derive(Clone, Debug)]
struct Indexed {
    key: BlockKey,
    parent: Option<BlockKey>,
    tokens: Box<[u32]>,
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    refs: u32,
    indexed: Option<Indexed>,
    /// Tick under which the block sits in the LRU (refs == 0 and indexed).
    lru: Option<u64>,
}

#[derive(Clone, Debug)]
struct SeqState {
    generation: u32,
    blocks: Vec<BlockId>,
    tokens: Vec<u32>,
    /// Prefix keys of the leading full blocks (whether or not the index holds them).
    keys: Vec<BlockKey>,
}

/// The pool. See the module docs for the layout and the rules.
#[derive(Clone, Debug)]
pub struct KvPool {
    layout: KvLayout,
    /// Offsets of each slot's K and V inside a block.
    slot_offsets: Vec<(usize, usize)>,
    block_floats: usize,
    capacity: usize,
    arena: Vec<f32>,
    meta: Vec<BlockMeta>,
    free: Vec<BlockId>,
    lru: BTreeMap<u64, BlockId>,
    /// Most blocks kept in `lru`.
    cache_budget: usize,
    tick: u64,
    index: HashMap<BlockKey, BlockId>,
    seqs: Vec<Option<SeqState>>,
    free_seqs: Vec<u32>,
    generation: u32,
    stats: PoolStats,
    /// The exported donor slots, when a drafter reads them in place.
    donor: Option<donor::DonorStore>,
    /// Donor regions made so far (ids are never reused, so a drafter tells a new one apart).
    donor_regions: RegionId,
}

impl KvPool {
    /// A pool of at most `capacity_blocks` blocks of `layout`; the arena grows on demand.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for no slots, an empty slot or zero capacity.
    pub fn new(layout: KvLayout, capacity_blocks: usize) -> Result<Self> {
        if layout.slots.is_empty()
            || layout
                .slots
                .iter()
                .any(|s| s.kv_heads == 0 || s.head_dim == 0)
            || capacity_blocks == 0
            || capacity_blocks > BlockId::MAX as usize
        {
            return Err(invalid(
                "KvPool::new",
                format!("layout {layout:?} with {capacity_blocks} blocks"),
            ));
        }
        let mut slot_offsets = Vec::with_capacity(layout.slots.len());
        let mut at = 0;
        for s in &layout.slots {
            slot_offsets.push((at, at + KvLayout::half(s)));
            at += 2 * KvLayout::half(s);
        }
        Ok(Self {
            layout,
            slot_offsets,
            block_floats: at,
            capacity: capacity_blocks,
            arena: Vec::new(),
            meta: Vec::new(),
            free: Vec::new(),
            lru: BTreeMap::new(),
            cache_budget: usize::MAX,
            tick: 0,
            index: HashMap::new(),
            seqs: Vec::new(),
            free_seqs: Vec::new(),
            donor: None,
            donor_regions: 0,
            generation: 0,
            stats: PoolStats {
                capacity_blocks,
                ..PoolStats::default()
            },
        })
    }

    /// The layout of every block.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Host bytes of one block (every slot's K and V).
    pub fn block_bytes(&self) -> usize {
        self.block_floats * std::mem::size_of::<f32>()
    }

    /// Usage counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            cached_blocks: self.lru.len(),
            arena_blocks: self.meta.len(),
            sequences: self.seqs.iter().flatten().count(),
            ..self.stats
        }
    }

    /// Keeps at most `blocks` unreferenced blocks for the prefix index (unbounded until
    /// set); the least recently released ones past it are dropped from the index now.
    pub fn set_cache_budget(&mut self, blocks: usize) {
        self.cache_budget = blocks;
        self.trim_cache();
    }

    /// Drops the least recently released cached blocks past the budget back to the free list.
    fn trim_cache(&mut self) {
        while self.lru.len() > self.cache_budget {
            let (_, b) = self
                .lru
                .pop_first()
                .expect("invariant: over budget, so not empty");
            self.meta[b as usize].lru = None;
            self.unindex(b);
            self.free.push(b);
        }
    }

    /// Blocks an allocation can still obtain (free, not yet materialised, or cached).
    pub fn available_blocks(&self) -> usize {
        self.free.len() + (self.capacity - self.meta.len()) + self.lru.len()
    }

    /// A new empty sequence.
    pub fn create(&mut self) -> SeqId {
        self.generation = self.generation.wrapping_add(1);
        let state = SeqState {
            generation: self.generation,
            blocks: Vec::new(),
            tokens: Vec::new(),
            keys: Vec::new(),
        };
        let index = match self.free_seqs.pop() {
            Some(i) => {
                self.seqs[i as usize] = Some(state);
                i
            }
            None => {
                self.seqs.push(Some(state));
                (self.seqs.len() - 1) as u32
            }
        };
        SeqId {
            index,
            generation: self.generation,
        }
    }

    /// Whether `seq` is live in this pool.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seq(seq).is_ok()
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        match self.seqs.get(seq.index as usize) {
            Some(Some(s)) if s.generation == seq.generation => Ok(s),
            _ => Err(invalid("KvPool", format!("unknown sequence {seq:?}"))),
        }
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut SeqState> {
        match self.seqs.get_mut(seq.index as usize) {
            Some(Some(s)) if s.generation == seq.generation => Ok(s),
            _ => Err(invalid("KvPool", format!("unknown sequence {seq:?}"))),
        }
    }

    /// Positions `seq` holds.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.tokens.len())
    }

    /// The tokens whose K/V `seq` holds.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn tokens(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(seq)?.tokens)
    }

    /// The prefix keys of `seq`'s leading full blocks entered so far (by
    /// [`KvPool::adopt_prefix`] and [`KvPool::index_full_blocks`]).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn block_keys(&self, seq: SeqId) -> Result<&[BlockKey]> {
        Ok(&self.seq(seq)?.keys)
    }

    /// The block table of `seq`: position `p` lives at offset `p % BLOCK_SIZE` of block
    /// `blocks[p / BLOCK_SIZE]`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn blocks(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// New blocks `seq` needs to grow by `extra` positions (copy-on-write included), for
    /// admission control.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn blocks_needed(&self, seq: SeqId, extra: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        Ok(self.plan_append(s, extra))
    }

    fn plan_append(&self, s: &SeqState, extra: usize) -> usize {
        let (len, have) = (s.tokens.len(), s.blocks.len());
        let grow = (len + extra).div_ceil(BLOCK_SIZE) - have;
        let cow = !len.is_multiple_of(BLOCK_SIZE)
            && extra > 0
            && self.meta[s.blocks[have - 1] as usize].refs > 1;
        grow + usize::from(cow)
    }

    /// Keeps the first `len` positions of `seq`, releasing its blocks past them.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence or `len` past its length.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self.seq_mut(seq)?;
        if len > s.tokens.len() {
            return Err(invalid(
                "KvPool::truncate",
                format!(
                    "cannot keep {len} positions of a sequence of {}",
                    s.tokens.len()
                ),
            ));
        }
        s.tokens.truncate(len);
        s.keys.truncate(len / BLOCK_SIZE);
        let tail = s.blocks.split_off(len.div_ceil(BLOCK_SIZE));
        for b in tail {
            self.unref(b);
        }
        Ok(())
    }

    /// Releases `seq` and all its blocks.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.truncate(seq, 0)?;
        self.seqs[seq.index as usize] = None;
        self.free_seqs.push(seq.index);
        Ok(())
    }

    /// A new sequence holding the first `len` positions of `seq`: full blocks are shared, a
    /// partial last block is copied.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence or `len` past its length,
    /// [`Error::KvPoolFull`] when the partial block cannot be copied.
    pub fn fork(&mut self, seq: SeqId, len: usize) -> Result<SeqId> {
        let s = self.seq(seq)?;
        if len > s.tokens.len() {
            return Err(invalid(
                "KvPool::fork",
                format!(
                    "cannot fork {len} positions of a sequence of {}",
                    s.tokens.len()
                ),
            ));
        }
        let full = len / BLOCK_SIZE;
        let shared: Vec<BlockId> = s.blocks[..full].to_vec();
        let partial = (!len.is_multiple_of(BLOCK_SIZE)).then(|| s.blocks[full]);
        let tokens = s.tokens[..len].to_vec();
        let keys = s.keys[..full.min(s.keys.len())].to_vec();
        let copy = match partial {
            Some(src) => Some(self.copy_block(src)?),
            None => None,
        };
        for &b in &shared {
            self.meta[b as usize].refs += 1;
        }
        let child = self.create();
        let c = self.seq_mut(child)?;
        c.blocks = shared;
        c.blocks.extend(copy);
        c.tokens = tokens;
        c.keys = keys;
        Ok(child)
    }

    /// How many positions [`KvPool::adopt_prefix`] would give a sequence for `tokens` now
    /// (changes nothing, counts nothing).
    pub fn cached_prefix(&self, tokens: &[u32]) -> usize {
        self.lookup(tokens).0.len() * BLOCK_SIZE
    }

    /// The longest chain of indexed full blocks that starts `tokens`, with their keys.
    fn lookup(&self, tokens: &[u32]) -> (Vec<BlockId>, Vec<BlockKey>) {
        let mut parent = None;
        let mut found = Vec::new();
        let mut keys = Vec::new();
        for chunk in tokens.chunks_exact(BLOCK_SIZE) {
            let key = block_key(parent.as_ref(), chunk);
            let Some(&b) = self.index.get(&key) else {
                break;
            };
            let hit = self.meta[b as usize]
                .indexed
                .as_ref()
                .is_some_and(|ix| ix.parent == parent && *ix.tokens == *chunk);
            if !hit {
                break;
            }
            found.push(b);
            keys.push(key);
            parent = Some(key);
        }
        (found, keys)
    }

    /// Gives the empty sequence `seq` the longest chain of indexed full blocks that starts
    /// `tokens`, returning how many positions it now holds (a multiple of [`BLOCK_SIZE`]).
    /// Pass at most the prompt minus its last token when that token's logits are needed.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown or non-empty sequence.
    pub fn adopt_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        if self.len(seq)? != 0 {
            return Err(invalid(
                "KvPool::adopt_prefix",
                format!("sequence {seq:?} is not empty"),
            ));
        }
        let (found, keys) = self.lookup(tokens);
        let len = found.len() * BLOCK_SIZE;
        self.stats.prefix_query_tokens += (tokens.len() / BLOCK_SIZE * BLOCK_SIZE) as u64;
        self.stats.prefix_hit_tokens += len as u64;
        for &b in &found {
            let m = &mut self.meta[b as usize];
            if let Some(t) = m.lru.take() {
                self.lru.remove(&t);
            }
            if m.refs == 0 {
                self.stats.used_blocks += 1;
            }
            m.refs += 1;
        }
        let s = self.seq_mut(seq)?;
        s.blocks = found;
        s.tokens = tokens[..len].to_vec();
        s.keys = keys;
        Ok(len)
    }

    /// Appends `tokens` to `seq`, allocating the blocks their K/V will be written to (the
    /// forward writes them with [`KvPool::write`]); all or nothing.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence, [`Error::KvPoolFull`] when the
    /// blocks cannot be had.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let s = self.seq(seq)?;
        let needed = self.plan_append(s, tokens.len());
        let available = self.available_blocks();
        if needed > available {
            return Err(Error::KvPoolFull { needed, available });
        }
        let len = s.tokens.len();
        if !len.is_multiple_of(BLOCK_SIZE) && !tokens.is_empty() {
            // The tail block is about to be written: copy it if shared, unindex it if cached.
            let last = *s.blocks.last().expect("invariant: a partial block exists");
            if self.meta[last as usize].refs > 1 {
                let copy = self.copy_block(last)?;
                self.unref(last);
                *self
                    .seq_mut(seq)?
                    .blocks
                    .last_mut()
                    .expect("invariant: non-empty") = copy;
            } else {
                self.unindex(last);
            }
        }
        let grow = (len + tokens.len()).div_ceil(BLOCK_SIZE) - self.seq(seq)?.blocks.len();
        let mut fresh = Vec::with_capacity(grow);
        for _ in 0..grow {
            fresh.push(self.alloc()?);
        }
        let s = self.seq_mut(seq)?;
        s.blocks.extend(fresh);
        s.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Enters the full blocks of `seq` not yet keyed into the prefix index (after their K/V
    /// were written).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence.
    pub fn index_full_blocks(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?;
        let full = s.tokens.len() / BLOCK_SIZE;
        let mut new = Vec::new();
        let mut parent = s.keys.last().copied();
        for i in s.keys.len()..full {
            let tokens = &s.tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let key = block_key(parent.as_ref(), tokens);
            new.push((s.blocks[i], key, parent, tokens.to_vec()));
            parent = Some(key);
        }
        for (b, key, parent, tokens) in new {
            self.seq_mut(seq)?.keys.push(key);
            let m = &mut self.meta[b as usize];
            if m.indexed.is_none() && !self.index.contains_key(&key) {
                self.index.insert(key, b);
                m.indexed = Some(Indexed {
                    key,
                    parent,
                    tokens: tokens.into_boxed_slice(),
                });
            }
        }
        Ok(())
    }

    /// Where position `pos` of `seq` lives: `(block, offset)`.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence or a position it does not hold.
    pub fn locate(&self, seq: SeqId, pos: usize) -> Result<(BlockId, usize)> {
        let s = self.seq(seq)?;
        match pos < s.tokens.len() {
            true => Ok((s.blocks[pos / BLOCK_SIZE], pos % BLOCK_SIZE)),
            false => Err(invalid(
                "KvPool::locate",
                format!("position {pos} of a sequence of {}", s.tokens.len()),
            )),
        }
    }

    /// Writes one position's `k` and `v` (`[kv_heads * head_dim]`, heads in order) into slot
    /// `slot` of `block` at `offset`.
    ///
    /// # Panics
    /// On a slot, block, offset or row length out of range (indexing bugs of the forward).
    pub fn write(&mut self, slot: usize, block: BlockId, offset: usize, k: &[f32], v: &[f32]) {
        let SlotShape { kv_heads, head_dim } = self.layout.slots[slot];
        assert!(offset < BLOCK_SIZE && k.len() == kv_heads * head_dim && v.len() == k.len());
        let (ks, vs) = self.block_mut(slot, block);
        for h in 0..kv_heads {
            let kh = &mut ks[h * head_dim * BLOCK_SIZE..(h + 1) * head_dim * BLOCK_SIZE];
            for (i, &x) in k[h * head_dim..(h + 1) * head_dim].iter().enumerate() {
                kh[i * BLOCK_SIZE + offset] = x;
            }
        }
        for h in 0..kv_heads {
            let at = (h * BLOCK_SIZE + offset) * head_dim;
            vs[at..at + head_dim].copy_from_slice(&v[h * head_dim..(h + 1) * head_dim]);
        }
    }

    /// K and V of slot `slot` in `block`, wherever they are stored (the arena, or the donor
    /// region for an exported slot).
    fn block_ref(&self, slot: usize, block: BlockId) -> (&[f32], &[f32]) {
        if let Some((d, i)) = self.donor.as_ref().and_then(|d| Some((d, d.index(slot)?))) {
            return d.block(i, block);
        }
        let (ko, vo) = self.slot_offsets[slot];
        let base = block as usize * self.block_floats;
        let half = KvLayout::half(&self.layout.slots[slot]);
        (
            &self.arena[base + ko..base + ko + half],
            &self.arena[base + vo..base + vo + half],
        )
    }

    fn block_mut(&mut self, slot: usize, block: BlockId) -> (&mut [f32], &mut [f32]) {
        if let Some(i) = self.donor.as_ref().and_then(|d| d.index(slot)) {
            let d = self.donor.as_mut().expect("invariant: checked above");
            return d.block_mut(i, block);
        }
        let (ko, vo) = self.slot_offsets[slot];
        let base = block as usize * self.block_floats;
        let half = KvLayout::half(&self.layout.slots[slot]);
        let (head, tail) = self.arena[base + ko..].split_at_mut(vo - ko);
        (&mut head[..half], &mut tail[..half])
    }

    /// K of head `head` of slot `slot` in `block`: `[head_dim][BLOCK_SIZE]` (transposed).
    ///
    /// # Panics
    /// On an index out of range.
    pub fn k_block(&self, slot: usize, block: BlockId, head: usize) -> &[f32] {
        let n = self.layout.slots[slot].head_dim * BLOCK_SIZE;
        &self.block_ref(slot, block).0[head * n..(head + 1) * n]
    }

    /// V of head `head` of slot `slot` in `block`: `[BLOCK_SIZE][head_dim]`.
    ///
    /// # Panics
    /// On an index out of range.
    pub fn v_block(&self, slot: usize, block: BlockId, head: usize) -> &[f32] {
        let n = self.layout.slots[slot].head_dim * BLOCK_SIZE;
        &self.block_ref(slot, block).1[head * n..(head + 1) * n]
    }

    /// K and V of positions `range` of `seq` in slot `slot`, as `[rows, kv_heads, head_dim]`
    /// row-major copies (what a drafter is sent).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence, slot or a range past its length.
    pub fn read_rows(
        &self,
        seq: SeqId,
        slot: usize,
        range: std::ops::Range<usize>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let s = self.seq(seq)?;
        let Some(&SlotShape { kv_heads, head_dim }) = self.layout.slots.get(slot) else {
            return Err(invalid("KvPool::read_rows", format!("no slot {slot}")));
        };
        if range.start > range.end || range.end > s.tokens.len() {
            return Err(invalid(
                "KvPool::read_rows",
                format!("rows {range:?} of a sequence of {}", s.tokens.len()),
            ));
        }
        let n = range.len() * kv_heads * head_dim;
        let (mut k, mut v) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in range {
            let (b, off) = (s.blocks[p / BLOCK_SIZE], p % BLOCK_SIZE);
            for h in 0..kv_heads {
                let kb = self.k_block(slot, b, h);
                k.extend((0..head_dim).map(|i| kb[i * BLOCK_SIZE + off]));
                v.extend_from_slice(
                    &self.v_block(slot, b, h)[off * head_dim..(off + 1) * head_dim],
                );
            }
        }
        Ok((k, v))
    }

    /// Moves the storage of `layers` (`(slot, target layer)`, in the drafter's order) into a
    /// donor region a drafter can map ([`KvPool::donor_share`]), carrying their K/V over; an
    /// empty list moves any exported slots back into the arena. The same list again is a no-op.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a slot that does not exist or is named twice.
    pub fn export_donors(&mut self, layers: &[(usize, u32)]) -> Result<()> {
        if self.donor.as_ref().map_or(&[][..], |d| d.layers()) == layers {
            return Ok(());
        }
        let blocks = self.meta.len();
        if let Some(old) = self.donor.take() {
            for &(slot, _) in old.layers() {
                let i = old.index(slot).expect("invariant: an exported slot");
                for b in 0..blocks as BlockId {
                    let (k, v) = old.block(i, b);
                    let (ak, av) = self.block_mut(slot, b);
                    ak.copy_from_slice(k);
                    av.copy_from_slice(v);
                }
            }
        }
        if layers.is_empty() {
            return Ok(());
        }
        self.donor_regions += 1;
        let mut store = donor::DonorStore::new(&self.layout, layers, blocks, self.donor_regions)?;
        for (i, &(slot, _)) in layers.iter().enumerate() {
            for b in 0..blocks as BlockId {
                let (k, v) = self.block_ref(slot, b);
                let (dk, dv) = store.block_mut(i, b);
                dk.copy_from_slice(k);
                dv.copy_from_slice(v);
            }
        }
        self.donor = Some(store);
        Ok(())
    }

    /// The exported `(slot, target layer)`s (empty when none).
    pub fn donor_layers(&self) -> &[(usize, u32)] {
        self.donor.as_ref().map_or(&[][..], |d| d.layers())
    }

    /// The current donor region's id, when slots are exported (it changes when the region
    /// grows: then hand the drafter [`KvPool::donor_share`] again).
    pub fn donor_region(&self) -> Option<RegionId> {
        self.donor.as_ref().map(|d| d.region())
    }

    /// The donor region to send a drafter (a new mapping each call: call it per new region).
    pub fn donor_share(&self) -> Option<DonorShare> {
        self.donor.as_ref().map(|d| d.share())
    }

    /// Bytes the pool copied into bigger donor regions as it grew (host memory only).
    pub fn donor_regrow_bytes(&self) -> u64 {
        self.donor.as_ref().map_or(0, |d| d.regrow_bytes)
    }

    /// The donor block table of positions `0..len` of `seq`, each block with its epoch made
    /// stable: what the drafter is told. `None` when no slot is exported.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown sequence or `len` past its length.
    pub fn donor_table(&mut self, seq: SeqId, len: usize) -> Result<Option<Vec<DonorBlock>>> {
        let s = self.seq(seq)?;
        if len > s.tokens.len() {
            return Err(invalid(
                "KvPool::donor_table",
                format!("{len} positions of a sequence of {}", s.tokens.len()),
            ));
        }
        let blocks = s.blocks[..len.div_ceil(BLOCK_SIZE)].to_vec();
        Ok(self.donor.as_mut().map(|d| d.table(&blocks)))
    }

    fn alloc(&mut self) -> Result<BlockId> {
        let b = if let Some(b) = self.free.pop() {
            b
        } else if self.meta.len() < self.capacity {
            // Grow the arena geometrically; block ids stay valid (they are offsets).
            let old = self.meta.len();
            let new = (old * 2).max(4).min(self.capacity);
            if self.donor.as_ref().is_some_and(|d| d.blocks() < new) {
                self.donor_regions += 1;
                let region = self.donor_regions;
                let d = self.donor.as_mut().expect("invariant: checked above");
                d.grow(new, region)?;
            }
            self.arena.resize(new * self.block_floats, 0.0);
            self.meta.resize(new, BlockMeta::default());
            self.free.extend((old as BlockId + 1..new as BlockId).rev());
            old as BlockId
        } else if let Some((_, b)) = self.lru.pop_first() {
            self.meta[b as usize].lru = None;
            self.unindex(b);
            b
        } else {
            return Err(Error::KvPoolFull {
                needed: 1,
                available: 0,
            });
        };
        if let Some(d) = &mut self.donor {
            // A new owner: readers of the block's old rows must see them go.
            d.claim(b);
        }
        self.meta[b as usize].refs = 1;
        self.stats.used_blocks += 1;
        Ok(b)
    }

    fn copy_block(&mut self, src: BlockId) -> Result<BlockId> {
        let dst = self.alloc()?;
        let n = self.block_floats;
        self.arena
            .copy_within(src as usize * n..(src as usize + 1) * n, dst as usize * n);
        let exported: Vec<usize> = (0..self.layout.slots.len())
            .filter(|&s| self.donor.as_ref().is_some_and(|d| d.index(s).is_some()))
            .collect();
        for slot in exported {
            let (k, v) = self.block_ref(slot, src);
            let (k, v) = (k.to_vec(), v.to_vec());
            let (dk, dv) = self.block_mut(slot, dst);
            dk.copy_from_slice(&k);
            dv.copy_from_slice(&v);
        }
        Ok(dst)
    }

    fn unref(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        m.refs -= 1;
        if m.refs > 0 {
            return;
        }
        self.stats.used_blocks -= 1;
        match m.indexed.is_some() {
            true => {
                self.tick += 1;
                m.lru = Some(self.tick);
                self.lru.insert(self.tick, b);
                self.trim_cache();
            }
            false => self.free.push(b),
        }
    }

    fn unindex(&mut self, b: BlockId) {
        if let Some(ix) = self.meta[b as usize].indexed.take() {
            if self.index.get(&ix.key) == Some(&b) {
                self.index.remove(&ix.key);
            }
        }
    }
}

/// `sha256(parent key, tokens)` truncated to 128 bits.
fn block_key(parent: Option<&BlockKey>, tokens: &[u32]) -> BlockKey {
    let mut h = Sha256::new();
    match parent {
        Some(p) => h.update(p),
        None => h.update([0u8; 16]),
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let d = h.finalize();
    let mut key = [0u8; 16];
    key.copy_from_slice(&d[..16]);
    key
}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidRequest { op, reason }
}

#[cfg(test)]
mod tests;
