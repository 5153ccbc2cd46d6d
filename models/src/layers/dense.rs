//! Dense matmul `y = x W^T` over f32 activations and `[n, k]` weights in f32, f16 or bf16,
//! with one result per row whatever the number of rows in the call.
//!
//! Each output `y[r, j]` is one dot product of row `r` of `x` with row `j` of `W`, summed in
//! a fixed order: `L`-wide vector accumulators (16 lanes on `avx512`, 8 on `avx2`/`avxvnni`
//! and `scalar`) take one fused multiply-add per `L` elements of `k`, in order; the lanes are
//! then summed as a fixed tree, and the `k % L` tail added one element at a time. A register
//! tile of up to `MR` rows by `NR` weight rows shares the loads, but every accumulator in it
//! runs exactly the instructions it would run in a 1 x 1 tile, so a row's bits never depend on
//! how many rows (or which other rows) share the call:
//!
//! ```text
//!  `par` over blocks of COLS_PER_TASK weight rows (output columns)
//!    for each tile of up to MR activation rows (8 on avx512, 4 on avx2)
//!      for each tile of NR = 3 weight rows (f16/bf16 converted to f32 in registers)
//!        for i in (0..k).step_by(L):  acc[r][c] = fma(x[r][i..i+L], w[c][i..i+L], acc[r][c])
//!        y[r][c] = hsum(acc[r][c]) + Σ_tail x * w        (same tree, same tail, any tile)
//! ```
//!
//! Half-precision weights are converted per tile in registers, never into a dequantized copy.

use half::{bf16, f16};

use super::simd::{Isa, Level};

/// Weight rows per weight tile.
const NR: usize = 3;
/// Output columns per parallel task (a multiple of [`NR`]).
const COLS_PER_TASK: usize = 8 * NR;

/// A borrowed dense weight `[n, k]`, row-major.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::F16(w) => w.len(),
            Weights::Bf16(w) => w.len(),
        }
    }
}

/// `xs` (`m` rows of `k`) times `w^T` (`w`: `n` rows of `k`) → `m` rows of `n`, row-major.
///
/// # Panics
/// If the lengths do not match `m`, `n` and `k` (callers check shapes first).
pub(crate) fn matmul(isa: Isa, w: Weights<'_>, n: usize, xs: &[f32], m: usize) -> Vec<f32> {
    assert!(m > 0 && n > 0, "invariant: non-empty matmul");
    let k = xs.len() / m;
    assert!(
        xs.len() == m * k && w.len() == n * k,
        "invariant: shapes checked by the caller"
    );
    // out_t[j * m + r] = y[r, j]: each task owns a contiguous range of output columns.
    let mut out_t = vec![0f32; n * m];
    crate::par::chunks_mut(&mut out_t, COLS_PER_TASK * m, |t, out| {
        let j0 = t * COLS_PER_TASK;
        match w {
            Weights::F32(w) => task(isa, &w[j0 * k..], xs, m, k, out),
            Weights::F16(w) => task(isa, &w[j0 * k..], xs, m, k, out),
            Weights::Bf16(w) => task(isa, &w[j0 * k..], xs, m, k, out),
        }
    });
    match m {
        1 => out_t,
        _ => (0..m)
            .flat_map(|r| (0..n).map(move |j| (r, j)))
            .map(|(r, j)| out_t[j * m + r])
            .collect(),
    }
}

/// A weight element type the kernels convert to f32 on load.
trait Elem: Copy + Send + Sync {
    fn f32(self) -> f32;
    /// 16 elements at `p` as f32.
    ///
    /// # Safety
    /// AVX-512F is available and `p..p + 16` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 elements at `p` as f32.
    ///
    /// # Safety
    /// AVX2 and F16C are available and `p..p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

impl Elem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
    /// bf16 is the top half of an f32: widen and shift (exact).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> __m512 {
        let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
    }
}

/// The columns of one task: `w` starts at the task's first weight row; `out` is
/// `[cols, m]` (`out[c * m + r]`).
fn task<E: Elem>(isa: Isa, w: &[E], xs: &[f32], m: usize, k: usize, out: &mut [f32]) {
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` and `Amx` tokens are only made after checking AVX-512F (and AVX2/FMA).
        Level::Avx512 | Level::Amx => unsafe { x86::task_avx512(w, xs, m, k, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` and `AvxVnni` tokens are only made after checking AVX2, FMA and F16C.
        Level::Avx2 | Level::AvxVnni => unsafe { x86::task_avx2(w, xs, m, k, out) },
        _ => tiles::<E, 4>(w, xs, m, k, out, |r, c, x, w, k, y| {
            scalar_dispatch(r, c, x, w, k, y)
        }),
    }
}

/// The tile loop shared by the builds: `kernel(rows, cols, x, w, k, y)` computes a
/// `rows x cols` tile into `y[r][c]`.
#[inline(always)]
fn tiles<E: Elem, const MR: usize>(
    w: &[E],
    xs: &[f32],
    m: usize,
    k: usize,
    out: &mut [f32],
    mut kernel: impl FnMut(usize, usize, &[f32], &[E], usize, &mut [[f32; NR]; 8]),
) {
    let cols = out.len() / m;
    let mut y = [[0f32; NR]; 8];
    for r0 in (0..m).step_by(MR) {
        let rows = MR.min(m - r0);
        let x = &xs[r0 * k..(r0 + rows) * k];
        let mut c0 = 0;
        while c0 < cols {
            // Full tiles of NR weight rows, then single rows: a weight row's tile width never
            // changes its arithmetic, this only keeps the count of kernel builds down.
            let width = if cols - c0 >= NR { NR } else { 1 };
            kernel(rows, width, x, &w[c0 * k..(c0 + width) * k], k, &mut y);
            for (r, yr) in y.iter().enumerate().take(rows) {
                for (c, &v) in yr.iter().enumerate().take(width) {
                    out[(c0 + c) * m + r0 + r] = v;
                }
            }
            c0 += width;
        }
    }
}

/// Expands `$f::<_, R, C>$args` for the runtime tile shape (`R` one of `$r`, `C` in `{1, NR}`).
macro_rules! dispatch_shape {
    ($f:ident, [$($r:literal)*], $rows:expr, $cols:expr, $args:tt) => {
        match ($rows, $cols) {
            $(
                ($r, 1) => $f::<_, $r, 1> $args,
                ($r, NR) => $f::<_, $r, NR> $args,
            )*
            _ => unreachable!("invariant: tile shapes are 1..=MR x {{1, NR}}"),
        }
    };
}

fn scalar_dispatch<E: Elem>(
    rows: usize,
    cols: usize,
    x: &[f32],
    w: &[E],
    k: usize,
    y: &mut [[f32; NR]; 8],
) {
    dispatch_shape!(scalar_tile, [1 2 3 4], rows, cols, (x, w, k, y))
}

/// Lanes of the portable build (as `avx2`'s, so the trees match in shape).
const SCALAR_LANES: usize = 8;

/// Sums 8 lanes as the SIMD builds do: halves, then pairs, then the last two.
#[inline(always)]
fn hsum8(v: [f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    (h[0] + h[2]) + (h[1] + h[3])
}

/// The portable tile (separate multiply and add: a software `mul_add` would be slow).
#[inline(always)]
fn scalar_tile<E: Elem, const R: usize, const C: usize>(
    x: &[f32],
    w: &[E],
    k: usize,
    y: &mut [[f32; NR]; 8],
) {
    const L: usize = SCALAR_LANES;
    let mut acc = [[[0f32; L]; C]; R];
    let full = k / L * L;
    for i in (0..full).step_by(L) {
        let wv: [[f32; L]; C] =
            std::array::from_fn(|c| std::array::from_fn(|l| w[c * k + i + l].f32()));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xv = &x[r * k + i..r * k + i + L];
            for (acc, wv) in acc.iter_mut().zip(&wv) {
                for l in 0..L {
                    acc[l] += xv[l] * wv[l];
                }
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            let mut s = hsum8(acc[r][c]);
            for i in full..k {
                s += x[r * k + i] * w[c * k + i].f32();
            }
            y[r][c] = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;

    /// Sums 16 lanes: halves, halves again, then as [`hsum8`]'s last steps.
    #[inline(always)]
    unsafe fn hsum16(v: __m512) -> f32 {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        hsum_256(h)
    }

    /// Sums 8 lanes: `[0..4] + [4..8]`, then `[0]+[2], [1]+[3]`, then the two.
    #[inline(always)]
    unsafe fn hsum_256(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<1>(p, p)))
    }

    /// The tile body of a build: `$load_x`/`$load_w` read `$l` lanes, `$fma` accumulates and
    /// `$hsum` reduces a vector (the fixed tree).
    macro_rules! tile_body {
        ($x:expr, $w:expr, $k:expr, $y:expr, $r:expr, $c:expr, $l:expr,
         $zero:expr, $load_x:expr, $load_w:expr, $fma:expr, $hsum:expr) => {{
            let (x, w, k, y): (&[f32], &[E], usize, &mut [[f32; NR]; 8]) = ($x, $w, $k, $y);
            let (xp, wp) = (x.as_ptr(), w.as_ptr());
            let mut acc = [[$zero; $c]; $r];
            let full = k / $l * $l;
            let mut i = 0;
            while i < full {
                let wv: [_; $c] = std::array::from_fn(|c| $load_w(wp.add(c * k + i)));
                for r in 0..$r {
                    let xv = $load_x(xp.add(r * k + i));
                    for c in 0..$c {
                        acc[r][c] = $fma(xv, wv[c], acc[r][c]);
                    }
                }
                i += $l;
            }
            for r in 0..$r {
                for c in 0..$c {
                    let mut s = $hsum(acc[r][c]);
                    for i in full..k {
                        s = (*xp.add(r * k + i)).mul_add((*wp.add(c * k + i)).f32(), s);
                    }
                    y[r][c] = s;
                }
            }
        }};
    }

    /// # Safety
    /// As [`task_avx512`]; `x` holds `R` rows and `w` `C` rows of `k`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn tile512<E: Elem, const R: usize, const C: usize>(
        x: &[f32],
        w: &[E],
        k: usize,
        y: &mut [[f32; NR]; 8],
    ) {
        tile_body!(
            x,
            w,
            k,
            y,
            R,
            C,
            16,
            _mm512_setzero_ps(),
            |p| _mm512_loadu_ps(p),
            |p| E::load16(p),
            |a, b, c| _mm512_fmadd_ps(a, b, c),
            |v| hsum16(v)
        )
    }

    /// # Safety
    /// As [`task_avx2`]; `x` holds `R` rows and `w` `C` rows of `k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<E: Elem, const R: usize, const C: usize>(
        x: &[f32],
        w: &[E],
        k: usize,
        y: &mut [[f32; NR]; 8],
    ) {
        tile_body!(
            x,
            w,
            k,
            y,
            R,
            C,
            8,
            _mm256_setzero_ps(),
            |p| _mm256_loadu_ps(p),
            |p| E::load8(p),
            |a, b, c| _mm256_fmadd_ps(a, b, c),
            |v| hsum_256(v)
        )
    }

    /// # Safety
    /// The CPU supports AVX-512F, AVX2, FMA and F16C; the slices match `m` and `k`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn task_avx512<E: Elem>(
        w: &[E],
        xs: &[f32],
        m: usize,
        k: usize,
        out: &mut [f32],
    ) {
        tiles::<E, 8>(w, xs, m, k, out, |r, c, x, w, k, y| {
            // SAFETY: the caller's features; `tiles` passes whole rows of the tile shape.
            unsafe { dispatch_shape!(tile512, [1 2 3 4 5 6 7 8], r, c, (x, w, k, y)) }
        })
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; the slices match `m` and `k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn task_avx2<E: Elem>(
        w: &[E],
        xs: &[f32],
        m: usize,
        k: usize,
        out: &mut [f32],
    ) {
        tiles::<E, 4>(w, xs, m, k, out, |r, c, x, w, k, y| {
            // SAFETY: the caller's features; `tiles` passes whole rows of the tile shape.
            unsafe { dispatch_shape!(tile256, [1 2 3 4], r, c, (x, w, k, y)) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const ROWS: [usize; 9] = [1, 2, 3, 7, 16, 17, 33, 100, 512];

    fn random(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-2.0..2.0)).collect()
    }

    /// `y = x W^T` in f64, the reference the kernels approximate.
    fn reference(w: &[f32], n: usize, xs: &[f32], m: usize) -> Vec<f64> {
        let k = xs.len() / m;
        (0..m * n)
            .map(|i| {
                let (r, j) = (i / n, i % n);
                (0..k)
                    .map(|t| xs[r * k + t] as f64 * w[j * k + t] as f64)
                    .sum()
            })
            .collect()
    }

    fn check_type(isa: Isa, w: Weights<'_>, dense: &[f32], n: usize, k: usize, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let xs = random(&mut rng, 512 * k);
        let alone: Vec<Vec<f32>> = (0..512)
            .map(|r| matmul(isa, w, n, &xs[r * k..(r + 1) * k], 1))
            .collect();
        for m in ROWS {
            let ys = matmul(isa, w, n, &xs[..m * k], m);
            for r in 0..m {
                let same = ys[r * n..(r + 1) * n]
                    .iter()
                    .zip(&alone[r])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{isa} {w:?}: row {r} of {m} rows differs from the row alone",
                    w = std::mem::discriminant(&w)
                );
            }
        }
        // And the values are the product (f32 accumulation of k terms).
        let want = reference(dense, n, &xs[..7 * k], 7);
        let ys = matmul(isa, w, n, &xs[..7 * k], 7);
        for (i, (&y, &e)) in ys.iter().zip(&want).enumerate() {
            assert!(
                (y as f64 - e).abs() <= 1e-4 * (k as f64).sqrt() * e.abs().max(1.0),
                "{isa} elem {i}: {y} vs {e}"
            );
        }
    }

    /// Every row is bit-identical whatever the row count, on every path this CPU runs, for
    /// each weight type; `k` has a tail past the vector width and `n` a tail past `NR`.
    #[test]
    fn rows_do_not_depend_on_row_count() {
        let (n, k) = (2 * COLS_PER_TASK + 5, 16 * 9 + 7);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let w = random(&mut rng, n * k);
        let w16: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let w16_f32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
        let wb_f32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        for isa in Isa::available() {
            check_type(isa, Weights::F32(&w), &w, n, k, 2);
            check_type(isa, Weights::F16(&w16), &w16_f32, n, k, 3);
            check_type(isa, Weights::Bf16(&wb), &wb_f32, n, k, 4);
        }
    }

    /// Half-precision weights give exactly the f32 kernel's results on their f32 values (the
    /// conversion is exact and happens before the same arithmetic).
    #[test]
    fn half_weights_are_converted_exactly() {
        let (n, k, m) = (7, 64 + 3, 5);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let w = random(&mut rng, n * k);
        let xs = random(&mut rng, m * k);
        let w16: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let w16_f32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
        let wb_f32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        for isa in Isa::available() {
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(matmul(isa, Weights::F16(&w16), n, &xs, m)),
                bits(matmul(isa, Weights::F32(&w16_f32), n, &xs, m)),
                "{isa} f16"
            );
            assert_eq!(
                bits(matmul(isa, Weights::Bf16(&wb), n, &xs, m)),
                bits(matmul(isa, Weights::F32(&wb_f32), n, &xs, m)),
                "{isa} bf16"
            );
        }
    }
}
