//! Named tensors from a GGUF file or HF safetensors, converted to the requested
//! [`WeightDType`]. Architectures ask for tensors by their HF name
//! (`model.layers.0.self_attn.q_proj.weight`); [`gguf_name`] maps that to llama.cpp's name
//! (`blk.0.attn_q.weight`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::layers::{Embedding, Linear};

/// The dtype weights are kept in after loading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDType {
    /// As stored: GGUF stays quantized (run by `layers::qmatmul`), safetensors keep their dtype.
    #[default]
    Native,
    /// Dense f32 (dequantizes GGUF).
    F32,
    /// Dense f16.
    F16,
    /// Dense bf16.
    Bf16,
}

impl FromStr for WeightDType {
    type Err = Error;

    /// Parses `native`, `f32`, `f16` or `bf16` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "native" => Ok(Self::Native),
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            _ => Err(Error::InvalidRequest {
                op: "parse weight dtype",
                reason: format!("'{s}' is not one of native, f32, f16, bf16"),
            }),
        }
    }
}

/// Which of llama.cpp's tensor-name tables a GGUF file follows: they differ for the norm
/// after attention (llama's `ffn_norm` is the norm *before* the MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufNames {
    /// llama, qwen2, qwen3, ...
    Llama,
    /// gemma2, gemma3, gemma4: sandwich norms (`post_attention_norm`, `ffn_norm`,
    /// `post_ffw_norm`).
    Gemma,
}

impl GgufNames {
    /// The table of GGUF `general.architecture` `arch`.
    pub fn of_arch(arch: &str) -> Self {
        match arch.starts_with("gemma") {
            true => Self::Gemma,
            false => Self::Llama,
        }
    }
}

/// HF tensor name → GGUF tensor name of a llama-family file (see [`gguf_name_in`]).
pub fn gguf_name(hf: &str) -> Option<String> {
    gguf_name_in(GgufNames::Llama, hf)
}

/// HF tensor name → GGUF tensor name, following llama.cpp's `tensor_mapping.py`.
pub fn gguf_name_in(names: GgufNames, hf: &str) -> Option<String> {
    let (stem, suffix) = hf.rsplit_once('.')?;
    let mapped = match stem {
        "model.embed_tokens" => "token_embd".to_string(),
        "model.norm" => "output_norm".to_string(),
        "lm_head" => "output".to_string(),
        _ => {
            let rest = stem.strip_prefix("model.layers.")?;
            let (layer, part) = rest.split_once('.')?;
            let part = match part {
                "input_layernorm" => "attn_norm",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "post_attention_layernorm" => match names {
                    GgufNames::Llama => "ffn_norm",
                    GgufNames::Gemma => "post_attention_norm",
                },
                "pre_feedforward_layernorm" => "ffn_norm",
                "post_feedforward_layernorm" => "post_ffw_norm",
                "mlp.gate_proj" => "ffn_gate",
                "mlp.up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                _ => return None,
            };
            format!("blk.{layer}.{part}")
        }
    };
    Some(format!("{mapped}.{suffix}"))
}

/// A tensor after the dtype policy: still quantized, or dense.
enum Raw {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

enum Source {
    Gguf {
        content: gguf_file::Content,
        file: File,
        names: GgufNames,
    },
    Safetensors(MmapedSafetensors),
}

/// An open weight file (or set of shards) that hands out layers.
pub struct Weights {
    source: Source,
    path: PathBuf,
    dtype: WeightDType,
    device: Device,
}

impl Weights {
    /// Wraps a GGUF file whose header has been read into `content`.
    pub fn gguf(
        content: gguf_file::Content,
        file: File,
        path: &Path,
        dtype: WeightDType,
        device: &Device,
    ) -> Self {
        let names = match content.metadata.get("general.architecture") {
            Some(gguf_file::Value::String(arch)) => GgufNames::of_arch(arch),
            _ => GgufNames::Llama,
        };
        Self {
            source: Source::Gguf {
                content,
                file,
                names,
            },
            path: path.to_path_buf(),
            dtype,
            device: device.clone(),
        }
    }

    /// Memory-maps safetensors shards of the HF directory `dir`.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if a shard is missing, truncated or not safetensors.
    pub fn safetensors(
        dir: &Path,
        shards: &[PathBuf],
        dtype: WeightDType,
        device: &Device,
    ) -> Result<Self> {
        // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we
        // rely on nobody truncating the checkpoint while the model runs.
        let st = unsafe { MmapedSafetensors::multi(shards) }.map_err(|e| Error::InvalidModel {
            path: dir.to_path_buf(),
            reason: format!("safetensors: {e}"),
        })?;
        Ok(Self {
            source: Source::Safetensors(st),
            path: dir.to_path_buf(),
            dtype,
            device: device.clone(),
        })
    }

    /// The file or directory the weights come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device tensors are loaded onto.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the checkpoint has the tensor of HF name `hf`.
    pub fn contains(&self, hf: &str) -> bool {
        match &self.source {
            Source::Gguf { content, names, .. } => {
                gguf_name_in(*names, hf).is_some_and(|n| content.tensor_infos.contains_key(&n))
            }
            Source::Safetensors(st) => st.get(hf).is_ok(),
        }
    }

    fn missing(&self, hf: &str) -> Error {
        let what = match &self.source {
            Source::Gguf { names, .. } => match gguf_name_in(*names, hf) {
                Some(n) => format!("tensor {n} ({hf})"),
                None => format!("tensor {hf} (no GGUF name)"),
            },
            Source::Safetensors(_) => format!("tensor {hf}"),
        };
        Error::Missing {
            what,
            path: self.path.clone(),
        }
    }

    fn invalid(&self, hf: &str, e: impl std::fmt::Display) -> Error {
        Error::InvalidModel {
            path: self.path.clone(),
            reason: format!("tensor {hf}: {e}"),
        }
    }

    /// Reads `hf` and applies the dtype policy.
    fn raw(&mut self, hf: &str) -> Result<Raw> {
        if !self.contains(hf) {
            return Err(self.missing(hf));
        }
        let dense = |t: Tensor| -> candle_core::Result<Tensor> {
            Ok(match self.dtype {
                WeightDType::Native => t,
                WeightDType::F32 => t.to_dtype(DType::F32)?,
                WeightDType::F16 => t.to_dtype(DType::F16)?,
                WeightDType::Bf16 => t.to_dtype(DType::BF16)?,
            })
        };
        match &mut self.source {
            Source::Gguf {
                content,
                file,
                names,
            } => {
                let name = gguf_name_in(*names, hf).expect("invariant: contains() mapped the name");
                let q =
                    content
                        .tensor(file, &name, &self.device)
                        .map_err(|e| Error::InvalidModel {
                            path: self.path.clone(),
                            reason: format!("tensor {name}: {e}"),
                        })?;
                match self.dtype {
                    WeightDType::Native => Ok(Raw::Quantized(Arc::new(q))),
                    _ => {
                        let t = q.dequantize(&self.device)?;
                        Ok(Raw::Dense(dense(t)?))
                    }
                }
            }
            Source::Safetensors(st) => {
                let t = st.load(hf, &self.device).map_err(|e| Error::InvalidModel {
                    path: self.path.clone(),
                    reason: format!("tensor {hf}: {e}"),
                })?;
                if t.dtype() == DType::U8 {
                    // Specula's int8 drafter weights (crate::int8): a scale per row beside them.
                    let invalid = |reason: String| Error::InvalidModel {
                        path: self.path.clone(),
                        reason,
                    };
                    let scale = st
                        .load(&format!("{hf}{}", crate::int8::SCALE_SUFFIX), &self.device)
                        .map_err(|_| {
                            invalid(crate::int8::Int8Error::NoScale(hf.into()).to_string())
                        })?;
                    let w = crate::int8::dequantize_rows(hf, &t, &scale)
                        .map_err(|e| invalid(e.to_string()))?;
                    return Ok(Raw::Dense(dense(w)?));
                }
                if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                    return Err(Error::UnsupportedQuant {
                        tensor: hf.to_string(),
                        dtype: format!("{:?}", t.dtype()),
                    });
                }
                Ok(Raw::Dense(dense(t)?))
            }
        }
    }

    /// A 1-D tensor (norm weight, bias) as dense f32.
    ///
    /// # Errors
    /// [`Error::Missing`] if absent, [`Error::InvalidModel`] if unreadable or not 1-D.
    pub fn vector(&mut self, hf: &str) -> Result<Tensor> {
        let t = match self.raw(hf)? {
            Raw::Quantized(q) => q.dequantize(&self.device)?,
            Raw::Dense(t) => t.to_dtype(DType::F32)?,
        };
        t.dims1().map_err(|e| self.invalid(hf, e))?;
        Ok(t)
    }

    /// The projection `{prefix}.weight` (+ `{prefix}.bias` when `bias` says so), checked to be
    /// `[out, in]`.
    ///
    /// # Errors
    /// [`Error::Missing`] for an absent required tensor, [`Error::InvalidModel`] for a wrong
    /// shape.
    pub fn linear(&mut self, prefix: &str, dims: (usize, usize), bias: Bias) -> Result<Linear> {
        let name = format!("{prefix}.weight");
        let raw = self.raw(&name)?;
        self.check_dims(&name, &raw, dims)?;
        let bias_name = format!("{prefix}.bias");
        let bias = match (bias, self.contains(&bias_name)) {
            (Bias::Required, _) | (Bias::IfPresent, true) => Some(self.vector(&bias_name)?),
            (Bias::IfPresent, false) | (Bias::No, _) => None,
        };
        self.linear_from(raw, bias)
    }

    fn linear_from(&self, raw: Raw, bias: Option<Tensor>) -> Result<Linear> {
        match raw {
            Raw::Quantized(q) => Linear::quantized(q, bias),
            Raw::Dense(t) => Linear::dense(t, bias),
        }
    }

    fn check_dims(&self, name: &str, raw: &Raw, (out, inp): (usize, usize)) -> Result<()> {
        let got = match raw {
            Raw::Quantized(q) => q.shape().dims().to_vec(),
            Raw::Dense(t) => t.dims().to_vec(),
        };
        if got != [out, inp] {
            return Err(self.invalid(name, format!("shape {got:?}, expected [{out}, {inp}]")));
        }
        Ok(())
    }

    /// The token embedding `[vocab, hidden]` and, when `tied`, an lm_head sharing its storage
    /// (otherwise `lm_head.weight`).
    ///
    /// # Errors
    /// As [`Weights::linear`].
    pub fn embedding_and_head(
        &mut self,
        dims: (usize, usize),
        tied: bool,
    ) -> Result<(Embedding, Linear)> {
        let name = "model.embed_tokens.weight";
        let raw = self.raw(name)?;
        self.check_dims(name, &raw, dims)?;
        let embed = match &raw {
            Raw::Quantized(q) => Embedding::Quantized(q.clone()),
            Raw::Dense(t) => Embedding::Dense(t.clone()),
        };
        let head = match tied {
            true => self.linear_from(raw, None)?,
            false => self.linear("lm_head", dims, Bias::No)?,
        };
        Ok((embed, head))
    }
}

/// Whether a projection has a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bias {
    /// It must have one.
    Required,
    /// Load it if the checkpoint has it.
    IfPresent,
    /// It has none.
    No,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_parses_and_names_map() {
        assert_eq!("BF16".parse::<WeightDType>().unwrap(), WeightDType::Bf16);
        assert_eq!(
            "native".parse::<WeightDType>().unwrap(),
            WeightDType::Native
        );
        let err = "q4".parse::<WeightDType>().unwrap_err().to_string();
        assert!(err.contains("native, f32, f16, bf16"), "{err}");
        assert_eq!(
            gguf_name("model.layers.12.mlp.down_proj.weight").as_deref(),
            Some("blk.12.ffn_down.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.q_proj.bias").as_deref(),
            Some("blk.0.attn_q.bias")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.0.unknown.weight"), None);
        // Gemma's sandwich norms: the norm after attention is not llama's pre-MLP norm.
        let gemma = |hf| gguf_name_in(GgufNames::of_arch("gemma3"), hf);
        assert_eq!(
            gemma("model.layers.3.post_attention_layernorm.weight").as_deref(),
            Some("blk.3.post_attention_norm.weight")
        );
        assert_eq!(
            gemma("model.layers.3.pre_feedforward_layernorm.weight").as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
        assert_eq!(
            gemma("model.layers.3.post_feedforward_layernorm.weight").as_deref(),
            Some("blk.3.post_ffw_norm.weight")
        );
        assert_eq!(
            gguf_name("model.layers.3.post_attention_layernorm.weight").as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
    }
}
