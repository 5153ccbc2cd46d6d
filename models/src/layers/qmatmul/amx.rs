//! AMX tile plumbing for the `amx` path of the packed kernels ([`super::packed`],
//! [`super::kpacked`]): one tile configuration, and the tile products of one or two 32-element
//! blocks for up to 16 activation rows against 16 weight rows.
//!
//! ```text
//!  tmm0, tmm1  C  [rows][16] i32      (colsb 64)
//!  tmm2, tmm3  A  [rows][32] i8       activation rows, `stride` bytes apart (colsb 32)
//!  tmm4, tmm5  B  [8][16 x 4] u8/i8   weight dwords: row t, lane n = elements 4t..4t+4 of
//!                                     weight row n (the packed layouts' chunk order)
//!  C = A B: C[r][n] = Σ_k A[r][k] B[k / 4][4 n + k % 4]   exact in i32 (|Σ| ≤ 32 · 255 · 128)
//! ```
//!
//! A block's integer sums are the ones the VNNI kernels compute, so the float operations that
//! follow (the callers run the `avx512` kernels' operations, in their order) give the same bits
//! as the `avx512` path. The tile instructions are written with `asm!` (the AMX intrinsics and
//! target features are not stable Rust); [`crate::layers::simd`] hands out an `amx` token only
//! after CPUID and Linux's grant of the tile state.

use std::arch::asm;

/// Most activation rows in one tile product.
pub(super) const ROWS: usize = 16;

/// Bytes of one B tile (8 rows of 64).
pub(super) const B_BYTES: usize = 512;

/// Room for two C tiles of [`ROWS`] rows (64 bytes a row), 64-byte aligned.
#[repr(C, align(64))]
pub(super) struct CTiles(pub [[i32; 16]; 2 * ROWS]);

/// Room for two unpacked B tiles, 64-byte aligned.
#[repr(C, align(64))]
pub(super) struct BTiles(pub [u8; 2 * B_BYTES]);

/// The tile state configured for `rows` activation rows; released on drop.
pub(super) struct Tiles {
    rows: usize,
}

#[repr(C, align(64))]
struct Config([u8; 64]);

impl Tiles {
    /// Configures the tiles for `rows` (1..=[`ROWS`]) activation rows.
    ///
    /// # Safety
    /// The process must hold an `amx` [`crate::layers::simd::Isa`] token (CPU support and the
    /// tile state granted).
    #[inline(always)]
    pub(super) unsafe fn configure(rows: usize) -> Tiles {
        assert!((1..=ROWS).contains(&rows));
        let mut cfg = Config([0; 64]);
        cfg.0[0] = 1; // palette 1
        let mut set = |t: usize, rows: usize, colsb: u16| {
            cfg.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            cfg.0[48 + t] = rows as u8;
        };
        set(0, rows, 64);
        set(1, rows, 64);
        set(2, rows, 32);
        set(3, rows, 32);
        set(4, 8, 64);
        set(5, 8, 64);
        // SAFETY: a valid palette-1 configuration (rows ≤ 16, colsb ≤ 64); the caller holds
        // the tile permission.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Tiles { rows }
    }

    /// `c[0][r] = a0[r] · b0` for the configured rows: `a0` row `r` is the 32 bytes at
    /// `a0 + r * stride`, `b0` one B tile ([`B_BYTES`]; signed weight bytes when `signed`,
    /// else unsigned).
    ///
    /// # Safety
    /// Every row of `a0` and all of `b0` are readable; `c` has room for the rows.
    #[inline(always)]
    pub(super) unsafe fn dot1(
        &self,
        signed: bool,
        c: &mut CTiles,
        a0: *const i8,
        stride: usize,
        b0: *const u8,
    ) {
        macro_rules! dot1 {
            ($op:literal) => {
                asm!(
                    "tileloadd tmm2, [{a0} + {s} * 1]",
                    "tileloadd tmm4, [{b0} + {w} * 1]",
                    "tilezero tmm0",
                    concat!($op, " tmm0, tmm2, tmm4"),
                    "tilestored [{c} + {w} * 1], tmm0",
                    a0 = in(reg) a0, b0 = in(reg) b0, c = in(reg) c.0.as_mut_ptr(),
                    s = in(reg) stride, w = in(reg) 64usize,
                    options(nostack),
                )
            };
        }
        debug_assert!(self.rows <= ROWS);
        // SAFETY: the caller's bounds; the tiles are configured (self exists).
        unsafe {
            match signed {
                true => dot1!("tdpbssd"),
                false => dot1!("tdpbsud"),
            }
        }
    }

    /// Two independent products: `c[0][r] = a0[r] · b0` and `c[ROWS + r] = a1[r] · b1`.
    ///
    /// # Safety
    /// As [`Tiles::dot1`], for both pairs.
    #[inline(always)]
    pub(super) unsafe fn dot2(
        &self,
        signed: bool,
        c: &mut CTiles,
        a: [*const i8; 2],
        stride: usize,
        b: [*const u8; 2],
    ) {
        macro_rules! dot2 {
            ($op:literal) => {
                asm!(
                    "tileloadd tmm2, [{a0} + {s} * 1]",
                    "tileloadd tmm4, [{b0} + {w} * 1]",
                    "tileloadd tmm3, [{a1} + {s} * 1]",
                    "tileloadd tmm5, [{b1} + {w} * 1]",
                    "tilezero tmm0",
                    "tilezero tmm1",
                    concat!($op, " tmm0, tmm2, tmm4"),
                    concat!($op, " tmm1, tmm3, tmm5"),
                    "tilestored [{c0} + {w} * 1], tmm0",
                    "tilestored [{c1} + {w} * 1], tmm1",
                    a0 = in(reg) a[0], a1 = in(reg) a[1], b0 = in(reg) b[0], b1 = in(reg) b[1],
                    c0 = in(reg) c.0.as_mut_ptr(), c1 = in(reg) c.0.as_mut_ptr().add(ROWS),
                    s = in(reg) stride, w = in(reg) 64usize,
                    options(nostack),
                )
            };
        }
        debug_assert!(self.rows <= ROWS);
        // SAFETY: the caller's bounds; the tiles are configured (self exists).
        unsafe {
            match signed {
                true => dot2!("tdpbssd"),
                false => dot2!("tdpbsud"),
            }
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `configure`; releasing returns them to the
        // init state (smaller context switches).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The stride between consecutive activation rows `q` (slices of one buffer, equally spaced,
/// as `Acts::rows` makes them), checked: a tile load reads each row at `first + r * stride`.
pub(super) fn row_stride<'a>(mut q: impl Iterator<Item = &'a [i8]>) -> usize {
    let first = q.next().expect("invariant: a tile product has rows");
    let (base, len) = (first.as_ptr() as usize, first.len());
    let mut stride = len;
    for (r, row) in (1..).zip(q) {
        let at = row.as_ptr() as usize;
        if r == 1 {
            stride = at.wrapping_sub(base);
        }
        assert!(
            at == base.wrapping_add(r * stride) && row.len() == len,
            "activation rows of one tile product must be equally spaced in one buffer"
        );
    }
    stride
}
