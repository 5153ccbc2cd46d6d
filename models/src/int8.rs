//! The int8 format of Specula's shipped drafter weights (`drafters/weights/<target>/<kind>/`,
//! written by `train/specula_train/export.py`), dequantized at load here and nowhere else.
//!
//! A matrix `W` [rows, cols] is stored as `W`: `U8` holding `q + 128`, `q` in [-127, 127], and
//! `W_scale`: `F32` [rows], so `W[r, c] = (W_u8[r, c] - 128) · W_scale[r]` (symmetric, one
//! scale per row). candle has no `I8` dtype, hence the offset. Vectors stay bf16/f32. Every
//! loader of those files reads through this module: [`dequantize_map`] for a whole file
//! (dflash, assistant), and [`crate::weights::Weights`] for one tensor at a time (mtp).

use std::collections::HashMap;

use candle_core::{DType, Tensor};

/// Name suffix of a matrix's per-row scales.
pub const SCALE_SUFFIX: &str = "_scale";

/// Why an int8 tensor cannot be dequantized.
#[derive(Debug, thiserror::Error)]
pub enum Int8Error {
    /// A `U8` tensor without its `_scale` companion.
    #[error(
        "tensor {0} is uint8 but has no {0}{SCALE_SUFFIX} (int8 weights need a scale per row)"
    )]
    NoScale(String),
    /// Scales that do not fit the matrix.
    #[error("tensor {name}: {reason}")]
    Shape {
        /// The matrix.
        name: String,
        /// What does not fit.
        reason: String,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// `(q - 128) · scale[r]` for `q` `U8` [rows, cols] and `scale` [rows], as f32.
///
/// # Errors
/// [`Int8Error::Shape`] when `q` is not a `U8` matrix or `scale` has not one value per row.
pub fn dequantize_rows(name: &str, q: &Tensor, scale: &Tensor) -> Result<Tensor, Int8Error> {
    let shape = |reason: String| Int8Error::Shape {
        name: name.to_string(),
        reason,
    };
    if q.dtype() != DType::U8 || q.rank() != 2 {
        return Err(shape(format!(
            "int8 weights must be a U8 matrix, got {:?} {:?}",
            q.dtype(),
            q.dims()
        )));
    }
    if scale.dims() != [q.dims()[0]] {
        return Err(shape(format!(
            "{} scales for {} rows",
            scale.elem_count(),
            q.dims()[0]
        )));
    }
    let scale = scale.to_dtype(DType::F32)?.unsqueeze(1)?;
    Ok((q.to_dtype(DType::F32)? - 128.0)?.broadcast_mul(&scale)?)
}

/// A whole file's tensors with every int8 matrix dequantized to f32 and its scales dropped;
/// other tensors are returned as they are.
///
/// # Errors
/// [`Int8Error::NoScale`] for a `U8` tensor without scales, [`Int8Error::Shape`] for scales
/// that do not fit.
pub fn dequantize_map(
    mut map: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>, Int8Error> {
    let names: Vec<String> = map
        .iter()
        .filter(|(_, t)| t.dtype() == DType::U8)
        .map(|(n, _)| n.clone())
        .collect();
    for name in names {
        let scale = map
            .remove(&format!("{name}{SCALE_SUFFIX}"))
            .ok_or_else(|| Int8Error::NoScale(name.clone()))?;
        let w = dequantize_rows(&name, &map[&name], &scale)?;
        map.insert(name, w);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn u8s(v: &[u8], rows: usize) -> Tensor {
        Tensor::from_slice(v, (rows, v.len() / rows), &Device::Cpu).unwrap()
    }

    #[test]
    fn rows_are_offset_and_scaled() {
        let q = u8s(&[128, 255, 1, 130, 126, 128], 2);
        let s = Tensor::new(&[0.5f32, 2.0], &Device::Cpu).unwrap();
        let w = dequantize_rows("w", &q, &s)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(w, [[0.0, 63.5, -63.5], [4.0, -4.0, 0.0]]);
    }

    #[test]
    fn a_map_loses_its_scales_and_keeps_the_rest() {
        let mut map = HashMap::new();
        map.insert("a.weight".to_string(), u8s(&[129, 127], 1));
        map.insert(
            "a.weight_scale".to_string(),
            Tensor::new(&[3.0f32], &Device::Cpu).unwrap(),
        );
        let norm = Tensor::new(&[1.5f32, 2.5], &Device::Cpu).unwrap();
        map.insert(
            "norm.weight".to_string(),
            norm.to_dtype(DType::BF16).unwrap(),
        );
        let out = dequantize_map(map).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out["a.weight"].to_vec2::<f32>().unwrap(), [[3.0, -3.0]]);
        assert_eq!(out["norm.weight"].dtype(), DType::BF16);
    }

    #[test]
    fn missing_or_misfit_scales_are_errors() {
        let mut map = HashMap::new();
        map.insert("a.weight".to_string(), u8s(&[1, 2, 3, 4], 2));
        let e = dequantize_map(map.clone()).unwrap_err();
        assert!(
            matches!(e, Int8Error::NoScale(ref n) if n == "a.weight"),
            "{e}"
        );
        map.insert(
            "a.weight_scale".to_string(),
            Tensor::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap(),
        );
        let e = dequantize_map(map).unwrap_err().to_string();
        assert!(e.contains("3 scales for 2 rows"), "{e}");
        let v = Tensor::new(&[1u8, 2], &Device::Cpu).unwrap();
        let s = Tensor::new(&[1.0f32], &Device::Cpu).unwrap();
        assert!(
            dequantize_rows("v", &v, &s).is_err(),
            "a vector is no matrix"
        );
    }
}
