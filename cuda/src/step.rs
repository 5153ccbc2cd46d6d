//! The decode/verify step on the GPU: weights, KV cache and scratch allocated once, the kernel
//! sequence of one forward over 1–16 rows, and one CUDA graph per window size.
//!
//! Per layer the step launches 6 kernels: qkv (one GEMM over the fused weight, the RMS norm
//! folded in, bias in its epilogue), attention (rope + q/k norm + K/V write and split-KV in one
//! kernel), the split merge, o_proj (residual add in its epilogue, which also hands gate|up its
//! norm: bf16(x * w) and the rows' sums of squares), gate|up (SiLU·mul in its epilogue), down
//! (residual add, handing the next layer's qkv its norm). [`StepOptions`] says which kernel each
//! projection takes (split-K over thread-block clusters for small grids, 16 columns a block
//! for grids of more than a wave) and can merge attention inside its kernel, or bring back an
//! earlier session's 9 kernels a layer, for A/B runs. The argmax splits each row over 32
//! blocks (the last to finish picks the best of their results).
//! Positions and tokens live in device memory (`state`), copied from pinned host memory
//! by the graph's first node, so a graph captured once replays at every position; the argmax
//! ids come back by its last node. Nothing inside a step allocates, syncs or uploads parameters.
//! Kernels can be launched with programmatic dependent launch ([`Step::set_pdl`]; see
//! `kernels/step.cu`).

use cudarc::driver::{sys, CudaGraph};

use crate::device::{DeviceBuffer, Gpu, Pinned};
use crate::error::{Context, Error, Result};
use crate::plan::{Proj, StepOptions};
use crate::shape::{Shape, ATTN_CHUNK, MAX_CTX, MAX_ROWS};

/// Blocks of the argmax over one row's logits (at most 32: `argmax_rows` in step.cu).
const ARGMAX_SPLITS: u32 = 32;

/// One transformer block's weights (bf16, `[out, in]`). `gate_up` interleaves its rows:
/// row `2j` is gate row `j`, row `2j + 1` is up row `j`.
pub struct LayerWeights {
    pub attn_norm: DeviceBuffer,
    pub qkv: DeviceBuffer,
    pub qkv_bias: Option<DeviceBuffer>,
    pub q_norm: Option<DeviceBuffer>,
    pub k_norm: Option<DeviceBuffer>,
    pub o: DeviceBuffer,
    pub mlp_norm: DeviceBuffer,
    pub gate_up: DeviceBuffer,
    pub down: DeviceBuffer,
}

/// All weights; `lm_head` is `None` when it is the embedding.
pub struct Weights {
    pub embed: DeviceBuffer,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DeviceBuffer,
    pub lm_head: Option<DeviceBuffer>,
}

/// Per-step activations, each sized for [`MAX_ROWS`] rows.
struct Scratch {
    state: DeviceBuffer,
    x: DeviceBuffer,
    xn: DeviceBuffer,
    qkv: DeviceBuffer,
    q: DeviceBuffer,
    attn: DeviceBuffer,
    act: DeviceBuffer,
    part_o: DeviceBuffer,
    part_ml: DeviceBuffer,
    logits: DeviceBuffer,
    ids: DeviceBuffer,
    /// Arrival counters of attention's in-kernel merge, one a head, then the argmax's, one a
    /// row, from 0.
    counters: DeviceBuffer,
    /// The argmax's best of each slice of a row: (value, index) pairs, `[MAX_ROWS][32]`.
    argmax_part: DeviceBuffer,
    /// The folded norms' sums of squares (fixed point), `[2 layers][MAX_ROWS]`.
    ssq: DeviceBuffer,
}

/// The step of one sequence: a model on the GPU with its KV cache of `max_ctx` positions.
pub struct Step {
    gpu: Gpu,
    shape: Shape,
    max_ctx: usize,
    weights: Weights,
    k_cache: DeviceBuffer,
    v_cache: DeviceBuffer,
    rope_cos: DeviceBuffer,
    rope_sin: DeviceBuffer,
    s: Scratch,
    host_state: Pinned<i32>,
    host_ids: Pinned<i32>,
    graphs: Vec<Option<CudaGraph>>,
    pdl: bool,
    options: StepOptions,
    taps: Taps,
}

/// Hidden states a step copies out for a drafter: the residual stream (f32) after each listed
/// layer, and the final norm's output (bf16, what the lm_head reads), `MAX_ROWS` rows a slot.
#[derive(Default)]
struct Taps {
    layers: Vec<usize>,
    layer_buf: Option<DeviceBuffer>,
    final_buf: Option<DeviceBuffer>,
}

/// The taps of one forward's rows, row-major `rows × hidden`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TapOut {
    /// One entry per layer of [`Step::set_taps`], in its order.
    pub layers: Vec<Vec<f32>>,
    /// The final norm's output, when asked.
    pub final_hidden: Option<Vec<f32>>,
}

impl Step {
    /// A model of `shape` with weights drawn on the device from `seed`, as `--load-format
    /// random` does: projections and embedding uniform with std 0.02, biases too, norms ones.
    ///
    /// # Errors
    /// [`Error::Invalid`] for `max_ctx` of 0; driver errors (out of memory) otherwise.
    pub fn random(gpu: Gpu, shape: Shape, max_ctx: usize, seed: u64) -> Result<Self> {
        let half_width = 0.02 * 3f32.sqrt();
        let mut seed_n = seed.wrapping_mul(1000);
        let mut rand = |n: usize| -> Result<DeviceBuffer> {
            let b = gpu.alloc(2 * n)?;
            seed_n += 1;
            gpu.fill_uniform(b.ptr(), n, seed_n, half_width)?;
            Ok(b)
        };
        let ones = |n: usize| -> Result<DeviceBuffer> {
            let b = gpu.alloc(2 * n)?;
            gpu.fill_const(b.ptr(), n, 1.0)?;
            Ok(b)
        };
        let (h, hd) = (shape.hidden, shape.head_dim);
        let mut layers = Vec::with_capacity(shape.layers);
        for _ in 0..shape.layers {
            layers.push(LayerWeights {
                attn_norm: ones(h)?,
                qkv: rand(shape.qkv_width() * h)?,
                qkv_bias: if shape.qkv_bias {
                    Some(rand(shape.qkv_width())?)
                } else {
                    None
                },
                q_norm: if shape.qk_norm { Some(ones(hd)?) } else { None },
                k_norm: if shape.qk_norm { Some(ones(hd)?) } else { None },
                o: rand(h * shape.heads * hd)?,
                mlp_norm: ones(h)?,
                gate_up: rand(2 * shape.intermediate * h)?,
                down: rand(h * shape.intermediate)?,
            });
        }
        let weights = Weights {
            embed: rand(shape.vocab * h)?,
            layers,
            final_norm: ones(h)?,
            lm_head: if shape.tied_embeddings {
                None
            } else {
                Some(rand(shape.vocab * h)?)
            },
        };
        Self::new(gpu, shape, max_ctx, weights)
    }

    /// A step over `weights` (already on the device, in the layout [`LayerWeights`] names).
    ///
    /// # Errors
    /// [`Error::Invalid`] for `max_ctx` of 0; [`Error::Unsupported`] for a shape the kernels
    /// cannot tile ([`Shape::check`]); driver errors otherwise.
    pub fn new(gpu: Gpu, shape: Shape, max_ctx: usize, weights: Weights) -> Result<Self> {
        if max_ctx == 0 {
            return Err(Error::Invalid("a KV cache of 0 positions".into()));
        }
        if max_ctx > MAX_CTX {
            return Err(Error::Unsupported(format!(
                "a KV cache of {max_ctx} positions (the attention merge holds {MAX_CTX})"
            )));
        }
        shape.check()?;
        let (h, hd, r) = (shape.hidden, shape.head_dim, MAX_ROWS);
        let attn_w = shape.heads * hd;
        let splits = max_ctx.div_ceil(ATTN_CHUNK);
        let cache = 2 * shape.layers * shape.kv_heads * max_ctx * hd;
        let counters = gpu.alloc(4 * (shape.heads + MAX_ROWS))?;
        // SAFETY: the buffer holds that many bytes; the counters start at 0.
        unsafe { cudarc::driver::result::memset_d8_sync(counters.ptr(), 0, counters.bytes()) }
            .ctx(|| "zeroing the counters".into())?;
        let s = Scratch {
            state: gpu.alloc(4 * (1 + r))?,
            x: gpu.alloc(4 * r * h)?,
            xn: gpu.alloc(2 * r * h)?,
            qkv: gpu.alloc(4 * r * shape.qkv_width())?,
            q: gpu.alloc(4 * r * attn_w)?,
            attn: gpu.alloc(2 * r * attn_w)?,
            act: gpu.alloc(2 * r * shape.intermediate)?,
            part_o: gpu.alloc(4 * r * shape.heads * splits * hd)?,
            part_ml: gpu.alloc(4 * r * shape.heads * splits * 2)?,
            logits: gpu.alloc(4 * r * shape.vocab)?,
            ids: gpu.alloc(4 * r)?,
            counters,
            argmax_part: gpu.alloc(8 * MAX_ROWS * ARGMAX_SPLITS as usize)?,
            ssq: gpu.alloc(8 * MAX_ROWS * 2 * shape.layers)?,
        };
        let (cos, sin) = rope_tables(&shape, max_ctx);
        let rope_cos = gpu.alloc(4 * cos.len())?;
        let rope_sin = gpu.alloc(4 * sin.len())?;
        gpu.upload(&rope_cos, 0, &cos)?;
        gpu.upload(&rope_sin, 0, &sin)?;
        let k_cache = gpu.alloc(cache)?;
        let v_cache = gpu.alloc(cache)?;
        let host_state = gpu.pinned::<i32>(1 + r)?;
        let host_ids = gpu.pinned::<i32>(r)?;
        gpu.sync()?;
        let options = StepOptions::auto(&shape, gpu.occupancy());
        Ok(Self {
            gpu,
            shape,
            max_ctx,
            weights,
            k_cache,
            v_cache,
            rope_cos,
            rope_sin,
            s,
            host_state,
            host_ids,
            graphs: (0..=r).map(|_| None).collect(),
            pdl: false,
            options,
            taps: Taps::default(),
        })
    }

    /// How the kernels run ([`StepOptions::auto`] unless set).
    pub fn options(&self) -> &StepOptions {
        &self.options
    }

    /// Runs later forwards with `options`. Drops the captured graphs.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a plan that cannot split its projection ([`StepOptions::check`]).
    pub fn set_options(&mut self, options: StepOptions) -> Result<()> {
        options.check(&self.shape)?;
        self.options = options;
        self.graphs.iter_mut().for_each(|g| *g = None);
        Ok(())
    }

    /// Turns programmatic dependent launch on or off: each kernel is then scheduled while the
    /// previous one finishes, and the projections start loading weights then. Off by default:
    /// on the H200 it gained 1% at one row on the 1.5B shape and lost 3% (8B) and up to 25%
    /// (16-row windows) elsewhere (BENCHMARKS.md). Drops the captured graphs, which hold the
    /// launches' attributes.
    pub fn set_pdl(&mut self, on: bool) {
        if on != self.pdl {
            self.pdl = on;
            self.graphs.iter_mut().for_each(|g| *g = None);
        }
    }

    /// Copies out the residual stream after each of `layers` and (with `final_hidden`) the
    /// final norm's output in every later forward ([`Self::taps`] reads them). Drops the
    /// captured graphs, which hold the copies.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a layer past the model's; driver errors (allocation).
    pub fn set_taps(&mut self, layers: &[usize], final_hidden: bool) -> Result<()> {
        if let Some(&l) = layers.iter().find(|&&l| l >= self.shape.layers) {
            return Err(Error::Invalid(format!(
                "a tap of layer {l} in a model of {} layers",
                self.shape.layers
            )));
        }
        let h = self.shape.hidden;
        self.taps = Taps {
            layers: layers.to_vec(),
            layer_buf: match layers.is_empty() {
                true => None,
                false => Some(self.gpu.alloc(4 * layers.len() * MAX_ROWS * h)?),
            },
            final_buf: match final_hidden {
                true => Some(self.gpu.alloc(2 * MAX_ROWS * h)?),
                false => None,
            },
        };
        self.graphs.iter_mut().for_each(|g| *g = None);
        Ok(())
    }

    /// The taps of the last forward's first `m` rows, as [`Self::set_taps`] asked.
    pub fn taps(&self, m: usize) -> Result<TapOut> {
        let (h, m) = (self.shape.hidden, m.min(MAX_ROWS));
        let mut out = TapOut::default();
        if let Some(buf) = &self.taps.layer_buf {
            for i in 0..self.taps.layers.len() {
                let mut v = vec![0f32; m * h];
                self.gpu.download(&mut v, buf, 4 * i * MAX_ROWS * h)?;
                out.layers.push(v);
            }
        }
        let mut fin = vec![0u16; m * h];
        if let Some(buf) = &self.taps.final_buf {
            self.gpu.download(&mut fin, buf, 0)?;
        }
        self.gpu.sync()?;
        if self.taps.final_buf.is_some() {
            out.final_hidden = Some(
                fin.iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect(),
            );
        }
        Ok(out)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Runs rows `tokens` at positions `pos0..pos0 + tokens.len()` (their K/V overwrite the
    /// cache there; earlier positions must hold this sequence's K/V) and returns each row's
    /// argmax. `graph` replays the window's CUDA graph (captured on first use); without it the
    /// kernels are launched one by one, as the graph holds them.
    ///
    /// # Errors
    /// [`Error::Invalid`] for 0 or more than 16 rows, a token outside the vocabulary or a
    /// window past the cache; driver errors otherwise.
    pub fn forward(&mut self, tokens: &[u32], pos0: usize, graph: bool) -> Result<&[i32]> {
        let m = tokens.len();
        if m == 0 || m > MAX_ROWS {
            return Err(Error::Invalid(format!("{m} rows (1 to {MAX_ROWS})")));
        }
        if pos0 + m > self.max_ctx {
            return Err(Error::Invalid(format!(
                "positions {pos0}..{} past the cache of {}",
                pos0 + m,
                self.max_ctx
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.shape.vocab) {
            return Err(Error::Invalid(format!(
                "token {t} outside the vocabulary of {}",
                self.shape.vocab
            )));
        }
        let st = self.host_state.as_mut_slice();
        st[0] = pos0 as i32;
        for (dst, &t) in st[1..].iter_mut().zip(tokens) {
            *dst = t as i32;
        }
        if graph {
            if self.graphs[m].is_none() {
                self.capture(m)?;
            }
            let g = self.graphs[m].as_ref().expect("captured above");
            g.launch()
                .ctx(|| format!("replaying the graph of {m} rows"))?;
        } else {
            self.encode(m)?;
        }
        self.gpu.sync()?;
        Ok(&self.host_ids.as_slice()[..m])
    }

    /// Captures the graph of a window of `m` rows (done by [`Self::forward`] on first use;
    /// call it ahead to keep capture out of timings).
    pub fn capture(&mut self, m: usize) -> Result<()> {
        let stream = self.gpu.stream.clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .ctx(|| "beginning a graph capture".into())?;
        let queued = self.encode(m);
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        queued?;
        let graph = graph
            .ctx(|| format!("capturing the graph of {m} rows"))?
            .ok_or_else(|| Error::Invalid("the capture recorded nothing".into()))?;
        graph.upload().ctx(|| "uploading a graph".into())?;
        self.graphs[m] = Some(graph);
        Ok(())
    }

    /// The f32 logits of the last forward's first `m` rows, `[m, vocab]`.
    pub fn logits(&self, m: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; m.min(MAX_ROWS) * self.shape.vocab];
        self.gpu.download(&mut out, &self.s.logits, 0)?;
        self.gpu.sync()?;
        Ok(out)
    }

    /// Queues one forward of `m` rows on the stream.
    fn encode(&self, m: usize) -> Result<()> {
        let gpu = &self.gpu;
        let k = &gpu.kernels;
        let sh = &self.shape;
        let s = &self.s;
        let stream = gpu.stream.cu_stream();
        let pdl = self.pdl;
        let (mi, h) = (m as i32, sh.hidden as i32);
        let (heads, kvh, hd) = (sh.heads as i32, sh.kv_heads as i32, sh.head_dim as i32);
        let max_ctx = self.max_ctx as i32;
        let splits = self.max_ctx.div_ceil(ATTN_CHUNK) as u32;
        let splits_i = splits as i32;
        let eps = sh.rms_eps;
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        let layer_cache = (sh.kv_heads * self.max_ctx * sh.head_dim * 2) as u64;
        let rows = m as u32;

        // Every pointer passed below is a live allocation sized in `new` for MAX_ROWS rows of
        // the shape it is passed as, and each argument list matches its kernel in step.cu.
        macro_rules! launch {
            ($f:expr, $grid:expr, $block:expr, $what:literal; $($arg:expr),* $(,)?) => {{
                let mut args = [$(std::ptr::from_ref($arg).cast_mut().cast::<std::ffi::c_void>()),*];
                // SAFETY: see above.
                unsafe { gpu.launch($f, $grid, $block, pdl, &mut args) }
                    .ctx(|| $what.into())
            }};
        }

        let st = s.state.ptr();
        // SAFETY: host_state is pinned, holds 1 + MAX_ROWS values and outlives the graph.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(st, self.host_state.raw().cast(), 4 * (1 + MAX_ROWS), stream)
                .result()
        }
        .ctx(|| "copying the step's inputs".into())?;
        let (x, xn) = (s.x.ptr(), s.xn.ptr());
        let embed = self.weights.embed.ptr();
        let opts = &self.options;
        // With the norms folded, norm i (2l: layer l's attention, 2l + 1: its MLP) hands its
        // projection bf16(x * w) in xn and the rows' sums of squares in slot i of `ssq`.
        let ssq = s.ssq.ptr();
        let slot = |i: usize| ssq + (8 * MAX_ROWS * i) as u64;
        let slots = 2 * sh.layers as i32;
        let (nw0, ssq0) = match opts.fold_norm {
            true => (self.weights.layers[0].attn_norm.ptr(), ssq),
            false => (0, 0),
        };
        launch!(&k.embed, (rows, 1), 256, "embed"; &embed, &st, &x, &h, &nw0, &xn, &ssq0, &slots)?;
        let norm = |w: u64, out: u64| launch!(&k.rmsnorm, (rows, 1), 256, "rmsnorm"; &x, &w, &out, &h, &eps);
        let counters = s.counters.ptr();
        let merge = i32::from(opts.merges_in_kernel(m));
        // One projection of the bf16 rows `xin`: `ssq_in` (0 for none) the folded norm's sums
        // of squares; `hand` (with the residual add) the next norm's weights and slot to fill.
        let gemm = |p: Proj,
                    xin: u64,
                    ssq_in: u64,
                    w: u64,
                    bias: u64,
                    out: u64,
                    mode: i32,
                    hand: Option<(u64, u64)>| {
            let plan = opts.plan(p);
            let (n, kk) = p.dims(sh);
            let (ni, ki) = (n as i32, kk as i32);
            let (xb_out, (nw_out, ssq_out)) = match hand {
                Some(h) => (xn, h),
                None => (0, (0, 0)),
            };
            launch!(gpu.gemm(plan, ssq_in != 0), plan.grid(n), 256, "projection";
                &xin, &ssq_in, &w, &bias, &out, &mi, &ni, &ki, &mode, &eps, &xb_out, &nw_out, &ssq_out)
        };
        // The norm `i` before a projection of weights `nw`: folded (handed over in xn and its
        // slot), or its own kernel into xn.
        let normed = |i: usize, nw: u64| -> Result<u64> {
            if opts.fold_norm {
                Ok(slot(i))
            } else {
                norm(nw, xn)?;
                Ok(0)
            }
        };
        let hand = |i: usize, nw: u64| opts.fold_norm.then(|| (nw, slot(i)));
        let opt = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, DeviceBuffer::ptr);
        let (cos, sin) = (self.rope_cos.ptr(), self.rope_sin.ptr());
        let (qkv, q, attn, act) = (s.qkv.ptr(), s.q.ptr(), s.attn.ptr(), s.act.ptr());
        let (po, pml) = (s.part_o.ptr(), s.part_ml.ptr());
        let rope_grid = (rows, (sh.heads + 2 * sh.kv_heads) as u32);
        let half = (sh.head_dim / 2) as u32;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let kc = self.k_cache.ptr() + l as u64 * layer_cache;
            let vc = self.v_cache.ptr() + l as u64 * layer_cache;
            let ssq_in = normed(2 * l, lw.attn_norm.ptr())?;
            gemm(
                Proj::Qkv,
                xn,
                ssq_in,
                lw.qkv.ptr(),
                opt(&lw.qkv_bias),
                qkv,
                0,
                None,
            )?;
            let (qn, kn) = (opt(&lw.q_norm), opt(&lw.k_norm));
            if opts.fused_attn {
                // Wider blocks for wider windows (the same bits, see step.cu).
                let (f, threads) = match m > 2 {
                    true => (&k.attn_fused_wide, 256),
                    false => (&k.attn_fused, 128),
                };
                launch!(f, (sh.heads as u32, splits), threads, "attn_fused";
                    &qkv, &st, &cos, &sin, &qn, &kn, &kc, &vc, &po, &pml, &counters, &attn,
                    &mi, &heads, &kvh, &hd, &max_ctx, &scale, &eps, &merge)?;
            } else {
                launch!(&k.rope_kv, rope_grid, half, "rope_kv";
                    &qkv, &st, &cos, &sin, &qn, &kn, &q, &kc, &vc, &heads, &kvh, &hd, &max_ctx, &eps)?;
                launch!(&k.attn_partial, (sh.heads as u32, splits), 128, "attn_partial";
                    &q, &kc, &vc, &st, &po, &pml, &mi, &heads, &kvh, &hd, &max_ctx, &scale)?;
            }
            if merge == 0 {
                launch!(&k.attn_merge, (sh.heads as u32, rows), 128, "attn_merge";
                    &po, &pml, &st, &attn, &heads, &hd, &splits_i)?;
            }
            let to_mlp = hand(2 * l + 1, lw.mlp_norm.ptr());
            gemm(Proj::O, attn, 0, lw.o.ptr(), 0, x, 1, to_mlp)?;
            let ssq_in = normed(2 * l + 1, lw.mlp_norm.ptr())?;
            gemm(Proj::GateUp, xn, ssq_in, lw.gate_up.ptr(), 0, act, 2, None)?;
            let to_next = match self.weights.layers.get(l + 1) {
                Some(next) => hand(2 * l + 2, next.attn_norm.ptr()),
                None => None,
            };
            gemm(Proj::Down, act, 0, lw.down.ptr(), 0, x, 1, to_next)?;
            if let (Some(i), Some(buf)) = (
                self.taps.layers.iter().position(|&t| t == l),
                &self.taps.layer_buf,
            ) {
                let at = buf.ptr() + (4 * i * MAX_ROWS * sh.hidden) as u64;
                // SAFETY: slot i of the tap buffer and x both hold MAX_ROWS rows of hidden f32.
                unsafe { sys::cuMemcpyDtoDAsync_v2(at, x, 4 * m * sh.hidden, stream).result() }
                    .ctx(|| format!("copying the tap of layer {l}"))?;
            }
        }
        norm(self.weights.final_norm.ptr(), xn)?;
        if let Some(buf) = &self.taps.final_buf {
            // SAFETY: the buffer and xn both hold MAX_ROWS rows of hidden bf16.
            unsafe { sys::cuMemcpyDtoDAsync_v2(buf.ptr(), xn, 2 * m * sh.hidden, stream).result() }
                .ctx(|| "copying the final hidden tap".into())?;
        }
        let lm = self
            .weights
            .lm_head
            .as_ref()
            .unwrap_or(&self.weights.embed)
            .ptr();
        let logits = s.logits.ptr();
        gemm(Proj::LmHead, xn, 0, lm, 0, logits, 0, None)?;
        let (ids, vocab) = (s.ids.ptr(), sh.vocab as i32);
        let (part, count) = (s.argmax_part.ptr(), counters + 4 * sh.heads as u64);
        launch!(&k.argmax_rows, (rows, ARGMAX_SPLITS), 512, "argmax_rows"; &logits, &ids, &vocab, &part, &count)?;
        // SAFETY: host_ids is pinned, holds MAX_ROWS ids and outlives the graph.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.host_ids.raw().cast(), ids, 4 * m, stream).result()
        }
        .ctx(|| "copying the ids back".into())?;
        Ok(())
    }
}

/// cos and sin of the rotary embedding, `[max_ctx, head_dim / 2]`, computed in f64.
pub fn rope_tables(shape: &Shape, max_ctx: usize) -> (Vec<f32>, Vec<f32>) {
    let half = shape.head_dim / 2;
    let mut cos = Vec::with_capacity(max_ctx * half);
    let mut sin = Vec::with_capacity(max_ctx * half);
    for p in 0..max_ctx {
        for i in 0..half {
            let inv = shape
                .rope_theta
                .powf(-((2 * i) as f64) / shape.head_dim as f64);
            let a = p as f64 * inv;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}
