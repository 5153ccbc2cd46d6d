//! The drafter's own tensors: a safetensors file read whole (drafters are small) and handed out
//! by name, with the shape checked and the file named in every error. Projections keep the
//! checkpoint's dtype by default (the shipped drafters are bf16: half the bytes of f32 per step,
//! the same values), or run in f32, or are requantized to Q8_0 (`--linear-dtype q8_0`): a
//! quarter of the f32 bytes through the runtime's quantized kernels, at the cost of exact parity
//! with the reference.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use specula_models::layers::{Linear, RmsNorm};

use crate::Error;

/// How the drafter's projections are stored (`--linear-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinearDType {
    /// As in the checkpoint (f32, f16 or bf16; other dtypes become f32).
    #[default]
    Stored,
    /// f32.
    F32,
    /// Requantized to Q8_0 at load (those whose input width is a multiple of 32).
    Q8_0,
}

impl std::str::FromStr for LinearDType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stored" => Ok(LinearDType::Stored),
            "f32" => Ok(LinearDType::F32),
            "q8_0" => Ok(LinearDType::Q8_0),
            other => Err(format!(
                "--linear-dtype must be stored, f32 or q8_0, got {other:?}"
            )),
        }
    }
}

/// The tensors of one drafter file, by checkpoint name (a leading `model.` is dropped).
pub struct Tensors {
    path: PathBuf,
    map: HashMap<String, Tensor>,
    linears: LinearDType,
}

impl Tensors {
    /// Reads `path` onto `device`.
    ///
    /// # Errors
    /// [`Error::Weights`] when the file is missing or not safetensors.
    pub fn read(path: &Path, device: &Device) -> Result<Self, Error> {
        let bad = |reason: String| Error::Weights {
            path: path.to_path_buf(),
            reason,
        };
        let map = candle_core::safetensors::load(path, device).map_err(|e| bad(e.to_string()))?;
        let map = specula_models::int8::dequantize_map(map).map_err(|e| bad(e.to_string()))?;
        let map = map
            .into_iter()
            .map(|(k, v)| (k.strip_prefix("model.").map(str::to_string).unwrap_or(k), v))
            .collect();
        Ok(Tensors {
            path: path.to_path_buf(),
            map,
            linears: LinearDType::Stored,
        })
    }

    /// Hands out projections stored as `linears` says.
    pub fn with_linears(mut self, linears: LinearDType) -> Self {
        self.linears = linears;
        self
    }

    /// Where the tensors came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file has `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn bad(&self, reason: String) -> Error {
        Error::Weights {
            path: self.path.clone(),
            reason,
        }
    }

    /// `name` as f32, checked to have `shape`.
    ///
    /// # Errors
    /// [`Error::Weights`] when it is absent or of another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, Error> {
        self.stored(name, shape)?
            .to_dtype(DType::F32)
            .map_err(|e| self.bad(format!("tensor {name}: {e}")))
    }

    /// `name` in the checkpoint's dtype, checked to have `shape`.
    fn stored(&self, name: &str, shape: &[usize]) -> Result<&Tensor, Error> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| self.bad(format!("tensor {name} is missing")))?;
        if t.dims() != shape {
            return Err(self.bad(format!(
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t)
    }

    /// The projection `{prefix}.weight` `[out, in]`, with `{prefix}.bias` when `bias`.
    ///
    /// # Errors
    /// As [`Tensors::get`].
    pub fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear, Error> {
        let name = format!("{prefix}.weight");
        let b = match bias {
            true => Some(self.get(&format!("{prefix}.bias"), &[out])?),
            false => None,
        };
        let bad = |e: String| self.bad(format!("{prefix}: {e}"));
        match self.linears {
            LinearDType::Q8_0 if inp.is_multiple_of(32) => {
                let w = self.get(&name, &[out, inp])?;
                let q = QTensor::quantize(&w, GgmlDType::Q8_0).map_err(|e| bad(e.to_string()))?;
                Linear::quantized(Arc::new(q), b).map_err(|e| bad(e.to_string()))
            }
            LinearDType::Stored => {
                let w = self.stored(&name, &[out, inp])?.clone();
                Linear::dense(w, b).map_err(|e| bad(e.to_string()))
            }
            _ => {
                let w = self.get(&name, &[out, inp])?;
                Linear::dense(w, b).map_err(|e| bad(e.to_string()))
            }
        }
    }

    /// The RMSNorm `{prefix}.weight` `[dim]`.
    ///
    /// # Errors
    /// As [`Tensors::get`].
    pub fn norm(&self, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm, Error> {
        let w = self.get(&format!("{prefix}.weight"), &[dim])?;
        RmsNorm::new(w, eps).map_err(|e| self.bad(format!("{prefix}: {e}")))
    }
}
