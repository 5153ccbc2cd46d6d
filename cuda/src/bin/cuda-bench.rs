//! Benchmark of the CUDA step on random bf16 weights of a preset shape (run on the GPU
//! machine by `scripts/gpu-bench`):
//!
//!   cuda-bench --config qwen3-8b --context 512 --decode-tokens 128 --out cuda-qwen3-8b.json
//!   cuda-bench --config qwen2.5-1.5b --variants auto,unfused,auto+fold,auto+down=b4
//!
//! Prints and writes: device-to-device copy bandwidth (bytes read + written), the bandwidth
//! limit of decode (that bandwidth over the bytes one step reads: bf16 weights + bf16 KV at
//! the context), and per variant of the kernel sequence ([`StepOptions::parse`]; the first is
//! the default's): plain decode tokens/s with graph replay (each token read back by the host,
//! as a server must) and the verify-window curve (median wall time of a forward of 1–16 rows
//! at the context, read back included). For the first variant also eager launches and
//! programmatic dependent launch. Before that, each projection alone in both kernels (plain
//! and the 64-register one), with and without the RMS norm folded in.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use cudarc::driver::{result, sys};
use serde_json::json;
use specula_cuda::device::Timer;
use specula_cuda::plan::GemmPlan;
use specula_cuda::{Gpu, Proj, Shape, Step, StepOptions};

#[derive(Parser)]
struct Args {
    /// A preset (qwen2.5-1.5b, qwen3-8b) or an HF config.json.
    #[arg(long)]
    config: String,
    #[arg(long, default_value_t = 512)]
    context: usize,
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    #[arg(long, default_value = "1,2,4,8,16", value_delimiter = ',')]
    windows: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Size of the bandwidth copy (MiB; 0 skips it and uses --bandwidth-gbps).
    #[arg(long, default_value_t = 2048)]
    copy_mib: usize,
    #[arg(long, default_value_t = 0.0)]
    bandwidth_gbps: f64,
    /// Kernel-sequence variants to run the step with, first the one measured in full.
    #[arg(long, default_value = "auto,unfused", value_delimiter = ',')]
    variants: Vec<String>,
    /// Skips the table of each projection alone (for profiler runs of the step).
    #[arg(long)]
    skip_gemm: bool,
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn copy_gbps(gpu: &Gpu, mib: usize) -> Result<f64> {
    let bytes = mib << 20;
    let (a, b) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    gpu.fill_const(a.ptr(), bytes / 2, 0.5)?;
    let timer = Timer::new(gpu)?;
    let copy = || -> Result<()> {
        // SAFETY: both buffers hold `bytes` bytes.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(b.ptr(), a.ptr(), bytes, gpu.stream.cu_stream()).result()
        }
        .context("device copy")
    };
    copy()?;
    let mut times = Vec::new();
    for _ in 0..10 {
        timer.start(gpu)?;
        copy()?;
        times.push(timer.stop_ms(gpu)? as f64);
    }
    Ok(2.0 * bytes as f64 / (median(times) * 1e-3) / 1e9)
}

/// One projection alone: launches back to back over a ring of weight copies larger than L2
/// (so each reads from memory), timed with events, for every plan and row count.
struct GemmBench<'a> {
    gpu: &'a Gpu,
    n: usize,
    k: usize,
    ring: Vec<specula_cuda::device::DeviceBuffer>,
    x: specula_cuda::device::DeviceBuffer,
    ssq: specula_cuda::device::DeviceBuffer,
    out: specula_cuda::device::DeviceBuffer,
}

impl<'a> GemmBench<'a> {
    fn new(gpu: &'a Gpu, n: usize, k: usize) -> Result<Self> {
        let bytes = 2 * n * k;
        let copies = (512usize << 20).div_ceil(bytes).clamp(2, 64);
        let ring: Vec<_> = (0..copies)
            .map(|_| gpu.alloc(bytes))
            .collect::<specula_cuda::Result<_>>()?;
        for (i, w) in ring.iter().enumerate() {
            gpu.fill_uniform(w.ptr(), n * k, i as u64, 0.03)?;
        }
        let x = gpu.alloc(2 * 16 * k)?;
        gpu.fill_const(x.ptr(), 16 * k, 0.5)?;
        // The folded norm's sums of squares (fixed point): any value times.
        let ssq = gpu.alloc(8 * 16)?;
        gpu.fill_const(ssq.ptr(), 4 * 16, 1.0)?;
        let out = gpu.alloc(4 * 16 * n)?;
        Ok(Self {
            gpu,
            n,
            k,
            ring,
            x,
            ssq,
            out,
        })
    }

    /// Microseconds of one launch and the weight bytes it streams per second.
    fn rate(&self, plan: GemmPlan, rows: usize, norm: bool) -> Result<(f64, f64)> {
        let gpu = self.gpu;
        let (xp, op, zero) = (self.x.ptr(), self.out.ptr(), 0u64);
        let nwp = if norm { self.ssq.ptr() } else { 0 };
        let (mi, ni, ki, mode, eps) = (rows as i32, self.n as i32, self.k as i32, 0i32, 1e-6f32);
        let f = gpu.gemm(plan, norm);
        let launch = |w: u64| -> Result<()> {
            let mut args = [&xp, &nwp, &w, &zero, &op]
                .map(|p| std::ptr::from_ref(p).cast_mut().cast::<std::ffi::c_void>())
                .to_vec();
            args.extend(
                [&mi, &ni, &ki, &mode]
                    .map(|p| std::ptr::from_ref(p).cast_mut().cast::<std::ffi::c_void>()),
            );
            args.push(std::ptr::from_ref(&eps).cast_mut().cast());
            args.extend(
                [&zero, &zero, &zero]
                    .map(|p| std::ptr::from_ref(p).cast_mut().cast::<std::ffi::c_void>()),
            );
            // SAFETY: the buffers are sized for the kernel's arguments above.
            unsafe { gpu.launch(f, plan.grid(self.n), 256, true, &mut args) }.context("projection")
        };
        for w in &self.ring {
            launch(w.ptr())?;
        }
        let timer = Timer::new(gpu)?;
        let copies = self.ring.len();
        let reps = 4 * copies;
        timer.start(gpu)?;
        for i in 0..reps {
            launch(self.ring[i % copies].ptr())?;
        }
        let us = timer.stop_ms(gpu)? as f64 * 1e3 / reps as f64;
        let bytes = 2 * self.n * self.k;
        Ok((us, bytes as f64 / (us * 1e-6) / 1e9))
    }
}

/// Decode tokens/s and the verify-window curve of `step` as it is set.
struct Measured {
    tps: f64,
    ids: Vec<u32>,
    curve: Vec<(usize, f64)>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let shape = Shape::from_spec(&args.config)?;
    let gpu = Gpu::new(0)?;
    let name = gpu.name();
    let (free, total) = result::mem_get_info().context("memory info")?;
    let gbps = if args.copy_mib > 0 {
        copy_gbps(&gpu, args.copy_mib)?
    } else {
        args.bandwidth_gbps
    };
    let occ = gpu.occupancy();
    println!(
        "{} SMs; projection blocks an SM: {} (plain), {} (b4); peak memory {:.0} GB/s",
        occ.sms, occ.fit, occ.fit_b4, occ.mem_gbps
    );
    let auto = StepOptions::auto(&shape, occ);
    let mut gemms = Vec::new();
    for p in Proj::ALL.into_iter().filter(|_| !args.skip_gemm) {
        let (n, k) = p.dims(&shape);
        let bench = GemmBench::new(&gpu, n, k)?;
        let foldable = matches!(p, Proj::Qkv | Proj::GateUp);
        for rows in [1, 16] {
            let mut best: Option<(f64, GemmPlan)> = None;
            for plan in GemmPlan::ALL.into_iter().filter(|p| p.fits(n, k)) {
                for norm in [false, true] {
                    if norm && !foldable {
                        continue;
                    }
                    let (us, gb) = bench.rate(plan, rows, norm)?;
                    let step_uses = plan == auto.plan(p) && norm == (foldable && auto.fold_norm);
                    println!(
                        "gemm {:8} {n:6}x{k:5} rows {rows:2} {plan:6}{}: {us:8.2} us, {gb:6.0} GB/s ({:.0}% of copy){}",
                        p.name(),
                        if norm { " norm" } else { "     " },
                        100.0 * gb / gbps,
                        if step_uses { " <- step" } else { "" }
                    );
                    if !norm && best.is_none_or(|(b, _)| us < b) {
                        best = Some((us, plan));
                    }
                    gemms.push(json!({"proj": p.name(), "n": n, "k": k, "rows": rows, "plan": plan.to_string(), "norm": norm, "us": us, "gbps": gb, "step_uses": step_uses}));
                }
            }
            if let Some((us, plan)) = best {
                println!("best {:8} rows {rows:2}: {plan} ({us:.2} us)", p.name());
            }
        }
    }
    let max_ctx = args.context + args.decode_tokens + 32;
    let t = Instant::now();
    let mut step = Step::random(gpu, shape.clone(), max_ctx, 1)?;
    let load_s = t.elapsed().as_secs_f64();
    // The prompt: pseudo-random ids, through the cache in windows of 16.
    let prompt: Vec<u32> = (0..args.context)
        .map(|i| ((i * 7919 + 13) % shape.vocab) as u32)
        .collect();
    let prefill = |step: &mut Step| -> Result<u32> {
        let mut last = 0;
        for (c, chunk) in prompt.chunks(16).enumerate() {
            last = *step.forward(chunk, c * 16, true)?.last().expect("rows") as u32;
        }
        Ok(last)
    };
    let decode = |step: &mut Step, graph: bool, mut tok: u32| -> Result<(f64, Vec<u32>)> {
        let mut ids = Vec::new();
        let t = Instant::now();
        for i in 0..args.decode_tokens {
            tok = step.forward(&[tok], args.context + i, graph)?[0] as u32;
            ids.push(tok);
        }
        Ok((args.decode_tokens as f64 / t.elapsed().as_secs_f64(), ids))
    };
    let curve_of = |step: &mut Step| -> Result<Vec<(usize, f64)>> {
        for &w in &args.windows {
            step.capture(w)?;
        }
        let mut curve = Vec::new();
        for &w in &args.windows {
            let tokens = &prompt[..w];
            let mut times = Vec::new();
            for _ in 0..args.reps + 2 {
                let t = Instant::now();
                step.forward(tokens, args.context, true)?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            curve.push((w, median(times[2..].to_vec())));
        }
        Ok(curve)
    };
    // Each variant: its own graphs and prefill (its K/V), warm-up, decode, curve.
    let measure = |step: &mut Step| -> Result<(u32, Measured)> {
        let t = Instant::now();
        step.capture(1)?;
        step.capture(16)?;
        let capture_ms = t.elapsed().as_secs_f64() * 1e3;
        let last = prefill(step)?;
        decode(step, true, last)?; // warm-up
        let (tps, ids) = decode(step, true, last)?;
        let curve = curve_of(step)?;
        println!("  (captures {capture_ms:.0} ms)");
        Ok((last, Measured { tps, ids, curve }))
    };
    let bytes = shape.step_weight_bytes() + shape.kv_bytes(args.context);
    let limit = gbps * 1e9 / bytes as f64;
    println!(
        "{} on {name} ({:.1} of {:.1} GiB free)",
        args.config,
        free as f64 / 1e9,
        total as f64 / 1e9
    );
    println!(
        "copy {gbps:.0} GB/s; step reads {:.3} GB; limit {limit:.0} tok/s",
        bytes as f64 / 1e9
    );
    let ratio_of = |curve: &[(usize, f64)]| {
        let one = curve.iter().find(|c| c.0 == 1).map_or(curve[0].1, |c| c.1);
        move |ms: f64| ms / one
    };
    let mut variants = Vec::new();
    let mut first_extra = json!(null);
    for (vi, spec) in args.variants.iter().enumerate() {
        let options = StepOptions::parse(spec, &shape, occ)?;
        step.set_options(options.clone())?;
        let (last, m) = measure(&mut step)?;
        let r = ratio_of(&m.curve);
        let w16 = m.curve.iter().find(|c| c.0 == 16).map(|c| r(c.1));
        println!(
            "variant {spec}: decode (graph) {:.1} tok/s = {:.1}% of the limit; window 16 {}; {}",
            m.tps,
            100.0 * m.tps / limit,
            w16.map_or("n/a".into(), |x| format!("{x:.2}x")),
            options.describe()
        );
        for (w, ms) in &m.curve {
            println!("  window {w:2}: {ms:.3} ms ({:.2}x)", r(*ms));
        }
        if vi == 0 {
            let (eager_tps, eager_ids) = decode(&mut step, false, last)?;
            step.set_pdl(true);
            decode(&mut step, true, last)?; // captures the graph with PDL
            let (pdl_tps, pdl_ids) = decode(&mut step, true, last)?;
            let curve_pdl = curve_of(&mut step)?;
            step.set_pdl(false);
            let same = m.ids == eager_ids && m.ids == pdl_ids;
            let rp = ratio_of(&curve_pdl);
            println!(
                "  graph with PDL {pdl_tps:.1} tok/s; eager {eager_tps:.1}; same ids graph/eager/PDL: {same}"
            );
            for (w, ms) in &curve_pdl {
                println!("  window {w:2} with PDL: {ms:.3} ms ({:.2}x)", rp(*ms));
            }
            first_extra = json!({
                "decode_eager_tok_s": eager_tps,
                "decode_pdl_tok_s": pdl_tps,
                "same_ids_graph_eager_pdl": same,
                "windows_pdl": curve_pdl.iter().map(|(w, ms)| json!({"rows": w, "ms": ms, "ratio": rp(*ms)})).collect::<Vec<_>>(),
            });
        }
        variants.push(json!({
            "variant": spec,
            "options": options.describe(),
            "decode_tok_s": m.tps,
            "fraction_of_limit": m.tps / limit,
            "windows": m.curve.iter().map(|(w, ms)| json!({"rows": w, "ms": ms, "ratio": r(*ms)})).collect::<Vec<_>>(),
        }));
    }
    let first = &variants[0];
    let out = json!({
        "config": args.config,
        "gpu": name,
        "parameters": shape.parameters(),
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "copy_gbps": gbps,
        "bytes_per_token": bytes,
        "limit_tok_s": limit,
        "decode_tok_s": first["decode_tok_s"],
        "fraction_of_limit": first["fraction_of_limit"],
        "windows": first["windows"],
        "decode_eager_tok_s": first_extra["decode_eager_tok_s"],
        "decode_pdl_tok_s": first_extra["decode_pdl_tok_s"],
        "same_ids_graph_eager_pdl": first_extra["same_ids_graph_eager_pdl"],
        "windows_pdl": first_extra["windows_pdl"],
        "variants": variants,
        "gemm": gemms,
        "load_s": load_s,
    });
    if let Some(path) = args.out {
        std::fs::write(&path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
