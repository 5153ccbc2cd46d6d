//! Token embedding lookup, from a dense table or straight from a quantized GGUF table
//! (dequantizing only the looked-up rows).

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// The `[vocab, hidden]` embedding table.
#[derive(Clone, Debug)]
pub enum Embedding {
    /// Quantized rows (GGUF, native dtype).
    Quantized(Arc<QTensor>),
    /// Dense rows in any float dtype.
    Dense(Tensor),
}

impl Embedding {
    /// Number of rows (the vocabulary size).
    pub fn vocab_size(&self) -> usize {
        match self {
            Embedding::Quantized(q) => q.shape().dims()[0],
            Embedding::Dense(t) => t.dims()[0],
        }
    }

    /// Looks up `ids`, returning `[ids.len(), hidden]` f32.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id outside the vocabulary.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::InvalidRequest {
                op: "forward",
                reason: format!("token id {bad} is outside the vocabulary of {vocab}"),
            });
        }
        let device = match self {
            Embedding::Quantized(q) => q.device(),
            Embedding::Dense(t) => t.device().clone(),
        };
        let ids = Tensor::new(ids, &device)?;
        let rows = match self {
            Embedding::Quantized(q) => q.embedding(&ids)?,
            Embedding::Dense(t) => t.index_select(&ids, 0)?,
        };
        Ok(rows.to_dtype(DType::F32)?)
    }
}
