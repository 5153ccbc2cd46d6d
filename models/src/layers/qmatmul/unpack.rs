//! Unpacking of GGUF weight blocks into one common form, [`Block`]: 32 signed 8-bit values
//! with a scale per group of 16 and an additive min, `w[i] = scale[i / 4 lane] * q[i] + min`.
//!
//! Every supported type maps onto it exactly (integers stay integers), so one dot kernel serves
//! them all. Layouts follow ggml (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`):
//!
//! ```text
//!  Q4_0  {f16 d, u8 qs[16]}                        w = d*(q - 8)        q in 0..15
//!  Q4_1  {f16 d, f16 m, u8 qs[16]}                 w = d*q + m          q in 0..15
//!  Q5_0  {f16 d, u8 qh[4], u8 qs[16]}              w = d*(q - 16)       q in 0..31
//!  Q8_0  {f16 d, i8 qs[32]}                        w = d*q
//! ```
//!
//! The k-quants (`Q4_K`, `Q6_K`) take another path, with integer sums across their 256-weight
//! super-blocks: [`super::kquant`].

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
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q8_0
    )
}

/// Whether blocks of `dtype` carry a non-zero `min`.
pub(super) fn has_min(dtype: GgmlDType) -> bool {
    dtype == GgmlDType::Q4_1
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
    let bytes = row.len() / out.len();
    for (src, dst) in row.chunks_exact(bytes).zip(out) {
        match dtype {
            GgmlDType::Q4_0 => q4_0(src, dst),
            GgmlDType::Q4_1 => q4_1(src, dst),
            GgmlDType::Q5_0 => q5_0(src, dst),
            _ => q8_0(src, dst),
        }
    }
}

#[inline(always)]
fn q4_0(src: &[u8], b: &mut Block) {
    let (lo, hi) = b.q.split_at_mut(QK / 2);
    for ((l, h), &x) in lo.iter_mut().zip(hi).zip(&src[2..18]) {
        *l = (x & 0x0F) as i8 - 8;
        *h = (x >> 4) as i8 - 8;
    }
    let d = f16_at(src, 0);
    b.finish(d, d, 0.0);
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

/// The same unpacking with AVX2 intrinsics, one block at a time in registers ([`x86::Kind`]):
/// the buffered multi-row path stores the blocks, the decode kernels in `fused` dot them
/// directly. Bit-identical to the portable build (tested).
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{Block, GgmlDType};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead of the block being unpacked.
    const PREFETCH: usize = 768;

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; the invariants of [`super::unpack_row`] hold.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn unpack_row(dtype: GgmlDType, row: &[u8], out: &mut [Block]) {
        match dtype {
            GgmlDType::Q4_0 => unpack_kind::<Q4_0>(row, out),
            GgmlDType::Q4_1 => unpack_kind::<Q4_1>(row, out),
            GgmlDType::Q5_0 => unpack_kind::<Q5_0>(row, out),
            _ => unpack_kind::<Q8_0>(row, out),
        }
    }

    #[inline(always)]
    unsafe fn unpack_kind<K: Kind>(row: &[u8], out: &mut [Block]) {
        for_each_block::<K>(row, out.len(), |b, _, w| store(&mut out[b], w));
    }

    /// Calls `f(b, b % 2, block b)` for the `n` 32-element blocks of a weight row of kind `K`,
    /// in order, prefetching the weight stream [`PREFETCH`] bytes ahead. The parity is a
    /// constant per unrolled position (`K::PER` is even), so callers can index by it freely.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `row` holds `n` blocks of kind `K`.
    #[inline(always)]
    pub(in super::super) unsafe fn for_each_block<K: Kind>(
        row: &[u8],
        n: usize,
        mut f: impl FnMut(usize, usize, Reg),
    ) {
        let base = row.as_ptr();
        let units = n / K::PER;
        let mut fetched = 0;
        for u in 0..units {
            while fetched < (u + 1) * K::BYTES + PREFETCH {
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(fetched) as *const i8);
                fetched += 64;
            }
            let p = base.add(u * K::BYTES);
            for j in 0..K::PER {
                f(u * K::PER + j, j % 2, K::get(p, j));
            }
        }
        if units * K::PER != n {
            // An odd count of 32-element blocks: the last one, at an even index.
            f(n - 1, 0, K::get(base.add(units * K::BYTES), 0));
        }
    }

    /// Byte i is 0xFF where bit i of `x` is set, else 0 (ggml's `bytes_from_bits_32`).
    #[inline(always)]
    unsafe fn bytes_from_bits(x: u32) -> __m256i {
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
    unsafe fn f16(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Writes a block in registers, with the derived fields of [`Block`].
    #[inline(always)]
    unsafe fn store(b: &mut Block, w: Reg) {
        _mm256_store_si256(b.q.as_mut_ptr() as *mut __m256i, w.q);
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), w.q);
        let corr = _mm256_madd_epi16(pairs, _mm256_set1_epi16(-128));
        _mm256_store_si256(b.neg_corr.as_mut_ptr() as *mut __m256i, corr);
        _mm256_store_ps(b.scale.as_mut_ptr(), w.sc);
        b.min = w.min;
    }

    /// One unpacked block in registers: `w[i] = sc[i / 4] * q[i] + min`.
    #[derive(Clone, Copy)]
    pub(in super::super) struct Reg {
        pub q: __m256i,
        pub sc: __m256,
        pub min: f32,
    }

    /// A GGUF block type, read in units of `PER` 32-element blocks (`BYTES` bytes).
    pub(in super::super) trait Kind {
        const PER: usize;
        const BYTES: usize;
        /// Whether blocks carry a non-zero `min`.
        const MIN: bool;
        /// Block `j` (`< PER`) of the unit at `p`.
        ///
        /// # Safety
        /// AVX2, FMA and F16C are available; `p..p + BYTES` is readable.
        unsafe fn get(p: *const u8, j: usize) -> Reg;
    }

    #[inline(always)]
    unsafe fn reg(q: __m256i, lo: f32, hi: f32, min: f32) -> Reg {
        Reg {
            q,
            sc: _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)),
            min,
        }
    }

    /// Low nibbles of 16 bytes in lanes 0..16, high nibbles in lanes 16..32.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let qs = _mm_loadu_si128(p as *const __m128i);
        let m4 = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(qs, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        _mm256_set_m128i(hi, lo)
    }

    /// `{f16 d, u8 qs[16]}`, two blocks per unit, centred by -8.
    pub(in super::super) struct Q4_0;
    impl Kind for Q4_0 {
        const PER: usize = 2;
        const BYTES: usize = 2 * 18;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn get(p: *const u8, j: usize) -> Reg {
            let p = p.add(18 * j);
            let d = f16(p);
            reg(
                _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)),
                d,
                d,
                0.0,
            )
        }
    }

    /// `{f16 d, f16 m, u8 qs[16]}`, two blocks per unit.
    pub(in super::super) struct Q4_1;
    impl Kind for Q4_1 {
        const PER: usize = 2;
        const BYTES: usize = 2 * 20;
        const MIN: bool = true;
        #[inline(always)]
        unsafe fn get(p: *const u8, j: usize) -> Reg {
            let p = p.add(20 * j);
            let d = f16(p);
            reg(nibbles(p.add(4)), d, d, f16(p.add(2)))
        }
    }

    /// `{f16 d, u8 qh[4], u8 qs[16]}`: element i takes bit i of qh as its 5th bit, centred by -16.
    pub(in super::super) struct Q5_0;
    impl Kind for Q5_0 {
        const PER: usize = 2;
        const BYTES: usize = 2 * 22;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn get(p: *const u8, j: usize) -> Reg {
            let p = p.add(22 * j);
            let qh = u32::from_le_bytes([*p.add(2), *p.add(3), *p.add(4), *p.add(5)]);
            let fifth = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
            let q = _mm256_or_si256(nibbles(p.add(6)), fifth);
            let d = f16(p);
            reg(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, d, 0.0)
        }
    }

    /// `{f16 d, i8 qs[32]}`.
    pub(in super::super) struct Q8_0;
    impl Kind for Q8_0 {
        const PER: usize = 2;
        const BYTES: usize = 2 * 34;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn get(p: *const u8, j: usize) -> Reg {
            let p = p.add(34 * j);
            let d = f16(p);
            reg(_mm256_loadu_si256(p.add(2) as *const __m256i), d, d, 0.0)
        }
    }
}
