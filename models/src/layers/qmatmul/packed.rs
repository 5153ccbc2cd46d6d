//! The 32-element block types (`Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`) repacked at load so that one
//! SIMD lane holds one weight row: 16 rows side by side per group, each output a lane of its
//! own, so no horizontal sums and one float multiply-add per 16 outputs and block (ggml's
//! `q4_0` 8x8 repack, in the same spirit).
//!
//! ```text
//!  group g = weight rows 16g..16g+16; per block b (32 weights), block_bytes apart:
//!    d[16] f16 | m[16] f16 (Q4_1 only) | data
//!    Q4_0/Q4_1 data: 4 chunks c of [16 lanes][4 bytes]: dword c of the row's 16 stored bytes
//!                    (low nibbles = elements 4c..4c+4, high nibbles = elements 16+4c..)
//!    Q5_0/Q8_0 data: 8 chunks c of [16 lanes][4 bytes]: elements 4c..4c+4 as bytes
//!                    (Q5_0 unsigned 0..31, Q8_0 signed)
//! ```
//!
//! Per output `(r, j)`, on every path, in this order:
//!
//! ```text
//!  for block b:  sumi = Σ_i q_w[j][32b + i] q_a[r][32b + i]          exact integer
//!                acc  = fma(f32(sumi), d_w[j][b] * d_a[r][b], acc)
//!                accm = fma(min_w[j][b], s_a[r][b], accm)            (types with a min)
//!  y = acc + accm
//! ```
//!
//! Every operation is per lane, so a row's bits depend neither on the other activation rows
//! of the call nor on the path: the AVX-512 (16 lanes, `vpdpbusd` zmm), AVX2 (8 lanes,
//! `vpmaddubsw` + `vpmaddwd`) and portable builds agree bit for bit. The 4- and 5-bit types
//! stay unsigned (`Q4_0`'s -8 and `Q5_0`'s -16 become the min `-8 d` / `-16 d`, exact), so
//! they are the unsigned side of the byte products; `Q8_0` takes the sign trick.

use candle_core::quantized::GgmlDType;
use half::f16;

#[cfg(target_arch = "x86_64")]
use super::groups::by_rows;
use super::groups::{rows_per_pass, Columns, Groups, LANES};
use super::ActRow;
use crate::layers::simd::Isa;
#[cfg(target_arch = "x86_64")]
use crate::layers::simd::Level;

/// Elements per block.
pub(super) const QK: usize = 32;

/// Fewest activation rows of a pass that the `amx` path runs on tiles: below it the tile setup
/// and the C tile's round trip through memory cost more than the VNNI kernels (CPU time on
/// SmolLM2 and Qwen 0.5B, ctx 256: 2 and 4 rows slower on tiles, 8 even, 16 faster); the
/// bits are the same either way.
pub(super) const AMX_MIN_ROWS: usize = 8;

/// Whether [`Packed::new`] takes this type.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q8_0
    )
}

/// How a type's blocks are stored once packed.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Format {
    /// Data as nibbles (4 chunks) rather than bytes (8 chunks).
    nibbles: bool,
    /// Byte values are signed (no min).
    signed: bool,
    /// A stored f16 min per row and block (after the scales).
    stored_min: bool,
    /// Else the min is `min_factor * d` (0 for none).
    min_factor: f32,
}

/// The formats of `Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`, in that order: the SIMD kernels take the
/// index as a const parameter, so each type's branches and block size fold away.
const FORMATS: [Format; 4] = [
    Format::new(true, false, false, -8.0),
    Format::new(true, false, true, 0.0),
    Format::new(false, false, false, -16.0),
    Format::new(false, true, false, 0.0),
];

impl Format {
    const fn new(nibbles: bool, signed: bool, stored_min: bool, min_factor: f32) -> Format {
        Format {
            nibbles,
            signed,
            stored_min,
            min_factor,
        }
    }

    /// The index of `dtype`'s format in [`FORMATS`].
    fn kind(dtype: GgmlDType) -> usize {
        match dtype {
            GgmlDType::Q4_0 => 0,
            GgmlDType::Q4_1 => 1,
            GgmlDType::Q5_0 => 2,
            _ => 3,
        }
    }

    fn of(dtype: GgmlDType) -> Format {
        FORMATS[Self::kind(dtype)]
    }

    const fn has_min(self) -> bool {
        self.stored_min || self.min_factor != 0.0
    }

    /// Offset of the data in a packed block.
    const fn data_at(self) -> usize {
        2 * LANES * (1 + self.stored_min as usize)
    }

    const fn chunks(self) -> usize {
        if self.nibbles {
            4
        } else {
            8
        }
    }

    const fn block_bytes(self) -> usize {
        self.data_at() + self.chunks() * 4 * LANES
    }
}

/// A `[n, k]` weight of a [`supports`]-ed type in the packed layout (see the module docs);
/// rows past `n` in the last group are zero.
pub(super) struct Packed {
    format: Format,
    /// `format`'s index in [`FORMATS`].
    kind: usize,
    groups: Groups,
}

/// Writes lane `lane` of the packed block `dst` from the GGUF block `src`.
fn pack_block(dtype: GgmlDType, format: Format, src: &[u8], lane: usize, dst: &mut [u8]) {
    dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
    if format.stored_min {
        dst[2 * LANES + 2 * lane..][..2].copy_from_slice(&src[2..4]);
    }
    let data = &mut dst[format.data_at()..];
    // Element i goes to chunk i / 4, byte i % 4 of the lane (for the nibble types, "element"
    // t < 16 is the stored byte t, holding elements t and 16 + t).
    let mut put = |i: usize, v: u8| data[(i / 4) * 4 * LANES + lane * 4 + i % 4] = v;
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => {
            for (t, &x) in src[src.len() - 16..].iter().enumerate() {
                put(t, x);
            }
        }
        GgmlDType::Q5_0 => {
            let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
            for t in 0..16 {
                let x = src[6 + t];
                put(t, (x & 0x0F) | (((qh >> t) & 1) << 4) as u8);
                put(16 + t, (x >> 4) | (((qh >> (16 + t)) & 1) << 4) as u8);
            }
        }
        _ => {
            for (i, &x) in src[2..34].iter().enumerate() {
                put(i, x);
            }
        }
    }
}

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]])
}

impl Packed {
    /// Repacks the raw GGUF bytes `raw` of a `[n, k]` weight of type `dtype` (`k` a multiple
    /// of 32, `raw` exactly `n * k / 32` blocks: checked by the caller).
    pub(super) fn new(dtype: GgmlDType, raw: &[u8], n: usize, k: usize) -> Packed {
        let format = Format::of(dtype);
        let nb = k / QK;
        let src_bytes = dtype.type_size();
        let groups = Groups::pack(n, k, QK, format.block_bytes(), |j, b, dst| {
            let src = &raw[(j * nb + b) * src_bytes..][..src_bytes];
            pack_block(dtype, format, src, j % LANES, dst);
        });
        Packed {
            format,
            kind: Format::kind(dtype),
            groups,
        }
    }

    /// The weight made of rows `ids` (row `i` is row `ids[i]`, bit for bit: lanes are copied).
    /// Every id is below [`Packed::rows`] (checked by the caller).
    pub(super) fn select_rows(&self, ids: &[usize]) -> Packed {
        let f = self.format;
        let mut spans = vec![(0, 2)];
        if f.stored_min {
            spans.push((2 * LANES, 2));
        }
        spans.extend((0..f.chunks()).map(|c| (f.data_at() + c * 4 * LANES, 4)));
        Packed {
            format: f,
            kind: self.kind,
            groups: self.groups.select(ids, &spans),
        }
    }

    /// Output rows (the weight's `n`).
    pub(super) fn rows(&self) -> usize {
        self.groups.rows()
    }

    /// Input width (the weight's `k`).
    pub(super) fn cols(&self) -> usize {
        self.groups.cols()
    }

    /// Weight row `j` as f32 (`d * q + min`), read back from the packed layout.
    #[cfg(test)]
    pub(super) fn dequantize_row(&self, j: usize) -> Vec<f32> {
        let f = self.format;
        let lane = j % LANES;
        let mut out = Vec::with_capacity(self.cols());
        for blk in self.groups.blocks_of(j) {
            let d = f16_at(blk, 2 * lane).to_f32();
            let min = match f.stored_min {
                true => f16_at(blk, 2 * LANES + 2 * lane).to_f32(),
                false => d * f.min_factor,
            };
            out.extend((0..QK).map(|i| d * weight(f, &blk[f.data_at()..], lane, i) as f32 + min));
        }
        out
    }

    /// `out[r, j] = y[r, j]` for the weight rows of groups `g0..` whose columns `out` owns
    /// (see [`Groups::rows_task`]), against the activation rows `acts`.
    pub(super) fn rows_task(&self, isa: Isa, acts: &[ActRow<'_>], g0: usize, out: &mut Columns) {
        let (f, kind) = (self.format, self.kind);
        self.groups
            .rows_task(acts, rows_per_pass(isa), g0, out, |group, a, ys| {
                group_dot(isa, f, kind, group, a, ys)
            });
    }
}

/// `ys[r]` = the 16 outputs of one group against activation row `a[r]` (`a.len() == ys.len()
/// <= MAX_ROWS`). `kind` is `f`'s index in [`FORMATS`].
fn group_dot(
    isa: Isa,
    f: Format,
    kind: usize,
    group: &[u8],
    a: &[ActRow<'_>],
    ys: &mut [[f32; LANES]],
) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: an `Isa` token proves its level's features; `group` holds the blocks of the
        // rows' width (the caller checked `k`).
        macro_rules! rows {
            ($kernel:ident, $k:literal) => {
                unsafe {
                    by_rows!(a, ys, |R| x86::$kernel::<R, $k>(
                        group,
                        a.try_into().unwrap()
                    ))
                }
            };
        }
        macro_rules! go {
            ($kernel:ident) => {
                match kind {
                    0 => rows!($kernel, 0),
                    1 => rows!($kernel, 1),
                    2 => rows!($kernel, 2),
                    _ => rows!($kernel, 3),
                }
            };
        }
        match isa.level() {
            // SAFETY: an `Amx` token proves AVX-512 and the granted tiles.
            Level::Amx if a.len() >= AMX_MIN_ROWS => unsafe {
                return match kind {
                    0 => x86::amx::<0>(group, a, ys),
                    1 => x86::amx::<1>(group, a, ys),
                    2 => x86::amx::<2>(group, a, ys),
                    _ => x86::amx::<3>(group, a, ys),
                };
            },
            Level::Avx512 | Level::Amx => return go!(avx512),
            Level::Avx2 | Level::AvxVnni => return go!(avx2),
            Level::Scalar => {}
        }
    }
    let _ = (isa, kind);
    for (y, r) in ys.iter_mut().zip(a) {
        *y = scalar(f, group, *r);
    }
}

/// Element `i` of lane `j` in a packed block's `data`.
#[inline(always)]
fn weight(f: Format, data: &[u8], j: usize, i: usize) -> i32 {
    match f.nibbles {
        true => {
            let byte = data[(i % 16 / 4) * 4 * LANES + j * 4 + i % 4];
            (if i < 16 { byte & 0x0F } else { byte >> 4 }) as i32
        }
        false => {
            let byte = data[(i / 4) * 4 * LANES + j * 4 + i % 4];
            match f.signed {
                true => byte as i8 as i32,
                false => byte as i32,
            }
        }
    }
}

/// The portable build (the same operations per lane as the SIMD builds).
fn scalar(f: Format, group: &[u8], a: ActRow<'_>) -> [f32; LANES] {
    let bb = f.block_bytes();
    let mut acc = [0f32; LANES];
    let mut accm = [0f32; LANES];
    for (b, blk) in group.chunks_exact(bb).enumerate() {
        let data = &blk[f.data_at()..];
        let qa = &a.q[b * QK..(b + 1) * QK];
        for j in 0..LANES {
            let sumi: i32 = (qa.iter().enumerate())
                .map(|(i, &x)| weight(f, data, j, i) * x as i32)
                .sum();
            let d = f16_at(blk, 2 * j).to_f32();
            acc[j] = (sumi as f32).mul_add(d * a.d[b], acc[j]);
            if f.has_min() {
                let mw = match f.stored_min {
                    true => f16_at(blk, 2 * LANES + 2 * j).to_f32(),
                    false => d * f.min_factor,
                };
                accm[j] = mw.mul_add(a.s[b], accm[j]);
            }
        }
    }
    std::array::from_fn(|j| acc[j] + accm[j])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::amx;
    use super::super::groups::{MAX_ROWS, ROWS};
    use super::{ActRow, FORMATS, LANES, QK};
    use std::arch::x86_64::*;

    /// Bytes of the weight stream requested ahead of the block being read.
    const PREFETCH: usize = 1024;

    const _: () = assert!(amx::ROWS <= MAX_ROWS && ROWS <= MAX_ROWS);

    /// The dword of activation bytes `4c..4c+4` of block `b`.
    #[inline(always)]
    unsafe fn act4(a: &ActRow<'_>, b: usize, c: usize) -> i32 {
        (a.q.as_ptr().add(b * QK + 4 * c) as *const i32).read_unaligned()
    }

    /// 16 lanes per register, `vpdpbusd` on zmm.
    ///
    /// # Safety
    /// AVX-512F/BW/VL/VNNI, AVX2, FMA and F16C; `group` holds `a[r].d.len()` blocks of `f`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn avx512<const R: usize, const K: usize>(
        group: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [[f32; LANES]; R] {
        let f = const { FORMATS[K] };
        let bb = const { FORMATS[K].block_bytes() };
        let nb = a[0].d.len();
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut accm = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let p = group.as_ptr().add(b * bb);
            for line in (0..bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + line) as *const i8);
            }
            let q = p.add(f.data_at());
            let mut isum = [_mm512_setzero_si512(); R];
            if f.nibbles {
                for c in 0..4 {
                    let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let lo = _mm512_and_si512(v, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    for r in 0..R {
                        let xl = _mm512_set1_epi32(act4(&a[r], b, c));
                        let xh = _mm512_set1_epi32(act4(&a[r], b, c + 4));
                        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, xl);
                        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, xh);
                    }
                }
            } else {
                for c in 0..8 {
                    let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let (u, neg) = match f.signed {
                        true => (_mm512_abs_epi8(v), _mm512_movepi8_mask(v)),
                        false => (v, 0),
                    };
                    for r in 0..R {
                        let x = _mm512_set1_epi32(act4(&a[r], b, c));
                        let x = match f.signed {
                            true => _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x),
                            false => x,
                        };
                        isum[r] = _mm512_dpbusd_epi32(isum[r], u, x);
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            let mw = match f.stored_min {
                true => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * LANES) as *const __m256i)),
                false => _mm512_mul_ps(d, _mm512_set1_ps(f.min_factor)),
            };
            for r in 0..R {
                let s = _mm512_mul_ps(d, _mm512_set1_ps(*a[r].d.get_unchecked(b)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
                if f.has_min() {
                    let sa = _mm512_set1_ps(*a[r].s.get_unchecked(b));
                    accm[r] = _mm512_fmadd_ps(mw, sa, accm[r]);
                }
            }
        }
        let mut out = [[0f32; LANES]; R];
        for r in 0..R {
            _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_add_ps(acc[r], accm[r]));
        }
        out
    }

    /// The `amx` build for [`super::AMX_MIN_ROWS`] to 16 rows: per block, one tile product
    /// gives the 16 x rows integer sums (the nibble types unpacked into a B tile first; `Q5_0`/`Q8_0` blocks are B
    /// tiles as packed), then the [`avx512`] build's float operations in its order, so the
    /// same bits.
    ///
    /// # Safety
    /// An `amx` token; `group` holds `a[r].d.len()` blocks of `f`; `a` are rows of one
    /// activation buffer (checked) and `ys.len() == a.len()`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn amx<const K: usize>(
        group: &[u8],
        a: &[ActRow<'_>],
        ys: &mut [[f32; LANES]],
    ) {
        let f = const { FORMATS[K] };
        let bb = const { FORMATS[K].block_bytes() };
        let nb = a[0].d.len();
        let rows = a.len();
        let stride = amx::row_stride(a.iter().map(|r| r.q));
        let tiles = amx::Tiles::configure(rows);
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); amx::ROWS];
        let mut accm = [_mm512_setzero_ps(); amx::ROWS];
        let mut c = amx::CTiles([[0; 16]; 2 * amx::ROWS]);
        let mut bt = amx::BTiles([0; 2 * amx::B_BYTES]);
        let mut b = 0;
        while b < nb {
            let pair = b + 1 < nb;
            // The B tile of block `b + i`: the nibbles split into 8 rows of bytes, else the
            // packed data itself.
            let mut b_tile = |i: usize| {
                let p = group.as_ptr().add((b + i) * bb);
                for line in (0..bb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + line) as *const i8);
                }
                let q = p.add(f.data_at());
                if !f.nibbles {
                    return q;
                }
                let dst = bt.0.as_mut_ptr().add(i * amx::B_BYTES);
                for c in 0..4 {
                    let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    _mm512_storeu_si512(dst.add(64 * c) as *mut _, _mm512_and_si512(v, m4));
                    _mm512_storeu_si512(dst.add(64 * (c + 4)) as *mut _, hi);
                }
                dst as *const u8
            };
            let act = |i: usize| a[0].q.as_ptr().add((b + i) * QK);
            if pair {
                let bs = [b_tile(0), b_tile(1)];
                tiles.dot2(f.signed, &mut c, [act(0), act(1)], stride, bs);
            } else {
                let b0 = b_tile(0);
                tiles.dot1(f.signed, &mut c, act(0), stride, b0);
            }
            for i in 0..1 + pair as usize {
                let p = group.as_ptr().add((b + i) * bb);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
                let mw = match f.stored_min {
                    true => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * LANES) as *const __m256i)),
                    false => _mm512_mul_ps(d, _mm512_set1_ps(f.min_factor)),
                };
                for r in 0..rows {
                    let isum = _mm512_load_si512(c.0.as_ptr().add(i * amx::ROWS + r) as *const _);
                    let s = _mm512_mul_ps(d, _mm512_set1_ps(*a[r].d.get_unchecked(b + i)));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[r]);
                    if f.has_min() {
                        let sa = _mm512_set1_ps(*a[r].s.get_unchecked(b + i));
                        accm[r] = _mm512_fmadd_ps(mw, sa, accm[r]);
                    }
                }
            }
            b += 2;
        }
        drop(tiles);
        for (r, y) in ys.iter_mut().enumerate() {
            _mm512_storeu_ps(y.as_mut_ptr(), _mm512_add_ps(acc[r], accm[r]));
        }
    }

    /// 8 lanes per register (two passes per group), `vpmaddubsw` + `vpmaddwd`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `group` holds `a[r].d.len()` blocks of `f`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2<const R: usize, const K: usize>(
        group: &[u8],
        a: &[ActRow<'_>; R],
    ) -> [[f32; LANES]; R] {
        let f = const { FORMATS[K] };
        let bb = const { FORMATS[K].block_bytes() };
        let nb = a[0].d.len();
        let m4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut out = [[0f32; LANES]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            let mut accm = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                let p = group.as_ptr().add(b * bb);
                // The second pass reads the lines the first one brought in.
                if h == 0 {
                    for line in (0..bb).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + line) as *const i8);
                    }
                }
                let q = p.add(f.data_at() + 32 * h);
                let mut isum = [_mm256_setzero_si256(); R];
                let widen = |p16: __m256i| _mm256_madd_epi16(p16, ones);
                if f.nibbles {
                    // 8 products of pairs, |Σ| <= 8 * 2 * 15 * 127 = 30480: 16 bits hold it.
                    let mut p16 = [_mm256_setzero_si256(); R];
                    for c in 0..4 {
                        let v = _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        for r in 0..R {
                            let xl = _mm256_set1_epi32(act4(&a[r], b, c));
                            let xh = _mm256_set1_epi32(act4(&a[r], b, c + 4));
                            let s = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, xl),
                                _mm256_maddubs_epi16(hi, xh),
                            );
                            p16[r] = _mm256_add_epi16(p16[r], s);
                        }
                    }
                    for r in 0..R {
                        isum[r] = widen(p16[r]);
                    }
                } else if !f.signed {
                    // 5-bit weights: 4 products of pairs, |Σ| <= 4 * 2 * 31 * 127 = 31496.
                    for half in 0..2 {
                        let mut p16 = [_mm256_setzero_si256(); R];
                        for c in 4 * half..4 * half + 4 {
                            let v = _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                            for r in 0..R {
                                let x = _mm256_set1_epi32(act4(&a[r], b, c));
                                p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(v, x));
                            }
                        }
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], widen(p16[r]));
                        }
                    }
                } else {
                    // Signed bytes: one product of pairs reaches 2 * 128 * 127, widen each.
                    for c in 0..8 {
                        let v = _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                        let u = _mm256_sign_epi8(v, v);
                        for r in 0..R {
                            let x = _mm256_sign_epi8(_mm256_set1_epi32(act4(&a[r], b, c)), v);
                            isum[r] = _mm256_add_epi32(isum[r], widen(_mm256_maddubs_epi16(u, x)));
                        }
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i));
                let mw = match f.stored_min {
                    true => _mm256_cvtph_ps(_mm_loadu_si128(
                        p.add(2 * LANES + 16 * h) as *const __m128i
                    )),
                    false => _mm256_mul_ps(d, _mm256_set1_ps(f.min_factor)),
                };
                for r in 0..R {
                    let s = _mm256_mul_ps(d, _mm256_set1_ps(*a[r].d.get_unchecked(b)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), s, acc[r]);
                    if f.has_min() {
                        let sa = _mm256_set1_ps(*a[r].s.get_unchecked(b));
                        accm[r] = _mm256_fmadd_ps(mw, sa, accm[r]);
                    }
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(
                    out[r].as_mut_ptr().add(8 * h),
                    _mm256_add_ps(acc[r], accm[r]),
                );
            }
        }
        out
    }
}
