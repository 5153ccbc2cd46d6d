//! The one attention kernel of Specula (CPU, f32): decode steps, verify windows and prefill
//! chunks of any number of sequences, over the paged [`KvPool`].
//!
//! Every (row, query head) is reduced over its keys in a fixed order: block by block of
//! [`BLOCK_SIZE`] keys, an online softmax (FlashAttention's running max and sum) merged in
//! ascending block order. Nothing in a row's arithmetic depends on which other rows are in
//! flight, so a row is bit-identical whether it runs alone (decode), in a verify window, in a
//! prefill chunk of any size or beside other sequences (the law: batch and chunking never change
//! the output). Rows are grouped into tiles only to reuse each loaded key block across rows and
//! across the query heads that share a KV head (GQA without repeating K/V).
//!
//! ```text
//!  unit = (sequence, kv head, tile of <= TILE rows)               `par` over units
//!  for block b of the sequence (ascending):  Kt [d][32], V [32][d] of the kv head
//!    for each pair of queries (row, query head of the group) with keys in the block:
//!      s[q][j] = Σ_i q[q][i] Kt[i][j]        (i ascending; one Kt load serves both queries)
//!      per query, keys lo_r..len_r of the block:
//!        s = scale s;  m' = max(m, max_j s[j]);  c = exp(m - m')
//!        l   = l c + Σ_j exp(s[j] - m')                 (fixed tree over 32 lanes)
//!      acc[q] = acc[q] c + Σ_j p[q][j] V[j]   (j ascending; one V load serves both queries
//!                                            over the keys they share, registers hold acc)
//!  out = acc / l
//! ```
//!
//! Row `r` at position `p` reads keys `lo..=p` with `lo = p + 1 - window` for a sliding-window
//! layer and 0 otherwise. Pairing queries only saves loads: every accumulator runs the
//! operations, in the order, it would run alone, whichever query it is paired with (or none).
//! The same code is compiled for AVX-512, AVX2 (eight-lane registers) and baseline x86-64 (and
//! any other target, on arrays); it has no fused multiply-adds and no reassociation, so every
//! build gives the same bits.

use std::ops::Range;

use lanes::Lanes;

use crate::kv_pool::{BlockId, KvPool, BLOCK_SIZE};

/// Rows per work unit.
const TILE: usize = 16;

/// One sequence's rows in the packed batch.
#[derive(Clone, Debug)]
pub struct Span {
    /// First row of the sequence in the batch.
    pub row: usize,
    /// Number of rows.
    pub rows: usize,
    /// Position of the first row (the sequence's length before this forward).
    pub pos: usize,
    /// The sequence's block table, covering at least `pos + rows` positions.
    pub blocks: Vec<BlockId>,
}

/// The shapes of one call.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Query heads.
    pub n_heads: usize,
    /// K/V heads (divides `n_heads`).
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Keys visible to a row (sliding-window layers), `None` for all.
    pub window: Option<usize>,
}

/// Which code the kernel runs (all give the same bits; see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Compiled for AVX-512F/VL (eight-lane registers, 32 of them).
    Avx512,
    /// Compiled for AVX2.
    Avx2,
    /// The target's baseline.
    Baseline,
}

impl Path {
    /// The widest path this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if Path::Avx512.available() {
                return Path::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") {
                return Path::Avx2;
            }
        }
        Path::Baseline
    }

    fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx2")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => std::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            Path::Avx512 | Path::Avx2 => false,
            Path::Baseline => true,
        }
    }
}

/// Attends `q` (`[T][n_heads][head_dim]`, after rope) to slot `slot` of `pool` for every span,
/// returning `[T][n_heads][head_dim]`. Rows not covered by a span are zero.
///
/// # Panics
/// If `q` or a span does not fit the shape or the pool (indexing bugs of the forward).
pub fn attend(q: &[f32], spans: &[Span], pool: &KvPool, slot: usize, shape: Shape) -> Vec<f32> {
    attend_on(Path::detect(), q, spans, pool, slot, shape)
}

/// [`attend`] on a chosen path (falls back to the baseline when the CPU lacks it).
pub fn attend_on(
    path: Path,
    q: &[f32],
    spans: &[Span],
    pool: &KvPool,
    slot: usize,
    shape: Shape,
) -> Vec<f32> {
    let path = match path.available() {
        true => path,
        false => Path::Baseline,
    };
    let Shape {
        n_heads,
        kv_heads,
        head_dim: d,
        ..
    } = shape;
    assert!(n_heads.is_multiple_of(kv_heads) && q.len().is_multiple_of(n_heads * d));
    let units: Vec<(usize, usize, usize, usize)> = spans
        .iter()
        .enumerate()
        .flat_map(|(s, span)| {
            (0..kv_heads).flat_map(move |h| {
                (0..span.rows)
                    .step_by(TILE)
                    .map(move |r0| (s, h, r0, (r0 + TILE).min(span.rows)))
            })
        })
        .collect();
    let groups = n_heads / kv_heads;
    let parts: Vec<Vec<f32>> = crate::par::map(units.len(), |u| {
        let (s, h, r0, r1) = units[u];
        let unit = Unit {
            q,
            span: &spans[s],
            pool,
            slot,
            shape,
            kv_head: h,
            r0,
            r1,
        };
        unit.run(path)
    });
    let mut out = vec![0f32; q.len()];
    for (&(s, h, r0, r1), part) in units.iter().zip(parts) {
        for (r, rows) in (r0..r1).zip(part.chunks_exact(groups * d)) {
            let at = ((spans[s].row + r) * n_heads + h * groups) * d;
            out[at..at + groups * d].copy_from_slice(rows);
        }
    }
    out
}

/// One work unit: rows `r0..r1` of a span, the query heads of KV head `kv_head`.
struct Unit<'a> {
    q: &'a [f32],
    span: &'a Span,
    pool: &'a KvPool,
    slot: usize,
    shape: Shape,
    kv_head: usize,
    r0: usize,
    r1: usize,
}

impl Unit<'_> {
    fn run(&self, path: Path) -> Vec<f32> {
        match path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `attend_on` takes this path only when the CPU has AVX-512F/VL and AVX2.
            Path::Avx512 => unsafe { self.run_avx512() },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `attend_on` takes this path only when the CPU has AVX2.
            Path::Avx2 => unsafe { self.run_avx2() },
            _ => self.run_body::<lanes::Portable>(),
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F and AVX-512VL (and AVX2).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,avx512f,avx512vl")]
    unsafe fn run_avx512(&self) -> Vec<f32> {
        self.run_body::<lanes::Avx>()
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self) -> Vec<f32> {
        self.run_body::<lanes::Avx>()
    }

    /// Keys `lo..len` (positions) of row `r` of the span, nondecreasing in `r`.
    #[inline(always)]
    fn keys(&self, r: usize) -> (usize, usize) {
        let len = self.span.pos + r + 1;
        let lo = self.shape.window.map_or(0, |w| len.saturating_sub(w));
        (lo, len)
    }

    #[inline(always)]
    fn run_body<V: Lanes>(&self) -> Vec<f32> {
        let Shape {
            n_heads,
            kv_heads,
            head_dim: d,
            scale,
            ..
        } = self.shape;
        let groups = n_heads / kv_heads;
        let rows = self.r1 - self.r0;
        let nq = rows * groups;
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0f32; nq];
        let mut acc = vec![0f32; nq * d];
        let first = self.keys(self.r0).0 / BLOCK_SIZE;
        let last = self.keys(self.r1 - 1).1.div_ceil(BLOCK_SIZE);
        // Query `i` of the unit is (row r0 + i / groups, head kv_head * groups + i % groups).
        let row_of: Vec<usize> = (0..nq).map(|i| self.r0 + i / groups).collect();
        let query = |i: usize| {
            let row = self.span.row + row_of[i];
            &self.q[(row * n_heads + self.kv_head * groups + i % groups) * d..][..d]
        };
        for blk in first..last {
            let b = self.span.blocks[blk];
            let kt = self.pool.k_block(self.slot, b, self.kv_head);
            let v = self.pool.v_block(self.slot, b, self.kv_head);
            let base = blk * BLOCK_SIZE;
            // The keys of row r in this block; the rows that have some are contiguous.
            let range = |i: usize| {
                let (lo, len) = self.keys(row_of[i]);
                let jlo = lo.saturating_sub(base).min(BLOCK_SIZE);
                let jhi = len.saturating_sub(base).min(BLOCK_SIZE);
                jlo..jhi
            };
            // Rows with keys here are contiguous (both ends of a row's keys grow with r).
            let Some(lo) = (0..nq).find(|&i| !range(i).is_empty()) else {
                continue;
            };
            let hi = (lo..nq).find(|&i| range(i).is_empty()).unwrap_or(nq);
            for a in (lo..hi).step_by(2) {
                match a + 1 < hi {
                    true => {
                        let b = a + 1;
                        let s = scores::<V, 2>([query(a), query(b)], kt);
                        let mut p = [[0f32; BLOCK_SIZE]; 2];
                        let ca = softmax(&s[0], range(a), scale, &mut m[a], &mut l[a], &mut p[0]);
                        let cb = softmax(&s[1], range(b), scale, &mut m[b], &mut l[b], &mut p[1]);
                        let (lo_acc, hi_acc) = acc.split_at_mut(b * d);
                        let accs = [&mut lo_acc[a * d..(a + 1) * d], &mut hi_acc[..d]];
                        values2::<V>(accs, [ca, cb], [&p[0], &p[1]], [range(a), range(b)], v);
                    }
                    false => {
                        let s = scores::<V, 1>([query(a)], kt);
                        let mut p = [0f32; BLOCK_SIZE];
                        let c = softmax(&s[0], range(a), scale, &mut m[a], &mut l[a], &mut p);
                        values1::<V>(&mut acc[a * d..(a + 1) * d], c, &p, range(a), v);
                    }
                }
            }
        }
        for (a, &l) in acc.chunks_exact_mut(d).zip(&l) {
            let inv = 1.0 / l;
            for x in a {
                *x *= inv;
            }
        }
        acc
    }
}

/// Raw scores `Σ_i q[i] Kt[i][j]` (i ascending, from 0) of `Q` queries against the 32 keys
/// of a block `kt` (`[d][BLOCK_SIZE]`): each loaded key vector serves every query.
#[inline(always)]
fn scores<V: Lanes, const Q: usize>(qs: [&[f32]; Q], kt: &[f32]) -> [[f32; BLOCK_SIZE]; Q] {
    const NV: usize = BLOCK_SIZE / 8;
    let d = qs[0].len();
    assert!(kt.len() == d * BLOCK_SIZE && qs.iter().all(|q| q.len() == d));
    let mut acc = [[V::zero(); NV]; Q];
    for i in 0..d {
        let row = &kt[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
        let k: [V; NV] = std::array::from_fn(|c| V::load(&row[c * 8..]));
        for (a, qv) in acc.iter_mut().zip(&qs) {
            let x = V::splat(qv[i]);
            for (a, &k) in a.iter_mut().zip(&k) {
                *a = a.add(x.mul(k));
            }
        }
    }
    let mut s = [[0f32; BLOCK_SIZE]; Q];
    for (s, a) in s.iter_mut().zip(&acc) {
        for (c, a) in a.iter().enumerate() {
            a.store(&mut s[c * 8..]);
        }
    }
    s
}

/// Merges the scores `s` of keys `keys` of one block into the running max `m` and sum `l`
/// of one (row, query head), writing the weights `p` (0 outside `keys`). Returns the factor
/// the accumulator must be rescaled by first, if any.
#[inline(always)]
fn softmax(
    s: &[f32; BLOCK_SIZE],
    keys: Range<usize>,
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    p: &mut [f32; BLOCK_SIZE],
) -> Option<f32> {
    // PyTorch: attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
    let mut x = [0f32; BLOCK_SIZE];
    for (j, (x, &s)) in x.iter_mut().zip(s).enumerate() {
        *x = match keys.contains(&j) {
            true => s * scale,
            false => f32::NEG_INFINITY,
        };
    }
    // A max is exact in any order (a tree, so that it vectorizes).
    let mut t = x;
    let mut n = BLOCK_SIZE;
    while n > 1 {
        n /= 2;
        for j in 0..n {
            t[j] = t[j].max(t[j + n]);
        }
    }
    let m_new = m.max(t[0]);
    for (p, &x) in p.iter_mut().zip(&x) {
        *p = match x == f32::NEG_INFINITY {
            true => 0.0,
            false => exp(x - m_new),
        };
    }
    let sum = tree_sum(p);
    let c = if *m == f32::NEG_INFINITY {
        *l = sum;
        None
    } else if *m != m_new {
        let c = exp(*m - m_new);
        *l = *l * c + sum;
        Some(c)
    } else {
        // c = exp(0) = 1: multiplying by it would change nothing.
        *l += sum;
        None
    };
    *m = m_new;
    c
}

/// `acc = acc · c + Σ_{j in keys} p[j] V[j]` (j ascending) for one query, `V` `[32][d]`.
#[inline(always)]
fn values1<V: Lanes>(
    acc: &mut [f32],
    c: Option<f32>,
    p: &[f32; BLOCK_SIZE],
    keys: Range<usize>,
    v: &[f32],
) {
    let d = acc.len();
    assert!(v.len() == d * BLOCK_SIZE);
    let mut o = 0;
    while o + 32 <= d {
        chunk1::<V, 4>(&mut acc[o..], c, p, keys.clone(), &v[o..], d);
        o += 32;
    }
    while o + 8 <= d {
        chunk1::<V, 1>(&mut acc[o..], c, p, keys.clone(), &v[o..], d);
        o += 8;
    }
    for e in o..d {
        tail(&mut acc[e], c, p, keys.clone(), &v[e..], d);
    }
}

/// [`values1`] for two queries at once: each loaded `V` vector serves both over the keys
/// they share; the keys only one of them has are added to it alone, in the same ascending
/// order, so each accumulator runs the operations it would run alone.
#[inline(always)]
fn values2<V: Lanes>(
    acc: [&mut [f32]; 2],
    c: [Option<f32>; 2],
    p: [&[f32; BLOCK_SIZE]; 2],
    keys: [Range<usize>; 2],
    v: &[f32],
) {
    let [a0, a1] = acc;
    let d = a0.len();
    assert!(v.len() == d * BLOCK_SIZE && a1.len() == d);
    let both = keys[0].start.max(keys[1].start)..keys[0].end.min(keys[1].end);
    if both.is_empty() {
        values1::<V>(a0, c[0], p[0], keys[0].clone(), v);
        values1::<V>(a1, c[1], p[1], keys[1].clone(), v);
        return;
    }
    let mut o = 0;
    while o + 32 <= d {
        chunk2::<V, 4>([&mut a0[o..], &mut a1[o..]], c, p, &keys, &both, &v[o..], d);
        o += 32;
    }
    while o + 8 <= d {
        chunk2::<V, 1>([&mut a0[o..], &mut a1[o..]], c, p, &keys, &both, &v[o..], d);
        o += 8;
    }
    for e in o..d {
        tail(&mut a0[e], c[0], p[0], keys[0].clone(), &v[e..], d);
        tail(&mut a1[e], c[1], p[1], keys[1].clone(), &v[e..], d);
    }
}

/// Loads `C` vectors of an accumulator, rescaled by `c`.
#[inline(always)]
fn load_acc<V: Lanes, const C: usize>(acc: &[f32], c: Option<f32>) -> [V; C] {
    let a: [V; C] = std::array::from_fn(|i| V::load(&acc[i * 8..]));
    match c {
        Some(c) => a.map(|a| a.mul(V::splat(c))),
        None => a,
    }
}

/// `a += p[j] V[j][o..o + 8C]` for `j` in `keys`; `v` starts at column `o` of row 0.
#[inline(always)]
fn add_rows<V: Lanes, const C: usize>(
    a: &mut [V; C],
    p: &[f32; BLOCK_SIZE],
    keys: Range<usize>,
    v: &[f32],
    d: usize,
) {
    for j in keys {
        let w = V::splat(p[j]);
        let row = &v[j * d..j * d + 8 * C];
        for (i, a) in a.iter_mut().enumerate() {
            *a = a.add(w.mul(V::load(&row[i * 8..])));
        }
    }
}

/// Columns `0..8C` of [`values1`] (`acc` and `v` start at the chunk's column).
#[inline(always)]
fn chunk1<V: Lanes, const C: usize>(
    acc: &mut [f32],
    c: Option<f32>,
    p: &[f32; BLOCK_SIZE],
    keys: Range<usize>,
    v: &[f32],
    d: usize,
) {
    let mut a = load_acc::<V, C>(acc, c);
    add_rows(&mut a, p, keys, v, d);
    for (i, a) in a.iter().enumerate() {
        a.store(&mut acc[i * 8..]);
    }
}

/// Columns `0..8C` of [`values2`].
#[inline(always)]
fn chunk2<V: Lanes, const C: usize>(
    acc: [&mut [f32]; 2],
    c: [Option<f32>; 2],
    p: [&[f32; BLOCK_SIZE]; 2],
    keys: &[Range<usize>; 2],
    both: &Range<usize>,
    v: &[f32],
    d: usize,
) {
    let mut a = [
        load_acc::<V, C>(acc[0], c[0]),
        load_acc::<V, C>(acc[1], c[1]),
    ];
    for ((a, p), keys) in a.iter_mut().zip(p).zip(keys) {
        add_rows(a, p, keys.start..both.start, v, d);
    }
    for j in both.clone() {
        let w = [V::splat(p[0][j]), V::splat(p[1][j])];
        let row = &v[j * d..j * d + 8 * C];
        let [a0, a1] = &mut a;
        for (i, (a0, a1)) in a0.iter_mut().zip(a1.iter_mut()).enumerate() {
            let x = V::load(&row[i * 8..]);
            *a0 = a0.add(w[0].mul(x));
            *a1 = a1.add(w[1].mul(x));
        }
    }
    for ((a, p), keys) in a.iter_mut().zip(p).zip(keys) {
        add_rows(a, p, both.end..keys.end, v, d);
    }
    for (acc, a) in acc.into_iter().zip(&a) {
        for (i, a) in a.iter().enumerate() {
            a.store(&mut acc[i * 8..]);
        }
    }
}

/// One column (`v[0]` of row 0) of [`values1`] past the last multiple of 8.
#[inline(always)]
fn tail(
    acc: &mut f32,
    c: Option<f32>,
    p: &[f32; BLOCK_SIZE],
    keys: Range<usize>,
    v: &[f32],
    d: usize,
) {
    if let Some(c) = c {
        *acc *= c;
    }
    for j in keys {
        *acc += p[j] * v[j * d];
    }
}

/// Σ of 32 lanes in a fixed pairwise tree.
#[inline(always)]
fn tree_sum(p: &[f32; BLOCK_SIZE]) -> f32 {
    let mut t = *p;
    let mut n = BLOCK_SIZE;
    while n > 1 {
        n /= 2;
        for j in 0..n {
            t[j] += t[j + n];
        }
    }
    t[0]
}

/// `e^x` for `x <= 0` (Cephes `expf`: Cody-Waite reduction, degree-5 polynomial; ~1 ulp),
/// written so that it vectorizes and gives the same bits on every build.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest by the 1.5 * 2^23 trick (no rounding instruction needed).
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let z = r * r;
    let p = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// Eight f32 lanes, the unit the kernel's arithmetic is written in: loads, stores, lane-wise
/// multiply and add, nothing fused, so every implementation gives the same bits.
mod lanes {
    /// Eight f32 lanes.
    pub(super) trait Lanes: Copy {
        /// All lanes 0.
        fn zero() -> Self;
        /// All lanes `x`.
        fn splat(x: f32) -> Self;
        /// The first 8 values of `s`.
        fn load(s: &[f32]) -> Self;
        /// Into the first 8 values of `s`.
        fn store(self, s: &mut [f32]);
        /// Lane-wise product.
        fn mul(self, o: Self) -> Self;
        /// Lane-wise sum.
        fn add(self, o: Self) -> Self;
    }

    /// Plain arrays (any target).
    #[derive(Clone, Copy)]
    pub(super) struct Portable([f32; 8]);

    impl Lanes for Portable {
        #[inline(always)]
        fn zero() -> Self {
            Self([0.0; 8])
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            Self([x; 8])
        }
        #[inline(always)]
        fn load(s: &[f32]) -> Self {
            Self(s[..8].try_into().expect("8 values"))
        }
        #[inline(always)]
        fn store(self, s: &mut [f32]) {
            s[..8].copy_from_slice(&self.0);
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            Self(std::array::from_fn(|i| self.0[i] * o.0[i]))
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            Self(std::array::from_fn(|i| self.0[i] + o.0[i]))
        }
    }

    /// One 256-bit register. Used only inside the kernel's `avx2`/`avx512` builds, which run
    /// after the CPU was checked (its methods are inlined there).
    #[cfg(target_arch = "x86_64")]
    #[derive(Clone, Copy)]
    pub(super) struct Avx(std::arch::x86_64::__m256);

    #[cfg(target_arch = "x86_64")]
    impl Lanes for Avx {
        #[inline(always)]
        fn zero() -> Self {
            // SAFETY: only reached from a build for a CPU with AVX2 (see the type's docs).
            unsafe { Self(std::arch::x86_64::_mm256_setzero_ps()) }
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: as `zero`.
            unsafe { Self(std::arch::x86_64::_mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(s: &[f32]) -> Self {
            assert!(s.len() >= 8);
            // SAFETY: 8 values are in bounds; AVX as `zero`.
            unsafe { Self(std::arch::x86_64::_mm256_loadu_ps(s.as_ptr())) }
        }
        #[inline(always)]
        fn store(self, s: &mut [f32]) {
            assert!(s.len() >= 8);
            // SAFETY: 8 values are in bounds; AVX as `zero`.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(s.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            // SAFETY: as `zero`.
            unsafe { Self(std::arch::x86_64::_mm256_mul_ps(self.0, o.0)) }
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            // SAFETY: as `zero`.
            unsafe { Self(std::arch::x86_64::_mm256_add_ps(self.0, o.0)) }
        }
    }
}

#[cfg(test)]
mod tests;
