//! K/V donor export: the pool's storage for some slots lives in a shared-memory region that a
//! drafter maps read-only (protocol 1.2 `MapDonors`, laid out by `specula_protocol::donor`), so
//! the drafter reads a sequence's K/V of those layers where the forward wrote them: no copy per
//! round.
//!
//! ```text
//!  heap arena:  block b: slot 0 | slot 1 | ... | slot 29      (exported slots' bytes unused)
//!  donor region (memfd): block b: slot 29 K | slot 29 V        (what attention and writes use)
//! ```
//!
//! **Epochs.** Every allocation of a block claims its epoch word (odd: being written); the
//! block becomes even (stable) when its rows are announced ([`super::KvPool::donor_table`]).
//! A block a reader still holds therefore never changes data under an unchanged even epoch:
//! rollback keeps positions below the committed length, and a freed block is re-claimed before
//! its next owner writes.
//!
//! **Growth.** The region starts at the blocks the arena holds and grows with it (doubling, a
//! new region id; the data and epochs are carried over), so a pool sized for many long
//! sequences does not commit its whole capacity in shared memory up front.

use ipc_channel::ipc::IpcSharedMemory;
use specula_protocol::donor::{DonorBlock, DonorLayout, DonorWriter};
use specula_protocol::shm::RegionId;

use super::{BlockId, KvLayout};
use crate::error::{Error, Result};

/// The exported slots and the region that holds them.
#[derive(Debug)]
pub(super) struct DonorStore {
    writer: DonorWriter,
    /// `(pool slot, target layer)` as exported, in the drafter's order.
    layers: Vec<(usize, u32)>,
    /// Per pool slot, its index in `layers` (`None`: the slot stays in the heap arena).
    of_slot: Vec<Option<usize>>,
    /// Bytes moved into a bigger region so far (host-internal; never sent).
    pub(super) regrow_bytes: u64,
}

impl Clone for DonorStore {
    /// A private copy (a new mapping with the same contents): a cloned pool never shares its
    /// storage with the original.
    fn clone(&self) -> Self {
        let writer = self
            .writer
            .regrow(self.writer.region(), self.writer.layout().blocks)
            .expect("invariant: a region regrows to its own size");
        DonorStore {
            writer,
            layers: self.layers.clone(),
            of_slot: self.of_slot.clone(),
            regrow_bytes: self.regrow_bytes,
        }
    }
}

impl DonorStore {
    /// A region of `blocks` blocks for `layers` (`(slot, target layer)`) of `layout`.
    pub(super) fn new(
        layout: &KvLayout,
        layers: &[(usize, u32)],
        blocks: usize,
        region: RegionId,
    ) -> Result<Self> {
        let mut of_slot = vec![None; layout.slots.len()];
        let mut shapes = Vec::with_capacity(layers.len());
        for (i, &(slot, layer)) in layers.iter().enumerate() {
            let Some(s) = layout.slots.get(slot) else {
                return Err(invalid(format!("no slot {slot} to export")));
            };
            if of_slot[slot].replace(i).is_some() {
                return Err(invalid(format!("slot {slot} exported twice")));
            }
            shapes.push((layer, s.kv_heads as u32, s.head_dim as u32));
        }
        let blocks = u32::try_from(blocks.max(1)).map_err(|_| invalid("too many blocks".into()))?;
        let donor = DonorLayout::f32(&shapes, blocks).map_err(|e| invalid(e.to_string()))?;
        let writer = DonorWriter::new(region, donor).map_err(|e| invalid(e.to_string()))?;
        Ok(DonorStore {
            writer,
            layers: layers.to_vec(),
            of_slot,
            regrow_bytes: 0,
        })
    }

    /// The exported `(slot, target layer)`s.
    pub(super) fn layers(&self) -> &[(usize, u32)] {
        &self.layers
    }

    /// The donor layer index of `slot`, when it is exported.
    pub(super) fn index(&self, slot: usize) -> Option<usize> {
        self.of_slot.get(slot).copied().flatten()
    }

    /// Blocks the region holds.
    pub(super) fn blocks(&self) -> usize {
        self.writer.layout().blocks as usize
    }

    /// Makes room for `blocks` blocks (a new, bigger region under id `region`).
    pub(super) fn grow(&mut self, blocks: usize, region: RegionId) -> Result<()> {
        if blocks <= self.blocks() {
            return Ok(());
        }
        let blocks = u32::try_from(blocks).map_err(|_| invalid("too many blocks".into()))?;
        self.regrow_bytes +=
            u64::from(self.writer.layout().blocks) * self.writer.layout().block_bytes;
        self.writer = self
            .writer
            .regrow(region, blocks)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(())
    }

    /// K and V of donor layer `i` in `block`.
    pub(super) fn block(&self, i: usize, block: BlockId) -> (&[f32], &[f32]) {
        self.writer.block(i, block)
    }

    /// K and V of donor layer `i` in `block`, for writing.
    pub(super) fn block_mut(&mut self, i: usize, block: BlockId) -> (&mut [f32], &mut [f32]) {
        self.writer.block_mut(i, block)
    }

    /// `block` changes owner: readers holding its old epoch drop what they read.
    pub(super) fn claim(&mut self, block: BlockId) {
        self.writer.claim(block);
    }

    /// The table entries of `blocks`, each made stable.
    pub(super) fn table(&mut self, blocks: &[BlockId]) -> Vec<DonorBlock> {
        blocks
            .iter()
            .map(|&block| DonorBlock {
                block,
                epoch: self.writer.publish(block),
            })
            .collect()
    }

    /// The region's id, a handle to send (a new mapping of it) and its layout.
    pub(super) fn share(&self) -> (RegionId, IpcSharedMemory, DonorLayout) {
        (
            self.writer.region(),
            self.writer.handle(),
            self.writer.layout().clone(),
        )
    }

    /// The region's id.
    pub(super) fn region(&self) -> RegionId {
        self.writer.region()
    }
}

fn invalid(reason: String) -> Error {
    Error::InvalidRequest {
        op: "KvPool::export_donors",
        reason,
    }
}
