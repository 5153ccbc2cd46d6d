//! The lane-per-row storage that every packed layout shares ([`super::packed`],
//! [`super::kpacked`], [`super::k6packed`]): weight rows in groups of [`LANES`], one SIMD lane
//! per row, each group's blocks one after another, and the task loop that runs a group's
//! kernel over chunks of activation rows and scatters its 16-wide outputs.
//!
//! ```text
//!  data = group 0 | group 1 | ...                  (rows 16g..16g+16; past n: zeros)
//!  group g = block 0 | block 1 | ... (k / block_elems blocks of block_bytes each)
//!  block   = fields of [16 lanes][len bytes] at fixed offsets (the layout's own)
//! ```
//!
//! The layouts differ only inside a block; which bytes of a block belong to a lane is
//! described by `(offset, len)` spans, lane `l` owning `offset + l * len..` of each.

use rayon::prelude::*;

use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Weight rows per group: one 512-bit register of 32-bit lanes.
pub(super) const LANES: usize = 16;

/// Activation rows per pass over a group's weights: each unpacked weight vector serves up to 8
/// rows (a verify window of 8 reads the weights once).
pub(super) const ROWS: usize = 8;

/// `$ys.copy_from_slice(&$call)` with `$r` a `const usize` equal to `$a.len()`, which must be
/// 1 to 8 ([`ROWS`]; anything else makes `$call`'s `try_into` panic): the SIMD kernels take
/// their row count as a const parameter, so each count gets its own unrolled build. `$call`
/// may name `$r` and borrow `$a.try_into().unwrap()` as `&[_; $r]`.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($a:expr, $ys:expr, |$r:ident| $call:expr) => {
        match $a.len() {
            1 => by_rows!(@ 1, $ys, $r, $call),
            2 => by_rows!(@ 2, $ys, $r, $call),
            3 => by_rows!(@ 3, $ys, $r, $call),
            4 => by_rows!(@ 4, $ys, $r, $call),
            5 => by_rows!(@ 5, $ys, $r, $call),
            6 => by_rows!(@ 6, $ys, $r, $call),
            7 => by_rows!(@ 7, $ys, $r, $call),
            _ => by_rows!(@ 8, $ys, $r, $call),
        }
    };
    (@ $n:literal, $ys:expr, $r:ident, $call:expr) => {{
        const $r: usize = $n;
        $ys.copy_from_slice(&$call)
    }};
}
#[cfg(target_arch = "x86_64")]
pub(super) use by_rows;

const _: () = assert!(ROWS == 8, "by_rows! has one arm per row count up to ROWS");

/// Most activation rows per pass on any path (the `amx` tile kernels' rows).
pub(super) const MAX_ROWS: usize = 16;

/// Activation rows per pass over a group's weights on the path `isa` for the layouts with
/// tile kernels: [`MAX_ROWS`] on `amx`, else [`ROWS`].
pub(super) fn rows_per_pass(isa: Isa) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa.level() == Level::Amx {
        return MAX_ROWS;
    }
    let _ = isa;
    ROWS
}

/// A `[n, k]` weight as groups of [`LANES`] rows (see the module docs).
pub(super) struct Groups {
    n: usize,
    k: usize,
    block_bytes: usize,
    /// Bytes of one group (`k / block_elems` blocks).
    group_bytes: usize,
    data: Vec<u8>,
}

impl Groups {
    /// `n` rows of `k / block_elems` blocks of `block_bytes`, filled in parallel by
    /// `fill(j, b, block)`, which writes row `j`'s lane (`j % LANES`) of its block `b`.
    pub(super) fn pack(
        n: usize,
        k: usize,
        block_elems: usize,
        block_bytes: usize,
        fill: impl Fn(usize, usize, &mut [u8]) + Sync,
    ) -> Groups {
        let group_bytes = k / block_elems * block_bytes;
        let mut data = vec![0u8; n.div_ceil(LANES) * group_bytes];
        data.par_chunks_mut(group_bytes)
            .enumerate()
            .for_each(|(g, group)| {
                for j in (g * LANES..(g + 1) * LANES).take_while(|&j| j < n) {
                    for (b, dst) in group.chunks_exact_mut(block_bytes).enumerate() {
                        fill(j, b, dst);
                    }
                }
            });
        Groups {
            n,
            k,
            block_bytes,
            group_bytes,
            data,
        }
    }

    /// The weight made of rows `ids` (row `i` is row `ids[i]`, bit for bit): lane
    /// `ids[i] % 16` of group `ids[i] / 16` copied into lane `i % 16` of group `i / 16`, each
    /// `(offset, len)` of `spans` in every block. Every id is below [`Groups::rows`] (checked
    /// by the caller).
    pub(super) fn select(&self, ids: &[usize], spans: &[(usize, usize)]) -> Groups {
        let gb = self.group_bytes;
        let mut out = vec![0u8; ids.len().div_ceil(LANES) * gb];
        for (i, &j) in ids.iter().enumerate() {
            let (src, dst) = (j / LANES * gb, i / LANES * gb);
            for b in (0..gb).step_by(self.block_bytes) {
                for &(base, len) in spans {
                    let from = src + b + base + (j % LANES) * len;
                    let to = dst + b + base + (i % LANES) * len;
                    out[to..to + len].copy_from_slice(&self.data[from..from + len]);
                }
            }
        }
        Groups {
            n: ids.len(),
            data: out,
            ..*self
        }
    }

    /// Output rows (the weight's `n`).
    pub(super) fn rows(&self) -> usize {
        self.n
    }

    /// Input width (the weight's `k`).
    pub(super) fn cols(&self) -> usize {
        self.k
    }

    /// The packed bytes of group `g`.
    pub(super) fn group(&self, g: usize) -> &[u8] {
        &self.data[g * self.group_bytes..(g + 1) * self.group_bytes]
    }

    /// The blocks of row `j`'s group, in order (row `j` is lane `j % LANES` of each).
    #[cfg(test)]
    pub(super) fn blocks_of(&self, j: usize) -> std::slice::ChunksExact<'_, u8> {
        self.group(j / LANES).chunks_exact(self.block_bytes)
    }

    /// `out[r, j] = y[r, j]` for the weight rows `j` of groups `g0..` whose columns `out`
    /// owns (rows past `n` are not written): `dot(group, a, ys)` sets `ys[r]` to the 16
    /// outputs of `group` against `a[r]`, for chunks `a` of at most `chunk` (≤ [`MAX_ROWS`])
    /// activation rows.
    pub(super) fn rows_task<A>(
        &self,
        acts: &[A],
        chunk: usize,
        g0: usize,
        out: &mut Columns<'_>,
        dot: impl Fn(&[u8], &[A], &mut [[f32; LANES]]),
    ) {
        debug_assert!(chunk <= MAX_ROWS && out.rows == acts.len());
        let mut ys = [[0f32; LANES]; MAX_ROWS];
        for gi in 0..out.cols.div_ceil(LANES) {
            let group = self.group(g0 + gi);
            let lanes = (out.cols - gi * LANES).min(LANES);
            for (c, a) in acts.chunks(chunk).enumerate() {
                let ys = &mut ys[..a.len()];
                dot(group, a, ys);
                for (r, y) in ys.iter().enumerate() {
                    out.write(c * chunk + r, gi * LANES, &y[..lanes]);
                }
            }
        }
    }
}

/// Columns `j0..j0 + cols` of a row-major `[rows, n]` output: one task's share of a matmul's
/// output, written in place (each activation row's 16 outputs of a group are one contiguous
/// run, where a weight-row-major buffer would need a transpose of the whole output after).
/// Made only by [`Columns::split`], whose views never overlap.
pub(super) struct Columns<'a> {
    ptr: *mut f32,
    n: usize,
    rows: usize,
    j0: usize,
    cols: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: a view writes only its own columns of a buffer it borrows mutably with the others
// of its split, which own the other columns.
unsafe impl Send for Columns<'_> {}

impl<'a> Columns<'a> {
    /// `out` (`[rows, n]`) as views of `width` columns each (the last one narrower).
    pub(super) fn split(out: &'a mut [f32], rows: usize, n: usize, width: usize) -> Vec<Self> {
        assert_eq!(out.len(), rows * n, "invariant: the output is [rows, n]");
        let ptr = out.as_mut_ptr();
        (0..n.div_ceil(width))
            .map(|t| Columns {
                ptr,
                n,
                rows,
                j0: t * width,
                cols: width.min(n - t * width),
                _out: std::marker::PhantomData,
            })
            .collect()
    }

    /// `out[r, j0 + j..][..vals.len()] = vals`.
    #[inline(always)]
    fn write(&mut self, r: usize, j: usize, vals: &[f32]) {
        assert!(r < self.rows && j + vals.len() <= self.cols);
        // SAFETY: in bounds of the `[rows, n]` buffer (checked above) and inside this view's
        // columns, which no other view of the split writes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                vals.as_ptr(),
                self.ptr.add(r * self.n + self.j0 + j),
                vals.len(),
            );
        }
    }
}
