//! The backbone on a candle device (`--device cuda[:N]`): the same forward as [`crate::model`]
//! with every step a candle op, the weights in f32 on the device (the checkpoint's bf16 values,
//! exactly), q|k|v and gate|up fused into one matmul each, and each session's context K/V kept
//! on the device in `[kv_heads, capacity, head_dim]` buffers that commits append to in place.
//! A block's own k/v are written into the slots after the context, so attention reads one view
//! `[kv_heads, rows + B, head_dim]` of each buffer (no concatenation): `softmax(q Kᵀ) V`, every
//! key visible to every row (no mask), 1/√d folded into the q_norm weight at load.
//!
//! The ops are device-generic: `--device candle-cpu` runs this path on the CPU (the tests check
//! it against the host path and the references there).

use candle_core::{DType, Device, Tensor, D};
use specula_models::layers::linear::Weight;
use specula_models::layers::{Linear, Rope};

use crate::config::DraftConfig;
use crate::tensors::Tensors;
use crate::Error;

fn err(e: impl std::fmt::Display) -> Error {
    Error::Forward(e.to_string())
}

/// Where the drafter's forward runs (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The host path ([`crate::model`]: the runtime's CPU kernels, host attention).
    #[default]
    Host,
    /// This module's candle ops on the CPU (tests; the GPU path's numerics without a GPU).
    CandleCpu,
    /// This module's candle ops on CUDA device N (a build with the `cuda` feature).
    Cuda(usize),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceChoice::Host),
            "candle-cpu" => Ok(DeviceChoice::CandleCpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!(
                    "--device must be cpu, candle-cpu, cuda or cuda:N, got {s:?}"
                )),
            },
        }
    }
}

impl DeviceChoice {
    /// The candle device of the device path (`None`: the host path).
    ///
    /// # Errors
    /// [`Error::Options`] for CUDA in a build without the `cuda` feature or a device that does
    /// not open.
    pub fn open(self) -> Result<Option<Device>, Error> {
        match self {
            DeviceChoice::Host => Ok(None),
            DeviceChoice::CandleCpu => Ok(Some(Device::Cpu)),
            DeviceChoice::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(Error::Options(format!(
                        "--device cuda:{n}: this dflash was built without the `cuda` feature \
                         (build it with scripts/build-cuda)"
                    )));
                }
                Device::new_cuda(n)
                    .map(Some)
                    .map_err(|e| Error::Options(format!("--device cuda:{n}: {e}")))
            }
        }
    }
}

/// A projection's weight `[out, in]` as f32 on `device`, with its bias.
///
/// # Errors
/// [`Error::Forward`] for a weight the host keeps quantized (the device path reads f32 linears).
pub fn dense(l: &Linear, device: &Device) -> Result<(Tensor, Option<Tensor>), Error> {
    let w = match l.weight() {
        Weight::Dense(w) => w.to_dtype(DType::F32).map_err(err)?,
        _ => return Err(err("the device path needs dense projections")),
    };
    let w = w.to_device(device).map_err(err)?;
    let b = l
        .bias()
        .map(|b| b.to_device(device))
        .transpose()
        .map_err(err)?;
    Ok((w, b))
}

/// `x Wᵀ (+ b)` for `x` `[rows, in]`, `w` `[out, in]`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

struct Layer {
    input_norm: Tensor,
    /// `[q; k; v]` rows.
    wqkv: Tensor,
    /// `q_norm.weight / √d`.
    q_norm: Tensor,
    k_norm: Tensor,
    wo: Tensor,
    post_norm: Tensor,
    /// `[gate; up]` rows.
    wgu: Tensor,
    wdown: Tensor,
}

/// The backbone's weights on the device.
pub struct DeviceBackbone {
    device: Device,
    fc: Tensor,
    hidden_norm: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `[max_pos, d / 2]`.
    cos: Tensor,
    sin: Tensor,
    eps: f32,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    capacity: usize,
}

/// One session's context on the device: per layer K (normed, rotated) and V buffers
/// `[kv_heads, capacity, head_dim]`, the first `rows` slots filled.
pub struct DeviceContext {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    rows: usize,
}

impl DeviceContext {
    /// Number of cached positions.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

impl DeviceBackbone {
    /// Loads the backbone from f32 `t` onto `device`; `rope` is the host path's (its tables),
    /// contexts hold up to `capacity` positions (a block's rows included).
    ///
    /// # Errors
    /// [`Error::Weights`] for a missing or misshapen tensor, [`Error::Forward`] when the device
    /// refuses them.
    pub fn load(
        c: &DraftConfig,
        t: &Tensors,
        rope: &Rope,
        capacity: usize,
        device: &Device,
    ) -> Result<Self, Error> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv, i) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        if c.attention_bias {
            return Err(Error::Options(
                "the device path has no attention biases (none of the shipped drafters has them)"
                    .into(),
            ));
        }
        let up = |x: Tensor| x.to_device(device).map_err(err);
        let get = |name: String, shape: &[usize]| t.get(&name, shape).and_then(up);
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("layers.{l}");
            let a = format!("{p}.self_attn");
            let wq = t.get(&format!("{a}.q_proj.weight"), &[q, h])?;
            let wk = t.get(&format!("{a}.k_proj.weight"), &[kv, h])?;
            let wv = t.get(&format!("{a}.v_proj.weight"), &[kv, h])?;
            let wg = t.get(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?;
            let wu = t.get(&format!("{p}.mlp.up_proj.weight"), &[i, h])?;
            let q_norm =
                (t.get(&format!("{a}.q_norm.weight"), &[hd])? / (hd as f64).sqrt()).map_err(err)?;
            layers.push(Layer {
                input_norm: get(format!("{p}.input_layernorm.weight"), &[h])?,
                wqkv: up(Tensor::cat(&[wq, wk, wv], 0).map_err(err)?)?,
                q_norm: up(q_norm)?,
                k_norm: get(format!("{a}.k_norm.weight"), &[hd])?,
                wo: get(format!("{a}.o_proj.weight"), &[h, q])?,
                post_norm: get(format!("{p}.post_attention_layernorm.weight"), &[h])?,
                wgu: up(Tensor::cat(&[wg, wu], 0).map_err(err)?)?,
                wdown: get(format!("{p}.mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let taps = c.target_layer_ids.len();
        let (cos, sin) = rope.tables();
        let rows = cos.len() / (hd / 2);
        let table = |v: &[f32]| {
            Tensor::from_slice(v, (rows, hd / 2), &Device::Cpu)
                .map_err(err)
                .and_then(up)
        };
        Ok(DeviceBackbone {
            device: device.clone(),
            fc: get("fc.weight".into(), &[h, taps * h])?,
            hidden_norm: get("hidden_norm.weight".into(), &[h])?,
            layers,
            norm: get("norm.weight".into(), &[h])?,
            cos: table(cos)?,
            sin: table(sin)?,
            eps: c.rms_norm_eps as f32,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
            intermediate: i,
            capacity: capacity.min(rows),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs a context of two rows and one block of `block` rows once, so the device's first
    /// kernels (loading, library handles) run at load, not in a session's first round, and a
    /// device that cannot run the forward fails the load with its reason. Returns the block's
    /// hidden rows.
    ///
    /// # Errors
    /// [`Error::Forward`] with the device's reason.
    pub fn warm_up(&self, block: usize) -> Result<Tensor, Error> {
        let (h, fin) = self.fc.dims2().map_err(err)?;
        let mut ctx = self.context()?;
        let f = Tensor::zeros((2, fin), DType::F32, &Device::Cpu).map_err(err)?;
        self.extend(&mut ctx, &f, 0)?;
        let x = Tensor::zeros((block, h), DType::F32, &Device::Cpu).map_err(err)?;
        self.forward(&ctx, &x, 2)
    }

    /// An empty context.
    ///
    /// # Errors
    /// [`Error::Forward`] when the device cannot allocate it.
    pub fn context(&self) -> Result<DeviceContext, Error> {
        let shape = (self.num_kv_heads, self.capacity, self.head_dim);
        let zeros = || Tensor::zeros(shape, DType::F32, &self.device).map_err(err);
        let n = self.layers.len();
        Ok(DeviceContext {
            k: (0..n).map(|_| zeros()).collect::<Result<_, _>>()?,
            v: (0..n).map(|_| zeros()).collect::<Result<_, _>>()?,
            rows: 0,
        })
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(x, w, self.eps)
    }

    /// `[rows, heads × d]` (a column range of a wider tensor) → normed per head, rotated at
    /// positions `pos..`, as `[1, rows, heads, d]`.
    fn heads(
        &self,
        x: &Tensor,
        heads: usize,
        norm: &Tensor,
        pos: usize,
    ) -> candle_core::Result<Tensor> {
        let rows = x.dim(0)?;
        let x = x.contiguous()?.reshape((1, rows, heads, self.head_dim))?;
        let x = self.rms(&x, norm)?;
        let cos = self.cos.narrow(0, pos, rows)?;
        let sin = self.sin.narrow(0, pos, rows)?;
        candle_nn::rotary_emb::rope_thd(&x, &cos, &sin)
    }

    /// Writes k `[1, rows, kvh, d]` and v `[rows, kvh × d]` (a column range) into layer `l`'s
    /// buffers at slot `at`.
    fn store(
        &self,
        ctx: &DeviceContext,
        l: usize,
        k: &Tensor,
        v: &Tensor,
        at: usize,
    ) -> candle_core::Result<()> {
        let (kvh, d) = (self.num_kv_heads, self.head_dim);
        let rows = v.dim(0)?;
        let k = k.reshape((rows, kvh, d))?.transpose(0, 1)?.contiguous()?;
        let v = v
            .contiguous()?
            .reshape((rows, kvh, d))?
            .transpose(0, 1)?
            .contiguous()?;
        ctx.k[l].slice_set(&k, 1, at)?;
        ctx.v[l].slice_set(&v, 1, at)
    }

    /// Appends positions `pos..pos + rows` from their tap features `[rows, n_taps × hidden]`
    /// (on any device: uploaded once).
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch, or past the context's capacity.
    pub fn extend(
        &self,
        ctx: &mut DeviceContext,
        features: &Tensor,
        pos: usize,
    ) -> Result<(), Error> {
        let rows = features.dims2().map_err(err)?.0;
        if rows == 0 {
            return Ok(());
        }
        if ctx.rows + rows > self.capacity || pos + rows > self.cos.dim(0).map_err(err)? {
            return Err(err(format!(
                "{} context rows past the device context's {}",
                ctx.rows + rows,
                self.capacity
            )));
        }
        let run = || -> candle_core::Result<()> {
            let f = features.to_device(&self.device)?;
            let h_ctx = self.rms(&linear(&f, &self.fc, None)?, &self.hidden_norm)?;
            let (q, kv) = (
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
            );
            for (l, layer) in self.layers.iter().enumerate() {
                let wkv = layer.wqkv.narrow(0, q, 2 * kv)?;
                let kvt = linear(&h_ctx, &wkv, None)?;
                let k = self.heads(
                    &kvt.narrow(1, 0, kv)?,
                    self.num_kv_heads,
                    &layer.k_norm,
                    pos,
                )?;
                self.store(ctx, l, &k, &kvt.narrow(1, kv, kv)?, ctx.rows)?;
            }
            Ok(())
        };
        run().map_err(err)?;
        ctx.rows += rows;
        Ok(())
    }

    /// One block `x` `[B, hidden]` (embeddings) at anchor position `pos` over `ctx`: the
    /// normed hidden rows `[B, hidden]`, on the device.
    ///
    /// # Errors
    /// [`Error::Forward`] on a shape mismatch, or a block past the context's capacity.
    pub fn forward(&self, ctx: &DeviceContext, x: &Tensor, pos: usize) -> Result<Tensor, Error> {
        let b = x.dims2().map_err(err)?.0;
        if ctx.rows + b > self.capacity || pos + b > self.cos.dim(0).map_err(err)? {
            return Err(err("the block runs past the device context"));
        }
        let (nh, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, kv, g) = (nh * d, kvh * d, nh / kvh);
        let keys = ctx.rows + b;
        let run = || -> candle_core::Result<Tensor> {
            let mut x = x.to_device(&self.device)?;
            for (l, layer) in self.layers.iter().enumerate() {
                let xn = self.rms(&x, &layer.input_norm)?;
                let qkv = linear(&xn, &layer.wqkv, None)?;
                // [1, B, nh, d] → [kvh, g·B, d] (rows of one K/V head's g query heads)
                let qh = self.heads(&qkv.narrow(1, 0, q)?, nh, &layer.q_norm, pos)?;
                let qh = qh
                    .reshape((b, kvh, g, d))?
                    .permute((1, 2, 0, 3))?
                    .contiguous()?
                    .reshape((kvh, g * b, d))?;
                let kh = self.heads(&qkv.narrow(1, q, kv)?, kvh, &layer.k_norm, pos)?;
                self.store(ctx, l, &kh, &qkv.narrow(1, q + kv, kv)?, ctx.rows)?;
                let kc = ctx.k[l].narrow(1, 0, keys)?;
                let vc = ctx.v[l].narrow(1, 0, keys)?;
                let scores = matmul_view(&qh, &kc.t()?)?;
                let p = candle_nn::ops::softmax_last_dim(&scores)?;
                let o = matmul_view(&p, &vc)?; // [kvh, g·B, d]
                let o = o
                    .reshape((kvh, g, b, d))?
                    .permute((2, 0, 1, 3))?
                    .contiguous()?
                    .reshape((b, q))?;
                x = (x + linear(&o, &layer.wo, None)?)?;
                let xn = self.rms(&x, &layer.post_norm)?;
                let gu = linear(&xn, &layer.wgu, None)?;
                let i = self.intermediate;
                let act = (candle_nn::ops::silu(&gu.narrow(1, 0, i)?)? * gu.narrow(1, i, i)?)?;
                x = (x + linear(&act, &layer.wdown, None)?)?;
            }
            self.rms(&x, &self.norm)
        };
        run().map_err(err)
    }
}

/// `a b` where `b` is a strided view of a context buffer; a contiguous copy if the backend
/// refuses its strides.
fn matmul_view(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    a.matmul(b).or_else(|_| a.matmul(&b.contiguous()?))
}

/// Greedy drafts of logits `[n, V]` in one read-back: the argmax row ids and each row's
/// softmax probability of its argmax (`1 / Σ exp(z − max)`).
///
/// # Errors
/// [`Error::Forward`] when the device fails.
pub fn greedy(logits: &Tensor) -> Result<(Vec<u32>, Vec<f32>), Error> {
    let run = || -> candle_core::Result<(Vec<u32>, Vec<f32>)> {
        let n = logits.dim(0)?;
        let ids = logits.argmax_keepdim(D::Minus1)?.to_dtype(DType::F32)?;
        let max = logits.max_keepdim(D::Minus1)?;
        let sum = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
        let both: Vec<f32> = Tensor::cat(&[ids, sum.recip()?], 1)?
            .flatten_all()?
            .to_vec1()?;
        let ids = (0..n).map(|r| both[2 * r] as u32).collect();
        let p = (0..n).map(|r| both[2 * r + 1]).collect();
        Ok((ids, p))
    };
    run().map_err(err)
}
