//! Unpacking of GGUF weight blocks into one common form, [`Block`]: 32 signed 8-bit values
//! with a scale per group of 16 and an additive min, `w[i] = scale[i / 4 lane] * q[i] + min`.
//!
//! Every supported type maps onto it exactly (integers stay integers), so one dot kernel serves
//! them all. Layouts follow ggml (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`):
//!
//! ```text
//!  Q4_1  {f16 d, f16 m, u8 qs[16]}                 w = d*q + m          q in 0..15
//!  Q5_0  {f16 d, u8 qh[4], u8 qs[16]}              w = d*(q - 16)       q in 0..31
//!  Q8_0  {f16 d, i8 qs[32]}                        w = d*q
//!  Q4_K  256 = 8 x 32 {f16 d, f16 dmin, u8 scales[12], u8 qs[128]}
//!                                                  w = d*sc_j*q - dmin*m_j   (6-bit sc, m)
//!  Q6_K  256 = 16 x 16 {u8 ql[128], u8 qh[64], i8 scales[16], f16 d}
//!                                                  w = d*sc_j*(q - 32)  q in 0..63
//! ```

use candle_core::quantized::GgmlDType;
use half::f16;

/// Elements per [`Block`] (and per activation block).
pub(super) const QK: usize = 32;

/// One weight block in the common form read by the dot kernels.
///
/// # Invariants
/// `neg_corr[l] = -128 * Σ q[4l..4l+4]` (the VNNI kernel feeds activations offset by +128), and
/// `scale[0..4]` / `scale[4..8]` are the scales of elements `0..16` / `16..32`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub(super) struct Block {
    pub q: [i8; QK],
    pub neg_corr: [i32; 8],
    pub scale: [f32; 8],
    pub min: f32,
}

impl Block {
    /// Fills the derived fields from `q`, the two half scales and the min.
    #[inline(always)]
    fn finish(&mut self, lo: f32, hi: f32, min: f32) {
        for (l, c) in self.neg_corr.iter_mut().enumerate() {
            let s: i32 = self.q[4 * l..4 * l + 4].iter().map(|&x| x as i32).sum();
            *c = -128 * s;
        }
        self.scale = [lo, lo, lo, lo, hi, hi, hi, hi];
        self.min = min;
    }
}

/// Whether [`unpack_row`] handles this type.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q8_0 | GgmlDType::Q4K | GgmlDType::Q6K
    )
}

/// Whether blocks of `dtype` carry a non-zero `min`.
pub(super) fn has_min(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q4K)
}

/// Elements per stored block of `dtype` (32, or 256 for the k-quants).
pub(super) fn block_elems(dtype: GgmlDType) -> usize {
    match dtype {
        GgmlDType::Q4K | GgmlDType::Q6K => 256,
        _ => QK,
    }
}

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Unpacks one weight row (`row`: the raw bytes of `out.len() * 32` elements) into `out`.
///
/// # Invariants
/// `dtype` is [`supports`]-ed and `row.len()` matches `out.len()` (checked by the caller).
pub(super) fn unpack_row(dtype: GgmlDType, row: &[u8], out: &mut [Block]) {
    let per = block_elems(dtype) / QK;
    let bytes = row.len() / (out.len() / per);
    for (src, dst) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(per)) {
        match dtype {
            GgmlDType::Q4_1 => q4_1(src, &mut dst[0]),
            GgmlDType::Q5_0 => q5_0(src, &mut dst[0]),
            GgmlDType::Q8_0 => q8_0(src, &mut dst[0]),
            GgmlDType::Q4K => q4k(src, dst),
            _ => q6k(src, dst),
        }
    }
}

#[inline(always)]
fn q4_1(src: &[u8], b: &mut Block) {
    let (lo, hi) = b.q.split_at_mut(QK / 2);
    for ((l, h), &x) in lo.iter_mut().zip(hi).zip(&src[4..20]) {
        *l = (x & 0x0F) as i8;
        *h = (x >> 4) as i8;
    }
    let d = f16_at(src, 0);
    b.finish(d, d, f16_at(src, 2));
}

/// The 5th bit of element `j` is bit `j` of `qh`; values are centred by -16.
#[inline(always)]
fn q5_0(src: &[u8], b: &mut Block) {
    let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
    let (lo, hi) = b.q.split_at_mut(QK / 2);
    for (j, ((l, h), &x)) in lo.iter_mut().zip(hi).zip(&src[6..22]).enumerate() {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        *l = ((x & 0x0F) | h0) as i8 - 16;
        *h = ((x >> 4) | h1) as i8 - 16;
    }
    let d = f16_at(src, 0);
    b.finish(d, d, 0.0);
}

#[inline(always)]
fn q8_0(src: &[u8], b: &mut Block) {
    for (q, &x) in b.q.iter_mut().zip(&src[2..34]) {
        *q = x as i8;
    }
    let d = f16_at(src, 0);
    b.finish(d, d, 0.0);
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a Q4_K block.
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Sub-block `2i` holds the low nibbles of `qs[32i..32i+32]`, sub-block `2i+1` the high ones.
#[inline(always)]
fn q4k(src: &[u8], out: &mut [Block]) {
    let d = f16_at(src, 0);
    let dmin = f16_at(src, 2);
    let scales = &src[4..16];
    let qs = &src[16..144];
    for (i, pair) in out.chunks_exact_mut(2).enumerate() {
        let q = &qs[32 * i..32 * i + 32];
        let (lo, hi) = pair.split_at_mut(1);
        for (l, &x) in q.iter().enumerate() {
            lo[0].q[l] = (x & 0x0F) as i8;
            hi[0].q[l] = (x >> 4) as i8;
        }
        let (sc, m) = scale_min_k4(2 * i, scales);
        lo[0].finish(d * sc as f32, d * sc as f32, -dmin * m as f32);
        let (sc, m) = scale_min_k4(2 * i + 1, scales);
        hi[0].finish(d * sc as f32, d * sc as f32, -dmin * m as f32);
    }
}

/// Each 128-element half: `ql[64]`, `qh[32]`, 8 scales; element `l + 32t` (t in 0..4) takes
/// nibble `t / 2` of `ql[l + 32 (t % 2)]` and bits `2t..2t+2` of `qh[l]`.
#[inline(always)]
fn q6k(src: &[u8], out: &mut [Block]) {
    let d = f16_at(src, 208);
    for (half, blocks) in out.chunks_exact_mut(4).enumerate() {
        let ql = &src[64 * half..64 * half + 64];
        let qh = &src[128 + 32 * half..128 + 32 * half + 32];
        let sc = &src[192 + 8 * half..192 + 8 * half + 8];
        for (t, b) in blocks.iter_mut().enumerate() {
            let ql = &ql[32 * (t % 2)..32 * (t % 2) + 32];
            let shift = 4 * (t / 2);
            for l in 0..QK {
                let low = (ql[l] >> shift) & 0x0F;
                let high = ((qh[l] >> (2 * t)) & 3) << 4;
                b.q[l] = (low | high) as i8 - 32;
            }
            let lo = d * (sc[2 * t] as i8) as f32;
            let hi = d * (sc[2 * t + 1] as i8) as f32;
            b.finish(lo, hi, 0.0);
        }
    }
}

/// The same unpacking with AVX2 intrinsics (bit-identical blocks; tested against the scalar
/// build).
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{scale_min_k4, Block, GgmlDType, QK};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead of the block being unpacked.
    pub(in super::super) const PREFETCH: usize = 768;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; the invariants of [`super::unpack_row`] hold.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn unpack_row(dtype: GgmlDType, row: &[u8], out: &mut [Block]) {
        let per = super::block_elems(dtype) / QK;
        let bytes = row.len() / (out.len() / per);
        let base = row.as_ptr();
        let mut fetched = 0;
        for (i, (src, dst)) in row
            .chunks_exact(bytes)
            .zip(out.chunks_exact_mut(per))
            .enumerate()
        {
            while fetched < (i + 1) * bytes + PREFETCH {
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(fetched) as *const i8);
                fetched += 64;
            }
            let p = src.as_ptr();
            match dtype {
                GgmlDType::Q4_1 => {
                    let qs = _mm_loadu_si128(p.add(4) as *const __m128i);
                    let m4 = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(qs, m4);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
                    let d = f16(p);
                    store(&mut dst[0], _mm256_set_m128i(hi, lo), d, d, f16(p.add(2)));
                }
                GgmlDType::Q5_0 => {
                    let qs = _mm_loadu_si128(p.add(6) as *const __m128i);
                    let m4 = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(qs, m4);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
                    // Element i takes bit i of qh as its 5th bit.
                    let qh = u32::from_le_bytes([*p.add(2), *p.add(3), *p.add(4), *p.add(5)]);
                    let fifth = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
                    let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), fifth);
                    let d = f16(p);
                    store(
                        &mut dst[0],
                        _mm256_sub_epi8(q, _mm256_set1_epi8(16)),
                        d,
                        d,
                        0.0,
                    );
                }
                GgmlDType::Q8_0 => {
                    let d = f16(p);
                    let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
                    store(&mut dst[0], q, d, d, 0.0);
                }
                GgmlDType::Q4K => q4k(src, dst),
                GgmlDType::Q6K => q6k(src, dst),
                _ => super::unpack_row(dtype, src, dst),
            }
        }
    }

    /// Byte i is 0xFF where bit i of `x` is set, else 0 (ggml's `bytes_from_bits_32`).
    #[inline(always)]
    pub(in super::super) unsafe fn bytes_from_bits(x: u32) -> __m256i {
        let spread = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), spread);
        let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
    }

    #[inline(always)]
    pub(in super::super) unsafe fn f16(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Writes `q` and the derived fields of [`Block`].
    #[inline(always)]
    unsafe fn store(b: &mut Block, q: __m256i, lo: f32, hi: f32, min: f32) {
        _mm256_store_si256(b.q.as_mut_ptr() as *mut __m256i, q);
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
        let corr = _mm256_madd_epi16(pairs, _mm256_set1_epi16(-128));
        _mm256_store_si256(b.neg_corr.as_mut_ptr() as *mut __m256i, corr);
        let scale = _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
        _mm256_store_ps(b.scale.as_mut_ptr(), scale);
        b.min = min;
    }

    #[inline(always)]
    unsafe fn q4k(src: &[u8], out: &mut [Block]) {
        let p = src.as_ptr();
        let (d, dmin) = (f16(p), f16(p.add(2)));
        let scales = &src[4..16];
        let m4 = _mm256_set1_epi8(0x0F);
        for i in 0..4 {
            let x = _mm256_loadu_si256(p.add(16 + 32 * i) as *const __m256i);
            let (sc, m) = scale_min_k4(2 * i, scales);
            let s = d * sc as f32;
            store(
                &mut out[2 * i],
                _mm256_and_si256(x, m4),
                s,
                s,
                -dmin * m as f32,
            );
            let (sc, m) = scale_min_k4(2 * i + 1, scales);
            let s = d * sc as f32;
            let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            store(&mut out[2 * i + 1], hi, s, s, -dmin * m as f32);
        }
    }

    #[inline(always)]
    unsafe fn q6k(src: &[u8], out: &mut [Block]) {
        let p = src.as_ptr();
        let d = f16(p.add(208));
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        let bias = _mm256_set1_epi8(32);
        for half in 0..2 {
            let ql0 = _mm256_loadu_si256(p.add(64 * half) as *const __m256i);
            let ql1 = _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
            // Bits 2t..2t+2 of qh moved to bits 4..6 (16-bit shifts; the mask drops spill-over).
            let high = [
                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2),
                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2),
                _mm256_and_si256(qh, m2),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
            ];
            let low = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            ];
            let sc = &src[192 + 8 * half..192 + 8 * half + 8];
            for t in 0..4 {
                let q = _mm256_sub_epi8(_mm256_or_si256(low[t], high[t]), bias);
                let lo = d * (sc[2 * t] as i8) as f32;
                let hi = d * (sc[2 * t + 1] as i8) as f32;
                store(&mut out[4 * half + t], q, lo, hi, 0.0);
            }
        }
    }
}
