//! Shared-memory tensors: a ring written by the host, read by one drafter.
//!
//! The host creates a region (a `memfd` through ipc-channel's [`IpcSharedMemory`], so nothing is
//! ever named in `/dev/shm` and the kernel frees it when the last process holding it dies), sends
//! it once with [`crate::wire::MapRegion`], then writes tensors into it and sends
//! [`TensorView`]s that point at them.
//!
//! ```text
//! region: [ header 64 B | data: capacity bytes, used as a ring                      ]
//! header: magic u64 | valid_from u64 | written u64 | capacity u64 | (padding)
//! a tensor written at absolute stream position `epoch` lives at data[epoch % capacity ..]
//! ```
//!
//! Positions (`epoch`s) only grow. A tensor never wraps: it skips to the next lap instead. Before
//! writing `[start, end)` the writer raises `valid_from` to `end - capacity` (everything older is
//! about to be overwritten); after writing it raises `written` to `end`. A reader copies the bytes,
//! then checks that `valid_from` has not passed the view's epoch: if it has, the copy may be torn
//! and the tensor is dropped (seqlock style: epoch checked before and after).
//!
//! The payload is written and read with relaxed atomic stores and loads of whole elements (u32
//! for f32, u16 for bf16), never through plain references: a reader racing a lapping writer
//! then reads stale or new elements, which the check afterwards throws away, rather than
//! racing a plain access (undefined behaviour, whatever the check says afterwards).

use std::marker::PhantomData;
use std::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};

use ipc_channel::ipc::IpcSharedMemory;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Names a region within one host-drafter connection.
pub type RegionId = u32;

/// Element type of a tensor in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float, little endian.
    F32,
    /// bfloat16 (the top half of an f32), little endian. @since protocol v1.1
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
}

/// Where a tensor lives in a region, and which write it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorView {
    /// The region.
    pub region: RegionId,
    /// Byte offset from the start of the region.
    pub offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Shape, row-major.
    pub shape: Vec<u32>,
    /// Absolute stream position of the write; the reader checks it is still intact.
    pub epoch: u64,
}

impl TensorView {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        // Saturating: the shape may come from the other process.
        self.shape
            .iter()
            .fold(1usize, |n, &d| n.saturating_mul(d as usize))
    }
}

/// K and V rows of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvView {
    /// `rows × kv_heads × head_dim`.
    pub k: TensorView,
    /// `rows × kv_heads × head_dim`.
    pub v: TensorView,
}

/// Target activations of a window of positions, as views into shared memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapViews {
    /// Absolute position of the first row.
    pub pos: u64,
    /// Number of rows.
    pub rows: u32,
    /// One per requested tap layer (same order as `Capabilities::tap_layers`): `rows × hidden`.
    pub layers: Vec<TensorView>,
    /// Post-final-norm hidden, `rows × hidden`, when asked for.
    pub final_hidden: Option<TensorView>,
    /// K/V rows per requested layer (same order as `Capabilities::kv_layers`).
    pub kv: Vec<KvView>,
}

impl TapViews {
    /// Every view, in message order: layers, final hidden, then K and V of each KV layer.
    pub fn views(&self) -> impl Iterator<Item = &TensorView> {
        let kv = self.kv.iter().flat_map(|kv| [&kv.k, &kv.v]);
        self.layers.iter().chain(&self.final_hidden).chain(kv)
    }

    /// The element types of every view.
    pub fn dtypes(&self) -> impl Iterator<Item = DType> + '_ {
        self.views().map(|v| v.dtype)
    }
}

const MAGIC: u64 = u64::from_le_bytes(*b"SPECSHM1");
const HEADER: usize = 64;
// Offsets of the header words.
const VALID_FROM: usize = 8;
const WRITTEN: usize = 16;
const CAPACITY: usize = 24;
// Tensors start on cache lines, which also keeps f32 reads aligned.
const ALIGN: u64 = 64;

fn word(mem: &[u8], at: usize) -> &AtomicU64 {
    assert!(
        at + 8 <= HEADER && mem.len() >= HEADER,
        "invariant: header word inside the header"
    );
    // SAFETY: `mem` is a page-aligned mapping shared with another process, at least HEADER bytes
    // long; `at` is 8-aligned; the borrow keeps the mapping alive. Header words are only ever
    // accessed atomically, by both processes.
    unsafe { &*(mem.as_ptr().add(at) as *const AtomicU64) }
}

/// The host's end of a region: the only writer.
#[derive(Debug)]
pub struct ShmWriter {
    id: RegionId,
    shm: IpcSharedMemory,
    capacity: u64,
    next: u64,
}

impl ShmWriter {
    /// Creates a region whose ring holds `capacity` bytes (rounded up to 64).
    ///
    /// # Errors
    /// [`Error::TooLarge`] when `capacity` is zero.
    pub fn new(id: RegionId, capacity: usize) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::TooLarge { bytes: 0, capacity });
        }
        let capacity = (capacity as u64).div_ceil(ALIGN) * ALIGN;
        let shm = IpcSharedMemory::from_byte(0, HEADER + capacity as usize);
        let base = &shm[..];
        word(base, 0).store(MAGIC, Ordering::Relaxed);
        word(base, CAPACITY).store(capacity, Ordering::Relaxed);
        word(base, VALID_FROM).store(0, Ordering::Relaxed);
        word(base, WRITTEN).store(0, Ordering::Release);
        Ok(ShmWriter {
            id,
            shm,
            capacity,
            next: 0,
        })
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// A handle to send to the drafter (it maps the same memory).
    pub fn handle(&self) -> IpcSharedMemory {
        self.shm.clone()
    }

    /// Writes `data` with the given shape and returns its view.
    ///
    /// # Errors
    /// [`Error::BadView`] when the shape does not match `data`; [`Error::TooLarge`] when the
    /// tensor is bigger than the ring.
    pub fn write_f32(&mut self, data: &[f32], shape: &[u32]) -> Result<TensorView> {
        self.write(DType::F32, data.len(), shape, |dst| {
            for (i, x) in data.iter().enumerate() {
                // SAFETY: `dst` is 4-aligned (tensors start on cache lines of a page-aligned
                // mapping) and holds `data.len()` elements; every access to it is atomic.
                unsafe { AtomicU32::from_ptr(dst.add(4 * i).cast()) }
                    .store(x.to_bits().to_le(), Ordering::Relaxed);
            }
        })
    }

    /// Writes bf16 values (their bit patterns) with the given shape and returns its view. Send
    /// such a view only to a peer at ≥ 1.1 (the `Since` of `Open`/`Commit` says so).
    ///
    /// # Errors
    /// As [`ShmWriter::write_f32`].
    pub fn write_bf16(&mut self, bits: &[u16], shape: &[u32]) -> Result<TensorView> {
        self.write(DType::BF16, bits.len(), shape, |dst| {
            for (i, x) in bits.iter().enumerate() {
                // SAFETY: as in `write_f32`, with 2-byte elements.
                unsafe { AtomicU16::from_ptr(dst.add(2 * i).cast()) }
                    .store(x.to_le(), Ordering::Relaxed);
            }
        })
    }

    fn write(
        &mut self,
        dtype: DType,
        len: usize,
        shape: &[u32],
        fill: impl FnOnce(*mut u8),
    ) -> Result<TensorView> {
        let numel: usize = shape.iter().map(|&d| d as usize).product();
        if numel != len {
            return Err(Error::BadView {
                reason: format!("shape {shape:?} holds {numel} values, got {len}"),
            });
        }
        let bytes = (len * dtype.size()) as u64;
        if bytes > self.capacity {
            return Err(Error::TooLarge {
                bytes: bytes as usize,
                capacity: self.capacity as usize,
            });
        }
        let mut start = self.next;
        let lap_offset = start % self.capacity;
        if lap_offset + bytes > self.capacity {
            start += self.capacity - lap_offset;
        }
        let end = start + bytes;
        // SAFETY: this process is the region's only writer, and its mapping is its own (the
        // drafter maps the memfd separately), so no other `&[u8]` of this mapping is alive.
        let mem = unsafe { self.shm.deref_mut() };
        let valid_from = word(mem, VALID_FROM);
        let new_valid = end.saturating_sub(self.capacity);
        if new_valid > valid_from.load(Ordering::Relaxed) {
            valid_from.store(new_valid, Ordering::Relaxed);
        }
        // Readers that see any of the new bytes must also see the raised `valid_from`.
        fence(Ordering::Release);
        let offset = HEADER as u64 + start % self.capacity;
        // Readers may race with this copy (atomic on both sides); they detect it through
        // `valid_from` and drop what they read. [offset, offset + bytes) lies inside the mapping
        // (checked above).
        fill(mem[offset as usize..(offset + bytes) as usize].as_mut_ptr());
        word(mem, WRITTEN).store(end, Ordering::Release);
        self.next = end.div_ceil(ALIGN) * ALIGN;
        Ok(TensorView {
            region: self.id,
            offset,
            dtype,
            shape: shape.to_vec(),
            epoch: start,
        })
    }
}

/// A drafter's end of a region: reads what the host wrote.
#[derive(Debug)]
pub struct ShmReader {
    id: RegionId,
    shm: IpcSharedMemory,
    capacity: u64,
}

impl ShmReader {
    /// Wraps a region received in [`crate::wire::MapRegion`].
    ///
    /// # Errors
    /// [`Error::BadView`] when the memory is not a Specula region.
    pub fn new(id: RegionId, shm: IpcSharedMemory) -> Result<Self> {
        if shm.len() < HEADER || word(&shm, 0).load(Ordering::Acquire) != MAGIC {
            return Err(Error::BadView {
                reason: format!("region {id} is not a Specula shared-memory region"),
            });
        }
        let capacity = word(&shm, CAPACITY).load(Ordering::Relaxed);
        if capacity == 0 || HEADER as u64 + capacity != shm.len() as u64 {
            return Err(Error::BadView {
                reason: format!(
                    "region {id} header says {capacity} bytes, mapping has {}",
                    shm.len()
                ),
            });
        }
        Ok(ShmReader { id, shm, capacity })
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// The tensor a view points at, borrowed from the mapping (nothing is copied).
    ///
    /// # Errors
    /// [`Error::BadView`] when the view names another region, or does not fit or match its epoch;
    /// [`Error::Torn`] when the tensor was already overwritten: drop it.
    pub fn view<'a>(&'a self, view: &TensorView) -> Result<TensorRef<'a>> {
        let bad = |reason: String| Err(Error::BadView { reason });
        if view.region != self.id {
            return bad(format!(
                "view names region {}, this is {}",
                view.region, self.id
            ));
        }
        // The shape is untrusted: its size may overflow any integer type.
        let bytes = view
            .shape
            .iter()
            .try_fold(view.dtype.size() as u64, |n, &d| {
                n.checked_mul(u64::from(d))
            });
        let Some(bytes) = bytes else {
            return bad(format!("view of shape {:?} overflows", view.shape));
        };
        if bytes > self.capacity
            || view.offset != HEADER as u64 + view.epoch % self.capacity
            || view.epoch % self.capacity + bytes > self.capacity
        {
            return bad(format!(
                "view at offset {} (epoch {}, {bytes} bytes) does not fit a ring of {} bytes",
                view.offset, view.epoch, self.capacity
            ));
        }
        let base = &self.shm[..];
        let written = word(base, WRITTEN).load(Ordering::Acquire);
        if written < view.epoch.saturating_add(bytes) {
            return bad(format!(
                "epoch {} is not written yet ({written})",
                view.epoch
            ));
        }
        let tensor = TensorRef {
            dtype: view.dtype,
            shape: view.shape.clone(),
            // Never dereferenced as a plain slice: elements are loaded atomically.
            ptr: base[view.offset as usize..(view.offset + bytes) as usize].as_ptr(),
            len: bytes as usize,
            guard: Some(Guard {
                reader: self,
                epoch: view.epoch,
            }),
            borrow: PhantomData,
        };
        tensor.check()?;
        Ok(tensor)
    }

    /// Copies the tensor a view points at, as f32.
    ///
    /// # Errors
    /// As [`ShmReader::view`], and [`Error::Torn`] when it was overwritten during the copy.
    pub fn read_f32(&self, view: &TensorView) -> Result<Vec<f32>> {
        self.view(view)?.to_f32()
    }

    fn valid_from(&self) -> u64 {
        word(&self.shm[..], VALID_FROM).load(Ordering::Relaxed)
    }
}

/// What tells a borrowed tensor whether it is still intact.
#[derive(Debug, Clone, Copy)]
struct Guard<'a> {
    reader: &'a ShmReader,
    epoch: u64,
}

/// A tensor borrowed from a shared-memory region (or from the host's own memory, in process):
/// read it in place, copy only what you keep.
///
/// The host may overwrite a region tensor once the ring laps, so every copying method checks
/// afterwards that the bytes were intact ([`Error::Torn`] otherwise).
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    dtype: DType,
    shape: Vec<u32>,
    /// `len` bytes, aligned to the element size, read only by atomic loads of whole elements.
    ptr: *const u8,
    len: usize,
    guard: Option<Guard<'a>>,
    borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a `TensorRef` only ever loads its bytes atomically, from memory borrowed for 'a (a
// region's mapping or the caller's slice), so sharing it between threads races nothing.
unsafe impl Send for TensorRef<'_> {}
// SAFETY: as for `Send`.
unsafe impl Sync for TensorRef<'_> {}

impl<'a> TensorRef<'a> {
    /// A view of f32 values in this process's memory (never torn). When `shape` does not hold
    /// `data.len()` values the view is one-dimensional.
    pub fn from_f32(data: &'a [f32], shape: &[u32]) -> Self {
        let numel: usize = shape.iter().map(|&d| d as usize).product();
        let shape = match numel == data.len() {
            true => shape.to_vec(),
            false => vec![data.len() as u32],
        };
        TensorRef {
            dtype: DType::F32,
            shape,
            ptr: data.as_ptr().cast(),
            len: data.len() * 4,
            guard: None,
            borrow: PhantomData,
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape, row-major.
    pub fn shape(&self) -> &[u32] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// Element `i` as f32 (`i < numel`).
    #[inline]
    fn load(&self, i: usize) -> f32 {
        debug_assert!(i < self.numel());
        // SAFETY: `i` is in bounds and `ptr` is aligned to the element size (see `ptr`); the
        // memory lives for 'a and every access to it is atomic (the writer's included).
        unsafe {
            match self.dtype {
                DType::F32 => f32::from_bits(u32::from_le(
                    AtomicU32::from_ptr(self.ptr.add(4 * i).cast_mut().cast())
                        .load(Ordering::Relaxed),
                )),
                DType::BF16 => f32::from_bits(
                    u32::from(u16::from_le(
                        AtomicU16::from_ptr(self.ptr.add(2 * i).cast_mut().cast())
                            .load(Ordering::Relaxed),
                    )) << 16,
                ),
            }
        }
    }

    /// Whether the bytes are still the ones the host wrote (always for in-process tensors).
    ///
    /// # Errors
    /// [`Error::Torn`] when the host has overwritten them.
    pub fn check(&self) -> Result<()> {
        let Some(guard) = self.guard else {
            return Ok(());
        };
        // Whatever was read before must be ordered before this check (seqlock reader side).
        fence(Ordering::Acquire);
        let valid_from = guard.reader.valid_from();
        match valid_from > guard.epoch {
            true => Err(Error::Torn {
                epoch: guard.epoch,
                valid_from,
            }),
            false => Ok(()),
        }
    }

    /// Appends the elements `range` (in elements, row-major), converted to f32, to `out`.
    ///
    /// # Errors
    /// [`Error::BadView`] when the range is out of bounds; [`Error::Torn`] as [`TensorRef::check`]
    /// (then `out` is left as it was).
    pub fn extend_f32(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        if range.start > range.end || range.end > self.numel() {
            return Err(Error::BadView {
                reason: format!("elements {range:?} of a tensor of {}", self.numel()),
            });
        }
        let before = out.len();
        out.extend(range.map(|i| self.load(i)));
        self.check().inspect_err(|_| out.truncate(before))
    }

    /// Copies the whole tensor as f32.
    ///
    /// # Errors
    /// [`Error::Torn`] as [`TensorRef::check`].
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel());
        self.extend_f32(0..self.numel(), &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_read_back_bit_for_bit() {
        let mut w = ShmWriter::new(3, 1024).unwrap();
        let r = ShmReader::new(3, w.handle()).unwrap();
        let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b = vec![f32::MIN_POSITIVE, -0.0, f32::MAX];
        let va = w.write_f32(&a, &[3, 4]).unwrap();
        let vb = w.write_f32(&b, &[3]).unwrap();
        assert_eq!(r.read_f32(&va).unwrap(), a);
        assert_eq!(
            r.read_f32(&vb)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn overwritten_tensor_is_detected_as_torn() {
        let mut w = ShmWriter::new(0, 256).unwrap();
        let r = ShmReader::new(0, w.handle()).unwrap();
        let first = w.write_f32(&[1.0; 32], &[32]).unwrap();
        assert_eq!(r.read_f32(&first).unwrap(), vec![1.0; 32]);
        // Two more 128-byte writes fill the 256-byte ring and reuse the first one's bytes.
        w.write_f32(&[2.0; 32], &[32]).unwrap();
        let third = w.write_f32(&[3.0; 32], &[32]).unwrap();
        assert!(matches!(r.read_f32(&first), Err(Error::Torn { .. })));
        assert_eq!(r.read_f32(&third).unwrap(), vec![3.0; 32]);
    }

    #[test]
    fn tensors_skip_to_next_lap_instead_of_wrapping() {
        let mut w = ShmWriter::new(0, 256).unwrap();
        let r = ShmReader::new(0, w.handle()).unwrap();
        w.write_f32(&[1.0; 40], &[40]).unwrap(); // 160 bytes: next write at 192
        let v = w.write_f32(&[5.0; 20], &[20]).unwrap(); // 80 bytes do not fit in 64
        assert_eq!(v.epoch, 256);
        assert_eq!(v.offset, HEADER as u64);
        assert_eq!(r.read_f32(&v).unwrap(), vec![5.0; 20]);
    }

    #[test]
    fn bf16_views_read_as_f32_and_borrow_in_place() {
        let mut w = ShmWriter::new(2, 1024).unwrap();
        let r = ShmReader::new(2, w.handle()).unwrap();
        let values = [1.0f32, -2.5, 3.0e-3, 65504.0];
        let bits: Vec<u16> = values.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let v = w.write_bf16(&bits, &[2, 2]).unwrap();
        assert_eq!(v.dtype, DType::BF16);
        let t = r.view(&v).unwrap();
        assert_eq!(
            (t.numel(), t.dtype(), t.shape()),
            (4, DType::BF16, &[2u32, 2][..])
        );
        let want: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert_eq!(t.to_f32().unwrap(), want);
        assert_eq!(want[0], 1.0);
        let mut row = vec![9.0];
        t.extend_f32(2..4, &mut row).unwrap();
        assert_eq!(row, [9.0, want[2], want[3]]);
        assert!(t.extend_f32(3..5, &mut row).is_err());
    }

    #[test]
    fn a_borrowed_view_notices_it_was_overwritten() {
        let mut w = ShmWriter::new(0, 256).unwrap();
        let r = ShmReader::new(0, w.handle()).unwrap();
        let first = w.write_f32(&[1.0; 32], &[32]).unwrap();
        let t = r.view(&first).unwrap();
        t.check().unwrap();
        w.write_f32(&[2.0; 32], &[32]).unwrap();
        w.write_f32(&[3.0; 32], &[32]).unwrap();
        assert!(matches!(t.check(), Err(Error::Torn { .. })));
        let mut out = vec![0.5];
        assert!(t.extend_f32(0..4, &mut out).is_err());
        assert_eq!(out, [0.5], "a torn copy leaves the output as it was");
        assert!(matches!(r.view(&first), Err(Error::Torn { .. })));
        let local = [4.0f32, 5.0];
        assert_eq!(
            TensorRef::from_f32(&local, &[1, 2]).to_f32().unwrap(),
            local
        );
    }

    #[test]
    fn bad_views_and_inputs_are_errors() {
        let mut w = ShmWriter::new(1, 256).unwrap();
        let r = ShmReader::new(1, w.handle()).unwrap();
        assert!(matches!(
            w.write_f32(&[0.0; 3], &[2, 2]),
            Err(Error::BadView { .. })
        ));
        assert!(matches!(
            w.write_f32(&[0.0; 65], &[65]),
            Err(Error::TooLarge { .. })
        ));
        let v = w.write_f32(&[0.0; 4], &[4]).unwrap();
        let other = TensorView {
            region: 2,
            ..v.clone()
        };
        assert!(r
            .read_f32(&other)
            .unwrap_err()
            .to_string()
            .contains("region 2"));
        let unwritten = TensorView {
            epoch: 64,
            offset: HEADER as u64 + 64,
            ..v.clone()
        };
        assert!(r
            .read_f32(&unwritten)
            .unwrap_err()
            .to_string()
            .contains("not written"));
        let shifted = TensorView {
            offset: v.offset + 4,
            ..v
        };
        assert!(matches!(r.read_f32(&shifted), Err(Error::BadView { .. })));
        assert!(ShmReader::new(1, IpcSharedMemory::from_byte(0, 128)).is_err());
        assert!(ShmWriter::new(0, 0).is_err());
    }
}
