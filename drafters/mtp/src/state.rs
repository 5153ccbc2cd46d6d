//! One session of the MTP drafter: the cache rebuilt from the target's verified hiddens, and
//! the recursion that drafts from it. Positions follow vLLM's `EagleProposer.propose`
//! (`vllm/v1/spec_decode/eagle.py` @ f7eef1b6): the pair `(h_p, t_{p+1})` runs at `p`, the
//! position of its hidden (`target_positions`, input ids shifted by one), and each deeper
//! draft step at one more (`positions += 1`).
//!
//! ```text
//! context t_0 … t_p, t_p pending (the target has not run it)
//! verified window (Open: rows 0…p-1; Commit/Advance: rows p_old…p_old+n-1)
//!     rows (h_i, t_{i+1}) at i            -> cache rows i, last row's output -> draft 1 = t_{p+1}
//! draft j ≥ 2: (recycled hidden of step j-1, draft j-1) at p + j - 2  -> draft j
//! after drafting: the cache is cut back to the verified rows; the next window rebuilds from
//! the target's hiddens, never from the drafted ones
//! ```

use candle_core::Tensor;
use specula_models::drafter_support::draft_vocab::{select_rows, DraftVocab};
use specula_models::layers::{Embedding, Linear};

use crate::model::{Cache, Mtp, Step};
use crate::{fwd, Error};

/// Rows per forward when a window is long (a prompt).
pub const CHUNK: usize = 128;

/// The target's parts an MTP step needs, with the module and the head drafts are picked with.
pub struct Core {
    /// The MTP module.
    pub mtp: Mtp,
    /// The target's token embedding (shared by every layout).
    pub embedding: Embedding,
    /// The module's own head, else the target's lm_head, restricted to the draft vocabulary
    /// when there is one.
    head: Linear,
    /// Draft-head row → vocabulary id (`None`: the rows are the vocabulary).
    vocab: Option<DraftVocab>,
}

impl Core {
    /// The parts over `mtp`: drafts come from its own head when it has one, else from the
    /// target's `lm_head`, over `vocab`'s ids only when given (the head's rows are copied out
    /// once, in their own storage).
    ///
    /// # Errors
    /// [`Error::Forward`] when a draft id is past the head's rows.
    pub fn new(
        mtp: Mtp,
        embedding: Embedding,
        lm_head: Linear,
        vocab: Option<DraftVocab>,
    ) -> Result<Self, Error> {
        let full = mtp.head().unwrap_or(&lm_head);
        let head = match &vocab {
            Some(v) => select_rows(full, v.ids()).map_err(fwd)?,
            None => full.clone(),
        };
        Ok(Core {
            mtp,
            embedding,
            head,
            vocab,
        })
    }

    /// Logits `[n, draft rows]` of `post` rows (after the out norm).
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch.
    pub fn logits(&self, post: &Tensor) -> Result<Tensor, Error> {
        self.head.forward(post).map_err(fwd)
    }

    /// The draft vocabulary, when drafts are restricted to one.
    pub fn vocab(&self) -> Option<&DraftVocab> {
        self.vocab.as_ref()
    }

    /// The vocabulary id of draft-head row `row`.
    pub fn id(&self, row: u32) -> u32 {
        self.vocab.as_ref().map_or(row, |v| v.id(row))
    }
}

/// One session's state.
#[derive(Debug, Clone, Default)]
pub struct Session {
    cache: Cache,
    /// The output of the last window row (position `pos - 1`), when its hidden came.
    last: Option<Step>,
    /// The pending id's position (the next window starts there).
    pos: usize,
    /// Rows whose hiddens never came (torn or missing taps): holes in the cache.
    missing: usize,
}

impl Session {
    /// A session whose context is one pending id at position 0; the rest of a prompt comes
    /// through [`Session::extend`] (the pending id itself enters as the token of the row before
    /// it, so it is not kept).
    pub fn new() -> Self {
        Session {
            cache: Cache::default(),
            last: None,
            pos: 0,
            missing: 0,
        }
    }

    /// The pending id's position.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Cached rows and rows missing from the cache.
    pub fn rows(&self) -> (usize, usize) {
        (self.cache.rows(), self.missing)
    }

    /// Commits `ids` after the pending id: `hidden` `[ids.len(), hidden]` holds the target's
    /// verified hiddens at positions `pos..pos + ids.len()` (the pending row first), or `None`
    /// when they did not come (the rows become a hole and nothing is drafted until a window
    /// with hiddens).
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch or an id outside the vocabulary.
    pub fn extend(
        &mut self,
        core: &Core,
        hidden: Option<&Tensor>,
        ids: &[u32],
    ) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let before = self.cache.rows();
        let result = match hidden {
            Some(h) => self.window(core, h, ids).map(Some),
            None => Ok(None),
        };
        self.last = match &result {
            Ok(Some(step)) => Some(step.clone()),
            // A failed window leaves a hole, as missing hiddens do: positions stay right.
            Ok(None) | Err(_) => {
                self.cache.truncate(before, core.mtp.row_width());
                self.missing += ids.len();
                None
            }
        };
        self.pos += ids.len();
        result.map(|_| ())
    }

    /// Runs the window `(hidden, ids)` at the pending position, in chunks of [`CHUNK`] rows
    /// (a chunk's scores are `rows × cache`: a whole prompt at once would be quadratic in
    /// memory); returns its last row's step.
    fn window(&mut self, core: &Core, hidden: &Tensor, ids: &[u32]) -> Result<Step, Error> {
        let mut last = None;
        for start in (0..ids.len()).step_by(CHUNK) {
            let n = CHUNK.min(ids.len() - start);
            let emb = core
                .embedding
                .forward(&ids[start..start + n])
                .map_err(fwd)?;
            let h = hidden.narrow(0, start, n).map_err(fwd)?;
            let step = core
                .mtp
                .forward(&mut self.cache, &h, &emb, self.pos + start)?;
            last = Some(Step {
                pre: step.pre.narrow(0, n - 1, 1).map_err(fwd)?,
                post: step.post.narrow(0, n - 1, 1).map_err(fwd)?,
            });
        }
        Ok(last.expect("invariant: windows are not empty"))
    }

    /// Ids committed without hiddens (a 1.0 host's `new_tokens`).
    pub fn extend_blind(&mut self, ids: &[u32]) {
        if !ids.is_empty() {
            self.missing += ids.len();
            self.pos += ids.len();
            self.last = None;
        }
    }

    /// Drafts up to `n` ids (fewer at `max_pos` or the layout's depth limit); `pick` chooses
    /// each from its logits `[1, draft rows]`, as a draft-head row (and may keep them: nothing
    /// else is copied out), or `None` to stop there (the drafter's confidence rule), and no
    /// deeper step runs.
    ///
    /// # Errors
    /// [`Error::Forward`] when a step fails.
    pub fn draft(
        &mut self,
        core: &Core,
        n: usize,
        max_pos: usize,
        pick: &mut dyn FnMut(&Tensor) -> Result<Option<u32>, Error>,
    ) -> Result<Vec<u32>, Error> {
        let mtp = &core.mtp;
        let depth = mtp.config().max_depth.map_or(n, |d| n.min(d));
        // Step j runs at pos - 1 + j; every position must fit the RoPE tables.
        let depth = depth.min(max_pos.saturating_sub(self.pos));
        let Some(first) = self.last.clone() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(depth);
        let verified = self.cache.rows();
        let mut step = first;
        let result = (|| {
            for j in 0..depth {
                if j > 0 {
                    let prev = *out.last().expect("invariant: one draft per step");
                    let emb = core.embedding.forward(&[prev]).map_err(fwd)?;
                    let h = mtp.recycled(&step).clone();
                    step = mtp.forward(&mut self.cache, &h, &emb, self.pos - 1 + j)?;
                }
                match pick(&core.logits(&step.post)?)? {
                    Some(row) => out.push(core.id(row)),
                    None => break,
                }
            }
            Ok(())
        })();
        // The drafted rows never stay: the next window rebuilds them from verified hiddens.
        self.cache.truncate(verified, mtp.row_width());
        result.map(|()| out)
    }
}
