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
//!  unit = (sequence, kv head, tile of <= TILE rows)               rayon over units
//!  for block b of the sequence (ascending):  Kt [d][32], V [32][d] of the kv head
//!    for row r of the tile, query head g of the group:     keys lo_r..len_r of the block
//!      s[j]  = scale * Σ_i q[i] Kt[i][j]                    (i ascending, one lane per key)
//!      m'    = max(m, max_j s[j]);  c = exp(m - m')
//!      l     = l c + Σ_j exp(s[j] - m')                     (fixed tree over 32 lanes)
//!      acc   = acc c + Σ_j exp(s[j] - m') V[j]              (j ascending)
//!  out = acc / l
//! ```
//!
//! Row `r` at position `p` reads keys `lo..=p` with `lo = p + 1 - window` for a sliding-window
//! layer and 0 otherwise. The same code is compiled for AVX-512, AVX2 and baseline x86-64 (and
//! any other target); it has no fused multiply-adds and no reassociation, so every build gives
//! the same bits.

use rayon::prelude::*;

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
    /// Compiled for AVX-512F.
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
            if std::is_x86_feature_detected!("avx512f") {
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
            Path::Avx512 => std::is_x86_feature_detected!("avx512f"),
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
    let parts: Vec<Vec<f32>> = units
        .par_iter()
        .map(|&(s, h, r0, r1)| {
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
        })
        .collect();
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
            // SAFETY: `attend_on` takes this path only when the CPU has AVX-512F.
            Path::Avx512 => unsafe { self.run_avx512() },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `attend_on` takes this path only when the CPU has AVX2.
            Path::Avx2 => unsafe { self.run_avx2() },
            _ => self.run_body(),
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self) -> Vec<f32> {
        self.run_body()
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self) -> Vec<f32> {
        self.run_body()
    }

    #[inline(always)]
    fn run_body(&self) -> Vec<f32> {
        let Shape {
            n_heads,
            kv_heads,
            head_dim: d,
            scale,
            window,
        } = self.shape;
        let groups = n_heads / kv_heads;
        let rows = self.r1 - self.r0;
        let nq = rows * groups;
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0f32; nq];
        let mut acc = vec![0f32; nq * d];
        // Keys lo..len of row r (positions), nondecreasing in r.
        let keys = |r: usize| {
            let len = self.span.pos + r + 1;
            let lo = window.map_or(0, |w| len.saturating_sub(w));
            (lo, len)
        };
        let first = keys(self.r0).0 / BLOCK_SIZE;
        let last = keys(self.r1 - 1).1.div_ceil(BLOCK_SIZE);
        for blk in first..last {
            let b = self.span.blocks[blk];
            let kt = self.pool.k_block(self.slot, b, self.kv_head);
            let v = self.pool.v_block(self.slot, b, self.kv_head);
            let base = blk * BLOCK_SIZE;
            for r in self.r0..self.r1 {
                let (lo, len) = keys(r);
                let jlo = lo.saturating_sub(base).min(BLOCK_SIZE);
                let jhi = len.saturating_sub(base).min(BLOCK_SIZE);
                if jlo >= jhi {
                    continue;
                }
                let row = self.span.row + r;
                for g in 0..groups {
                    let head = self.kv_head * groups + g;
                    let qv = &self.q[(row * n_heads + head) * d..][..d];
                    let i = (r - self.r0) * groups + g;
                    let state = State {
                        m: &mut m[i],
                        l: &mut l[i],
                        acc: &mut acc[i * d..(i + 1) * d],
                    };
                    block_update(qv, kt, v, jlo..jhi, scale, state);
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

/// The running softmax of one (row, query head).
struct State<'a> {
    m: &'a mut f32,
    l: &'a mut f32,
    acc: &'a mut [f32],
}

/// Merges keys `keys` of one block into `st`.
#[inline(always)]
fn block_update(
    qv: &[f32],
    kt: &[f32],
    v: &[f32],
    keys: std::ops::Range<usize>,
    scale: f32,
    st: State<'_>,
) {
    let d = qv.len();
    // PyTorch: attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
    let mut s = [0f32; BLOCK_SIZE];
    for (i, &qi) in qv.iter().enumerate() {
        let kr: &[f32; BLOCK_SIZE] = kt[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]
            .try_into()
            .expect("invariant: a block row has BLOCK_SIZE keys");
        for j in 0..BLOCK_SIZE {
            s[j] += qi * kr[j];
        }
    }
    let mut mb = f32::NEG_INFINITY;
    for (j, x) in s.iter_mut().enumerate() {
        *x = match keys.contains(&j) {
            true => *x * scale,
            false => f32::NEG_INFINITY,
        };
        mb = mb.max(*x);
    }
    let m_new = st.m.max(mb);
    let mut p = [0f32; BLOCK_SIZE];
    for j in 0..BLOCK_SIZE {
        p[j] = match s[j] == f32::NEG_INFINITY {
            true => 0.0,
            false => exp(s[j] - m_new),
        };
    }
    let sum = tree_sum(&p);
    if *st.m == f32::NEG_INFINITY {
        *st.l = sum;
    } else if *st.m != m_new {
        let c = exp(*st.m - m_new);
        *st.l = *st.l * c + sum;
        for a in st.acc.iter_mut() {
            *a *= c;
        }
    } else {
        // c = exp(0) = 1: multiplying by it would change nothing.
        *st.l += sum;
    }
    for j in keys {
        let pj = p[j];
        for (a, &x) in st.acc.iter_mut().zip(&v[j * d..(j + 1) * d]) {
            *a += pj * x;
        }
    }
    *st.m = m_new;
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

#[cfg(test)]
mod tests;
