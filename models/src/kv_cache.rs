//! The one KV cache of Specula: per layer, K (after rope) and V in pre-allocated buffers that
//! grow by doubling, so decode appends without re-allocating and the speculative loop rolls back
//! rejected draft tokens with [`KvCache::truncate`] / [`KvCache::trim`] (just a length change).
//!
//! Candle's own caches concatenate per step and cannot be truncated; this one writes each chunk
//! into place with `Tensor::slice_set` (one 2-D memcpy per layer per chunk).
//!
//! ```text
//!  layer l:  K buffer [kv_heads, capacity, head_dim]      (V identical)
//!
//!            pos: 0   1   2  ...  len-1 | len ... capacity-1
//!  head 0       [ k   k   k  ...   k    |  (unused, stale)  ]
//!  head 1       [ k   k   k  ...   k    |                   ]
//!   ...
//!            \________ layer(l) ______/
//!             narrow(1, 0, len): a view, no copy
//!
//!  append(l, k[kv_heads, n, head_dim]) writes rows len..len+n of every head;
//!  truncate(keep) only sets len = keep (stale rows are overwritten by the next append).
//! ```

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Smallest buffer allocated on first use (positions per layer).
const MIN_CAPACITY: usize = 64;

/// K and V of one layer.
#[derive(Clone, Debug)]
struct LayerKv {
    /// `[kv_heads, capacity, head_dim]`, or `None` before the first append.
    buffers: Option<(Tensor, Tensor)>,
    capacity: usize,
    len: usize,
}

/// Per-layer K/V of one sequence. Created by [`crate::Model::new_cache`].
///
/// # Invariants
/// Between forwards every layer holds the same number of positions, [`KvCache::len`]. Views
/// returned by [`KvCache::layer`] and [`KvCache::append`] alias the buffers: rows past a later
/// `truncate` may be overwritten by later appends, so copy a view you want to keep.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    kv_heads: usize,
    head_dim: usize,
    max_len: usize,
    dtype: DType,
    device: Device,
}

impl KvCache {
    /// An empty cache for `num_layers` layers; buffers are allocated on first append and never
    /// grow past `max_len` positions.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let empty = LayerKv {
            buffers: None,
            capacity: 0,
            len: 0,
        };
        Self {
            layers: vec![empty; num_layers],
            kv_heads,
            head_dim,
            max_len,
            dtype,
            device: device.clone(),
        }
    }

    /// Number of positions every layer holds.
    pub fn len(&self) -> usize {
        self.layers.iter().map(|l| l.len).min().unwrap_or(0)
    }

    /// Number of positions layer `l` holds (differs from [`KvCache::len`] only in the middle
    /// of a forward).
    ///
    /// # Panics
    /// If `l >= num_layers()`.
    pub fn layer_len(&self, l: usize) -> usize {
        self.layers[l].len
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Positions the buffers can hold before the next growth (smallest over layers).
    pub fn capacity(&self) -> usize {
        self.layers.iter().map(|l| l.capacity).min().unwrap_or(0)
    }

    /// Maximum number of positions (the model's context length).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Appends `k` and `v` (`[kv_heads, n, head_dim]`, any `n`) at the end of layer `layer`
    /// and returns views of all of that layer's K and V (`[kv_heads, len + n, head_dim]`).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a bad layer index, a shape or dtype mismatch, or growth past
    /// `max_len`.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (kv_heads, head_dim, max_len) = (self.kv_heads, self.head_dim, self.max_len);
        let (dtype, device) = (self.dtype, self.device.clone());
        let n_layers = self.layers.len();
        let slot = self.layers.get_mut(layer).ok_or_else(|| {
            invalid(
                "KvCache::append",
                format!("layer {layer} out of range (cache has {n_layers} layers)"),
            )
        })?;
        for (name, t) in [("k", k), ("v", v)] {
            let dims = t.dims();
            if dims.len() != 3 || dims[0] != kv_heads || dims[2] != head_dim || t.dtype() != dtype {
                return Err(invalid(
                    "KvCache::append",
                    format!(
                        "{name} is {:?} {:?}, expected [{kv_heads}, n, {head_dim}] {dtype:?}",
                        dims,
                        t.dtype()
                    ),
                ));
            }
        }
        let n = k.dim(1)?;
        if v.dim(1)? != n {
            return Err(invalid(
                "KvCache::append",
                format!("k has {n} positions but v has {}", v.dim(1)?),
            ));
        }
        let needed = slot.len + n;
        if needed > max_len {
            return Err(Error::ContextOverflow {
                got: needed,
                max: max_len,
            });
        }
        if needed > slot.capacity {
            // Doubling keeps the amortised cost of growth per token constant.
            let new_cap = (slot.capacity * 2)
                .max(needed)
                .max(MIN_CAPACITY)
                .min(max_len);
            let shape = (kv_heads, new_cap, head_dim);
            let nk = Tensor::zeros(shape, dtype, &device)?;
            let nv = Tensor::zeros(shape, dtype, &device)?;
            if let Some((ok, ov)) = &slot.buffers {
                nk.slice_set(ok, 1, 0)?;
                nv.slice_set(ov, 1, 0)?;
            }
            slot.buffers = Some((nk, nv));
            slot.capacity = new_cap;
        }
        let (bk, bv) = slot
            .buffers
            .as_ref()
            .expect("invariant: buffers allocated above when capacity was 0");
        bk.slice_set(&k.contiguous()?, 1, slot.len)?;
        bv.slice_set(&v.contiguous()?, 1, slot.len)?;
        slot.len = needed;
        Ok((bk.narrow(1, 0, needed)?, bv.narrow(1, 0, needed)?))
    }

    /// Views `[kv_heads, len, head_dim]` of layer `l`'s K (after rope) and V.
    ///
    /// # Panics
    /// If `l >= num_layers()` (an indexing bug in the caller, like a slice index).
    pub fn layer(&self, l: usize) -> (Tensor, Tensor) {
        let slot = &self.layers[l];
        match &slot.buffers {
            Some((k, v)) => (
                k.narrow(1, 0, slot.len)
                    .expect("invariant: len <= capacity"),
                v.narrow(1, 0, slot.len)
                    .expect("invariant: len <= capacity"),
            ),
            None => {
                let empty =
                    Tensor::zeros((self.kv_heads, 0, self.head_dim), self.dtype, &self.device)
                        .expect("invariant: an empty tensor can always be created");
                (empty.clone(), empty)
            }
        }
    }

    /// Keeps the first `keep_len` positions of every layer.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `keep_len > len()`.
    pub fn truncate(&mut self, keep_len: usize) -> Result<()> {
        let len = self.len();
        if keep_len > len {
            return Err(invalid(
                "KvCache::truncate",
                format!("cannot keep {keep_len} positions, the cache holds {len}"),
            ));
        }
        for l in &mut self.layers {
            l.len = keep_len;
        }
        Ok(())
    }

    /// Rolls back the last `n` positions (e.g. rejected draft tokens).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `n > len()`.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        let len = self.len();
        if n > len {
            return Err(invalid(
                "KvCache::trim",
                format!("cannot roll back {n} positions, the cache holds {len}"),
            ));
        }
        self.truncate(len - n)
    }
}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidRequest { op, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(start: usize, n: usize) -> Tensor {
        // [2 heads, n, 3]: value = 100*head + position, so rows are recognisable.
        let data: Vec<f32> = (0..2)
            .flat_map(|h| (start..start + n).flat_map(move |p| [(100 * h + p) as f32; 3]))
            .collect();
        Tensor::from_vec(data, (2, n, 3), &Device::Cpu).unwrap()
    }

    fn positions(t: &Tensor) -> Vec<Vec<f32>> {
        t.narrow(2, 0, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    #[test]
    fn append_grows_truncate_and_trim() {
        let mut c = KvCache::new(2, 2, 3, 1000, DType::F32, &Device::Cpu);
        assert_eq!(c.len(), 0);
        assert_eq!(c.layer(1).0.dims(), &[2, 0, 3]);
        for (start, n) in [(0, 5), (5, 1), (6, 70)] {
            for l in 0..2 {
                let (k, v) = c.append(l, &chunk(start, n), &chunk(start, n)).unwrap();
                assert_eq!(k.dims(), &[2, start + n, 3]);
                assert_eq!(v.dims(), &[2, start + n, 3]);
            }
        }
        assert_eq!(c.len(), 76);
        assert_eq!(c.capacity(), 128, "64 doubled once");
        let (k, _) = c.layer(0);
        let want: Vec<Vec<f32>> = (0..2)
            .map(|h| (0..76).map(|p| (100 * h + p) as f32).collect())
            .collect();
        assert_eq!(positions(&k), want, "rows survive growth in order");

        c.trim(6).unwrap();
        assert_eq!(c.len(), 70);
        c.truncate(3).unwrap();
        assert_eq!(c.len(), 3);
        // Overwrite from position 3 with new values: the old rows 3.. must be gone.
        for l in 0..2 {
            c.append(l, &chunk(500, 2), &chunk(500, 2)).unwrap();
        }
        let (_, v) = c.layer(1);
        assert_eq!(positions(&v)[0], vec![0., 1., 2., 500., 501.]);
        assert!(c.truncate(6).is_err());
        assert!(c.trim(6).is_err());
    }

    #[test]
    fn append_rejects_bad_input() {
        let mut c = KvCache::new(1, 2, 3, 8, DType::F32, &Device::Cpu);
        assert!(c.append(1, &chunk(0, 1), &chunk(0, 1)).is_err(), "layer");
        let wrong = Tensor::zeros((1, 1, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(c.append(0, &wrong, &wrong).is_err(), "heads");
        assert!(
            c.append(0, &chunk(0, 2), &chunk(0, 1)).is_err(),
            "k/v lengths"
        );
        c.append(0, &chunk(0, 8), &chunk(0, 8)).unwrap();
        assert_eq!(c.capacity(), 8, "capped at max_len");
        let err = c.append(0, &chunk(8, 1), &chunk(8, 1)).unwrap_err();
        assert!(
            matches!(err, Error::ContextOverflow { got: 9, max: 8 }),
            "{err}"
        );
    }
}
