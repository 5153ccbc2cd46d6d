//! `Q6_K` repacked at load with one weight row per SIMD lane (16 rows per group), like
//! [`super::kpacked`]'s `Q4_K`: a super-block's integer sums stay per lane, the int8
//! sub-block scales are applied per lane with integer multiplies, and one float multiply-add
//! per 16 outputs and super-block remains. The 6-bit values keep their 6.5 bits per weight
//! (as many bytes as GGUF's layout), reordered so that three 64-byte loads give the four
//! dwords of one 16-weight sub-block for all 16 lanes. Activations are ggml's `q8_K`
//! ([`super::kquant::Acts`]).
//!
//! ```text
//!  group g = weight rows 16g..16g+16; per super-block s, BLOCK bytes apart:
//!    d[16] f16 | sc[16 sub][16 lanes] i8 |
//!    16 sub-blocks of [L0 | L1 | H], each [16 lanes][4 bytes], for the lane's q[0..16]
//!    (6-bit, 0..63, of elements 16 sub..16 sub + 16), byte b of each:
//!      L0 = q[b] & 15      | (q[8 + b] & 15) << 4
//!      L1 = q[4 + b] & 15  | (q[12 + b] & 15) << 4
//!      H  = q[b] >> 4 | (q[4 + b] >> 4) << 2 | (q[8 + b] >> 4) << 4 | (q[12 + b] >> 4) << 6
//!  so  q[0..4]  = L0 & 15 | (H << 4) & 48      q[4..8]   = L1 & 15 | (H << 2) & 48
//!      q[8..12] = L0 >> 4 | H & 48             q[12..16] = L1 >> 4 | (H >> 2) & 48
//! ```
//!
//! The weights stay unsigned (the u8 side of `vpdpbusd` / `vpmaddubsw`); GGUF's `-32` offset
//! comes from the activations' sums per 16 values (`bsums`). Per output `(r, j)`, on every
//! path, in this order:
//!
//! ```text
//!  for super-block s:  isum = Σ_sub sc[sub] Σ_i q a  -  32 Σ_sub sc[sub] bsum[sub]   exact
//!                      acc  = fma(f32(isum), d * d_a, acc)
//!  y = acc
//! ```
//!
//! All per lane, so the AVX-512, AVX2 and portable builds agree bit for bit and a row's bits
//! do not depend on the other rows of the call. Bounds: a sub-block's `Σ q a` is at most
//! 16 · 63 · 127 in magnitude, `isum` below 2^29: no i32 overflow anywhere.

use candle_core::quantized::GgmlDType;
use half::f16;

#[cfg(target_arch = "x86_64")]
use super::groups::by_rows;
use super::groups::{Columns, Groups, LANES, ROWS};
use super::kquant::{ActRow, QK_K};
use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Stored bytes of a GGUF `Q6_K` super-block: ql[128], qh[64], scales[16] i8, d f16.
const SRC: usize = 210;

const AT_SC: usize = 2 * LANES;
const AT_Q: usize = AT_SC + 16 * LANES;
/// Packed bytes of one sub-block's weights (L0, L1, H).
const SUB: usize = 3 * 4 * LANES;
/// Packed bytes of one group's super-block (16 times GGUF's).
const BLOCK: usize = AT_Q + 16 * SUB;

/// Whether [`K6Packed::new`] takes this type.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    dtype == GgmlDType::Q6K
}

/// A `[n, k]` `Q6_K` weight in the packed layout (see the module docs); rows past `n` in the
/// last group are zero.
pub(super) struct K6Packed(Groups);

/// The 6-bit value (0..63) of element `i` of a GGUF `Q6_K` super-block (ggml's
/// `dequantize_row_q6_K`: element `128 h + 32 t + l` from `ql[64 h + 32 (t % 2) + l]`'s
/// nibble `t / 2` and bits `2 t` of `qh[32 h + l]`).
fn gguf_q(src: &[u8], i: usize) -> u8 {
    let (h, t, l) = (i / 128, i % 128 / 32, i % 32);
    let ql = src[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2)) & 0x0F;
    let qh = src[128 + 32 * h + l] >> (2 * t) & 3;
    ql | qh << 4
}

impl K6Packed {
    /// Repacks the raw GGUF bytes `raw` of a `[n, k]` `Q6_K` weight (`k` a multiple of 256).
    pub(super) fn new(raw: &[u8], n: usize, k: usize) -> K6Packed {
        let nsb = k / QK_K;
        K6Packed(Groups::pack(n, k, QK_K, BLOCK, |j, s, dst| {
            let lane = j % LANES;
            let src = &raw[(j * nsb + s) * SRC..][..SRC];
            dst[2 * lane..][..2].copy_from_slice(&src[208..210]);
            for sub in 0..16 {
                dst[AT_SC + sub * LANES + lane] = src[192 + sub];
                let q: [u8; 16] = std::array::from_fn(|i| gguf_q(src, 16 * sub + i));
                let at = AT_Q + sub * SUB + 4 * lane;
                for b in 0..4 {
                    dst[at + b] = q[b] & 15 | (q[8 + b] & 15) << 4;
                    dst[at + 4 * LANES + b] = q[4 + b] & 15 | (q[12 + b] & 15) << 4;
                    dst[at + 8 * LANES + b] = q[b] >> 4
                        | (q[4 + b] >> 4) << 2
                        | (q[8 + b] >> 4) << 4
                        | (q[12 + b] >> 4) << 6;
                }
            }
        }))
    }

    /// The weight made of rows `ids` (row `i` is row `ids[i]`, bit for bit: lanes are copied).
    /// Every id is below [`K6Packed::rows`] (checked by the caller).
    pub(super) fn select_rows(&self, ids: &[usize]) -> K6Packed {
        let mut spans = vec![(0, 2)];
        spans.extend((0..16).map(|sub| (AT_SC + sub * LANES, 1)));
        spans.extend((0..16 * 3).map(|v| (AT_Q + v * 4 * LANES, 4)));
        K6Packed(self.0.select(ids, &spans))
    }

    /// Output rows (the weight's `n`).
    pub(super) fn rows(&self) -> usize {
        self.0.rows()
    }

    /// Input width (the weight's `k`).
    pub(super) fn cols(&self) -> usize {
        self.0.cols()
    }

    /// As [`super::packed::Packed::rows_task`]: `out[r, j] = y[r, j]`. Up to
    /// [`ROWS`] activation rows a pass on every path (no tile kernel: `amx` runs `avx512`).
    pub(super) fn rows_task(&self, isa: Isa, acts: &[ActRow<'_>], g0: usize, out: &mut Columns) {
        (self.0).rows_task(acts, ROWS, g0, out, |group, a, ys| {
            group_dot(isa, group, a, ys)
        });
    }

    /// Weight row `j` as f32 (`d sc (q - 32)`), read back from the packed layout.
    #[cfg(test)]
    pub(super) fn dequantize_row(&self, j: usize) -> Vec<f32> {
        let lane = j % LANES;
        let mut out = Vec::with_capacity(self.cols());
        for blk in self.0.blocks_of(j) {
            let d = f16_at(blk, 2 * lane);
            for i in 0..QK_K {
                let sc = blk[AT_SC + i / 16 * LANES + lane] as i8 as f32;
                out.push(d * sc * (weight(blk, lane, i) - 32) as f32);
            }
        }
        out
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Element `i` (of 256) of lane `lane` in a packed super-block: its 6-bit value (0..63).
#[inline(always)]
fn weight(blk: &[u8], lane: usize, i: usize) -> i32 {
    let (sub, e) = (i / 16, i % 16);
    let at = AT_Q + sub * SUB + 4 * lane + e % 4;
    let (l0, l1, h) = (blk[at], blk[at + 4 * LANES], blk[at + 8 * LANES]);
    let q = match e / 4 {
        0 => l0 & 15 | (h << 4) & 48,
        1 => l1 & 15 | (h << 2) & 48,
        2 => l0 >> 4 | h & 48,
        _ => l1 >> 4 | (h >> 2) & 48,
    };
    q as i32
}

/// `ys[r]` = the 16 outputs of one group against activation row `a[r]` (`a.len() == ys.len()
/// <= ROWS`).
fn group_dot(isa: Isa, group: &[u8], a: &[ActRow<'_>], ys: &mut [[f32; LANES]]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: an `Isa` token proves its level's features; `group` holds the super-blocks
        // of the rows' width (checked by `matmul`).
        macro_rules! go {
            ($kernel:ident) => {
                unsafe { by_rows!(a, ys, |R| x86::$kernel::<R>(group, a.try_into().unwrap())) }
            };
        }
        match isa.level() {
            Level::Avx512 | Level::Amx => return go!(avx512),
            // 256-bit VNNI would only replace vpmaddubsw + vpmaddwd; it runs the AVX2 build,
            // as the other packed layouts do (same bits).
            Level::Avx2 | Level::AvxVnni => return go!(avx2),
            Level::Scalar => {}
        }
    }
    let _ = isa;
    for (y, r) in ys.iter_mut().zip(a) {
        *y = scalar(group, *r);
    }
}

/// The portable build (the same operations per lane as the SIMD builds).
fn scalar(group: &[u8], a: ActRow<'_>) -> [f32; LANES] {
    let mut acc = [0f32; LANES];
    for (s, blk) in group.chunks_exact(BLOCK).enumerate() {
        let qa = &a.q[s * QK_K..(s + 1) * QK_K];
        let bs = &a.bsums[16 * s..16 * (s + 1)];
        for (j, acc) in acc.iter_mut().enumerate() {
            let mut sumi = 0i32;
            let mut corr = 0i32;
            for sub in 0..16 {
                let dot: i32 = (16 * sub..16 * sub + 16)
                    .map(|i| weight(blk, j, i) * qa[i] as i32)
                    .sum();
                let sc = blk[AT_SC + sub * LANES + j] as i8 as i32;
                sumi += sc * dot;
                corr += sc * bs[sub] as i32;
            }
            let d = f16_at(blk, 2 * j);
            *acc = ((sumi - 32 * corr) as f32).mul_add(d * a.d[s], *acc);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ActRow, AT_Q, AT_SC, BLOCK, LANES, QK_K, SUB};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead.
    const PREFETCH: usize = 2048;

    #[inline(always)]
    unsafe fn act4(a: &ActRow<'_>, at: usize) -> i32 {
        (a.q.as_ptr().add(at) as *const i32).read_unaligned()
    }

    /// The activation sums of sub-blocks `2i` and `2i + 1` of super-block `s` as one dword
    /// (two i16): `vpmaddwd`/`vpdpwssd` against scale pairs.
    #[inline(always)]
    unsafe fn bsum_pair(a: &ActRow<'_>, s: usize, i: usize) -> i32 {
        (a.bsums.as_ptr().add(16 * s + 2 * i) as *const i32).read_unaligned()
    }

    /// 16 lanes per register: per sub-block, four `vpdpbusd` per row into a fresh sum, one
    /// `vpmulld` by the lane's scale; the offset term two sub-blocks per `vpdpwssd`.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/VNNI, AVX2, FMA and F16C; `group` holds `a[r].d.len()` super-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn avx512<const R: usize>(
        group: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [[f32; LANES]; R] {
        let nsb = a[0].d.len();
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x30);
        let mut acc = [_mm512_setzero_ps(); R];
        for s in 0..nsb {
            let p = group.as_ptr().add(s * BLOCK);
            let mut sumi = [_mm512_setzero_si512(); R];
            for sub in 0..16 {
                let q = p.add(AT_Q + sub * SUB);
                for line in (0..SUB).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PREFETCH + line) as *const i8);
                }
                let l0 = _mm512_loadu_si512(q as *const _);
                let l1 = _mm512_loadu_si512(q.add(4 * LANES) as *const _);
                let h = _mm512_loadu_si512(q.add(8 * LANES) as *const _);
                let or_and =
                    |x, y| _mm512_or_si512(_mm512_and_si512(x, m4), _mm512_and_si512(y, m2));
                let w = [
                    or_and(l0, _mm512_slli_epi16(h, 4)),
                    or_and(l1, _mm512_slli_epi16(h, 2)),
                    or_and(_mm512_srli_epi16(l0, 4), h),
                    or_and(_mm512_srli_epi16(l1, 4), _mm512_srli_epi16(h, 2)),
                ];
                let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                    p.add(AT_SC + sub * LANES) as *const __m128i
                ));
                let x = s * QK_K + 16 * sub;
                for r in 0..R {
                    let mut t = _mm512_setzero_si512();
                    for (c, &w) in w.iter().enumerate() {
                        let xa = _mm512_set1_epi32(act4(&a[r], x + 4 * c));
                        t = _mm512_dpbusd_epi32(t, w, xa);
                    }
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(t, sc));
                }
            }
            let mut corr = [_mm512_setzero_si512(); R];
            for i in 0..8 {
                let lo = _mm_loadu_si128(p.add(AT_SC + 2 * i * LANES) as *const __m128i);
                let hi = _mm_loadu_si128(p.add(AT_SC + (2 * i + 1) * LANES) as *const __m128i);
                // Lane l: (sc[2i][l], sc[2i + 1][l]) as two i16.
                let pair = _mm512_cvtepi8_epi16(_mm256_set_m128i(
                    _mm_unpackhi_epi8(lo, hi),
                    _mm_unpacklo_epi8(lo, hi),
                ));
                for r in 0..R {
                    let b = _mm512_set1_epi32(bsum_pair(&a[r], s, i));
                    corr[r] = _mm512_dpwssd_epi32(corr[r], pair, b);
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            for r in 0..R {
                let isum = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(corr[r], 5));
                let da = _mm512_set1_ps(*a[r].d.get_unchecked(s));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), acc[r]);
            }
        }
        let mut out = [[0f32; LANES]; R];
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
        }
        out
    }

    /// 8 lanes per register (two passes per group). Per sub-block and row, four `vpmaddubsw`
    /// (6-bit weight times 8-bit activation pairs, |Σ| ≤ 2 · 63 · 127) added two by two in 16
    /// bits (≤ 32004: no saturation), then `vpmaddwd` by the lane's scale pair widens and
    /// scales them; the offset term two sub-blocks per `vpmaddwd`. The same exact integers
    /// as the other builds.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `group` holds `a[r].d.len()` super-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2<const R: usize>(
        group: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [[f32; LANES]; R] {
        let nsb = a[0].d.len();
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        let mut out = [[0f32; LANES]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for s in 0..nsb {
                let p = group.as_ptr().add(s * BLOCK);
                let mut sumi = [_mm256_setzero_si256(); R];
                for sub in 0..16 {
                    let q = p.add(AT_Q + sub * SUB);
                    if h == 0 {
                        for line in (0..SUB).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(
                                q.wrapping_add(PREFETCH + line) as *const i8
                            );
                        }
                    }
                    let q = q.add(32 * h);
                    let l0 = _mm256_loadu_si256(q as *const __m256i);
                    let l1 = _mm256_loadu_si256(q.add(4 * LANES) as *const __m256i);
                    let hb = _mm256_loadu_si256(q.add(8 * LANES) as *const __m256i);
                    let or_and =
                        |x, y| _mm256_or_si256(_mm256_and_si256(x, m4), _mm256_and_si256(y, m2));
                    let w = [
                        or_and(l0, _mm256_slli_epi16(hb, 4)),
                        or_and(l1, _mm256_slli_epi16(hb, 2)),
                        or_and(_mm256_srli_epi16(l0, 4), hb),
                        or_and(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hb, 2)),
                    ];
                    // Lane l: (sc[l], sc[l]) as two i16.
                    let v = _mm_loadl_epi64(p.add(AT_SC + sub * LANES + 8 * h) as *const __m128i);
                    let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
                    let x = s * QK_K + 16 * sub;
                    for r in 0..R {
                        let xa = |c: usize| _mm256_set1_epi32(act4(&a[r], x + 4 * c));
                        let p01 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[0], xa(0)),
                            _mm256_maddubs_epi16(w[1], xa(1)),
                        );
                        let p23 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[2], xa(2)),
                            _mm256_maddubs_epi16(w[3], xa(3)),
                        );
                        let v = _mm256_add_epi32(
                            _mm256_madd_epi16(p01, sc),
                            _mm256_madd_epi16(p23, sc),
                        );
                        sumi[r] = _mm256_add_epi32(sumi[r], v);
                    }
                }
                let mut corr = [_mm256_setzero_si256(); R];
                for i in 0..8 {
                    let at = AT_SC + 2 * i * LANES + 8 * h;
                    let lo = _mm_loadl_epi64(p.add(at) as *const __m128i);
                    let hi = _mm_loadl_epi64(p.add(at + LANES) as *const __m128i);
                    // Lane l: (sc[2i][l], sc[2i + 1][l]) as two i16.
                    let pair = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
                    for r in 0..R {
                        let b = _mm256_set1_epi32(bsum_pair(&a[r], s, i));
                        corr[r] = _mm256_add_epi32(corr[r], _mm256_madd_epi16(pair, b));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i));
                for r in 0..R {
                    let isum = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(corr[r], 5));
                    let da = _mm256_set1_ps(*a[r].d.get_unchecked(s));
                    acc[r] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, da), acc[r]);
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * h), acc[r]);
            }
        }
        out
    }
}
