//! Kernel tests: unpacking against candle's dequantization, products against a dense matmul,
//! exact chunk-size invariance, and agreement of the SIMD and scalar builds.

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

/// The types of the 32-element [`Block`] path (the k-quants have their own kernels).
const BLOCK_TYPES: [GgmlDType; 4] = [
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

/// A small `[n, k]` weight (k spans two k-quant super-blocks) quantized to `dtype`.
fn weight(rng: &mut rand::rngs::StdRng, dtype: GgmlDType) -> (QTensor, Tensor) {
    let w = randn(rng, (24, 512));
    let q = QTensor::quantize(&w, dtype).unwrap();
    let dense = q.dequantize(&Device::Cpu).unwrap();
    (q, dense)
}

/// Every row of `q` unpacked by this build's [`unpack::unpack_row`].
fn unpacked_rows(q: &QTensor) -> Vec<Vec<Block>> {
    let (n, k) = q.shape().dims2().unwrap();
    let data = q.data().unwrap();
    let row_bytes = data.len() / n;
    (0..n)
        .map(|j| {
            let mut blocks = vec![Block::default(); k / QK];
            unpack::unpack_row(
                q.dtype(),
                &data[j * row_bytes..(j + 1) * row_bytes],
                &mut blocks,
            );
            blocks
        })
        .collect()
}

/// `scale * q + min` of the unpacked blocks is candle's dequantization of the same bytes.
#[test]
fn unpack_matches_candle_dequantize() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for dtype in BLOCK_TYPES {
        let (q, dense) = weight(&mut rng, dtype);
        let k = dense.dim(1).unwrap();
        let dense: Vec<f32> = dense.flatten_all().unwrap().to_vec1().unwrap();
        for (j, blocks) in unpacked_rows(&q).iter().enumerate() {
            for (b, blk) in blocks.iter().enumerate() {
                for i in 0..QK {
                    let ours = blk.scale[i / 4] * blk.q[i] as f32 + blk.min;
                    let theirs = dense[j * k + b * QK + i];
                    assert!(
                        (ours - theirs).abs() <= 1e-6 * theirs.abs().max(1.0),
                        "{dtype:?} row {j} elem {}: {ours} vs {theirs}",
                        b * QK + i
                    );
                }
                let sums: Vec<i32> = (0..8)
                    .map(|l| {
                        -128 * blk.q[4 * l..4 * l + 4]
                            .iter()
                            .map(|&x| x as i32)
                            .sum::<i32>()
                    })
                    .collect();
                assert_eq!(blk.neg_corr.to_vec(), sums, "{dtype:?} row {j} block {b}");
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
        for m in [1, 3, 8, 17] {
            let xs = randn(&mut rng, (m, 512));
            let ours = matmul(Isa::detect(), &q, &xs).unwrap();
            let theirs = xs.matmul(&dense.t().unwrap()).unwrap();
            assert_eq!(ours.dims(), theirs.dims());
            let diff = max_abs(&(ours - &theirs).unwrap());
            let scale = max_abs(&theirs);
            assert!(
                diff < 1e-2 * scale,
                "{dtype:?} m={m}: {diff} (max |y| {scale})"
            );
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
        let xs = randn(&mut rng, (512, 512));
        for isa in Isa::available() {
            let alone = |r: usize| -> Vec<u32> {
                let y = matmul(isa, &q, &xs.narrow(0, r, 1).unwrap()).unwrap();
                let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
                y.into_iter().map(f32::to_bits).collect()
            };
            let first: Vec<Vec<u32>> = (0..100).map(alone).collect();
            for m in [2, 3, 7, 16, 17, 33, 100, 512] {
                let ys: Vec<Vec<f32>> = matmul(isa, &q, &xs.narrow(0, 0, m).unwrap())
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                for (r, y) in ys.iter().enumerate() {
                    let want = match r {
                        r if r < 100 => first[r].clone(),
                        511 => alone(511),
                        _ => continue,
                    };
                    let y: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        y, want,
                        "{dtype:?} {isa}: row {r} of {m} rows differs from it alone"
                    );
                }
            }
        }
    }
}

/// Every SIMD build of this CPU computes the same integer lane sums as the scalar one, so the
/// results agree up to fused-multiply-add rounding.
#[test]
fn simd_matches_scalar() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for dtype in BLOCK_TYPES {
        let (q, _) = weight(&mut rng, dtype);
        let xs: Vec<f32> = randn(&mut rng, (1, 512))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let acts = Acts::quantize(Isa::SCALAR, &xs, 512);
        for isa in Isa::available() {
            assert_eq!(
                Acts::quantize(isa, &xs, 512).q,
                acts.q,
                "{isa} quantization"
            );
            for (j, blocks) in unpacked_rows(&q).iter().enumerate() {
                let mut simd = [0f32];
                dot::dot_rows(isa, blocks, unpack::has_min(dtype), &acts.rows(), &mut simd);
                let simd = simd[0];
                let scalar = dot::dot_scalar(blocks, acts.rows()[0]);
                assert!(
                    (simd - scalar).abs() <= 1e-5 * scalar.abs().max(1.0),
                    "{dtype:?} ({isa}) row {j}: {simd} vs {scalar}"
                );
            }
        }
    }
}

#[test]
fn rejects_bad_inputs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (q, _) = weight(&mut rng, GgmlDType::Q4_1);
    let bad = Tensor::zeros((2, 64), DType::F32, &Device::Cpu).unwrap();
    assert!(matmul(Isa::detect(), &q, &bad).is_err());
    let f32_weight = QTensor::quantize(&randn(&mut rng, (4, 64)), GgmlDType::F32).unwrap();
    let xs = Tensor::zeros((1, 64), DType::F32, &Device::Cpu).unwrap();
    assert!(matmul(Isa::detect(), &f32_weight, &xs).is_err());
}

/// The AVX2 unpacking writes exactly the blocks of the portable one.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_unpack_matches_scalar() {
    if Isa::detect() == Isa::SCALAR {
        eprintln!("no AVX2 on this CPU: only the portable unpacking runs here");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for dtype in BLOCK_TYPES {
        let (q, _) = weight(&mut rng, dtype);
        let data = q.data().unwrap();
        let row_bytes = data.len() / 24;
        let mut scalar = vec![Block::default(); 512 / QK];
        let mut simd = scalar.clone();
        for j in 0..24 {
            let row = &data[j * row_bytes..(j + 1) * row_bytes];
            unpack::unpack_row(dtype, row, &mut scalar);
            // SAFETY: the detected path is not scalar, so the CPU has AVX2, FMA and F16C.
            unsafe { unpack::x86::unpack_row(dtype, row, &mut simd) };
            for (b, (s, v)) in scalar.iter().zip(&simd).enumerate() {
                assert_eq!(s.q, v.q, "{dtype:?} row {j} block {b}");
                assert_eq!(s.neg_corr, v.neg_corr, "{dtype:?} row {j} block {b}");
                assert_eq!(s.scale.map(f32::to_bits), v.scale.map(f32::to_bits));
                assert_eq!(
                    s.min.to_bits(),
                    v.min.to_bits(),
                    "{dtype:?} row {j} block {b}"
                );
            }
        }
    }
}

/// Every SIMD build this CPU runs gives bit-identical products (same integer lanes, same float
/// order), buffered or fused, so the AVX2 fallback is exercised even on a VNNI machine.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_builds_agree_exactly() {
    let simd: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::SCALAR)
        .collect();
    let Some(&first) = simd.first() else {
        eprintln!("no AVX2 on this CPU: only the portable build runs here");
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for dtype in BLOCK_TYPES {
        let (q, _) = weight(&mut rng, dtype);
        let xs: Vec<f32> = randn(&mut rng, (6, 512))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let acts = Acts::quantize(first, &xs, 512);
        let data = q.data().unwrap();
        let row = &data[..data.len() / 24];
        let mut blocks = vec![Block::default(); 512 / QK];
        unpack::unpack_row(dtype, row, &mut blocks);
        let has_min = unpack::has_min(dtype);
        let mut want = [0f32; 6];
        dot::dot_rows(first, &blocks, has_min, &acts.rows(), &mut want);
        for &isa in &simd {
            let mut got = [0f32; 6];
            dot::dot_rows(isa, &blocks, has_min, &acts.rows(), &mut got);
            assert_eq!(
                got.map(f32::to_bits),
                want.map(f32::to_bits),
                "{dtype:?} {isa}"
            );
            // The decode kernels (unpacking in registers) give the same bits.
            for (r, a) in acts.rows().into_iter().enumerate() {
                // SAFETY: `isa` is an available SIMD path.
                let y = unsafe { fused::dot(isa, dtype, row, a) };
                assert_eq!(
                    y.to_bits(),
                    want[r].to_bits(),
                    "{dtype:?} {isa} fused row {r}"
                );
            }
        }
    }
}

/// The k-quant kernels: every SIMD build gives the same bits (exact integer sums, one float
/// order), in a group of rows or alone, and the scalar build agrees up to FMA rounding.
#[test]
fn k_quant_builds_agree() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let (q, _) = weight(&mut rng, dtype);
        let xs = randn(&mut rng, (kquant::GROUP + 1, 512));
        let bits = |isa: Isa| -> Vec<u32> {
            let y = matmul(isa, &q, &xs).unwrap();
            let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
            y.into_iter().map(f32::to_bits).collect()
        };
        let scalar: Vec<f32> = bits(Isa::SCALAR).into_iter().map(f32::from_bits).collect();
        let simd: Vec<Isa> = Isa::available()
            .into_iter()
            .filter(|&i| i != Isa::SCALAR)
            .collect();
        let Some(&first) = simd.first() else {
            eprintln!("no AVX2 on this CPU: only the portable build runs here");
            continue;
        };
        let want = bits(first);
        for &isa in &simd {
            assert_eq!(bits(isa), want, "{dtype:?} {isa} vs {first}");
        }
        // Q4_K's two terms (scales, mins) nearly cancel: compare against the outputs' size.
        let size = scalar.iter().fold(1f32, |a, v| a.max(v.abs()));
        for (i, (&s, &v)) in scalar.iter().zip(&want).enumerate() {
            let v = f32::from_bits(v);
            assert!(
                (s - v).abs() <= 1e-5 * size,
                "{dtype:?} output {i}: scalar {s} vs {first} {v}"
            );
        }
    }
}
