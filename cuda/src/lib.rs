//! Specula's CUDA step: a graph-captured bf16 decode/verify forward of llama-family models for
//! 1–16 query rows, written to stream the weights once per step at near memory bandwidth.
//!
//! - [`shape`]: the model shape the kernels run, and the bytes one step reads.
//! - [`device`]: context, stream, buffers and the kernels of `kernels/step.cu` (PTX from nvcc
//!   at build time, see build.rs), loaded once with cached handles.
//! - [`plan`]: which kernel each projection takes and which kernels the step fuses.
//! - [`step`]: weights, KV cache, the kernel sequence and one CUDA graph per window size.
//! - [`checkpoint`]: real weights, a GGUF file dequantized to bf16 in the kernels' layout.
//! - [`reference`]: the same forward on the CPU in f32, rounding where the GPU rounds, which
//!   the device check (`cuda-check`) compares the kernels against.
//!
//! The crate builds without CUDA (CI): the driver is loaded at run time and, with no nvcc at
//! build time, [`device::Gpu::new`] says how to build the kernels. candle's per-op CUDA path in
//! specula-models stays the fallback.

pub mod checkpoint;
pub mod device;
pub mod error;
pub mod plan;
pub mod reference;
pub mod shape;
pub mod step;

pub use device::Gpu;
pub use error::{Error, Result};
pub use plan::{GemmPlan, Proj, StepOptions};
pub use shape::Shape;
pub use step::Step;
