//! The decode step's kernels (one activation row, x86 SIMD builds): each 32-element weight
//! block is unpacked into registers and dotted at once, so the weight stream is read once and
//! nothing is written back. (The unpacked [`Block`](super::unpack::Block) the multi-row path
//! writes is 128 bytes per 32 weights; a Q4_K block is 18. On Qwen2.5-1.5B this took decode
//! from about 7 to 9.5 tokens/s on the 2-core dev box.)
//!
//! A verify chunk (several rows) still unpacks each weight row once into a buffer and reuses
//! it for every row: redoing the unpacking per row would cost more than the buffer. Both paths
//! compute, per block, the same eight integer lane sums and the same f32 operations in the same
//! order (see the `dot` module docs), so a decode step here is bit-identical to the same row
//! of a verify chunk there (`rows_do_not_depend_on_chunk_size` checks it for every type).
//!
//! ```text
//!  for each pair of blocks (b even, b + 1):          (Q4_K/Q6_K: 8 blocks per super-block)
//!    q, scales, min  <- unpack block b in registers  (bit-for-bit what `unpack` writes)
//!    acc[b % 2] += f32(lanes(q, q_a)) * (scales * d_a);   min[b % 2] += min_w * s_a
//! ```

use std::arch::x86_64::*;

use candle_core::quantized::GgmlDType;

use super::dot::x86::hsum;
use super::dot::{ActRow, Isa};
use super::unpack::x86::{bytes_from_bits, f16, PREFETCH};
use super::unpack::{scale_min_k4, QK};

/// One unpacked block in registers: `w[i] = sc[i / 4] * q[i] + min`.
#[derive(Clone, Copy)]
struct Reg {
    q: __m256i,
    sc: __m256,
    min: f32,
}

/// A GGUF block type, read in units of `PER` 32-element blocks (`BYTES` bytes).
trait Kind {
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

/// `{f16 d, f16 m, u8 qs[16]}`, two blocks per unit.
struct Q4_1;
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
struct Q5_0;
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
struct Q8_0;
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

/// `{f16 d, f16 dmin, u8 scales[12], u8 qs[128]}`: block `j` is the low (`j` even) or high
/// nibbles of `qs[32 (j / 2)..][..32]`.
struct Q4K;
impl Kind for Q4K {
    const PER: usize = 8;
    const BYTES: usize = 144;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn get(p: *const u8, j: usize) -> Reg {
        let (d, dmin) = (f16(p), f16(p.add(2)));
        let x = _mm256_loadu_si256(p.add(16 + 32 * (j / 2)) as *const __m256i);
        // Even blocks take the low nibbles, odd ones the high.
        let x = if j & 1 == 0 {
            x
        } else {
            _mm256_srli_epi16(x, 4)
        };
        let scales = std::slice::from_raw_parts(p.add(4), 12);
        let (sc, m) = scale_min_k4(j, scales);
        let s = d * sc as f32;
        reg(
            _mm256_and_si256(x, _mm256_set1_epi8(0x0F)),
            s,
            s,
            -dmin * m as f32,
        )
    }
}

/// `{u8 ql[128], u8 qh[64], i8 scales[16], f16 d}`: block `4 half + t` takes nibble `t / 2` of
/// `ql[64 half + 32 (t % 2)..]` and bits `2t..2t+2` of `qh[32 half..]`, centred by -32.
struct Q6K;
impl Kind for Q6K {
    const PER: usize = 8;
    const BYTES: usize = 210;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn get(p: *const u8, j: usize) -> Reg {
        let (half, t) = (j / 4, j % 4);
        let d = f16(p.add(208));
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        let ql = _mm256_loadu_si256(p.add(64 * half + 32 * (t % 2)) as *const __m256i);
        let low = if t < 2 {
            _mm256_and_si256(ql, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
        };
        let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
        // Bits 2t..2t+2 of qh moved to bits 4..6 (16-bit shifts; the mask drops spill-over).
        let high = match t {
            0 => _mm256_slli_epi16(qh, 4),
            1 => _mm256_slli_epi16(qh, 2),
            2 => qh,
            _ => _mm256_srli_epi16(qh, 2),
        };
        let q = _mm256_or_si256(low, _mm256_and_si256(high, m2));
        let sc = p.add(192 + 8 * half + 2 * t) as *const i8;
        let lo = d * (*sc) as f32;
        let hi = d * (*sc.add(1)) as f32;
        reg(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), lo, hi, 0.0)
    }
}

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
        let base = row.as_ptr();
        let units = n / <$k>::PER;
        let mut fetched = 0;
        for u in 0..units {
            while fetched < (u + 1) * <$k>::BYTES + PREFETCH {
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(fetched) as *const i8);
                fetched += 64;
            }
            let p = base.add(u * <$k>::BYTES);
            // PER is even: block parity is j's.
            for j in 0..<$k>::PER {
                block(u * <$k>::PER + j, j % 2, <$k>::get(p, j));
            }
        }
        if n % <$k>::PER != 0 {
            // An odd count of 32-element blocks: the last one, at an even index.
            block(n - 1, 0, <$k>::get(base.add(units * <$k>::BYTES), 0));
        }
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
    match isa {
        Isa::AvxVnni => avxvnni::<K>(row, a),
        Isa::Avx512Vnni => avx512vnni::<K>(row, a),
        _ => avx2::<K>(row, a),
    }
}

/// Weight row `row` (raw GGUF bytes of `dtype`) dotted with the activation row `a`.
///
/// # Safety
/// `isa` came from [`Isa::detect`] and is not [`Isa::Scalar`]; `dtype` is supported; `row`
/// holds exactly `32 * a.d.len()` weights.
pub(super) unsafe fn dot(isa: Isa, dtype: GgmlDType, row: &[u8], a: ActRow<'_>) -> f32 {
    match dtype {
        GgmlDType::Q4_1 => dot_kind::<Q4_1>(isa, row, a),
        GgmlDType::Q5_0 => dot_kind::<Q5_0>(isa, row, a),
        GgmlDType::Q8_0 => dot_kind::<Q8_0>(isa, row, a),
        GgmlDType::Q4K => dot_kind::<Q4K>(isa, row, a),
        _ => dot_kind::<Q6K>(isa, row, a),
    }
}
