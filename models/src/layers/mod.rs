//! The building blocks shared by every architecture: linear projections (dense or quantized,
//! on our own SIMD kernels chosen at run time by [`simd::Isa`]),
//! RMS norm, rotary embeddings, attention over the [`crate::kv_cache::KvCache`], the gated MLP
//! and the token embedding.

pub mod attention;
mod dense;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod qmatmul;
pub mod rope;
pub mod simd;

pub use attention::Attention;
pub use embedding::Embedding;
pub use linear::Linear;
pub use mlp::Mlp;
pub use norm::RmsNorm;
pub use rope::{Rope, RopeStyle};
