//! Prompt-lookup decoding: propose the tokens that followed an earlier occurrence of the
//! context's suffix (the most recent one, or the one whose next token followed that suffix most
//! often). Needs no model, and pays off when the output copies from the prompt (code edits,
//! summaries with quotes, RAG).
//!
//! Reference: Saxena, "Prompt Lookup Decoding" (2023,
//! <https://github.com/apoorvumang/prompt-lookup-decoding>) and vLLM's `NgramProposer`. Unlike
//! them, [`NgramIndex`] never rescans the context: a hash map from each n-gram to its
//! continuations (next id → count and latest position) is updated as tokens are appended, so a
//! lookup costs `max_n - min_n + 1` probes however long the context is.

use std::collections::HashMap;

use specula_protocol::sdk::{CommitArgs, Drafter, DrafterInfo, OpenArgs, Proposal};
use specula_protocol::wire::{Capabilities, SessionId};

/// Which earlier occurrence of a matched suffix to copy from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choice {
    /// The latest occurrence: text being edited tends to repeat what was just said.
    #[default]
    Recent,
    /// The latest occurrence among those followed by the suffix's most frequent next id (ties
    /// go to the latest): steadier on boilerplate that repeats with small variations.
    Frequent,
}

/// Which suffix lengths to try, longest first, and which occurrence to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// Shortest suffix that may match (a 1-gram matches often and guesses badly, hence 2).
    pub min_n: usize,
    /// Longest suffix tried first.
    pub max_n: usize,
    /// Occurrence to copy from.
    pub choice: Choice,
}

impl Default for NgramConfig {
    fn default() -> Self {
        NgramConfig {
            min_n: 2,
            max_n: 4,
            choice: Choice::Recent,
        }
    }
}

impl NgramConfig {
    /// Checks `1 <= min_n <= max_n <= 32`.
    ///
    /// # Errors
    /// A message naming the bad bound.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_n == 0 || self.min_n > self.max_n || self.max_n > 32 {
            return Err(format!(
                "n-gram sizes must satisfy 1 <= min ({}) <= max ({}) <= 32",
                self.min_n, self.max_n
            ));
        }
        Ok(())
    }
}

/// The context of one session and its n-gram index.
///
/// # Invariants
/// For the n-gram `g` (hash `h`), `next[(n, h)]` lists each id `t` that followed `g` with how
/// often it did and the latest end position `p` of `g` followed by `t`: `tokens[p-n..p] == g`
/// and `tokens[p] == t`. Only n-grams that have a continuation are indexed, which is why an
/// n-gram is inserted one token after it is complete.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    config: NgramConfig,
    tokens: Vec<u32>,
    next: HashMap<(usize, u64), Vec<Continuation>>,
}

/// One id that followed an n-gram.
#[derive(Debug, Clone, Copy)]
struct Continuation {
    id: u32,
    count: u32,
    /// Latest end position of the n-gram where `id` followed.
    at: usize,
}

fn hash(gram: &[u32]) -> u64 {
    // FNV-1a over the ids: cheap, and collisions are caught by comparing the slices.
    gram.iter().fold(0xcbf2_9ce4_8422_2325, |h, &id| {
        (h ^ u64::from(id)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl NgramIndex {
    /// An empty context.
    pub fn new(config: NgramConfig) -> Self {
        NgramIndex {
            config,
            tokens: Vec::new(),
            next: HashMap::new(),
        }
    }

    /// The context so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends ids to the context, indexing the n-grams that now have a continuation.
    pub fn extend(&mut self, ids: &[u32]) {
        for &id in ids {
            let end = self.tokens.len();
            for n in self.config.min_n..=self.config.max_n.min(end) {
                let seen = self
                    .next
                    .entry((n, hash(&self.tokens[end - n..end])))
                    .or_default();
                match seen.iter_mut().find(|c| c.id == id) {
                    Some(c) => {
                        c.count += 1;
                        c.at = end;
                    }
                    None => seen.push(Continuation {
                        id,
                        count: 1,
                        at: end,
                    }),
                }
            }
            self.tokens.push(id);
        }
    }

    /// Up to `k` ids that followed an earlier occurrence (per [`Choice`]) of the longest
    /// matching suffix; empty when no suffix of `min_n..=max_n` ids occurred before.
    pub fn propose(&self, k: usize) -> Vec<u32> {
        let len = self.tokens.len();
        for n in (self.config.min_n..=self.config.max_n.min(len)).rev() {
            let suffix = &self.tokens[len - n..];
            let Some(seen) = self.next.get(&(n, hash(suffix))) else {
                continue;
            };
            let best = match self.config.choice {
                Choice::Recent => seen.iter().max_by_key(|c| c.at),
                Choice::Frequent => seen.iter().max_by_key(|c| (c.count, c.at)),
            };
            // A hash collision shows as an occurrence that is not the suffix.
            if let Some(p) = best
                .map(|c| c.at)
                .filter(|&p| self.tokens[p - n..p] == *suffix)
            {
                return self.tokens[p..len.min(p + k)].to_vec();
            }
        }
        Vec::new()
    }
}

/// The n-gram drafter: one [`NgramIndex`] per session.
#[derive(Debug)]
pub struct NgramDrafter {
    config: NgramConfig,
    max_draft_len: u32,
    sessions: HashMap<SessionId, NgramIndex>,
}

impl NgramDrafter {
    /// A drafter proposing at most `max_draft_len` ids per round.
    pub fn new(config: NgramConfig, max_draft_len: u32) -> Self {
        NgramDrafter {
            config,
            max_draft_len,
            sessions: HashMap::new(),
        }
    }
}

impl Drafter for NgramDrafter {
    fn info(&self) -> DrafterInfo {
        let caps = Capabilities::tokens_only(self.max_draft_len);
        DrafterInfo::new("ngram", env!("CARGO_PKG_VERSION"), caps)
    }

    fn open(&mut self, session: SessionId, args: OpenArgs<'_>) {
        let mut index = NgramIndex::new(self.config);
        index.extend(args.prompt);
        self.sessions.insert(session, index);
    }

    fn draft(&mut self, session: SessionId, new_tokens: &[u32], n: usize) -> Proposal {
        let Some(index) = self.sessions.get_mut(&session) else {
            return Proposal::none();
        };
        index.extend(new_tokens);
        Proposal::tokens(index.propose(n))
    }

    fn commit(&mut self, session: SessionId, args: CommitArgs<'_>) {
        if let Some(index) = self.sessions.get_mut(&session) {
            index.extend(args.ids);
        }
    }

    fn close(&mut self, session: SessionId) {
        self.sessions.remove(&session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(min_n: usize, max_n: usize, choice: Choice) -> NgramConfig {
        NgramConfig {
            min_n,
            max_n,
            choice,
        }
    }

    fn index(min_n: usize, max_n: usize, ids: &[u32]) -> NgramIndex {
        let mut index = NgramIndex::new(config(min_n, max_n, Choice::Recent));
        index.extend(ids);
        index
    }

    /// The obvious quadratic algorithm the index must agree with.
    fn rescan(tokens: &[u32], config: NgramConfig, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (config.min_n..=config.max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            // Every earlier end position of the suffix that has a continuation, latest first.
            let ends: Vec<usize> = (n..len)
                .rev()
                .filter(|&p| &tokens[p - n..p] == suffix)
                .collect();
            let count = |p: usize| ends.iter().filter(|&&q| tokens[q] == tokens[p]).count();
            let best = match config.choice {
                Choice::Recent => ends.first().copied(),
                // max_by_key keeps the last maximum: iterate oldest first so ties go to the latest.
                Choice::Frequent => ends.iter().rev().copied().max_by_key(|&p| count(p)),
            };
            if let Some(p) = best {
                return tokens[p..len.min(p + k)].to_vec();
            }
        }
        Vec::new()
    }

    #[test]
    fn proposes_continuation_of_latest_longest_match() {
        // "a b c d ... a b" → after the suffix "a b", "c d" followed.
        let ix = index(1, 3, &[1, 2, 3, 4, 9, 1, 2]);
        assert_eq!(ix.propose(2), vec![3, 4]);
        assert_eq!(ix.propose(10), vec![3, 4, 9, 1, 2]);
        // The most recent occurrence wins: "1 2 5" is later than "1 2 3".
        let ix = index(2, 2, &[1, 2, 3, 7, 1, 2, 5, 1, 2]);
        assert_eq!(ix.propose(1), vec![5]);
    }

    #[test]
    fn longer_suffix_beats_shorter() {
        // Suffix "6 1 2" never occurred: the 2-gram "1 2" matches, latest followed by 3.
        let ix = index(1, 3, &[7, 1, 2, 8, 0, 1, 2, 3, 6, 1, 2]);
        assert_eq!(ix.propose(1), vec![3]);
        // Suffix "7 1 2" occurred (followed by 8): it beats the later "1 2" (followed by 3).
        let ix = index(1, 3, &[7, 1, 2, 8, 0, 1, 2, 3, 7, 1, 2]);
        assert_eq!(ix.propose(1), vec![8]);
    }

    #[test]
    fn nothing_without_a_match() {
        assert!(index(2, 4, &[1, 2, 3, 4, 5]).propose(4).is_empty());
        assert!(index(2, 4, &[]).propose(4).is_empty());
        assert!(index(2, 4, &[1, 2, 1, 2]).propose(0).is_empty());
    }

    #[test]
    fn frequent_choice_copies_the_usual_continuation() {
        // "1 2" was followed by 3 twice, then by 5 once (latest).
        let ids = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 5, 7, 1, 2];
        let mut ix = NgramIndex::new(config(2, 2, Choice::Frequent));
        ix.extend(&ids);
        // Copies from the latest "1 2 3", not from the latest "1 2".
        assert_eq!(ix.propose(3), vec![3, 8, 1]);
        assert_eq!(index(2, 2, &ids).propose(3), vec![5, 7, 1]);
    }

    #[test]
    fn incremental_index_matches_a_full_rescan() {
        for choice in [Choice::Recent, Choice::Frequent] {
            // A small alphabet makes many matches of every length; pseudo-random but fixed.
            let mut state = 12345u32;
            let config = config(1, 4, choice);
            let mut ix = NgramIndex::new(config);
            for step in 0..3000 {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let id = (state >> 16) % 6;
                ix.extend(&[id]);
                if step % 7 == 0 {
                    let want = rescan(ix.tokens(), config, 5);
                    assert_eq!(ix.propose(5), want, "{choice:?} at step {step}");
                }
            }
        }
    }

    #[test]
    fn config_is_checked() {
        assert!(NgramConfig::default().validate().is_ok());
        assert!(config(0, 3, Choice::Recent).validate().is_err());
        assert!(config(4, 3, Choice::Frequent).validate().is_err());
    }
}
