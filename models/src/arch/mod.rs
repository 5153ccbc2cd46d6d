//! The architectures Specula runs, registered in one place: [`spec`]'s `match`.
//!
//! All of them are the llama block with switches (see [`llama`]); a new family either adds a
//! row to that `match` or a new module beside `llama.rs`.

pub mod llama;

use crate::error::{Error, Result};
use crate::layers::RopeStyle;

/// What distinguishes one llama-family architecture from another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchSpec {
    /// The canonical name (`llama`, `qwen2`, `qwen3`).
    pub name: &'static str,
    /// Rope layout of q/k in GGUF files of this architecture (HF files are always
    /// [`RopeStyle::HalfSplit`]).
    pub gguf_rope: RopeStyle,
    /// q/k/v projections always have biases (qwen2).
    pub qkv_bias: bool,
    /// q and k have per-head RMS norms (qwen3).
    pub qk_norm: bool,
}

/// Names accepted by [`spec`], for error messages.
pub const SUPPORTED: &str = "llama, mistral, qwen2, qwen3";

/// The spec of the architecture named by GGUF `general.architecture` or HF `model_type`.
///
/// # Errors
/// [`Error::UnsupportedArchitecture`] naming what is supported.
pub fn spec(name: &str) -> Result<ArchSpec> {
    let spec = |name, gguf_rope, qkv_bias, qk_norm| ArchSpec {
        name,
        gguf_rope,
        qkv_bias,
        qk_norm,
    };
    match name {
        // llama.cpp's converter permutes llama q/k rows (mistral converts as llama).
        "llama" | "mistral" => Ok(spec("llama", RopeStyle::Interleaved, false, false)),
        "qwen2" => Ok(spec("qwen2", RopeStyle::HalfSplit, true, false)),
        "qwen3" => Ok(spec("qwen3", RopeStyle::HalfSplit, false, true)),
        other => Err(Error::UnsupportedArchitecture {
            got: other.to_string(),
            supported: SUPPORTED.to_string(),
        }),
    }
}
