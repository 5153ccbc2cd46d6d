//! K/V donor views (protocol 1.2): the host's KV-pool blocks of the donor layers live in one
//! shared-memory region that the drafter maps read-only, so a drafter that attends over the
//! target's K/V (the Gemma 4 assistant) reads a session's whole context without a copy.
//!
//! ```text
//! region: [ header 64 B | epochs: u64 × blocks | (pad to 64) | block 0 | block 1 | ... ]
//! block:  per donor layer: K [kv_heads][head_dim][block_size]   V [kv_heads][block_size][head_dim]
//! session: table [(block, epoch), ...], len   ->  position p is offset p % block_size of
//!          table[p / block_size].block, valid while that block's epoch word still equals epoch
//! ```
//!
//! The layout is the KV pool's (`specula_models::kv_pool`): K transposed inside a block, V
//! row-major, [`DONOR_BLOCK_SIZE`] positions a block. The host is the only writer. Before a block
//! changes owner (it is freed and handed to another sequence, or evicted) the host raises the
//! block's epoch word to an odd value ([`DonorWriter::claim`]: being written), writes its new
//! owner's rows, and makes it even again before announcing it ([`DonorWriter::publish`]:
//! stable). Tables carry even epochs only. A reader holds the epoch each table entry was
//! announced with and checks it after reading ([`DonorRows::check`]): a changed (or odd) epoch
//! means the block was reused under it and what it read is dropped (seqlock style). Positions of
//! a session below its announced `len` are never rewritten while its blocks keep their epochs
//! (rollback only ever cuts positions past the committed length).

use std::ops::Range;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use ipc_channel::ipc::IpcSharedMemory;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::shm::{DType, RegionId};

/// Positions per block (the KV pool's `BLOCK_SIZE`).
pub const DONOR_BLOCK_SIZE: u32 = 32;

const MAGIC: u64 = u64::from_le_bytes(*b"SPECKVD1");
const HEADER: u64 = 64;
const ALIGN: u64 = 64;

/// One donor layer inside every block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorLayer {
    /// The target layer whose K/V these are (0-based decoder layer id).
    pub layer: u32,
    /// K/V heads of that layer.
    pub kv_heads: u32,
    /// Head width of that layer.
    pub head_dim: u32,
    /// Byte offset of K (`[kv_heads][head_dim][block_size]`, transposed) inside a block.
    pub k_offset: u64,
    /// Byte offset of V (`[kv_heads][block_size][head_dim]`) inside a block.
    pub v_offset: u64,
}

/// Where everything is in a donor region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorLayout {
    /// Positions per block ([`DONOR_BLOCK_SIZE`]).
    pub block_size: u32,
    /// Blocks in the region (the pool's capacity).
    pub blocks: u32,
    /// Bytes of one block (all donor layers).
    pub block_bytes: u64,
    /// Byte offset of the epoch words (`u64` per block).
    pub epochs_offset: u64,
    /// Byte offset of block 0.
    pub data_offset: u64,
    /// Element type of K and V.
    pub dtype: DType,
    /// The donor layers, in the order the drafter asked for them (`Capabilities::kv_layers`).
    pub layers: Vec<DonorLayer>,
}

impl DonorLayout {
    /// The layout of `blocks` blocks of f32 K/V for `layers` = `(layer, kv_heads, head_dim)`.
    ///
    /// # Errors
    /// [`Error::BadView`] for no layers, an empty layer or zero blocks.
    pub fn f32(layers: &[(u32, u32, u32)], blocks: u32) -> Result<Self> {
        if layers.is_empty() || blocks == 0 || layers.iter().any(|l| l.1 == 0 || l.2 == 0) {
            return Err(Error::BadView {
                reason: format!("donor layout of layers {layers:?} in {blocks} blocks"),
            });
        }
        let bs = u64::from(DONOR_BLOCK_SIZE);
        let mut at = 0u64;
        let layers = layers
            .iter()
            .map(|&(layer, kv_heads, head_dim)| {
                let half = u64::from(kv_heads) * u64::from(head_dim) * bs * 4;
                let l = DonorLayer {
                    layer,
                    kv_heads,
                    head_dim,
                    k_offset: at,
                    v_offset: at + half,
                };
                at += 2 * half;
                l
            })
            .collect();
        let epochs_offset = HEADER;
        let data_offset = (epochs_offset + 8 * u64::from(blocks)).div_ceil(ALIGN) * ALIGN;
        Ok(DonorLayout {
            block_size: DONOR_BLOCK_SIZE,
            blocks,
            block_bytes: at.div_ceil(ALIGN) * ALIGN,
            epochs_offset,
            data_offset,
            dtype: DType::F32,
            layers,
        })
    }

    /// Bytes of the whole region.
    pub fn region_bytes(&self) -> u64 {
        self.data_offset + self.block_bytes * u64::from(self.blocks)
    }

    /// Checks the layout is self-consistent and fits `len` bytes.
    fn validate(&self, len: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::BadView { reason });
        if self.block_size != DONOR_BLOCK_SIZE || self.dtype != DType::F32 {
            return bad(format!(
                "donor blocks of {} {:?} positions (this reader: {DONOR_BLOCK_SIZE} f32)",
                self.block_size, self.dtype
            ));
        }
        // Every field is untrusted (it came in `MapDonors`): sums and products are checked.
        let epochs_end = self.epochs_offset.checked_add(8 * u64::from(self.blocks));
        let region_bytes = self
            .block_bytes
            .checked_mul(u64::from(self.blocks))
            .and_then(|b| b.checked_add(self.data_offset));
        if self.epochs_offset < HEADER
            || !self.epochs_offset.is_multiple_of(8)
            || !self.data_offset.is_multiple_of(ALIGN)
            || !self.block_bytes.is_multiple_of(ALIGN)
            || epochs_end.is_none_or(|end| end > self.data_offset)
            || region_bytes != Some(len as u64)
        {
            return bad(format!("donor layout {self:?} does not fit {len} bytes"));
        }
        let bs = u64::from(self.block_size);
        for l in &self.layers {
            let half = u64::from(l.kv_heads)
                .checked_mul(u64::from(l.head_dim))
                .and_then(|n| n.checked_mul(bs * 4));
            let fits = |off: u64| {
                half.and_then(|h| off.checked_add(h))
                    .is_some_and(|end| end <= self.block_bytes)
            };
            if half.is_none_or(|h| h == 0)
                || !l.k_offset.is_multiple_of(4)
                || !l.v_offset.is_multiple_of(4)
                || !fits(l.k_offset)
                || !fits(l.v_offset)
            {
                return bad(format!("donor layer {l:?} does not fit a block"));
            }
        }
        Ok(())
    }
}

/// One entry of a session's block table as the drafter holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DonorBlock {
    /// The block.
    pub block: u32,
    /// The block's epoch when the host announced it; a different epoch now means it was reused.
    pub epoch: u64,
}

fn epoch_word<'a>(mem: &'a [u8], layout: &DonorLayout, block: u32) -> &'a AtomicU64 {
    let at = (layout.epochs_offset + 8 * u64::from(block)) as usize;
    assert!(
        block < layout.blocks && at + 8 <= mem.len(),
        "invariant: epoch word inside the region"
    );
    // SAFETY: the mapping is page-aligned and at least `at + 8` bytes long; `at` is 8-aligned
    // (validated layout); epoch words are only accessed atomically, by both processes.
    unsafe { &*(mem.as_ptr().add(at) as *const AtomicU64) }
}

fn floats(mem: &[u8], at: u64, n: usize) -> &[f32] {
    let at = at as usize;
    assert!(
        at + 4 * n <= mem.len() && at.is_multiple_of(4),
        "invariant: in the region"
    );
    // SAFETY: in bounds and 4-aligned (checked), any bit pattern is an f32. The host may write
    // these bytes concurrently; readers detect that through the block epochs and drop the data.
    unsafe { std::slice::from_raw_parts(mem.as_ptr().add(at).cast::<f32>(), n) }
}

/// The host's end: owns the region's memory and is its only writer.
#[derive(Debug)]
pub struct DonorWriter {
    region: RegionId,
    shm: IpcSharedMemory,
    layout: DonorLayout,
}

impl DonorWriter {
    /// A zeroed region for `layout` (every epoch 0).
    ///
    /// # Errors
    /// [`Error::BadView`] for an inconsistent layout.
    pub fn new(region: RegionId, layout: DonorLayout) -> Result<Self> {
        let shm = IpcSharedMemory::from_byte(0, layout.region_bytes() as usize);
        layout.validate(shm.len())?;
        let mut w = DonorWriter {
            region,
            shm,
            layout,
        };
        // SAFETY: the mapping is this process's own and no other borrow of it is alive.
        let mem = unsafe { w.shm.deref_mut() };
        mem[..8].copy_from_slice(&MAGIC.to_le_bytes());
        Ok(w)
    }

    /// The region's id.
    pub fn region(&self) -> RegionId {
        self.region
    }

    /// The layout.
    pub fn layout(&self) -> &DonorLayout {
        &self.layout
    }

    /// A handle to send to the drafter in [`crate::wire::MapDonors`].
    pub fn handle(&self) -> IpcSharedMemory {
        self.shm.clone()
    }

    /// The current epoch of `block`.
    pub fn epoch(&self, block: u32) -> u64 {
        epoch_word(&self.shm, &self.layout, block).load(Ordering::Acquire)
    }

    /// Marks `block` as changing owner before anything is written into it: its epoch becomes
    /// odd (being written), so readers holding its old, even epoch drop what they read from now
    /// on. Returns the new epoch.
    pub fn claim(&mut self, block: u32) -> u64 {
        let word = epoch_word(&self.shm, &self.layout, block);
        let now = word.load(Ordering::Relaxed);
        // An odd epoch was never announced (tables carry even ones): it stays odd, but moves on
        // so that no two owners of a block ever share an epoch.
        let epoch = now + 1 + (now & 1);
        word.store(epoch, Ordering::Relaxed);
        // Readers that see any byte written after this must also see the new epoch.
        fence(Ordering::Release);
        epoch
    }

    /// The epoch to announce `block` with: a block claimed since (odd) becomes stable (even)
    /// once its owner's rows are written; a stable block keeps its epoch.
    pub fn publish(&mut self, block: u32) -> u64 {
        let word = epoch_word(&self.shm, &self.layout, block);
        let now = word.load(Ordering::Relaxed);
        if now & 1 == 0 {
            return now;
        }
        // The rows written before must be visible to a reader that sees the even epoch.
        fence(Ordering::Release);
        word.store(now + 1, Ordering::Release);
        now + 1
    }

    /// A copy of this region with room for `blocks` blocks (at least the current ones): the
    /// same layers, every block's data and epoch carried over. The pool grows its donor region
    /// this way (rarely, geometrically) instead of reserving its whole capacity up front.
    ///
    /// # Errors
    /// [`Error::BadView`] for fewer blocks than now.
    pub fn regrow(&self, region: RegionId, blocks: u32) -> Result<DonorWriter> {
        if blocks < self.layout.blocks {
            return Err(Error::BadView {
                reason: format!(
                    "donor region of {} blocks cannot shrink to {blocks}",
                    self.layout.blocks
                ),
            });
        }
        let shapes: Vec<(u32, u32, u32)> = self
            .layout
            .layers
            .iter()
            .map(|l| (l.layer, l.kv_heads, l.head_dim))
            .collect();
        let mut next = DonorWriter::new(region, DonorLayout::f32(&shapes, blocks)?)?;
        let (old, bytes) = (&self.layout, self.layout.block_bytes as usize);
        for b in 0..old.blocks {
            let from = (old.data_offset + u64::from(b) * old.block_bytes) as usize;
            let to = (next.layout.data_offset + u64::from(b) * next.layout.block_bytes) as usize;
            let epoch = self.epoch(b);
            epoch_word(&next.shm, &next.layout, b).store(epoch, Ordering::Relaxed);
            // SAFETY: `next` is this process's own, fresh mapping; nobody else has it yet.
            let mem = unsafe { next.shm.deref_mut() };
            mem[to..to + bytes].copy_from_slice(&self.shm[from..from + bytes]);
        }
        Ok(next)
    }

    /// K and V of donor layer `i` in `block`, for reading (what the host's own attention reads).
    ///
    /// # Panics
    /// On a layer or block out of range.
    pub fn block(&self, i: usize, block: u32) -> (&[f32], &[f32]) {
        let l = &self.layout.layers[i];
        assert!(block < self.layout.blocks, "block {block} out of range");
        let n = (l.kv_heads * l.head_dim * self.layout.block_size) as usize;
        let base = self.layout.data_offset + u64::from(block) * self.layout.block_bytes;
        (
            floats(&self.shm, base + l.k_offset, n),
            floats(&self.shm, base + l.v_offset, n),
        )
    }

    /// K (`[kv_heads][head_dim][block_size]`) and V (`[kv_heads][block_size][head_dim]`) of donor
    /// layer `i` (index into [`DonorLayout::layers`]) in `block`, for writing.
    ///
    /// # Panics
    /// On a layer or block out of range.
    pub fn block_mut(&mut self, i: usize, block: u32) -> (&mut [f32], &mut [f32]) {
        let l = &self.layout.layers[i];
        assert!(block < self.layout.blocks, "block {block} out of range");
        let n = (l.kv_heads * l.head_dim * self.layout.block_size) as usize;
        let base = self.layout.data_offset + u64::from(block) * self.layout.block_bytes;
        let (k, v) = ((base + l.k_offset) as usize, (base + l.v_offset) as usize);
        // SAFETY: this process is the only writer and its mapping is its own.
        let mem = unsafe { self.shm.deref_mut() };
        let ptr = mem.as_mut_ptr();
        assert!(k.max(v) + 4 * n <= mem.len() && (k + 4 * n <= v || v + 4 * n <= k));
        // SAFETY: two disjoint, in-bounds, 4-aligned ranges of the mapping (checked above).
        unsafe {
            (
                std::slice::from_raw_parts_mut(ptr.add(k).cast::<f32>(), n),
                std::slice::from_raw_parts_mut(ptr.add(v).cast::<f32>(), n),
            )
        }
    }

    /// Writes one position's `k` and `v` (`[kv_heads * head_dim]`, heads in order) of donor
    /// layer `i` at `offset` of `block`, in the pool's layout.
    ///
    /// # Panics
    /// On an index or row length out of range.
    pub fn write_row(&mut self, i: usize, block: u32, offset: usize, k: &[f32], v: &[f32]) {
        let (kv_heads, head_dim) = {
            let l = &self.layout.layers[i];
            (l.kv_heads as usize, l.head_dim as usize)
        };
        let bs = self.layout.block_size as usize;
        assert!(offset < bs && k.len() == kv_heads * head_dim && v.len() == k.len());
        let (kb, vb) = self.block_mut(i, block);
        for h in 0..kv_heads {
            for d in 0..head_dim {
                kb[(h * head_dim + d) * bs + offset] = k[h * head_dim + d];
            }
            let at = (h * bs + offset) * head_dim;
            vb[at..at + head_dim].copy_from_slice(&v[h * head_dim..(h + 1) * head_dim]);
        }
    }
}

/// The drafter's end: a donor region mapped read-only.
#[derive(Debug)]
pub struct DonorReader {
    region: RegionId,
    shm: IpcSharedMemory,
    layout: DonorLayout,
}

impl DonorReader {
    /// Wraps a region received in [`crate::wire::MapDonors`].
    ///
    /// # Errors
    /// [`Error::BadView`] when the memory is not a donor region or does not match `layout`.
    pub fn new(region: RegionId, shm: IpcSharedMemory, layout: DonorLayout) -> Result<Self> {
        if shm.len() < HEADER as usize || shm[..8] != MAGIC.to_le_bytes() {
            return Err(Error::BadView {
                reason: format!("region {region} is not a K/V donor region"),
            });
        }
        layout.validate(shm.len())?;
        Ok(DonorReader {
            region,
            shm,
            layout,
        })
    }

    /// The region's id.
    pub fn region(&self) -> RegionId {
        self.region
    }

    /// The layout.
    pub fn layout(&self) -> &DonorLayout {
        &self.layout
    }

    /// Positions `0..len` of a session whose block table is `table`.
    ///
    /// # Errors
    /// [`Error::BadView`] when the table is too short for `len` or names a block outside the
    /// region.
    pub fn rows<'a>(&'a self, table: &'a [DonorBlock], len: usize) -> Result<DonorRows<'a>> {
        let bs = self.layout.block_size as usize;
        if table.len() < len.div_ceil(bs) {
            return Err(Error::BadView {
                reason: format!("{len} positions in a table of {} blocks", table.len()),
            });
        }
        if let Some(b) = table.iter().find(|b| b.block >= self.layout.blocks) {
            return Err(Error::BadView {
                reason: format!(
                    "block {} outside a region of {}",
                    b.block, self.layout.blocks
                ),
            });
        }
        Ok(DonorRows {
            reader: self,
            table: &table[..len.div_ceil(bs)],
            len,
        })
    }
}

/// A session's donor K/V, positions `0..len`, borrowed from the mapped region in place.
#[derive(Debug, Clone, Copy)]
pub struct DonorRows<'a> {
    reader: &'a DonorReader,
    table: &'a [DonorBlock],
    len: usize,
}

impl<'a> DonorRows<'a> {
    /// Positions readable (`0..len`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is readable.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The donor layers, in the order asked for.
    pub fn layers(&self) -> &'a [DonorLayer] {
        &self.reader.layout.layers
    }

    /// Blocks covering `0..len`.
    pub fn blocks(&self) -> usize {
        self.table.len()
    }

    /// K of head `head` of donor layer `i` in the table's `b`-th block: `[head_dim][block_size]`
    /// (transposed; positions past `len` in the last block are not part of the session).
    ///
    /// # Panics
    /// On an index out of range.
    pub fn k_block(&self, i: usize, b: usize, head: usize) -> &'a [f32] {
        self.half(i, b, head, true)
    }

    /// V of head `head` of donor layer `i` in the table's `b`-th block: `[block_size][head_dim]`.
    ///
    /// # Panics
    /// On an index out of range.
    pub fn v_block(&self, i: usize, b: usize, head: usize) -> &'a [f32] {
        self.half(i, b, head, false)
    }

    fn half(&self, i: usize, b: usize, head: usize, k: bool) -> &'a [f32] {
        let layout = &self.reader.layout;
        let l = &layout.layers[i];
        assert!(head < l.kv_heads as usize, "head {head} out of range");
        let n = (l.head_dim * layout.block_size) as usize;
        let off = match k {
            true => l.k_offset,
            false => l.v_offset,
        };
        let at = layout.data_offset
            + u64::from(self.table[b].block) * layout.block_bytes
            + off
            + (head * n * 4) as u64;
        floats(&self.reader.shm, at, n)
    }

    /// Whether every block still holds this session's data (call it after reading in place).
    ///
    /// # Errors
    /// [`Error::Torn`] when the host reused a block under the reader.
    pub fn check(&self) -> Result<()> {
        // Whatever was read before must be ordered before the epoch loads (seqlock reader side).
        fence(Ordering::Acquire);
        for b in self.table {
            let now =
                epoch_word(&self.reader.shm, &self.reader.layout, b.block).load(Ordering::Relaxed);
            // An odd epoch is a block being written: never readable, even if announced so.
            if now != b.epoch || b.epoch & 1 == 1 {
                return Err(Error::Torn {
                    epoch: b.epoch,
                    valid_from: now,
                });
            }
        }
        Ok(())
    }

    /// Copies positions `range` of donor layer `i` as row-major `[rows, kv_heads, head_dim]` K and
    /// V (what a 1.1 host sends in taps), checked against reuse afterwards.
    ///
    /// # Errors
    /// [`Error::BadView`] for a range past `len`; [`Error::Torn`] as [`DonorRows::check`].
    pub fn copy_rows(&self, i: usize, range: Range<usize>) -> Result<(Vec<f32>, Vec<f32>)> {
        if range.start > range.end || range.end > self.len || i >= self.layers().len() {
            return Err(Error::BadView {
                reason: format!("rows {range:?} of layer {i} of {} positions", self.len),
            });
        }
        let l = &self.layers()[i];
        let (heads, hd) = (l.kv_heads as usize, l.head_dim as usize);
        let bs = self.reader.layout.block_size as usize;
        let n = range.len() * heads * hd;
        let (mut k, mut v) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in range {
            let (b, off) = (p / bs, p % bs);
            for h in 0..heads {
                let kb = self.k_block(i, b, h);
                k.extend((0..hd).map(|d| kb[d * bs + off]));
                v.extend_from_slice(&self.v_block(i, b, h)[off * hd..(off + 1) * hd]);
            }
        }
        self.check()?;
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> (DonorWriter, DonorReader) {
        let layout = DonorLayout::f32(&[(5, 2, 4), (9, 1, 8)], 3).unwrap();
        let w = DonorWriter::new(7, layout.clone()).unwrap();
        let r = DonorReader::new(7, w.handle(), layout).unwrap();
        (w, r)
    }

    #[test]
    fn rows_written_by_the_host_read_back_in_place_and_copied() {
        let (mut w, r) = region();
        w.claim(2);
        w.claim(0);
        let (e2, e0) = (w.publish(2), w.publish(0));
        // 40 positions: block 2 holds 0..32, block 0 holds 32..40.
        for p in 0..40usize {
            let block = [2, 0][p / 32];
            let k: Vec<f32> = (0..8).map(|i| (p * 100 + i) as f32).collect();
            let v: Vec<f32> = (0..8).map(|i| -((p * 100 + i) as f32)).collect();
            w.write_row(0, block, p % 32, &k, &v);
            let k1: Vec<f32> = (0..8).map(|i| (p * 10 + i) as f32 + 0.5).collect();
            w.write_row(1, block, p % 32, &k1, &k1);
        }
        let table = [
            DonorBlock {
                block: 2,
                epoch: e2,
            },
            DonorBlock {
                block: 0,
                epoch: e0,
            },
        ];
        let rows = r.rows(&table, 40).unwrap();
        assert_eq!((rows.len(), rows.blocks()), (40, 2));
        // In place: K transposed, head 1, dimension 3 of position 33 (block 1, offset 1).
        assert_eq!(rows.k_block(0, 1, 1)[3 * 32 + 1], (3300 + 4 + 3) as f32);
        assert_eq!(
            rows.v_block(0, 0, 0)[5 * 4..6 * 4],
            [-500.0, -501.0, -502.0, -503.0]
        );
        let (k, v) = rows.copy_rows(0, 30..34).unwrap();
        let want: Vec<f32> = (30..34)
            .flat_map(|p| (0..8).map(move |i| (p * 100 + i) as f32))
            .collect();
        assert_eq!(k, want);
        assert_eq!(v, want.iter().map(|x| -x).collect::<Vec<_>>());
        let (k1, _) = rows.copy_rows(1, 39..40).unwrap();
        assert_eq!(
            k1,
            (0..8).map(|i| (390 + i) as f32 + 0.5).collect::<Vec<_>>()
        );
        rows.check().unwrap();
    }

    #[test]
    fn a_reused_block_is_detected() {
        let (mut w, r) = region();
        w.claim(1);
        let e = w.publish(1);
        let table = [DonorBlock { block: 1, epoch: e }];
        let rows = r.rows(&table, 3).unwrap();
        rows.check().unwrap();
        // The host frees the block and hands it to another sequence.
        w.claim(1);
        assert!(matches!(rows.check(), Err(Error::Torn { .. })));
        assert!(rows.copy_rows(0, 0..3).is_err());
    }

    #[test]
    fn claimed_blocks_are_odd_until_published_and_regrowth_keeps_everything() {
        let (mut w, r) = region();
        let e = w.claim(1);
        assert_eq!(e % 2, 1, "a claimed block is being written");
        let odd = [DonorBlock { block: 1, epoch: e }];
        assert!(r.rows(&odd, 3).unwrap().check().is_err(), "odd: never read");
        w.write_row(0, 1, 2, &[1.0; 8], &[2.0; 8]);
        let stable = w.publish(1);
        assert_eq!((stable % 2, w.publish(1)), (0, stable), "published once");
        let table = [DonorBlock {
            block: 1,
            epoch: stable,
        }];
        r.rows(&table, 3).unwrap().check().unwrap();
        // Re-claiming an odd block moves it on (no two owners share an epoch).
        let e2 = w.claim(2);
        assert!(w.claim(2) > e2);
        let grown = w.regrow(8, 5).unwrap();
        assert_eq!((grown.layout().blocks, grown.epoch(1)), (5, stable));
        let g = DonorReader::new(8, grown.handle(), grown.layout().clone()).unwrap();
        let (k, v) = g.rows(&table, 3).unwrap().copy_rows(0, 2..3).unwrap();
        assert_eq!((k, v), (vec![1.0; 8], vec![2.0; 8]));
        assert!(w.regrow(9, 2).is_err(), "regrowth never shrinks");
    }

    #[test]
    fn bad_layouts_tables_and_regions_are_errors() {
        let (_, r) = region();
        let table = [DonorBlock { block: 0, epoch: 0 }];
        assert!(r
            .rows(&table, 33)
            .unwrap_err()
            .to_string()
            .contains("33 positions"));
        let outside = [DonorBlock { block: 3, epoch: 0 }];
        assert!(r
            .rows(&outside, 1)
            .unwrap_err()
            .to_string()
            .contains("outside"));
        let rows = r.rows(&table, 4).unwrap();
        assert!(rows.copy_rows(0, 2..5).is_err());
        assert!(rows.copy_rows(2, 0..1).is_err());
        assert!(DonorLayout::f32(&[], 3).is_err());
        assert!(DonorLayout::f32(&[(0, 0, 4)], 3).is_err());
        assert!(DonorLayout::f32(&[(0, 1, 4)], 0).is_err());
        let layout = DonorLayout::f32(&[(0, 1, 4)], 2).unwrap();
        let not_donor = IpcSharedMemory::from_byte(0, layout.region_bytes() as usize);
        assert!(DonorReader::new(0, not_donor, layout.clone()).is_err());
        let w = DonorWriter::new(0, layout.clone()).unwrap();
        let bigger = DonorLayout {
            blocks: 3,
            ..layout
        };
        let err = DonorReader::new(0, w.handle(), bigger).unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }
}
