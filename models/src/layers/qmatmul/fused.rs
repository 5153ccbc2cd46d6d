//! The decode step's kernels (one activation row, x86 SIMD builds): each 32-element weight
//! block is unpacked into registers and dotted at once, so the weight stream is read once and
//! nothing is written back. (The unpacked [`Block`](super::unpack::Block) the multi-row path
//! writes is 128 bytes per 32 weights; a Q4_K block is 18. On Qwen2.5-1.5B this took decode
//! from about 7 to 9.5 tokens/s on the 2-core dev box.)
//!
//! A verify chunk (several rows) still unpacks each weight row once into a buffer and reuses
//! it for every row: unpacking in registers once per group of 4 or 8 rows was measured slower
//! (SmolLM2 Q4_1, 8 and 16 rows: 62-68 vs 57 ms and 131-135 vs 104-105 ms CPU). Both paths
//! compute, per block, the same eight integer lane sums and the same f32 operations in the same
//! order (see the `dot` module docs), so a decode step here is bit-identical to the same row
//! of a verify chunk there (`rows_do_not_depend_on_row_count` and `simd_builds_agree_exactly` check it for every type and path).
//!
//! ```text
//!  for each pair of blocks (b even, b + 1):
//!    q, scales, min  <- unpack block b in registers  (bit-for-bit what `unpack` writes)
//!    acc[b % 2] += f32(lanes(q, q_a)) * (scales * d_a);   min[b % 2] += min_w * s_a
//! ```

use std::arch::x86_64::*;

use candle_core::quantized::GgmlDType;

use super::dot::x86::hsum;
use super::dot::ActRow;
use super::unpack::x86::{for_each_block, Kind, Reg, Q4_0, Q4_1, Q5_0, Q8_0};
use super::unpack::QK;
use crate::layers::simd::{Isa, Level};

/// The body shared by the builds: `$prep(q)` is a block's weight-side work, and
/// `$lanes(prep, q_a)` gives its eight integer lane sums against the activation block.
macro_rules! body {
    ($k:ty, $row:expr, $a:expr, |$q:ident| $prep:expr, |$pp:ident, $qa:ident| $lanes:expr) => {{
        let (row, a): (&[u8], ActRow<'_>) = ($row, $a);
        let n = a.d.len();
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut min = [0f32; 2];
        let mut block = |b: usize, par: usize, w: Reg| {
            let $q = w.q;
            let $pp = $prep;
            let $qa = _mm256_loadu_si256(a.q.as_ptr().add(b * QK) as *const __m256i);
            let lanes = $lanes;
            let s = _mm256_mul_ps(w.sc, _mm256_set1_ps(*a.d.get_unchecked(b)));
            acc[par] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), s, acc[par]);
            if <$k>::MIN {
                min[par] = w.min.mul_add(*a.s.get_unchecked(b), min[par]);
            }
        };
        for_each_block::<$k>(row, n, |b, par, w| block(b, par, w));
        hsum(_mm256_add_ps(acc[0], acc[1])) + (min[0] + min[1])
    }};
}

/// `vpdpbusd(neg_corr, q_a + 128, q_w) = Σ q_a q_w`, with `neg_corr = -128 Σ q_w` per lane.
#[inline(always)]
unsafe fn neg_corr(q: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(-128))
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn avxvnni<K: Kind>(row: &[u8], a: ActRow<'_>) -> f32 {
    body!(K, row, a, |q| neg_corr(q), |corr, qa| {
        _mm256_dpbusd_avx_epi32(corr, qa, q)
    })
}

/// [`avxvnni`] with the EVEX encoding of the same instruction.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni,avx512vl")]
unsafe fn avx512vnni<K: Kind>(row: &[u8], a: ActRow<'_>) -> f32 {
    body!(K, row, a, |q| neg_corr(q), |corr, qa| {
        _mm256_dpbusd_epi32(corr, qa, q)
    })
}

/// ggml's sign trick: `|q_w| * sign(q_a, q_w)` fits `vpmaddubsw` without saturating
/// (|q_w| <= 128, |q_a| <= 127), then `vpmaddwd` sums lane pairs to the same 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<K: Kind>(row: &[u8], a: ActRow<'_>) -> f32 {
    body!(K, row, a, |q| _mm256_sign_epi8(q, q), |abs, qa| {
        let qa = _mm256_xor_si256(qa, _mm256_set1_epi8(-128));
        let p16 = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(qa, q));
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    })
}

#[inline(always)]
unsafe fn dot_kind<K: Kind>(isa: Isa, row: &[u8], a: ActRow<'_>) -> f32 {
    match isa.level() {
        Level::AvxVnni => avxvnni::<K>(row, a),
        Level::Avx512 => avx512vnni::<K>(row, a),
        _ => avx2::<K>(row, a),
    }
}

/// Weight row `row` (raw GGUF bytes of `dtype`) dotted with the activation row `a`.
///
/// # Safety
/// `isa` is not the scalar path; `dtype` is supported; `row` holds exactly `32 * a.d.len()`
/// weights.
pub(super) unsafe fn dot(isa: Isa, dtype: GgmlDType, row: &[u8], a: ActRow<'_>) -> f32 {
    match dtype {
        GgmlDType::Q4_0 => dot_kind::<Q4_0>(isa, row, a),
        GgmlDType::Q4_1 => dot_kind::<Q4_1>(isa, row, a),
        GgmlDType::Q5_0 => dot_kind::<Q5_0>(isa, row, a),
        _ => dot_kind::<Q8_0>(isa, row, a),
    }
}
