//! Kernel tests: the packed layout against candle's dequantization, products against a dense
//! matmul, exact row-count invariance, and bit-for-bit agreement of every build.

use super::*;
use candle_core::DType;
use rand::{Rng, SeedableRng};

const TYPES: [GgmlDType; 6] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// The types of the [`packed`] path (the k-quants have their own kernels).
const PACKED_TYPES: [GgmlDType; 4] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
];

fn randn(rng: &mut rand::rngs::StdRng, shape: (usize, usize)) -> Tensor {
    let data: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A small `[n, k]` weight (k spans two k-quant super-blocks; n = 40 leaves a partial group
/// of 16 rows) quantized to `dtype`.
fn weight(rng: &mut rand::rngs::StdRng, dtype: GgmlDType) -> (QTensor, Tensor) {
    weight_of(rng, dtype, 512)
}

/// As [`weight`], `k` wide.
fn weight_of(rng: &mut rand::rngs::StdRng, dtype: GgmlDType, k: usize) -> (QTensor, Tensor) {
    let w = randn(rng, (40, k));
    let q = QTensor::quantize(&w, dtype).unwrap();
    let dense = q.dequantize(&Device::Cpu).unwrap();
    (q, dense)
}

fn bits(isa: Isa, w: &QWeight, xs: &Tensor) -> Vec<Vec<u32>> {
    let y: Vec<Vec<f32>> = matmul(isa, w, xs).unwrap().to_vec2().unwrap();
    y.into_iter()
        .map(|r| r.into_iter().map(f32::to_bits).collect())
        .collect()
}

/// The packed layout holds exactly candle's dequantization of the same bytes.
#[test]
fn packing_keeps_every_weight() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for dtype in PACKED_TYPES {
        let (q, dense) = weight(&mut rng, dtype);
        let (n, k) = dense.dims2().unwrap();
        let dense: Vec<f32> = dense.flatten_all().unwrap().to_vec1().unwrap();
        let p = Packed::new(dtype, &q.data().unwrap(), n, k);
        for j in 0..n {
            let ours = p.dequantize_row(j);
            for (i, (&o, &t)) in ours.iter().zip(&dense[j * k..(j + 1) * k]).enumerate() {
                assert!(
                    (o - t).abs() <= 1e-6 * t.abs().max(1.0),
                    "{dtype:?} row {j} elem {i}: {o} vs {t}"
                );
            }
        }
    }
}

/// The packed `Q4_K` and `Q6_K` layouts hold exactly candle's dequantization of the same
/// bytes.
#[test]
fn k_packing_keeps_every_weight() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let (q, dense) = weight(&mut rng, dtype);
        let (n, k) = dense.dims2().unwrap();
        let dense: Vec<f32> = dense.flatten_all().unwrap().to_vec1().unwrap();
        let raw = q.data().unwrap();
        let rows: Vec<Vec<f32>> = match dtype {
            GgmlDType::Q4K => {
                let p = kpacked::KPacked::new(&raw, n, k);
                (0..n).map(|j| p.dequantize_row(j)).collect()
            }
            _ => {
                let p = k6packed::K6Packed::new(&raw, n, k);
                (0..n).map(|j| p.dequantize_row(j)).collect()
            }
        };
        for (j, row) in rows.iter().enumerate() {
            for (i, (&o, &t)) in row.iter().zip(&dense[j * k..]).enumerate() {
                assert!(
                    (o - t).abs() <= 1e-5 * t.abs().max(1.0),
                    "{dtype:?} row {j} elem {i}: {o} vs {t}"
                );
            }
        }
    }
}

/// The products are the dense product of the dequantized weight, up to the 8-bit activations.
#[test]
fn matches_dense_matmul() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for dtype in TYPES {
        let (q, dense) = weight(&mut rng, dtype);
        let q = QWeight::new(Arc::new(q)).unwrap();
        for isa in Isa::available() {
            for m in [1, 3, 8, 17] {
                let xs = randn(&mut rng, (m, 512));
                let ours = matmul(isa, &q, &xs).unwrap();
                let theirs = xs.matmul(&dense.t().unwrap()).unwrap();
                assert_eq!(ours.dims(), theirs.dims());
                let diff = max_abs(&(ours - &theirs).unwrap());
                let scale = max_abs(&theirs);
                assert!(
                    diff < 1e-2 * scale,
                    "{dtype:?} {isa} m={m}: {diff} (max |y| {scale})"
                );
            }
        }
    }
}

/// Row r of a call is bit-identical to the same row multiplied alone, for every row count and
/// every SIMD path this CPU runs.
#[test]
fn rows_do_not_depend_on_row_count() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for dtype in TYPES {
        let (q, _) = weight(&mut rng, dtype);
        let q = QWeight::new(Arc::new(q)).unwrap();
        let xs = randn(&mut rng, (512, 512));
        for isa in Isa::available() {
            let alone = |r: usize| bits(isa, &q, &xs.narrow(0, r, 1).unwrap()).remove(0);
            let first: Vec<Vec<u32>> = (0..100).map(alone).collect();
            for m in [2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 100, 512] {
                let ys = bits(isa, &q, &xs.narrow(0, 0, m).unwrap());
                for (r, y) in ys.iter().enumerate() {
                    let want = match r {
                        r if r < 100 => first[r].clone(),
                        511 => alone(511),
                        _ => continue,
                    };
                    assert_eq!(
                        *y, want,
                        "{dtype:?} {isa}: row {r} of {m} rows differs from it alone"
                    );
                }
            }
        }
    }
}

/// Every build this CPU runs, the portable one included, gives the same bits for the packed
/// types (per-lane integer sums and the same fused float operations), at every row count: the
/// `amx` tile kernels (8 to 16 rows a pass, blocks in pairs plus an odd one) included.
#[test]
fn packed_builds_agree_exactly() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let shapes = PACKED_TYPES
        .into_iter()
        .flat_map(|t| [(t, 512), (t, 544)])
        .chain([(GgmlDType::Q4K, 512), (GgmlDType::Q4K, 768)])
        .chain([(GgmlDType::Q6K, 256), (GgmlDType::Q6K, 768)]);
    for (dtype, k) in shapes {
        let (q, _) = weight_of(&mut rng, dtype, k);
        let q = QWeight::new(Arc::new(q)).unwrap();
        let xs = randn(&mut rng, (35, k));
        for m in [1, 2, 3, 9, 16, 17, 35] {
            let xs = xs.narrow(0, 0, m).unwrap();
            let want = bits(Isa::SCALAR, &q, &xs);
            for isa in Isa::available() {
                assert_eq!(
                    bits(isa, &q, &xs),
                    want,
                    "{dtype:?} k {k} m {m}: {isa} vs scalar"
                );
            }
        }
    }
}

/// `Q8_0` at its extremes (weights -128 and 127, activations at ±127): the sign trick stays
/// exact on every path (no 16-bit saturation), equal to the exact product in f64.
#[test]
fn q8_0_extremes_are_exact() {
    let (n, k) = (16, 64);
    let mut raw = Vec::new();
    for j in 0..n {
        for b in 0..k / 32 {
            raw.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            raw.extend((0..32).map(|i| match (i + j + b) % 3 {
                0 => 0x80u8, // -128
                1 => 0x7F,
                _ => (i * 7 + j) as u8,
            }));
        }
    }
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(raw),
        &Device::Cpu,
        GgmlDType::Q8_0,
    )
    .unwrap();
    let q = QTensor::new(storage, (n, k)).unwrap();
    let w = q.dequantize(&Device::Cpu).unwrap();
    let q = QWeight::new(Arc::new(q)).unwrap();
    // Each activation row quantizes exactly to ±127 (its block maximum is 127 d).
    let xs: Vec<f32> = (0..2 * k)
        .map(|i| if (i / 3) % 2 == 0 { 127.0 } else { -127.0 })
        .collect();
    let xs = Tensor::from_vec(xs, (2, k), &Device::Cpu).unwrap();
    let exact = xs
        .matmul(&w.t().unwrap())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for isa in Isa::available() {
        let got = matmul(isa, &q, &xs).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, exact, "{isa}");
    }
}

#[test]
fn rejects_bad_inputs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (q, _) = weight(&mut rng, GgmlDType::Q4_1);
    let q = QWeight::new(Arc::new(q)).unwrap();
    let bad = Tensor::zeros((2, 64), DType::F32, &Device::Cpu).unwrap();
    let err = matmul(Isa::detect(), &q, &bad).unwrap_err().to_string();
    assert!(err.contains("with input"), "{err}");
    let f32_weight = QTensor::quantize(&randn(&mut rng, (4, 64)), GgmlDType::F32).unwrap();
    let err = QWeight::new(Arc::new(f32_weight)).unwrap_err().to_string();
    assert!(err.contains("unsupported block type"), "{err}");
}

/// A weight restricted to some rows gives exactly those columns of the full product, for every
/// type and path (a draft vocabulary's lm_head); an id past the rows is refused.
#[test]
fn selected_rows_give_the_full_products_columns() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let ids: [u32; 19] = [
        39, 0, 17, 16, 15, 5, 5, 38, 1, 20, 33, 2, 31, 32, 8, 9, 24, 25, 3,
    ];
    for dtype in TYPES {
        let (q, _) = weight(&mut rng, dtype);
        let q = QWeight::new(Arc::new(q)).unwrap();
        let sub = q.select_rows(&ids).unwrap();
        assert_eq!(sub.shape(), (ids.len(), 512));
        let xs = randn(&mut rng, (3, 512));
        for isa in Isa::available() {
            let full = bits(isa, &q, &xs);
            let part = bits(isa, &sub, &xs);
            for (r, row) in part.iter().enumerate() {
                let want: Vec<u32> = ids.iter().map(|&j| full[r][j as usize]).collect();
                assert_eq!(*row, want, "{dtype:?} {isa}: row {r}");
            }
        }
        assert!(q.select_rows(&[40]).is_err(), "{dtype:?}: row 40 of 40");
    }
}

/// Raw GGUF bytes of a `[n, k]` weight of `dtype` whose scales are 1 (so the f16 fields are
/// sane) and whose quant bytes are `q(j, i)`: row `j`, byte `i` of a block's quants.
fn raw_weight(dtype: GgmlDType, n: usize, k: usize, q: impl Fn(usize, usize) -> u8) -> QTensor {
    let one = half::f16::from_f32(1.0).to_le_bytes();
    let mut raw = Vec::new();
    for j in 0..n {
        for _ in 0..k / block_elems(dtype) {
            let start = raw.len();
            // The f16 fields first (Q6_K's d last), then the quant bytes.
            let (halves, quants) = match dtype {
                GgmlDType::Q4_0 => (1, 16),
                GgmlDType::Q4_1 => (2, 16),
                GgmlDType::Q5_0 => (1, 4 + 16),
                GgmlDType::Q8_0 => (1, 32),
                // d, dmin; 12 bytes of 6-bit scales and mins, 128 of nibbles.
                GgmlDType::Q4K => (2, 12 + 128),
                // 128 bytes of low nibbles, 64 of high bits, 16 i8 scales; d.
                _ => (0, 128 + 64 + 16),
            };
            for _ in 0..halves {
                raw.extend(one);
            }
            raw.extend((0..quants).map(|i| q(j, i)));
            if halves == 0 {
                raw.extend(one);
            }
            assert_eq!(raw.len() - start, dtype.type_size());
        }
    }
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(raw),
        &Device::Cpu,
        dtype,
    )
    .unwrap();
    QTensor::new(storage, (n, k)).unwrap()
}

/// Weights at their largest magnitudes against activations all at +127 or all at -127: the
/// 16-bit partial sums of the AVX2 kernels neither saturate nor wrap, so every build gives the
/// portable build's bits (its integer sums are plain i32).
#[test]
fn extreme_blocks_do_not_overflow() {
    let (n, k) = (32, 512);
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let noise: Vec<u8> = (0..n * 256).map(|_| rng.random()).collect();
    // Rows 0..8 all ones bits (every nibble 15, 5-bit 31, 6-bit 63, scales 63 or -1), rows 8..16
    // 0x80 (Q8_0's -128, Q6_K's scale -128), the rest noise.
    let q = |j: usize, i: usize| match j {
        0..8 => 0xFF,
        8..16 => 0x80,
        _ => noise[j * 256 + i],
    };
    let mut xs: Vec<f32> = vec![1.5; k];
    xs.extend(vec![-1.5; k]);
    xs.extend((0..k).map(|i| if i % 3 == 0 { 1.5 } else { -1.5 }));
    let xs = Tensor::from_vec(xs, (3, k), &Device::Cpu).unwrap();
    for dtype in TYPES {
        let q = QWeight::new(Arc::new(raw_weight(dtype, n, k, q))).unwrap();
        let scalar = bits(Isa::SCALAR, &q, &xs);
        for isa in Isa::available() {
            assert_eq!(bits(isa, &q, &xs), scalar, "{dtype:?} {isa} vs scalar");
        }
    }
}

/// `Q6_K` against an f64 product of candle's dequantized weight and the exactly quantized
/// activations: only the f32 rounding of the per-super-block accumulation separates them, on
/// every path; odd shapes (n not a multiple of 16, one super-block) included.
#[test]
fn q6k_matches_an_f64_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    for (n, k) in [(40, 512), (7, 256), (33, 1280)] {
        let w = randn(&mut rng, (n, k));
        let q = QTensor::quantize(&w, GgmlDType::Q6K).unwrap();
        let dense: Vec<f32> = (q.dequantize(&Device::Cpu).unwrap().flatten_all())
            .unwrap()
            .to_vec1()
            .unwrap();
        let q = QWeight::new(Arc::new(q)).unwrap();
        let m = 5;
        let xs = randn(&mut rng, (m, k));
        let flat: Vec<f32> = xs.flatten_all().unwrap().to_vec1().unwrap();
        let acts = kquant::Acts::quantize(Isa::SCALAR, &flat, k);
        let rows = acts.rows();
        for isa in Isa::available() {
            let ys: Vec<Vec<f32>> = matmul(isa, &q, &xs).unwrap().to_vec2().unwrap();
            for (r, a) in rows.iter().enumerate() {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| dense[j * k + i] as f64 * a.q[i] as f64 * a.d[i / 256] as f64)
                        .sum();
                    let size: f64 = (0..k)
                        .map(|i| {
                            (dense[j * k + i] as f64 * a.q[i] as f64 * a.d[i / 256] as f64).abs()
                        })
                        .sum();
                    let got = ys[r][j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * size.max(1e-3),
                        "{isa} [{n}, {k}] row {r} out {j}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// `Q6_K`: each row of an m-row call is bit-identical to the row alone, and every path to the
/// portable build, at the row counts of decode, verify and prefill chunks.
#[test]
fn q6k_rows_and_builds_are_bit_identical() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    for (n, k) in [(40, 512), (23, 256)] {
        let q = QTensor::quantize(&randn(&mut rng, (n, k)), GgmlDType::Q6K).unwrap();
        let q = QWeight::new(Arc::new(q)).unwrap();
        let xs = randn(&mut rng, (64, k));
        let alone: Vec<Vec<u32>> = (0..64)
            .map(|r| bits(Isa::SCALAR, &q, &xs.narrow(0, r, 1).unwrap()).remove(0))
            .collect();
        for isa in Isa::available() {
            for m in [1, 2, 3, 7, 8, 9, 16, 17, 64] {
                let ys = bits(isa, &q, &xs.narrow(0, 0, m).unwrap());
                for (r, y) in ys.iter().enumerate() {
                    assert_eq!(
                        *y, alone[r],
                        "{isa} [{n}, {k}] row {r} of {m} vs scalar alone"
                    );
                }
            }
        }
    }
}

/// Bad `Q6_K` shapes are refused with the reason: a width that is not whole super-blocks
/// (where candle lets such a tensor be built at all), a weight that is not 2-D, and an input
/// of the wrong width.
#[test]
fn q6k_bad_shapes_are_refused() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(vec![0u8; 3 * 210]),
        &Device::Cpu,
        GgmlDType::Q6K,
    )
    .unwrap();
    if let Ok(t) = QTensor::new(storage, (2, 384)) {
        let err = QWeight::new(Arc::new(t)).unwrap_err().to_string();
        assert!(err.contains("whole number of blocks"), "{err}");
    }
    let flat = Tensor::zeros(512, DType::F32, &Device::Cpu).unwrap();
    let flat = QTensor::quantize(&flat, GgmlDType::Q6K).unwrap();
    let err = QWeight::new(Arc::new(flat)).unwrap_err().to_string();
    assert!(err.contains("not 2-D"), "{err}");
    let (q, _) = weight(&mut rng, GgmlDType::Q6K);
    let q = QWeight::new(Arc::new(q)).unwrap();
    let bad = Tensor::zeros((3, 256), DType::F32, &Device::Cpu).unwrap();
    for isa in Isa::available() {
        let err = matmul(isa, &q, &bad).unwrap_err().to_string();
        assert!(err.contains("with input"), "{err}");
    }
}
