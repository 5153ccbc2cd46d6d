//! The kernel against a plain f64 softmax, and its rows bit for bit whatever the batch, the
//! chunking, the tiling and the SIMD path.

use rand::{Rng, SeedableRng};

use super::*;
use crate::kv_pool::{KvLayout, SeqId};

const KV: usize = 2;
const HEADS: usize = 6;
const D: usize = 16;

fn rand_vec(n: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A pool with sequences of the given lengths, K/V random.
fn pool_with(lens: &[usize], seed: u64) -> (KvPool, Vec<SeqId>) {
    pool_dims(lens, seed, KV, D)
}

/// [`pool_with`] for `kv` heads of width `d`.
fn pool_dims(lens: &[usize], seed: u64, kv: usize, d: usize) -> (KvPool, Vec<SeqId>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pool = KvPool::new(KvLayout::uniform(1, kv, d), 64).unwrap();
    let seqs = lens
        .iter()
        .map(|&n| {
            let s = pool.create();
            pool.append(s, &vec![0; n]).unwrap();
            for p in 0..n {
                let (b, off) = pool.locate(s, p).unwrap();
                let (k, v) = (rand_vec(kv * d, &mut rng), rand_vec(kv * d, &mut rng));
                pool.write(0, b, off, &k, &v);
            }
            s
        })
        .collect();
    (pool, seqs)
}

fn shape(window: Option<usize>) -> Shape {
    Shape {
        n_heads: HEADS,
        kv_heads: KV,
        head_dim: D,
        scale: 1.0 / (D as f32).sqrt(),
        window,
    }
}

/// Span over rows `pos..pos + rows` of `seq`, starting at batch row `row`.
fn span(pool: &KvPool, seq: SeqId, row: usize, pos: usize, rows: usize) -> Span {
    Span {
        row,
        rows,
        pos,
        blocks: pool.blocks(seq).unwrap().to_vec(),
    }
}

/// softmax(q K^T * scale) V in f64 for one row at `pos`.
fn reference(pool: &KvPool, seq: SeqId, q: &[f32], pos: usize, window: Option<usize>) -> Vec<f32> {
    let (k, v) = pool.read_rows(seq, 0, 0..pos + 1).unwrap();
    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let mut out = vec![0f32; HEADS * D];
    for h in 0..HEADS {
        let kv = h / (HEADS / KV);
        let qh = &q[h * D..(h + 1) * D];
        let s: Vec<f64> = (lo..=pos)
            .map(|t| {
                let kt = &k[(t * KV + kv) * D..][..D];
                qh.iter()
                    .zip(kt)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    / (D as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for i in 0..D {
            let acc: f64 = (lo..=pos)
                .zip(&e)
                .map(|(t, p)| p * v[(t * KV + kv) * D + i] as f64)
                .sum();
            out[h * D + i] = (acc / z) as f32;
        }
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn matches_the_softmax_reference_with_and_without_window() {
    let len = 3 * BLOCK_SIZE + 5;
    let (pool, seqs) = pool_with(&[len], 1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let rows = 20;
    let pos = len - rows;
    let q = rand_vec(rows * HEADS * D, &mut rng);
    for window in [None, Some(7), Some(BLOCK_SIZE + 3)] {
        let out = attend(
            &q,
            &[span(&pool, seqs[0], 0, pos, rows)],
            &pool,
            0,
            shape(window),
        );
        for r in 0..rows {
            let want = reference(
                &pool,
                seqs[0],
                &q[r * HEADS * D..][..HEADS * D],
                pos + r,
                window,
            );
            let got = &out[r * HEADS * D..][..HEADS * D];
            let err = want
                .iter()
                .zip(got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 2e-6, "row {r} window {window:?}: {err}");
        }
    }
}

/// A row's output is the same bits alone, in a chunk of any size, tiled differently, next to
/// another sequence, and on every SIMD path.
#[test]
fn rows_are_bit_identical_whatever_the_batch_chunk_and_path() {
    let (la, lb) = (2 * BLOCK_SIZE + 9, 45);
    let (pool, seqs) = pool_with(&[la, lb], 3);
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let (ra, rb) = (TILE + 7, 3);
    let (pa, pb) = (la - ra, lb - rb);
    let w = HEADS * D;
    let qa = rand_vec(ra * w, &mut rng);
    let qb = rand_vec(rb * w, &mut rng);
    let s = shape(None);
    // Each row alone: the decode step at its position.
    let alone: Vec<Vec<f32>> = (0..ra)
        .map(|r| {
            attend(
                &qa[r * w..(r + 1) * w],
                &[span(&pool, seqs[0], 0, pa + r, 1)],
                &pool,
                0,
                s,
            )
        })
        .collect();
    let whole = attend(&qa, &[span(&pool, seqs[0], 0, pa, ra)], &pool, 0, s);
    for (r, row) in alone.iter().enumerate() {
        assert!(
            same_bits(row, &whole[r * w..(r + 1) * w]),
            "row {r}: chunk vs alone"
        );
    }
    // Chunks of 5 (another tiling), packed B first then A's chunks.
    let q = [&qb[..], &qa[..]].concat();
    let mut spans = vec![span(&pool, seqs[1], 0, pb, rb)];
    for c in (0..ra).step_by(5) {
        let n = 5.min(ra - c);
        spans.push(span(&pool, seqs[0], rb + c, pa + c, n));
    }
    let packed = attend(&q, &spans, &pool, 0, s);
    assert!(
        same_bits(&packed[rb * w..], &whole),
        "A beside B, in chunks of 5"
    );
    let b_alone = attend(&qb, &[span(&pool, seqs[1], 0, pb, rb)], &pool, 0, s);
    assert!(same_bits(&packed[..rb * w], &b_alone), "B beside A");
    for path in [Path::Avx512, Path::Avx2, Path::Baseline] {
        let other = attend_on(path, &q, &spans, &pool, 0, s);
        assert!(
            same_bits(&other, &packed),
            "{path:?} differs from {:?}",
            Path::detect()
        );
    }
}

#[test]
fn exp_is_accurate_on_the_softmax_range() {
    for i in 0..=10_000 {
        let x = -87.0 * i as f32 / 10_000.0;
        let (got, want) = (exp(x) as f64, (x as f64).exp());
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
    }
    assert_eq!(exp(0.0), 1.0);
}

/// Every head width (whole 32-column chunks, 8-column chunks, a scalar tail) and group size
/// (queries paired within a row and across rows): each row of a chunk equals the row alone
/// and the f64 softmax, on every path.
#[test]
fn head_widths_and_groups_pair_queries_without_changing_a_row() {
    for (kv, groups, d) in [
        (1, 1, 8),
        (2, 3, 36),
        (1, 4, 40),
        (2, 2, 64),
        (1, 3, 128),
        (1, 6, 64),
        (2, 5, 20),
        (1, 7, 72),
    ] {
        let heads = kv * groups;
        let len = 2 * BLOCK_SIZE + 11;
        let (pool, seqs) = pool_dims(&[len], 7 + d as u64, kv, d);
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let rows = 19;
        let pos = len - rows;
        let w = heads * d;
        let q = rand_vec(rows * w, &mut rng);
        for window in [None, Some(BLOCK_SIZE - 5)] {
            let s = Shape {
                n_heads: heads,
                kv_heads: kv,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                window,
            };
            let whole = attend(&q, &[span(&pool, seqs[0], 0, pos, rows)], &pool, 0, s);
            for path in [Path::Avx512, Path::Avx2, Path::Baseline] {
                let other = attend_on(path, &q, &[span(&pool, seqs[0], 0, pos, rows)], &pool, 0, s);
                assert!(same_bits(&other, &whole), "d {d} groups {groups}: {path:?}");
            }
            let (k, v) = pool.read_rows(seqs[0], 0, 0..len).unwrap();
            for r in 0..rows {
                let one = &q[r * w..(r + 1) * w];
                let alone = attend(one, &[span(&pool, seqs[0], 0, pos + r, 1)], &pool, 0, s);
                let got = &whole[r * w..(r + 1) * w];
                assert!(
                    same_bits(&alone, got),
                    "d {d} groups {groups} {window:?}: row {r}"
                );
                let p = pos + r;
                let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
                for h in 0..heads {
                    let kvh = h / groups;
                    let qh = &one[h * d..(h + 1) * d];
                    let sc: Vec<f64> = (lo..=p)
                        .map(|t| {
                            let kt = &k[(t * kv + kvh) * d..][..d];
                            let dot: f64 =
                                qh.iter().zip(kt).map(|(a, b)| *a as f64 * *b as f64).sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for i in 0..d {
                        let want: f64 = (lo..=p)
                            .zip(&e)
                            .map(|(t, e)| e * v[(t * kv + kvh) * d + i] as f64)
                            .sum::<f64>()
                            / z;
                        let err = (want - got[h * d + i] as f64).abs();
                        assert!(err < 3e-6, "d {d} groups {groups} row {r} head {h}: {err}");
                    }
                }
            }
        }
    }
}
