//! The kernels of short calls (a decode step, a verify window of up to [`max_rows`] rows; x86
//! SIMD builds): each 32-element weight block is unpacked into registers and dotted at once
//! with every row of the call, so the weight stream is read once and nothing is written back. (The unpacked [`Block`](super::unpack::Block) the multi-row path
//! writes is 128 bytes per 32 weights; a Q4_K block is 18. On Qwen2.5-1.5B this took decode
//! from about 7 to 9.5 tokens/s on the 2-core dev box.)
//!
//! Longer calls (prefill chunks) unpack each weight row once into a buffer and reuse it for
//! every tile of rows: redoing the unpacking per tile would cost more than the buffer. Both paths
//! compute, per block, the same eight integer lane sums and the same f32 operations in the same
//! order (see the `dot` module docs), so a decode step here is bit-identical to the same row
//! of a verify chunk there (`rows_do_not_depend_on_row_count` and `simd_builds_agree_exactly`
//! check it for every type and path). The `avx512` build holds blocks `b` and `b + 1` in the
//! two halves of one register: the same operations, half the instructions.
//!
//! ```text
//!  for each pair of blocks (b even, b + 1):          (Q4_K/Q6_K: 8 blocks per super-block)
//!    q, scales, min  <- unpack block b in registers  (bit-for-bit what `unpack` writes)
//!    acc[b % 2] += f32(lanes(q, q_a)) * (scales * d_a);   min[b % 2] += min_w * s_a
//! ```

use std::arch::x86_64::*;

use candle_core::quantized::GgmlDType;

use super::dot::x86::{halves, hsum, join_ps, pair_d, pair_q};
use super::dot::ActRow;
use super::unpack::x86::{for_each_block, Kind, Reg, Q4K, Q4_0, Q4_1, Q5_0, Q6K, Q8_0};
use super::unpack::QK;
use crate::layers::simd::{Isa, Level};

/// The most rows one call of these kernels takes on `isa` (its register budget: 32 zmm on
/// `avx512`, 16 ymm otherwise).
pub(super) fn max_rows(isa: Isa) -> usize {
    match isa.level() {
        Level::Avx512 => 8,
        _ => 4,
    }
}

/// The 256-bit body shared by the builds: `$prep(q)` is a block's weight-side work, and
/// `$lanes(prep, q_a)` gives its eight integer lane sums against an activation block.
macro_rules! body {
    ($k:ty, $r:expr, $row:expr, $a:expr, |$q:ident| $prep:expr, |$pp:ident, $qa:ident| $lanes:expr) => {{
        let (row, a): (&[u8], &[ActRow<'_>; $r]) = ($row, $a);
        let n = a[0].d.len();
        let mut acc = [[_mm256_setzero_ps(); $r]; 2];
        let mut min = [[0f32; $r]; 2];
        let mut block = |b: usize, par: usize, w: Reg| {
            let $q = w.q;
            let $pp = $prep;
            for r in 0..$r {
                let a = a.get_unchecked(r);
                let $qa = _mm256_loadu_si256(a.q.as_ptr().add(b * QK) as *const __m256i);
                let lanes = $lanes;
                let s = _mm256_mul_ps(w.sc, _mm256_set1_ps(*a.d.get_unchecked(b)));
                acc[par][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), s, acc[par][r]);
                if <$k>::MIN {
                    min[par][r] = w.min.mul_add(*a.s.get_unchecked(b), min[par][r]);
                }
            }
        };
        for_each_block::<$k>(row, n, |b, par, w| block(b, par, w));
        std::array::from_fn(|r| hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (min[0][r] + min[1][r]))
    }};
}

/// `vpdpbusd(neg_corr, q_a + 128, q_w) = Σ q_a q_w`, with `neg_corr = -128 Σ q_w` per lane.
#[inline(always)]
unsafe fn neg_corr(q: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(-128))
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn avxvnni<K: Kind, const R: usize>(row: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    body!(K, R, row, a, |q| neg_corr(q), |corr, qa| {
        _mm256_dpbusd_avx_epi32(corr, qa, q)
    })
}

/// Two blocks per 512-bit register, as [`super::dot`]'s `dot_avx512` (bit-identical to it and
/// to the 256-bit builds): even block `b` in the low half, `b + 1` in the high half.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn avx512<K: Kind, const R: usize>(row: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let n = a[0].d.len();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut min = [[0f32; R]; 2];
    let mut lo = Reg {
        q: _mm256_setzero_si256(),
        sc: _mm256_setzero_ps(),
        min: 0.0,
    };
    let mut pair = |b: usize, lo: Reg, hi: Reg, both: bool| {
        let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo.q), hi.q);
        let pairs = _mm512_maddubs_epi16(_mm512_set1_epi8(1), q);
        let corr = _mm512_madd_epi16(pairs, _mm512_set1_epi16(-128));
        let sc = join_ps(lo.sc, hi.sc);
        let mask: __mmask16 = if both { 0xFFFF } else { 0x00FF };
        for (acc, a) in acc.iter_mut().zip(a) {
            let lanes = _mm512_dpbusd_epi32(corr, pair_q(a.q.as_ptr().add(b * QK), both), q);
            let s = _mm512_mul_ps(sc, pair_d(a.d.as_ptr().add(b), both));
            *acc = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(lanes), s, *acc, mask);
        }
    };
    for_each_block::<K>(row, n, |b, par, w| {
        if K::MIN {
            for (min, a) in min[par].iter_mut().zip(a) {
                *min = w.min.mul_add(*a.s.get_unchecked(b), *min);
            }
        }
        match par {
            0 if b + 1 == n => pair(b, w, w, false),
            0 => lo = w,
            _ => pair(b - 1, lo, w, true),
        }
    });
    std::array::from_fn(|r| hsum(halves(acc[r])) + (min[0][r] + min[1][r]))
}

/// ggml's sign trick: `|q_w| * sign(q_a, q_w)` fits `vpmaddubsw` without saturating
/// (|q_w| <= 128, |q_a| <= 127), then `vpmaddwd` sums lane pairs to the same 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<K: Kind, const R: usize>(row: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    body!(K, R, row, a, |q| _mm256_sign_epi8(q, q), |abs, qa| {
        let qa = _mm256_xor_si256(qa, _mm256_set1_epi8(-128));
        let p16 = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(qa, q));
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    })
}

/// Expands to the `match` over the supported types calling `$f::<Kind, R>(row, a)`.
macro_rules! by_type {
    ($f:ident, $r:expr, $dtype:expr, $row:expr, $a:expr) => {
        match $dtype {
            GgmlDType::Q4_0 => $f::<Q4_0, $r>($row, $a),
            GgmlDType::Q4_1 => $f::<Q4_1, $r>($row, $a),
            GgmlDType::Q5_0 => $f::<Q5_0, $r>($row, $a),
            GgmlDType::Q8_0 => $f::<Q8_0, $r>($row, $a),
            GgmlDType::Q4K => $f::<Q4K, $r>($row, $a),
            _ => $f::<Q6K, $r>($row, $a),
        }
    };
}

/// A group of `R` rows on a 256-bit build (`R <= 4`).
#[inline(always)]
unsafe fn group_256<const R: usize>(
    isa: Isa,
    dtype: GgmlDType,
    row: &[u8],
    a: &[ActRow<'_>],
) -> [f32; R] {
    let a: &[ActRow<'_>; R] = a.try_into().expect("invariant: a group of R rows");
    match isa.level() {
        Level::AvxVnni => by_type!(avxvnni, R, dtype, row, a),
        _ => by_type!(avx2, R, dtype, row, a),
    }
}

/// A group of `R` rows on the 512-bit build (`R <= 8`).
#[inline(always)]
unsafe fn group_512<const R: usize>(dtype: GgmlDType, row: &[u8], a: &[ActRow<'_>]) -> [f32; R] {
    let a: &[ActRow<'_>; R] = a.try_into().expect("invariant: a group of R rows");
    by_type!(avx512, R, dtype, row, a)
}

/// Weight row `row` (raw GGUF bytes of `dtype`) dotted with each activation row of `a`
/// (at most [`max_rows`]) into `ys`.
///
/// # Safety
/// `isa` is not the scalar path; `dtype` is supported; `row` holds exactly `32 * a[r].d.len()`
/// weights for every row, and `ys.len() == a.len() <= max_rows(isa)`.
pub(super) unsafe fn dot_rows(
    isa: Isa,
    dtype: GgmlDType,
    row: &[u8],
    a: &[ActRow<'_>],
    ys: &mut [f32],
) {
    if isa.level() == Level::Avx512 {
        match a.len() {
            1 => ys.copy_from_slice(&group_512::<1>(dtype, row, a)),
            2 => ys.copy_from_slice(&group_512::<2>(dtype, row, a)),
            3 => ys.copy_from_slice(&group_512::<3>(dtype, row, a)),
            4 => ys.copy_from_slice(&group_512::<4>(dtype, row, a)),
            5 => ys.copy_from_slice(&group_512::<5>(dtype, row, a)),
            6 => ys.copy_from_slice(&group_512::<6>(dtype, row, a)),
            7 => ys.copy_from_slice(&group_512::<7>(dtype, row, a)),
            _ => ys.copy_from_slice(&group_512::<8>(dtype, row, a)),
        }
        return;
    }
    match a.len() {
        1 => ys.copy_from_slice(&group_256::<1>(isa, dtype, row, a)),
        2 => ys.copy_from_slice(&group_256::<2>(isa, dtype, row, a)),
        3 => ys.copy_from_slice(&group_256::<3>(isa, dtype, row, a)),
        _ => ys.copy_from_slice(&group_256::<4>(isa, dtype, row, a)),
    }
}
