//! Dot product of one unpacked weight row with quantized activation rows, in one build per
//! [`Isa`] path (`avx512`, `avxvnni`, `avx2`, `scalar`).
//!
//! All of them compute, per 32-element block, the same eight exact integer lane sums
//! `Σ_{i in 4l..4l+4} q_w[i] * q_a[i]`, then accumulate in f32 in one fixed order:
//!
//! ```text
//!  acc[b % 2] += f32(lanes) * (scale_w * d_a)      (8 lanes, two accumulators by block parity)
//!  min[b % 2] += min_w * s_a
//!  y = hsum(acc[0] + acc[1]) + (min[0] + min[1])
//! ```
//!
//! Nothing depends on how many activation rows share the weights, which is what makes a verify
//! row bit-identical to the decode step at the same position. The two accumulators only break
//! the add latency chain.

use super::unpack::{Block, QK};
use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// One activation row quantized to 8 bits per 32-element block.
///
/// # Invariants
/// `q.len() == QK * d.len() == QK * s.len()`; `q` holds `round(x / d) + 128` and
/// `s[b] = d[b] * Σ round(x / d)`.
#[derive(Clone, Copy)]
pub(super) struct ActRow<'a> {
    pub q: &'a [u8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

/// `ys[r] = Σ_b` block `b` of `w` against block `b` of `acts[r]` (see the module docs) on the
/// path `isa`; `has_min` says whether any block of `w` has a non-zero `min` (else that term
/// is skipped).
///
/// Rows go through the SIMD kernels four at a time (sharing the weight loads); a row's
/// instructions are the same whichever group it lands in.
#[inline(always)]
pub(super) fn dot_rows(isa: Isa, w: &[Block], has_min: bool, acts: &[ActRow<'_>], ys: &mut [f32]) {
    debug_assert_eq!(acts.len(), ys.len());
    for a in acts {
        assert!(a.d.len() == w.len() && a.s.len() == w.len() && a.q.len() == w.len() * QK);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.level() != Level::Scalar {
        let mut quads = acts.chunks_exact(4).zip(ys.chunks_exact_mut(4));
        for (a, y) in &mut quads {
            let a: &[ActRow<'_>; 4] = a.try_into().expect("invariant: chunks of 4");
            y.copy_from_slice(&dispatch(isa, w, has_min, a));
        }
        let rest = acts.len() / 4 * 4;
        for (a, y) in acts[rest..].iter().zip(&mut ys[rest..]) {
            *y = dispatch::<1>(isa, w, has_min, std::array::from_ref(a))[0];
        }
        return;
    }
    for (a, y) in acts.iter().zip(ys) {
        *y = dot_scalar(w, *a);
    }
}

/// One group of `R` rows through the build of `isa` (not scalar).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dispatch<const R: usize>(isa: Isa, w: &[Block], has_min: bool, a: &[ActRow<'_>; R]) -> [f32; R] {
    // SAFETY: an `Isa` token is only made after checking the features of its level; the
    // lengths were asserted in `dot_rows`.
    unsafe {
        match (isa.level(), has_min) {
            (Level::AvxVnni, true) => x86::dot_avxvnni::<R, true>(w, a),
            (Level::AvxVnni, false) => x86::dot_avxvnni::<R, false>(w, a),
            (Level::Avx512, true) => x86::dot_avx512vnni::<R, true>(w, a),
            (Level::Avx512, false) => x86::dot_avx512vnni::<R, false>(w, a),
            (_, true) => x86::dot_avx2::<R, true>(w, a),
            (_, false) => x86::dot_avx2::<R, false>(w, a),
        }
    }
}

/// Portable build: the same lane sums and accumulation order as the SIMD builds (which also
/// fuse the multiply-adds, so the last bits may differ from this one).
pub(super) fn dot_scalar(w: &[Block], a: ActRow<'_>) -> f32 {
    let mut acc = [[0f32; 8]; 2];
    let mut min = [0f32; 2];
    for (b, blk) in w.iter().enumerate() {
        let qa = &a.q[b * QK..(b + 1) * QK];
        let p = b % 2;
        let lanes = blk.q.chunks_exact(4).zip(qa.chunks_exact(4));
        for ((acc, &scale), (w4, a4)) in acc[p].iter_mut().zip(&blk.scale).zip(lanes) {
            let lane: i32 = (w4.iter().zip(a4))
                .map(|(&w, &a)| w as i32 * (a as i32 - 128))
                .sum();
            *acc += lane as f32 * (scale * a.d[b]);
        }
        min[p] += blk.min * a.s[b];
    }
    let v: [f32; 8] = std::array::from_fn(|l| acc[0][l] + acc[1][l]);
    // The SIMD builds' horizontal order: halves, then pairs, then the last two.
    let h: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    ((h[0] + h[2]) + (h[1] + h[3])) + (min[0] + min[1])
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{ActRow, Block, QK};
    use std::arch::x86_64::*;

    /// Horizontal sum: `v[0..4] + v[4..8]`, then `[0]+[2], [1]+[3]`, then the two.
    #[inline(always)]
    pub(in super::super) unsafe fn hsum(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
    }

    /// The body shared by the builds: `$lanes(blk, q_a)` gives a block's eight integer lane
    /// sums; blocks alternate between two accumulators (even, odd) to break the add chain.
    macro_rules! dot_body {
        ($w:expr, $a:expr, $r:expr, $has_min:expr, |$blk:ident, $qa:ident| $lanes:expr) => {{
            let (w, a): (&[Block], &[ActRow<'_>; $r]) = ($w, $a);
            let mut acc = [[_mm256_setzero_ps(); $r]; 2];
            let mut min = [[0f32; $r]; 2];
            let mut block = |b: usize, p: usize| {
                let $blk = w.get_unchecked(b);
                let sc = _mm256_load_ps($blk.scale.as_ptr());
                for r in 0..$r {
                    let row = a.get_unchecked(r);
                    let $qa = _mm256_loadu_si256(row.q.as_ptr().add(b * QK) as *const __m256i);
                    let lanes = $lanes;
                    let s = _mm256_mul_ps(sc, _mm256_set1_ps(*row.d.get_unchecked(b)));
                    acc[p][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), s, acc[p][r]);
                    if $has_min {
                        min[p][r] = $blk.min.mul_add(*row.s.get_unchecked(b), min[p][r]);
                    }
                }
            };
            for b in (0..w.len() / 2 * 2).step_by(2) {
                block(b, 0);
                block(b + 1, 1);
            }
            if w.len() % 2 == 1 {
                block(w.len() - 1, 0);
            }
            std::array::from_fn(|r| {
                hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (min[0][r] + min[1][r])
            })
        }};
    }

    /// `vpdpbusd(neg_corr, q_a + 128, q_w) = Σ q_a q_w` exactly (see [`Block`]'s invariant).
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub(super) unsafe fn dot_avxvnni<const R: usize, const MIN: bool>(
        w: &[Block],
        a: &[ActRow<'_>; R],
    ) -> [f32; R] {
        dot_body!(w, a, R, MIN, |blk, qa| _mm256_dpbusd_avx_epi32(
            _mm256_load_si256(blk.neg_corr.as_ptr() as *const __m256i),
            qa,
            _mm256_load_si256(blk.q.as_ptr() as *const __m256i),
        ))
    }

    /// [`dot_avxvnni`] with the EVEX encoding of the same instruction (the `avx512` path).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vnni,avx512vl")]
    pub(super) unsafe fn dot_avx512vnni<const R: usize, const MIN: bool>(
        w: &[Block],
        a: &[ActRow<'_>; R],
    ) -> [f32; R] {
        dot_body!(w, a, R, MIN, |blk, qa| _mm256_dpbusd_epi32(
            _mm256_load_si256(blk.neg_corr.as_ptr() as *const __m256i),
            qa,
            _mm256_load_si256(blk.q.as_ptr() as *const __m256i),
        ))
    }

    /// ggml's sign trick: `|q_w| * sign(q_a, q_w)` fits `vpmaddubsw` without saturating
    /// (|q_w| <= 128, |q_a| <= 127), then `vpmaddwd` sums lane pairs to the same 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_avx2<const R: usize, const MIN: bool>(
        w: &[Block],
        a: &[ActRow<'_>; R],
    ) -> [f32; R] {
        let bias = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        dot_body!(w, a, R, MIN, |blk, qa| {
            let qa = _mm256_xor_si256(qa, bias);
            let qw = _mm256_load_si256(blk.q.as_ptr() as *const __m256i);
            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
            _mm256_madd_epi16(p16, ones)
        })
    }
}
