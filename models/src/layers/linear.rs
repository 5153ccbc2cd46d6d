//! A linear projection `y = x W^T (+ b)` over weights kept `[out, in]`: GGUF blocks run by
//! [`qmatmul`], dense f32/f16/bf16 run by [`dense`], both ours on the CPU so that a row's
//! output is bit-identical whatever the number of rows in the call (one decode row, a verify
//! window, a prefill chunk, rows of several sequences). candle's kernels run only on
//! accelerators.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, DType, Device, Module, Storage, Tensor};

use crate::error::{Error, Result};
use crate::layers::dense::{self, Weights};
use crate::layers::qmatmul;
use crate::layers::simd::Isa;

/// How the weight is stored.
#[derive(Clone, Debug)]
pub enum Weight {
    /// GGUF blocks of a type [`qmatmul::supports`], on the CPU (repacked at load).
    Quantized(Arc<qmatmul::QWeight>),
    /// Dense, contiguous `[out, in]` in f32, f16 or bf16 (on the CPU: [`dense`]). GGUF
    /// tensors of other block types are dequantized to f32 at load.
    Dense(Tensor),
    /// GGUF blocks on an accelerator, run by candle.
    Device(QMatMul),
}

/// Linear layer with optional bias (bias kept in f32).
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    isa: Isa,
}

impl Linear {
    /// A projection over GGUF blocks.
    ///
    /// # Errors
    /// If the tensor cannot be dequantized or wrapped, or `SPECULA_ISA` names a SIMD path this
    /// CPU lacks.
    pub fn quantized(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let cpu = Device::Cpu;
        let weight = match weight.dtype() {
            _ if !weight.device().is_cpu() => Weight::Device(QMatMul::from_arc(weight)?),
            t if qmatmul::supports(t) => {
                Weight::Quantized(Arc::new(qmatmul::QWeight::new(weight)?))
            }
            // Dense GGUF tensors keep their precision; exotic block types become f32.
            GgmlDType::F16 => Weight::Dense(weight.dequantize_f16(&cpu)?),
            GgmlDType::BF16 => Weight::Dense(weight.dequantize(&cpu)?.to_dtype(DType::BF16)?),
            _ => Weight::Dense(weight.dequantize(&cpu)?),
        };
        Self::new(weight, bias)
    }

    /// A projection over an already packed quantized weight (e.g. [`qmatmul::QWeight::select_rows`]).
    ///
    /// # Errors
    /// As [`Linear::quantized`].
    pub fn from_qweight(weight: Arc<qmatmul::QWeight>, bias: Option<Tensor>) -> Result<Self> {
        Self::new(Weight::Quantized(weight), bias)
    }

    /// A dense projection over `weight` `[out, in]` (f32, f16 or bf16 are kept; other dtypes
    /// become f32).
    ///
    /// # Errors
    /// If `weight` is not 2-D, or as [`Linear::quantized`].
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        weight.dims2()?;
        let weight = match weight.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => weight.contiguous()?,
            _ => weight.to_dtype(DType::F32)?.contiguous()?,
        };
        Self::new(Weight::Dense(weight), bias)
    }

    fn new(weight: Weight, bias: Option<Tensor>) -> Result<Self> {
        Ok(Self {
            weight,
            bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
            isa: Isa::selected()?,
        })
    }

    /// The stored weight.
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// The bias, in f32.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The SIMD path this layer runs on the CPU.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// This layer on another SIMD path (tests and benchmarks compare paths).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.isa = isa;
        self
    }

    /// `xs` `[.., in]` f32 → `[.., out]` f32.
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let Some((&k, lead)) = dims.split_last() else {
            return Err(Error::InvalidRequest {
                op: "linear",
                reason: "a scalar input".into(),
            });
        };
        let rows: usize = lead.iter().product();
        let xs2 = xs.reshape((rows, k))?;
        let ys = match &self.weight {
            Weight::Quantized(w) => qmatmul::matmul(self.isa, w, &xs2)?,
            Weight::Dense(w) if w.device().is_cpu() => dense_forward(self.isa, w, &xs2)?,
            // Accelerators: candle's matmul, in the weight's dtype (no dequantized copy).
            Weight::Dense(w) => xs2
                .to_dtype(w.dtype())?
                .matmul(&w.t()?)?
                .to_dtype(DType::F32)?,
            Weight::Device(q) => q.forward(&xs2.contiguous()?)?,
        };
        let mut out = lead.to_vec();
        out.push(ys.dim(1)?);
        let ys = ys.reshape(out)?;
        match &self.bias {
            Some(b) => Ok(ys.broadcast_add(b)?),
            None => Ok(ys),
        }
    }
}

impl Linear {
    /// `layers[i].forward(xs)` for every `i`, bit for bit, for projections that share their
    /// input (q|k|v, gate|up): when all are quantized on the CPU on one SIMD path, one
    /// [`qmatmul::matmul_many`] (one activation quantization, one fork-join).
    ///
    /// # Errors
    /// On a shape mismatch.
    pub fn forward_many(layers: &[&Linear], xs: &Tensor) -> Result<Vec<Tensor>> {
        let quantized: Option<Vec<&qmatmul::QWeight>> = (layers.iter())
            .map(|l| match &l.weight {
                Weight::Quantized(w) if l.isa == layers[0].isa => Some(&**w),
                _ => None,
            })
            .collect();
        let (Some(ws), Some((&k, lead))) = (quantized, xs.dims().split_last()) else {
            return layers.iter().map(|l| l.forward(xs)).collect();
        };
        let rows: usize = lead.iter().product();
        let ys = qmatmul::matmul_many(layers[0].isa, &ws, &xs.reshape((rows, k))?)?;
        (layers.iter().zip(ys))
            .map(|(l, ys)| {
                let mut out = lead.to_vec();
                out.push(ys.dim(1)?);
                let ys = ys.reshape(out)?;
                match &l.bias {
                    Some(b) => Ok(ys.broadcast_add(b)?),
                    None => Ok(ys),
                }
            })
            .collect()
    }
}

/// `xs` `[m, k]` times the CPU dense weight `w` `[n, k]` through [`dense::matmul`].
fn dense_forward(isa: Isa, w: &Tensor, xs: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let (m, xk) = xs.dims2()?;
    if xk != k {
        return Err(Error::InvalidRequest {
            op: "linear",
            reason: format!("input {:?} against weight [{n}, {k}]", xs.shape()),
        });
    }
    if m == 0 {
        return Ok(Tensor::zeros((0, n), DType::F32, &Device::Cpu)?);
    }
    let xs = xs.to_dtype(DType::F32)?.contiguous()?;
    let (x_storage, x_layout) = xs.storage_and_layout();
    let (w_storage, w_layout) = w.storage_and_layout();
    let (Storage::Cpu(x_cpu), Storage::Cpu(w_cpu)) = (&*x_storage, &*w_storage) else {
        return Err(Error::InvalidRequest {
            op: "linear",
            reason: "dense operands off the CPU".into(),
        });
    };
    let x = &x_cpu.as_slice::<f32>()?[x_layout.start_offset()..][..m * k];
    let at = w_layout.start_offset();
    // `Linear::dense` keeps the weight contiguous in one of these dtypes.
    let weights = match w_cpu {
        CpuStorage::F32(v) => Weights::F32(&v[at..at + n * k]),
        CpuStorage::F16(v) => Weights::F16(&v[at..at + n * k]),
        CpuStorage::BF16(v) => Weights::Bf16(&v[at..at + n * k]),
        _ => {
            return Err(Error::InvalidRequest {
                op: "linear",
                reason: format!("dense weight of dtype {:?}", w.dtype()),
            })
        }
    };
    let ys = dense::matmul(isa, weights, n, x, m);
    Ok(Tensor::from_vec(ys, (m, n), &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every weight type our models use, through [`Linear`] as a model builds it.
    fn layers(rng: &mut rand::rngs::StdRng, n: usize, k: usize) -> Vec<(String, Linear)> {
        let data: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w = Tensor::from_vec(data, (n, k), &Device::Cpu).unwrap();
        let mut out = Vec::new();
        for t in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5K,
            GgmlDType::F16,
            GgmlDType::F32,
        ] {
            let q = Arc::new(QTensor::quantize(&w, t).unwrap());
            out.push((format!("gguf {t:?}"), Linear::quantized(q, None).unwrap()));
        }
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let d = Linear::dense(w.to_dtype(dt).unwrap(), None).unwrap();
            out.push((format!("dense {dt:?}"), d));
        }
        out
    }

    /// A row's output is bit-identical at every row count, for every weight type and every
    /// SIMD path this CPU runs (the property the engine's batch invariance rests on).
    #[test]
    fn rows_are_bit_identical_at_every_row_count() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let (n, k) = (40, 512);
        let xs: Vec<f32> = (0..512 * k).map(|_| rng.random_range(-2.0..2.0)).collect();
        let xs = Tensor::from_vec(xs, (512, k), &Device::Cpu).unwrap();
        for (name, layer) in layers(&mut rng, n, k) {
            for isa in Isa::available() {
                let layer = layer.clone().with_isa(isa);
                let one = |r: usize| -> Vec<u32> {
                    let y = layer.forward(&xs.narrow(0, r, 1).unwrap()).unwrap();
                    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
                    y.into_iter().map(f32::to_bits).collect()
                };
                let alone: Vec<Vec<u32>> = (0..100).map(one).collect();
                for m in [2, 3, 7, 16, 17, 33, 100, 512] {
                    let ys: Vec<Vec<f32>> = layer
                        .forward(&xs.narrow(0, 0, m).unwrap())
                        .unwrap()
                        .to_vec2()
                        .unwrap();
                    // Rows past 100 are checked against row 511 alone (the last one).
                    for (r, y) in ys.iter().enumerate() {
                        let y: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                        let want = match r {
                            r if r < 100 => alone[r].clone(),
                            511 => one(511),
                            _ => continue,
                        };
                        assert_eq!(y, want, "{name} {isa}: row {r} of {m} rows");
                    }
                }
            }
        }
    }

    /// `forward_many` over layers sharing an input gives each layer's own `forward`, bit for
    /// bit: packed 32-element, `Q4_K`, `Q6_K` and dense weights mixed, a bias, every SIMD path, one
    /// row, a window and a window past a group of 8.
    #[test]
    fn forward_many_equals_each_forward() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let k = 512;
        let xs: Vec<f32> = (0..9 * k).map(|_| rng.random_range(-2.0..2.0)).collect();
        let xs = Tensor::from_vec(xs, (9, k), &Device::Cpu).unwrap();
        let mut all: Vec<Linear> = layers(&mut rng, 48, k)
            .into_iter()
            .map(|(_, l)| l)
            .collect();
        let bias = Tensor::arange(0f32, 48., &Device::Cpu).unwrap();
        all.push(Linear::new(all[4].weight.clone(), Some(bias)).unwrap());
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        // Q4_0 Q4_1 Q5_0 | Q8_0 Q4_K Q6_K Q4_K+bias | Q4_1 + dense f16 | Q6_K alone
        for ids in [vec![0, 1, 2], vec![3, 4, 5, 12], vec![1, 7], vec![5]] {
            for isa in Isa::available() {
                let set: Vec<Linear> = ids.iter().map(|&i| all[i].clone().with_isa(isa)).collect();
                let ls: Vec<&Linear> = set.iter().collect();
                for m in [1, 4, 9] {
                    let x = xs.narrow(0, 0, m).unwrap();
                    let got = Linear::forward_many(&ls, &x).unwrap();
                    assert_eq!(got.len(), ls.len());
                    for (l, y) in ls.iter().zip(got) {
                        let want = l.forward(&x).unwrap();
                        assert_eq!(y.dims(), want.dims());
                        assert_eq!(bits(&y), bits(&want), "{isa} {ids:?} m {m}");
                    }
                }
            }
        }
    }

    #[test]
    fn bias_and_leading_dims() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        let w: Vec<f32> = (0..6 * 32).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w = Tensor::from_vec(w, (6, 32), &Device::Cpu).unwrap();
        let b = Tensor::arange(0f32, 6., &Device::Cpu).unwrap();
        let layer = Linear::dense(w.clone(), Some(b.clone())).unwrap();
        let xs: Vec<f32> = (0..2 * 3 * 32)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let xs = Tensor::from_vec(xs, (2, 3, 32), &Device::Cpu).unwrap();
        let ys = layer.forward(&xs).unwrap();
        assert_eq!(ys.dims(), &[2, 3, 6]);
        let want = xs
            .reshape((6, 32))
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        let diff = (ys.reshape((6, 6)).unwrap() - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn wrong_input_width_is_an_error() {
        let w = Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap();
        let layer = Linear::dense(w.clone(), None).unwrap();
        let bad = Tensor::zeros((2, 31), DType::F32, &Device::Cpu).unwrap();
        let err = layer.forward(&bad).unwrap_err().to_string();
        assert!(err.contains("input"), "{err}");
        let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap());
        let layer = Linear::quantized(q, None).unwrap();
        assert!(layer.forward(&bad).is_err());
    }
}
