//! `Q4_K` repacked at load with one weight row per SIMD lane (16 rows per group), like
//! [`super::packed`] for the 32-element types: the integer sums of a super-block stay per
//! lane, the sub-block scales and mins are applied per lane with integer multiplies, and one
//! float multiply-add per 16 outputs and super-block remains (ggml's `q4_K` 8x8 repack, in
//! the same spirit). Activations are ggml's `q8_K` ([`super::kquant::Acts`]).
//!
//! ```text
//!  group g = weight rows 16g..16g+16; per super-block s, BLOCK bytes apart:
//!    d[16] f16 | dmin[16] f16 | sc[8][16] u8 | m[8][16] u8 |
//!    qs: 4 chunks c x 8 dwords t of [16 lanes][4 bytes]: bytes 32c+4t.. of the row's qs
//!        (low nibbles = elements 64c+4t.., sub-block 2c; high = 64c+32+4t.., sub-block 2c+1)
//! ```
//!
//! Per output `(r, j)`, on every path, in this order:
//!
//! ```text
//!  for super-block s:  sumi = Σ_sub sc[sub] Σ_i q a          exact integers
//!                      summ = Σ_sub m[sub] (Σ_i a)
//!                      acc  = fma(f32(sumi), d * d_a, acc)
//!                      accm = fma(f32(summ), dmin * d_a, accm)
//!  y = acc - accm
//! ```
//!
//! All per lane, so the AVX-512, AVX2 and portable builds agree bit for bit and a row's bits
//! do not depend on the other rows of the call.

use candle_core::quantized::GgmlDType;
use half::f16;

#[cfg(target_arch = "x86_64")]
use super::groups::by_rows;
use super::groups::{rows_per_pass, Columns, Groups, LANES};
use super::kquant::{ActRow, QK_K};
use super::packed::AMX_MIN_ROWS;
use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Stored bytes of a GGUF `Q4_K` super-block.
const SRC: usize = 144;

const AT_SC: usize = 4 * LANES;
const AT_M: usize = AT_SC + 8 * LANES;
const AT_Q: usize = AT_M + 8 * LANES;
/// Packed bytes of one group's super-block.
const BLOCK: usize = AT_Q + 128 * LANES;

/// Whether [`KPacked::new`] takes this type.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    dtype == GgmlDType::Q4K
}

/// A `[n, k]` `Q4_K` weight in the packed layout (see the module docs); rows past `n` in the
/// last group are zero.
pub(super) struct KPacked(Groups);

/// ggml's `get_scale_min_k4` for all 8 sub-blocks: (scales, mins).
fn scales_mins(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        };
    }
    (sc, mn)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl KPacked {
    /// Repacks the raw GGUF bytes `raw` of a `[n, k]` `Q4_K` weight (`k` a multiple of 256).
    pub(super) fn new(raw: &[u8], n: usize, k: usize) -> KPacked {
        let nsb = k / QK_K;
        KPacked(Groups::pack(n, k, QK_K, BLOCK, |j, s, dst| {
            let lane = j % LANES;
            let src = &raw[(j * nsb + s) * SRC..][..SRC];
            dst[2 * lane..][..2].copy_from_slice(&src[0..2]);
            dst[2 * LANES + 2 * lane..][..2].copy_from_slice(&src[2..4]);
            let (sc, mn) = scales_mins(&src[4..16]);
            for sub in 0..8 {
                dst[AT_SC + sub * LANES + lane] = sc[sub];
                dst[AT_M + sub * LANES + lane] = mn[sub];
            }
            for (t, &x) in src[16..].iter().enumerate() {
                // byte t = 4 * dword + i: dword t / 4 of [c][dword] order
                dst[AT_Q + (t / 4) * 4 * LANES + lane * 4 + t % 4] = x;
            }
        }))
    }

    /// The weight made of rows `ids` (row `i` is row `ids[i]`, bit for bit: lanes are copied).
    /// Every id is below [`KPacked::rows`] (checked by the caller).
    pub(super) fn select_rows(&self, ids: &[usize]) -> KPacked {
        let mut spans = vec![(0, 2), (2 * LANES, 2)];
        for sub in 0..8 {
            spans.push((AT_SC + sub * LANES, 1));
            spans.push((AT_M + sub * LANES, 1));
        }
        spans.extend((0..128 / 4).map(|c| (AT_Q + c * 4 * LANES, 4)));
        KPacked(self.0.select(ids, &spans))
    }

    /// Output rows (the weight's `n`).
    pub(super) fn rows(&self) -> usize {
        self.0.rows()
    }

    /// Input width (the weight's `k`).
    pub(super) fn cols(&self) -> usize {
        self.0.cols()
    }

    /// As [`super::packed::Packed::rows_task`]: `out[r, j] = y[r, j]`.
    pub(super) fn rows_task(&self, isa: Isa, acts: &[ActRow<'_>], g0: usize, out: &mut Columns) {
        (self.0).rows_task(acts, rows_per_pass(isa), g0, out, |group, a, ys| {
            group_dot(isa, group, a, ys)
        });
    }

    /// Weight row `j` as f32, read back from the packed layout.
    #[cfg(test)]
    pub(super) fn dequantize_row(&self, j: usize) -> Vec<f32> {
        let lane = j % LANES;
        let mut out = Vec::with_capacity(self.cols());
        for blk in self.0.blocks_of(j) {
            let (d, dmin) = (f16_at(blk, 2 * lane), f16_at(blk, 2 * LANES + 2 * lane));
            for i in 0..QK_K {
                let sub = i / 32;
                let sc = blk[AT_SC + sub * LANES + lane] as f32;
                let m = blk[AT_M + sub * LANES + lane] as f32;
                out.push(d * sc * weight(blk, lane, i) as f32 - dmin * m);
            }
        }
        out
    }
}

/// Element `i` (of 256) of lane `lane` in a packed super-block.
#[inline(always)]
fn weight(blk: &[u8], lane: usize, i: usize) -> i32 {
    let (c, within) = (i / 64, i % 64);
    let t = 32 * c + within % 32;
    let byte = blk[AT_Q + (t / 4) * 4 * LANES + lane * 4 + t % 4];
    (if within < 32 { byte & 0x0F } else { byte >> 4 }) as i32
}

/// `ys[r]` = the 16 outputs of one group against activation row `a[r]` (`a.len() == ys.len()
/// <= MAX_ROWS`).
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
            // SAFETY: an `Amx` token proves AVX-512 and the granted tiles.
            Level::Amx if a.len() >= AMX_MIN_ROWS => return unsafe { x86::amx(group, a, ys) },
            Level::Avx512 | Level::Amx => return go!(avx512),
            Level::Avx2 | Level::AvxVnni => return go!(avx2),
            Level::Scalar => {}
        }
    }
    let _ = isa;
    for (y, r) in ys.iter_mut().zip(a) {
        *y = scalar(group, *r);
    }
}

/// The sum of activations of sub-block `sub` (32 values) of super-block `s`.
#[inline(always)]
fn bsum32(a: &ActRow<'_>, s: usize, sub: usize) -> i32 {
    a.bsums[16 * s + 2 * sub] as i32 + a.bsums[16 * s + 2 * sub + 1] as i32
}

/// The portable build (the same operations per lane as the SIMD builds).
fn scalar(group: &[u8], a: ActRow<'_>) -> [f32; LANES] {
    let mut acc = [0f32; LANES];
    let mut accm = [0f32; LANES];
    for (s, blk) in group.chunks_exact(BLOCK).enumerate() {
        let qa = &a.q[s * QK_K..(s + 1) * QK_K];
        for j in 0..LANES {
            let mut sumi = 0i32;
            let mut summ = 0i32;
            for sub in 0..8 {
                let dot: i32 = (32 * sub..32 * sub + 32)
                    .map(|i| weight(blk, j, i) * qa[i] as i32)
                    .sum();
                sumi += blk[AT_SC + sub * LANES + j] as i32 * dot;
                summ += blk[AT_M + sub * LANES + j] as i32 * bsum32(&a, s, sub);
            }
            let (d, dmin) = (f16_at(blk, 2 * j), f16_at(blk, 2 * LANES + 2 * j));
            acc[j] = (sumi as f32).mul_add(d * a.d[s], acc[j]);
            accm[j] = (summ as f32).mul_add(dmin * a.d[s], accm[j]);
        }
    }
    std::array::from_fn(|j| acc[j] - accm[j])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::amx;
    use super::{bsum32, ActRow, AT_M, AT_Q, AT_SC, BLOCK, LANES, QK_K};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead.
    const PREFETCH: usize = 2048;

    #[inline(always)]
    unsafe fn act4(a: &ActRow<'_>, at: usize) -> i32 {
        (a.q.as_ptr().add(at) as *const i32).read_unaligned()
    }

    /// The end of super-block `s` (at `p`) for rows `a` (the first `sumi.len()`), given their
    /// scaled integer sums `sumi`: the mins term, then the two float multiply-adds per row.
    #[inline(always)]
    unsafe fn super_block_end(
        p: *const u8,
        a: &[ActRow<'_>],
        s: usize,
        sumi: &[__m512i],
        acc: &mut [__m512],
        accm: &mut [__m512],
    ) {
        let rows = sumi.len();
        let mut summ = [_mm512_setzero_si512(); amx::ROWS];
        for sub in 0..8 {
            let mn =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(AT_M + sub * LANES) as *const __m128i));
            for r in 0..rows {
                let b = _mm512_set1_epi32(bsum32(&a[r], s, sub));
                summ[r] = _mm512_add_epi32(summ[r], _mm512_mullo_epi32(mn, b));
            }
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * LANES) as *const __m256i));
        for r in 0..rows {
            let da = _mm512_set1_ps(*a[r].d.get_unchecked(s));
            let (sd, sm) = (_mm512_mul_ps(d, da), _mm512_mul_ps(dmin, da));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), sd, acc[r]);
            accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ[r]), sm, accm[r]);
        }
    }

    /// # Safety
    /// AVX-512F/BW/VL/VNNI, AVX2, FMA and F16C; `group` holds `a[r].d.len()` super-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn avx512<const R: usize>(
        group: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [[f32; LANES]; R] {
        let nsb = a[0].d.len();
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut accm = [_mm512_setzero_ps(); R];
        for s in 0..nsb {
            let p = group.as_ptr().add(s * BLOCK);
            let mut sumi = [_mm512_setzero_si512(); R];
            for c in 0..4 {
                let mut il = [_mm512_setzero_si512(); R];
                let mut ih = [_mm512_setzero_si512(); R];
                for t in 0..8 {
                    let at = AT_Q + (8 * c + t) * 4 * LANES;
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at + PREFETCH) as *const i8);
                    let v = _mm512_loadu_si512(p.add(at) as *const _);
                    let lo = _mm512_and_si512(v, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    for r in 0..R {
                        let x = s * QK_K + 64 * c + 4 * t;
                        il[r] = _mm512_dpbusd_epi32(il[r], lo, _mm512_set1_epi32(act4(&a[r], x)));
                        ih[r] =
                            _mm512_dpbusd_epi32(ih[r], hi, _mm512_set1_epi32(act4(&a[r], x + 32)));
                    }
                }
                let scl = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    p.add(AT_SC + 2 * c * LANES) as *const __m128i
                ));
                let sch = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    p.add(AT_SC + (2 * c + 1) * LANES) as *const __m128i
                ));
                for r in 0..R {
                    let v = _mm512_add_epi32(
                        _mm512_mullo_epi32(il[r], scl),
                        _mm512_mullo_epi32(ih[r], sch),
                    );
                    sumi[r] = _mm512_add_epi32(sumi[r], v);
                }
            }
            super_block_end(p, a, s, &sumi, &mut acc, &mut accm);
        }
        let mut out = [[0f32; LANES]; R];
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_sub_ps(acc[r], accm[r]));
        }
        out
    }

    /// The `amx` build for [`super::AMX_MIN_ROWS`] to 16 rows: per chunk of two sub-blocks,
    /// the nibbles split into two B tiles and two tile products give the 16 x rows integer sums of each sub-block;
    /// then the [`avx512`] build's integer scaling and float operations, so the same bits.
    ///
    /// # Safety
    /// An `amx` token; `group` holds `a[r].d.len()` super-blocks; `a` are rows of one
    /// activation buffer (checked) and `ys.len() == a.len()`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn amx(group: &[u8], a: &[ActRow<'_>], ys: &mut [[f32; LANES]]) {
        let nsb = a[0].d.len();
        let rows = a.len();
        let stride = amx::row_stride(a.iter().map(|r| r.q));
        let tiles = amx::Tiles::configure(rows);
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); amx::ROWS];
        let mut accm = [_mm512_setzero_ps(); amx::ROWS];
        let mut c = amx::CTiles([[0; 16]; 2 * amx::ROWS]);
        let mut bt = amx::BTiles([0; 2 * amx::B_BYTES]);
        for s in 0..nsb {
            let p = group.as_ptr().add(s * BLOCK);
            let mut sumi = [_mm512_setzero_si512(); amx::ROWS];
            for ch in 0..4 {
                let dst = bt.0.as_mut_ptr();
                for t in 0..8 {
                    let at = AT_Q + (8 * ch + t) * 4 * LANES;
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at + PREFETCH) as *const i8);
                    let v = _mm512_loadu_si512(p.add(at) as *const _);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    _mm512_storeu_si512(dst.add(64 * t) as *mut _, _mm512_and_si512(v, m4));
                    _mm512_storeu_si512(dst.add(amx::B_BYTES + 64 * t) as *mut _, hi);
                }
                let x = a[0].q.as_ptr().add(s * QK_K + 64 * ch);
                let b = [dst as *const u8, dst.add(amx::B_BYTES) as *const u8];
                tiles.dot2(false, &mut c, [x, x.add(32)], stride, b);
                let scl = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    p.add(AT_SC + 2 * ch * LANES) as *const __m128i
                ));
                let sch = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    p.add(AT_SC + (2 * ch + 1) * LANES) as *const __m128i,
                ));
                for (r, sumi) in sumi[..rows].iter_mut().enumerate() {
                    let il = _mm512_load_si512(c.0.as_ptr().add(r) as *const _);
                    let ih = _mm512_load_si512(c.0.as_ptr().add(amx::ROWS + r) as *const _);
                    let v =
                        _mm512_add_epi32(_mm512_mullo_epi32(il, scl), _mm512_mullo_epi32(ih, sch));
                    *sumi = _mm512_add_epi32(*sumi, v);
                }
            }
            super_block_end(p, a, s, &sumi[..rows], &mut acc, &mut accm);
        }
        drop(tiles);
        for (r, y) in ys.iter_mut().enumerate() {
            _mm512_storeu_ps(y.as_mut_ptr(), _mm512_sub_ps(acc[r], accm[r]));
        }
    }

    /// Per 32-bit lane the 16-bit pair `(v, v)` of the 8 bytes at `p` (lanes `8h..8h+8` of a
    /// sub-block's scales): `vpmaddwd` by it multiplies a lane's two 16-bit sums by `v`.
    #[inline(always)]
    unsafe fn pair16(p: *const u8) -> __m256i {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(v, _mm256_slli_epi32(v, 16))
    }

    /// Per 32-bit lane the 16-bit pair `(m[2i], m[2i+1])` of two sub-blocks' mins (8 lanes
    /// each at `p` and `p + LANES`).
    #[inline(always)]
    unsafe fn mins16(p: *const u8) -> __m256i {
        let lo = _mm_loadl_epi64(p as *const __m128i);
        let hi = _mm_loadl_epi64(p.add(LANES) as *const __m128i);
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi))
    }

    /// 8 lanes per register (two passes per group). A sub-block's 8 `vpmaddubsw` (4-bit weight
    /// times 8-bit activation pairs, |Σ| ≤ 8 · 2 · 15 · 127 = 30480: no saturation) add up in
    /// 16 bits, then one `vpmaddwd` by the lane's scale widens and scales them; the mins term
    /// takes two sub-blocks per `vpmaddwd` (|bsum| ≤ 32 · 127 fits 16 bits). Up to 4 rows take
    /// both sub-blocks of a weight vector at once; 5 to 8 rows one sub-block at a time, so that
    /// their 16-bit sums fit the 16 registers. The same exact integers as the other builds.
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
        let mut out = [[0f32; LANES]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            let mut accm = [_mm256_setzero_ps(); R];
            for s in 0..nsb {
                let p = group.as_ptr().add(s * BLOCK);
                let mut sumi = [_mm256_setzero_si256(); R];
                if R <= 4 {
                    // Both sub-blocks of a chunk from one load of the weight vector.
                    for c in 0..4 {
                        let mut pl = [_mm256_setzero_si256(); R];
                        let mut ph = [_mm256_setzero_si256(); R];
                        for t in 0..8 {
                            let at = AT_Q + (8 * c + t) * 4 * LANES + 32 * h;
                            if h == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    p.wrapping_add(at + PREFETCH) as *const i8
                                );
                            }
                            let v = _mm256_loadu_si256(p.add(at) as *const __m256i);
                            let lo = _mm256_and_si256(v, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                            let x = s * QK_K + 64 * c + 4 * t;
                            for r in 0..R {
                                let xl = _mm256_set1_epi32(act4(&a[r], x));
                                let xh = _mm256_set1_epi32(act4(&a[r], x + 32));
                                pl[r] = _mm256_add_epi16(pl[r], _mm256_maddubs_epi16(lo, xl));
                                ph[r] = _mm256_add_epi16(ph[r], _mm256_maddubs_epi16(hi, xh));
                            }
                        }
                        let scl = pair16(p.add(AT_SC + 2 * c * LANES + 8 * h));
                        let sch = pair16(p.add(AT_SC + (2 * c + 1) * LANES + 8 * h));
                        for r in 0..R {
                            let v = _mm256_add_epi32(
                                _mm256_madd_epi16(pl[r], scl),
                                _mm256_madd_epi16(ph[r], sch),
                            );
                            sumi[r] = _mm256_add_epi32(sumi[r], v);
                        }
                    }
                } else {
                    // One sub-block at a time (low nibbles of chunk c, then high): up to 8 rows'
                    // 16-bit sums stay in registers beside the weight vector.
                    for sub in 0..8 {
                        let (c, high) = (sub / 2, sub % 2 == 1);
                        let mut p16 = [_mm256_setzero_si256(); R];
                        for t in 0..8 {
                            let at = AT_Q + (8 * c + t) * 4 * LANES + 32 * h;
                            if h == 0 && !high {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    p.wrapping_add(at + PREFETCH) as *const i8
                                );
                            }
                            let v = _mm256_loadu_si256(p.add(at) as *const __m256i);
                            let w = match high {
                                false => _mm256_and_si256(v, m4),
                                true => _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            };
                            let x = s * QK_K + 32 * sub + 4 * t;
                            for r in 0..R {
                                let xa = _mm256_set1_epi32(act4(&a[r], x));
                                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(w, xa));
                            }
                        }
                        let sc = pair16(p.add(AT_SC + sub * LANES + 8 * h));
                        for r in 0..R {
                            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p16[r], sc));
                        }
                    }
                }
                let mut summ = [_mm256_setzero_si256(); R];
                for i in 0..4 {
                    let mn = mins16(p.add(AT_M + 2 * i * LANES + 8 * h));
                    for r in 0..R {
                        let (b0, b1) = (bsum32(&a[r], s, 2 * i), bsum32(&a[r], s, 2 * i + 1));
                        let b = _mm256_set1_epi32((b0 & 0xFFFF) | (b1 << 16));
                        summ[r] = _mm256_add_epi32(summ[r], _mm256_madd_epi16(mn, b));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i));
                let dmin =
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * LANES + 16 * h) as *const __m128i));
                for r in 0..R {
                    let da = _mm256_set1_ps(*a[r].d.get_unchecked(s));
                    let (sd, sm) = (_mm256_mul_ps(d, da), _mm256_mul_ps(dmin, da));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), sd, acc[r]);
                    accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ[r]), sm, accm[r]);
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(
                    out[r].as_mut_ptr().add(8 * h),
                    _mm256_sub_ps(acc[r], accm[r]),
                );
            }
        }
        out
    }
}
