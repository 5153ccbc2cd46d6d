//! A bounded LRU of draft caches keyed by the token prefix they hold, so a session re-opened
//! with a context that shares a prefix with a closed one (the host re-opens every session after
//! a drafter swap, and chat turns share their history) only prefills the new part.
//!
//! Entries are *moved* in and out, never cloned: [`KvCache`] clones alias the same buffers and a
//! later append to one would overwrite rows of the other.

use specula_models::KvCache;

/// K/V rows of the draft model for `ids` (the cache holds exactly `ids.len()` positions).
#[derive(Debug)]
pub struct Checkpoint {
    /// The ids whose K/V rows the cache holds, in order.
    pub ids: Vec<u32>,
    /// The cache itself.
    pub cache: KvCache,
}

/// Most-recently-used-last list of at most `capacity` checkpoints.
#[derive(Debug)]
pub struct Checkpoints {
    capacity: usize,
    entries: Vec<Checkpoint>,
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Checkpoints {
    /// An empty list keeping at most `capacity` caches (0 disables checkpoints).
    pub fn new(capacity: usize) -> Self {
        Checkpoints {
            capacity,
            entries: Vec::new(),
        }
    }

    /// Number of checkpoints held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no checkpoint is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Stores `checkpoint` as the most recent one, evicting the least recently used past
    /// capacity. Empty checkpoints are dropped: they save nothing.
    pub fn put(&mut self, checkpoint: Checkpoint) {
        if self.capacity == 0 || checkpoint.ids.is_empty() {
            return;
        }
        self.entries.push(checkpoint);
        if self.entries.len() > self.capacity {
            self.entries.remove(0);
        }
    }

    /// Takes out the checkpoint sharing the longest prefix with `ids` (at least one id),
    /// truncated to that shared prefix; `None` when no checkpoint shares any.
    pub fn take_longest(&mut self, ids: &[u32]) -> Option<Checkpoint> {
        let (best, shared) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, c)| (i, common_prefix(&c.ids, ids)))
            // On ties the most recent entry wins (`max_by_key` keeps the last maximum).
            .max_by_key(|&(_, shared)| shared)?;
        if shared == 0 {
            return None;
        }
        let mut checkpoint = self.entries.remove(best);
        checkpoint.ids.truncate(shared);
        // Cannot fail: `shared <= ids.len() == cache.len()` by the type's invariant.
        checkpoint
            .cache
            .truncate(shared)
            .expect("invariant: a checkpoint's cache holds its ids");
        Some(checkpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_models::testing::TinyModel;

    /// A tiny random model's cache holding `n` positions.
    fn cache(n: usize) -> KvCache {
        let config = TinyModel::tiny_config("llama").unwrap();
        let model = specula_models::random::load("tiny", config, &Default::default())
            .unwrap()
            .model;
        let mut c = model.new_cache();
        if n > 0 {
            let ids: Vec<u32> = (1..=n as u32).collect();
            model.forward(&ids, &mut c, &Default::default()).unwrap();
        }
        c
    }

    fn checkpoint(ids: &[u32]) -> Checkpoint {
        Checkpoint {
            ids: ids.to_vec(),
            cache: cache(ids.len()),
        }
    }

    #[test]
    fn takes_the_longest_shared_prefix_and_truncates_to_it() {
        let mut lru = Checkpoints::new(4);
        lru.put(checkpoint(&[1, 2, 3, 4]));
        lru.put(checkpoint(&[1, 2, 9]));
        let got = lru.take_longest(&[1, 2, 3, 7, 8]).unwrap();
        assert_eq!(got.ids, vec![1, 2, 3]);
        assert_eq!(got.cache.len(), 3);
        assert_eq!(lru.len(), 1, "taken out, not copied");
        assert!(lru.take_longest(&[5, 6]).is_none(), "no shared prefix");
        assert_eq!(lru.take_longest(&[1, 2, 9, 9]).unwrap().ids, vec![1, 2, 9]);
        assert!(lru.is_empty());
    }

    #[test]
    fn evicts_least_recently_used_and_ignores_empty() {
        let mut lru = Checkpoints::new(2);
        lru.put(checkpoint(&[1]));
        lru.put(checkpoint(&[2]));
        lru.put(checkpoint(&[]));
        lru.put(checkpoint(&[3]));
        assert_eq!(lru.len(), 2);
        assert!(lru.take_longest(&[1]).is_none(), "oldest was evicted");
        assert!(lru.take_longest(&[2]).is_some());
        let mut off = Checkpoints::new(0);
        off.put(checkpoint(&[1]));
        assert!(off.is_empty());
    }
}
