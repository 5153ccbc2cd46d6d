//! The drafter's own tensors: a safetensors file read whole (drafters are small) and handed out
//! by name as f32, with the shape checked and the file named in every error. Projections can be
//! requantized to Q8_0 (`--linear-dtype q8_0`): a quarter of the bytes per step through the
//! runtime's quantized kernels, at the cost of exact parity with the f32 reference.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use specula_models::layers::{Linear, RmsNorm};

use crate::Error;

/// The tensors of one drafter file, by checkpoint name (a leading `model.` is dropped).
pub struct Tensors {
    path: PathBuf,
    map: HashMap<String, Tensor>,
    q8: bool,
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
            q8: false,
        })
    }

    /// Hands out projections requantized to Q8_0 (those whose input width is a multiple of the
    /// 32-weight block) when `on`.
    pub fn with_q8(mut self, on: bool) -> Self {
        self.q8 = on;
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
        t.to_dtype(DType::F32)
            .map_err(|e| self.bad(format!("tensor {name}: {e}")))
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
        let w = self.get(&format!("{prefix}.weight"), &[out, inp])?;
        let b = match bias {
            true => Some(self.get(&format!("{prefix}.bias"), &[out])?),
            false => None,
        };
        let bad = |e: String| self.bad(format!("{prefix}: {e}"));
        match self.q8 && inp.is_multiple_of(32) {
            true => {
                let q = QTensor::quantize(&w, GgmlDType::Q8_0).map_err(|e| bad(e.to_string()))?;
                Linear::quantized(Arc::new(q), b).map_err(|e| bad(e.to_string()))
            }
            false => Linear::dense(w, b).map_err(|e| bad(e.to_string())),
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
