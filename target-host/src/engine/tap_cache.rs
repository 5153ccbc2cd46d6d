//! The host's cache of drafter taps for prefix-cached blocks, so that a sequence feeding a tap
//! drafter adopts cached K/V blocks too.
//!
//! **The choice, and why.** A prefix-cache hit skips the target forward over the shared blocks,
//! and with it the taps (hidden states, K/V rows) a tap drafter's `Open` must carry for those
//! positions. Three ways out: (1) prefill everything for tap sessions (no hit at all: what the
//! engine did before); (2) store tap rows inside the KV pool's blocks; (3) keep a host cache of
//! tap rows keyed by the pool's block key (`sha256(parent key, tokens)`, one key names a whole
//! prefix). This is (3): the taps depend on what the current drafter asks for (layers, final
//! hidden, K/V layers), which the pool does not know and should not — the pool's block layout
//! is shared with K/V donor views and the GPU step, and adding per-drafter payloads to it would
//! tie those to drafter choices. A separate cache is emptied when the wants change (a swap to
//! a drafter that taps other layers), bounded by its own byte budget with LRU eviction, and
//! needs nothing from the protocol: the drafter still gets one `Open` with the taps of every
//! position before the pending one, bit-identical to what a prefill would have made (a row
//! depends only on its sequence's tokens).
//!
//! A block is usable only when both hold it: [`TapCache::leading`] counts the leading blocks
//! of a prompt whose taps are here, and the sequence adopts at most that many pool blocks.
//! Blocks are stored as a sequence's taps cover them (each prefill chunk, and at its end).
//! While a tap drafter is loaded, a plain sequence's prefill makes taps too (for this cache
//! only) when they extend a cached prefix: otherwise a plain request would cache blocks that
//! no later tap request could adopt.

use std::collections::{BTreeMap, HashMap};

use specula_models::kv_pool::{BlockKey, BLOCK_SIZE};

use crate::proposer::{TapRows, Wants};

/// The cache. See the module docs.
#[derive(Debug)]
pub struct TapCache {
    wants: Wants,
    budget: usize,
    bytes: usize,
    tick: u64,
    blocks: HashMap<BlockKey, (TapRows, u64)>,
    lru: BTreeMap<u64, BlockKey>,
}

impl TapCache {
    /// An empty cache of at most `budget` bytes of taps.
    pub fn new(budget: usize) -> Self {
        TapCache {
            wants: Wants::default(),
            budget,
            bytes: 0,
            tick: 0,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    /// Empties the cache when the drafter now wants other taps than those cached.
    pub fn follow(&mut self, wants: &Wants) {
        if *wants != self.wants {
            self.blocks.clear();
            self.lru.clear();
            self.bytes = 0;
            self.wants = wants.clone();
        }
    }

    /// Bytes of taps held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many of `keys` (a prompt's block chain, in order) have their taps here, from the
    /// first on.
    pub fn leading(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.blocks.contains_key(*k))
            .count()
    }

    /// The taps of the first `keys.len()` blocks of a prompt, from position 0; marks them used.
    /// `None` when one is missing (call [`TapCache::leading`] first).
    pub fn prefix(&mut self, keys: &[BlockKey]) -> Option<TapRows> {
        let mut out = TapRows::default();
        for key in keys {
            self.tick += 1;
            let (rows, tick) = self.blocks.get_mut(key)?;
            self.lru.remove(tick);
            *tick = self.tick;
            self.lru.insert(self.tick, *key);
            out.extend(rows);
        }
        Some(out)
    }

    /// Stores the blocks of a sequence whose keys are `keys` (block `i` covers positions
    /// `i * BLOCK_SIZE..`) that `taps` covers whole; blocks already here are kept as they are.
    pub fn insert(&mut self, keys: &[BlockKey], taps: &TapRows) {
        let end = taps.pos + taps.rows;
        for (i, key) in keys.iter().enumerate() {
            let start = i * BLOCK_SIZE;
            if start < taps.pos || start + BLOCK_SIZE > end || self.blocks.contains_key(key) {
                continue;
            }
            let rows = taps.window(start - taps.pos, BLOCK_SIZE);
            let bytes = rows.bytes();
            if bytes > self.budget {
                return;
            }
            while self.bytes + bytes > self.budget {
                self.evict_one();
            }
            self.tick += 1;
            self.bytes += bytes;
            self.lru.insert(self.tick, *key);
            self.blocks.insert(*key, (rows, self.tick));
        }
    }

    fn evict_one(&mut self) {
        let Some((_, key)) = self.lru.pop_first() else {
            return;
        };
        if let Some((rows, _)) = self.blocks.remove(&key) {
            self.bytes -= rows.bytes();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_models::kv_pool::chain_keys;

    const B: usize = BLOCK_SIZE;

    fn wants() -> Wants {
        Wants {
            tap_layers: vec![1],
            ..Wants::default()
        }
    }

    /// Two floats a row, recognisable by position.
    fn taps(pos: usize, rows: usize) -> TapRows {
        TapRows {
            pos,
            rows,
            layers: vec![(pos * 2..(pos + rows) * 2).map(|x| x as f32).collect()],
            final_hidden: None,
            kv: vec![],
            donor: None,
        }
    }

    #[test]
    fn whole_blocks_are_kept_and_a_prefix_comes_back_in_order() {
        let prompt: Vec<u32> = (0..3 * B as u32 + 5).collect();
        let keys = chain_keys(&prompt);
        let mut c = TapCache::new(1 << 20);
        c.follow(&wants());
        // A chunk covering one and a half blocks stores only the whole one.
        c.insert(&keys, &taps(0, B + B / 2));
        assert_eq!(c.leading(&keys), 1);
        c.insert(&keys, &taps(0, 3 * B + 5));
        assert_eq!(c.leading(&keys), 3);
        assert_eq!(c.prefix(&keys[..2]), Some(taps(0, 2 * B)));
        // Another prompt shares nothing: its first key differs.
        let other: Vec<u32> = (1..B as u32 + 1).collect();
        assert_eq!(c.leading(&chain_keys(&other)), 0);
        // A window that starts mid-sequence stores the blocks it covers whole.
        let mut d = TapCache::new(1 << 20);
        d.follow(&wants());
        d.insert(&keys, &taps(B, 2 * B));
        assert_eq!(d.leading(&keys), 0, "block 0 is missing");
        assert_eq!(d.prefix(&keys[1..3]), Some(taps(B, 2 * B)));
    }

    #[test]
    fn other_wants_empty_it_and_the_budget_evicts_least_recently_used() {
        let prompt: Vec<u32> = (0..3 * B as u32).collect();
        let keys = chain_keys(&prompt);
        let block = taps(0, B).bytes();
        let mut c = TapCache::new(2 * block);
        c.follow(&wants());
        c.insert(&keys[..2], &taps(0, 2 * B));
        assert_eq!(c.bytes(), 2 * block);
        // Use block 0, then store block 2: block 1 is the least recently used.
        c.prefix(&keys[..1]).expect("held");
        c.insert(&keys, &taps(0, 3 * B));
        assert_eq!(c.bytes(), 2 * block, "within the budget");
        assert_eq!(c.leading(&keys), 1, "block 1 went");
        assert!(c.prefix(&keys[2..]).is_some(), "block 2 is held");
        c.follow(&Wants::default());
        assert_eq!((c.leading(&keys), c.bytes()), (0, 0));
    }
}
