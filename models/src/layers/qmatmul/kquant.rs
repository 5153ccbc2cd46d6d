//! `Q6_K` weights against activations quantized per 256 values (ggml's `q8_K`, also the
//! activations of [`super::kpacked`]'s `Q4_K`), with integer sums across the whole 256-weight
//! super-block: one float multiply-add per super-block and row instead of one per 32 weights
//! (ggml's `ggml_vec_dot_q6_K_q8_K`).
//!
//! ```text
//!  Q6_K  w = d sc_j (q - 32)      (q in 0..63, 16 sub-blocks j of 16, i8 sc_j)
//!        y += d d_a (Σ_j sc_j Σ_i q a  -  32 Σ_j sc_j (Σ_i a))
//! ```
//!
//! The weights stay unsigned (`vpmaddubsw` takes them as its u8 side, the activations as i8),
//! so no sign trick is needed, and the offset comes from the activations' sums per 16 values
//! (`bsums`), computed once per row at quantization. Every sum inside a super-block is an exact
//! integer; the float operations per row (`acc += f32(sumi) * (d d_a)` per super-block, then a
//! fixed horizontal order) do not depend on the other rows, so a row of an m-row call is
//! bit-identical to it alone. The SIMD kernels read each super-block once for a group of up to
//! [`GROUP`] rows: the weights are unpacked into registers once and reused by every row.
//! Integer results are equal on every path, so `avx2`, `avxvnni` and `avx512` agree bit for
//! bit; the scalar build differs only by fused-multiply-add rounding.

use candle_core::quantized::GgmlDType;
use half::f16;

use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Elements per super-block (and per activation scale).
pub(super) const QK_K: usize = 256;

/// Activation rows per kernel call on the SIMD paths (the weights are unpacked once for them).
pub(super) const GROUP: usize = 8;

/// Whether this module's kernels handle weights of `dtype`.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    dtype == GgmlDType::Q6K
}

/// Activation rows quantized to i8 per 256 values: `x ≈ d[b] * q`, and `bsums[16 b + j]` the
/// sum of `q[256 b + 16 j..][..16]`.
pub(super) struct Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    bsums: Vec<i16>,
    k: usize,
}

/// One row of [`Acts`].
#[derive(Clone, Copy)]
pub(super) struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub bsums: &'a [i16],
}

impl Acts {
    /// Quantizes `xs` (`rows * k` values, row-major, `k` a multiple of 256); each row on its
    /// own.
    pub(super) fn quantize(isa: Isa, xs: &[f32], k: usize) -> Acts {
        #[cfg(target_arch = "x86_64")]
        if isa.level() != Level::Scalar {
            // SAFETY: every non-scalar `Isa` token was made after checking AVX2 and FMA.
            return unsafe { Self::quantize_avx2(xs, k) };
        }
        let _ = isa;
        Self::quantize_body(xs, k)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantize_avx2(xs: &[f32], k: usize) -> Acts {
        Self::quantize_body(xs, k)
    }

    #[inline(always)]
    fn quantize_body(xs: &[f32], k: usize) -> Acts {
        let blocks = xs.len() / QK_K;
        let mut acts = Acts {
            q: vec![0; xs.len()],
            d: Vec::with_capacity(blocks),
            bsums: Vec::with_capacity(blocks * 16),
            k,
        };
        for (x, q) in xs.chunks_exact(QK_K).zip(acts.q.chunks_exact_mut(QK_K)) {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v * inv).round_ties_even() as i8;
            }
            acts.d.push(d);
            for q16 in q.chunks_exact(16) {
                acts.bsums.push(q16.iter().map(|&v| v as i16).sum());
            }
        }
        acts
    }

    pub(super) fn rows(&self) -> Vec<ActRow<'_>> {
        let kb = self.k / QK_K;
        (self.q.chunks_exact(self.k))
            .zip(
                self.d
                    .chunks_exact(kb)
                    .zip(self.bsums.chunks_exact(16 * kb)),
            )
            .map(|(q, (d, bsums))| ActRow { q, d, bsums })
            .collect()
    }
}

#[inline(always)]
fn f16_at(p: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([p[at], p[at + 1]]).to_f32()
}

/// Stored bytes of one `Q6_K` super-block.
const BLOCK_BYTES: usize = 210;

/// `ys[r] = row · acts[r]` for one weight row (raw `Q6_K` bytes) on the path `isa`.
///
/// # Panics
/// If a row's length does not match the weight row's.
pub(super) fn dot_rows(isa: Isa, row: &[u8], acts: &[ActRow<'_>], ys: &mut [f32]) {
    debug_assert_eq!(acts.len(), ys.len());
    let nsb = row.len() / BLOCK_BYTES;
    for a in acts {
        assert!(a.d.len() == nsb && a.q.len() == nsb * QK_K && a.bsums.len() == nsb * 16);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.level() != Level::Scalar {
        for (a, y) in acts.chunks(GROUP).zip(ys.chunks_mut(GROUP)) {
            // SAFETY: lengths asserted above; a non-scalar token proves AVX2, FMA and F16C.
            unsafe {
                match a.len() {
                    8 => y.copy_from_slice(&x86::dispatch::<8>(isa, row, a.try_into().unwrap())),
                    7 => y.copy_from_slice(&x86::dispatch::<7>(isa, row, a.try_into().unwrap())),
                    6 => y.copy_from_slice(&x86::dispatch::<6>(isa, row, a.try_into().unwrap())),
                    5 => y.copy_from_slice(&x86::dispatch::<5>(isa, row, a.try_into().unwrap())),
                    4 => y.copy_from_slice(&x86::dispatch::<4>(isa, row, a.try_into().unwrap())),
                    3 => y.copy_from_slice(&x86::dispatch::<3>(isa, row, a.try_into().unwrap())),
                    2 => y.copy_from_slice(&x86::dispatch::<2>(isa, row, a.try_into().unwrap())),
                    _ => y.copy_from_slice(&x86::dispatch::<1>(isa, row, a.try_into().unwrap())),
                }
            }
        }
        return;
    }
    let _ = isa;
    for (a, y) in acts.iter().zip(ys) {
        *y = q6k_scalar(row, *a);
    }
}

/// Portable `Q6_K`: the same integer sums as the SIMD builds and the same float operations up
/// to fusing (so the last bits may differ from them).
pub(super) fn q6k_scalar(row: &[u8], a: ActRow<'_>) -> f32 {
    let mut acc = 0f32;
    for (sb, p) in row.chunks_exact(210).enumerate() {
        let d = f16_at(p, 208);
        let sc = &p[192..208];
        let q8 = &a.q[sb * QK_K..(sb + 1) * QK_K];
        let mut sumi = 0i32;
        for half in 0..2 {
            let ql = &p[64 * half..64 * half + 64];
            let qh = &p[128 + 32 * half..128 + 32 * half + 32];
            for t in 0..4 {
                let ql = &ql[32 * (t % 2)..32 * (t % 2) + 32];
                let x = &q8[128 * half + 32 * t..][..32];
                for (g, s) in [0..16, 16..32].into_iter().enumerate() {
                    let dot: i32 = s
                        .map(|l| {
                            let q =
                                ((ql[l] >> (4 * (t / 2))) & 0xF) | (((qh[l] >> (2 * t)) & 3) << 4);
                            q as i32 * x[l] as i32
                        })
                        .sum();
                    sumi += (sc[8 * half + 2 * t + g] as i8) as i32 * dot;
                }
            }
        }
        let bs = &a.bsums[sb * 16..(sb + 1) * 16];
        let corr: i32 = (0..16).map(|j| (sc[j] as i8) as i32 * bs[j] as i32).sum();
        acc += (sumi - 32 * corr) as f32 * (d * a.d[sb]);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ActRow, QK_K};
    use crate::layers::simd::{Isa, Level};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead of the super-block being read.
    const PREFETCH: usize = 768;

    #[inline(always)]
    unsafe fn f16(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline(always)]
    unsafe fn prefetch(p: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + line) as *const i8);
        }
    }

    /// Horizontal sum: `v[0..4] + v[4..8]`, then `[0]+[2], [1]+[3]`, then the two.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        hsum4(_mm_add_ps(
            _mm256_castps256_ps128(v),
            _mm256_extractf128_ps(v, 1),
        ))
    }

    /// Horizontal sum of 4 lanes: `[0]+[2], [1]+[3]`, then the two.
    #[inline(always)]
    unsafe fn hsum4(v: __m128) -> f32 {
        let p = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
    }

    /// The Q6_K body for `$r` rows; `$madd(acc, p16, scale)` is `acc + vpmaddwd(p16, scale)`.
    macro_rules! q6k_body {
        ($row:expr, $a:expr, $r:expr, |$acc:ident, $p16:ident, $sc:ident| $madd:expr) => {{
            let (row, a): (&[u8], &[ActRow<'_>; $r]) = ($row, $a);
            let m4 = _mm256_set1_epi8(0x0F);
            let m2 = _mm256_set1_epi8(0x30);
            let mut acc = [_mm256_setzero_ps(); $r];
            for sb in 0..a[0].d.len() {
                let p = row.as_ptr().add(sb * 210);
                prefetch(p, 210);
                let d = f16(p.add(208));
                let sc = p.add(192) as *const i8;
                let mut sumi = [_mm256_setzero_si256(); $r];
                let sc16 = _mm_loadu_si128(sc as *const __m128i);
                for half in 0..2 {
                    let ql1 = _mm256_loadu_si256(p.add(64 * half) as *const __m256i);
                    let ql2 = _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql2, m4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_and_si256(qh, m2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql2, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                        ),
                    ];
                    // Sub-block j's scale in the low 128 bits, j + 1's in the high (16 bits each).
                    let s: [__m256i; 4] = std::array::from_fn(|t| {
                        let j = _mm_set1_epi8((8 * half + 2 * t) as i8);
                        let pick = _mm_add_epi8(
                            j,
                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                        );
                        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc16, pick))
                    });
                    for r in 0..$r {
                        let q8 = a.get_unchecked(r).q.as_ptr().add(sb * QK_K + 128 * half);
                        let mut v = sumi[r];
                        for t in 0..4 {
                            let x = _mm256_loadu_si256(q8.add(32 * t) as *const __m256i);
                            let ($acc, $p16, $sc) = (v, _mm256_maddubs_epi16(q[t], x), s[t]);
                            v = $madd;
                        }
                        sumi[r] = v;
                    }
                }
                let scales = _mm256_cvtepi8_epi16(sc16);
                for r in 0..$r {
                    let row = a.get_unchecked(r);
                    let bs = _mm256_loadu_si256(row.bsums.as_ptr().add(sb * 16) as *const __m256i);
                    let corr = _mm256_slli_epi32(_mm256_madd_epi16(bs, scales), 5);
                    let v = _mm256_sub_epi32(sumi[r], corr);
                    let da = *row.d.get_unchecked(sb);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d * da), acc[r]);
                }
            }
            std::array::from_fn(|r| hsum(acc[r]))
        }};
    }

    macro_rules! builds {
        ($name:ident, $features:literal, |$acc:ident, $p16:ident, $sc:ident| $madd:expr) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(row: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
                q6k_body!(row, a, R, |$acc, $p16, $sc| $madd)
            }
        };
    }

    builds!(q6k_avx2, "avx2,fma,f16c", |acc, p16, sc| {
        _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc))
    });
    builds!(q6k_avxvnni, "avx2,fma,f16c,avxvnni", |acc, p16, sc| {
        _mm256_dpwssd_avx_epi32(acc, p16, sc)
    });
    builds!(
        q6k_avx512,
        "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
        |acc, p16, sc| _mm256_dpwssd_epi32(acc, p16, sc)
    );

    /// # Safety
    /// `isa` is not scalar; `row` holds `a[r].d.len()` `Q6_K` super-blocks and every
    /// activation row matches it.
    #[inline(always)]
    pub(super) unsafe fn dispatch<const R: usize>(
        isa: Isa,
        row: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [f32; R] {
        match isa.level() {
            Level::Avx512 | Level::Amx => q6k_avx512(row, a),
            Level::AvxVnni => q6k_avxvnni(row, a),
            _ => q6k_avx2(row, a),
        }
    }
}
