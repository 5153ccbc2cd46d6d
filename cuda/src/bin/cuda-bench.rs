//! Benchmark of the CUDA step on random bf16 weights of a preset shape (run on the GPU
//! machine by `scripts/gpu-bench`):
//!
//!   cuda-bench --config qwen3-8b --context 512 --decode-tokens 128 --out cuda-qwen3-8b.json
//!
//! Prints and writes: device-to-device copy bandwidth (bytes read + written), the bandwidth
//! limit of decode (that bandwidth over the bytes one step reads: bf16 weights + bf16 KV at
//! the context), plain decode tokens/s with graph replay (each token read back by the host, as
//! a server must), the same with programmatic dependent launch and with eager launches, the
//! verify-window curve (median wall time of a forward of 1–16 rows at the context, read back
//! included) with and without PDL, and each projection kernel's bandwidth alone.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use cudarc::driver::{result, sys};
use serde_json::json;
use specula_cuda::device::Timer;
use specula_cuda::{Gpu, Shape, Step};

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

/// The projection kernel alone on one weight shape: launches back to back over a ring of
/// weight copies larger than L2 (so each reads from memory), timed with events. Returns the
/// microseconds of one launch and the weight bytes it streams per second.
fn gemm_rate(gpu: &Gpu, b4: bool, rows: usize, n: usize, k: usize) -> Result<(f64, f64)> {
    let bytes = 2 * n * k;
    let copies = (512usize << 20).div_ceil(bytes).clamp(2, 64);
    let ring: Vec<_> = (0..copies)
        .map(|_| gpu.alloc(bytes))
        .collect::<specula_cuda::Result<_>>()?;
    for (i, w) in ring.iter().enumerate() {
        gpu.fill_uniform(w.ptr(), n * k, i as u64, 0.03)?;
    }
    let x = gpu.alloc(2 * 16 * k)?;
    gpu.fill_uniform(x.ptr(), 16 * k, 99, 1.0)?;
    let out = gpu.alloc(4 * 16 * n)?;
    let (xp, op, zero) = (x.ptr(), out.ptr(), 0u64);
    let (mi, ni, ki, mode) = (rows as i32, n as i32, k as i32, 0i32);
    let launch = |w: u64| -> Result<()> {
        let mut args = [&xp as *const u64, &w, &zero, &op]
            .map(|p| p.cast_mut().cast::<std::ffi::c_void>())
            .to_vec();
        args.extend(
            [&mi, &ni, &ki, &mode]
                .map(|p| std::ptr::from_ref(p).cast_mut().cast::<std::ffi::c_void>()),
        );
        let (f, threads) = if b4 {
            (&gpu.kernels.skinny_gemm_b4, 256)
        } else {
            (&gpu.kernels.skinny_gemm, 256)
        };
        // SAFETY: the buffers are sized for the kernel's arguments above.
        unsafe { gpu.launch(f, ((n / 8) as u32, 1), threads, true, &mut args) }
            .context("skinny_gemm")
    };
    for w in &ring {
        launch(w.ptr())?;
    }
    let timer = Timer::new(gpu)?;
    let reps = 4 * copies;
    timer.start(gpu)?;
    for i in 0..reps {
        launch(ring[i % copies].ptr())?;
    }
    let us = timer.stop_ms(gpu)? as f64 * 1e3 / reps as f64;
    Ok((us, bytes as f64 / (us * 1e-6) / 1e9))
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
    let (sms, fit, fit_b4) = gpu.occupancy();
    println!("{sms} SMs; projection blocks an SM: {fit} (plain), {fit_b4} (b4)");
    let mut gemms = Vec::new();
    for (what, n, k) in [
        ("qkv", shape.qkv_width(), shape.hidden),
        ("o_proj", shape.hidden, shape.heads * shape.head_dim),
        ("gate_up", 2 * shape.intermediate, shape.hidden),
        ("down", shape.hidden, shape.intermediate),
        ("lm_head", shape.vocab, shape.hidden),
    ] {
        for rows in [1, 16] {
            for b4 in [false, true] {
                let (us, gb) = gemm_rate(&gpu, b4, rows, n, k)?;
                let kernel = if b4 { "b4" } else { "plain" };
                let picked =
                    gpu.gemm_kernel(n).cu_function() == gpu.kernels.skinny_gemm_b4.cu_function();
                let step_uses = picked == b4;
                println!(
                    "gemm {what:8} {n:6}x{k:5} rows {rows:2} {kernel:5}: {us:8.2} us, {gb:6.0} GB/s ({:.0}% of copy){}",
                    100.0 * gb / gbps,
                    if step_uses { " <- step" } else { "" }
                );
                gemms.push(json!({"proj": what, "n": n, "k": k, "rows": rows, "kernel": kernel, "us": us, "gbps": gb, "step_uses": step_uses}));
            }
        }
    }
    let max_ctx = args.context + args.decode_tokens + 32;
    let t = Instant::now();
    let mut step = Step::random(gpu, shape.clone(), max_ctx, 1)?;
    let load_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for &w in &args.windows {
        step.capture(w)?;
    }
    step.capture(1)?;
    step.capture(16)?;
    let capture_ms = t.elapsed().as_secs_f64() * 1e3;
    // The prompt: pseudo-random ids, through the cache in windows of 16.
    let prompt: Vec<u32> = (0..args.context)
        .map(|i| ((i * 7919 + 13) % shape.vocab) as u32)
        .collect();
    let mut last = 0;
    for (c, chunk) in prompt.chunks(16).enumerate() {
        last = *step.forward(chunk, c * 16, true)?.last().expect("rows") as u32;
    }
    let decode = |step: &mut Step, graph: bool, mut tok: u32| -> Result<(f64, Vec<u32>)> {
        let mut ids = Vec::new();
        let t = Instant::now();
        for i in 0..args.decode_tokens {
            tok = step.forward(&[tok], args.context + i, graph)?[0] as u32;
            ids.push(tok);
        }
        Ok((args.decode_tokens as f64 / t.elapsed().as_secs_f64(), ids))
    };
    decode(&mut step, true, last)?; // warm-up
    let (graph_tps, graph_ids) = decode(&mut step, true, last)?;
    let (eager_tps, eager_ids) = decode(&mut step, false, last)?;
    step.set_pdl(true);
    decode(&mut step, true, last)?; // captures the graph with PDL
    let (pdl_tps, pdl_ids) = decode(&mut step, true, last)?;
    step.set_pdl(false);
    for &w in &args.windows {
        step.capture(w)?;
    }
    let curve_of = |step: &mut Step| -> Result<Vec<(usize, f64)>> {
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
    let curve = curve_of(&mut step)?;
    step.set_pdl(true);
    let curve_pdl = curve_of(&mut step)?;
    step.set_pdl(false);
    let bytes = shape.step_weight_bytes() + shape.kv_bytes(args.context);
    let limit = gbps * 1e9 / bytes as f64;
    let one = curve.iter().find(|c| c.0 == 1).map_or(curve[0].1, |c| c.1);
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
    let same = graph_ids == eager_ids && graph_ids == pdl_ids;
    println!(
        "decode (graph) {graph_tps:.1} tok/s = {:.1}% of the limit; graph with PDL {pdl_tps:.1}; eager {eager_tps:.1}; same ids: {same}",
        100.0 * graph_tps / limit
    );
    let one_pdl = curve_pdl
        .iter()
        .find(|c| c.0 == 1)
        .map_or(curve_pdl[0].1, |c| c.1);
    for ((w, ms), (_, np)) in curve.iter().zip(&curve_pdl) {
        println!(
            "window {w:2}: {ms:.3} ms ({:.2}x); with PDL {np:.3} ms ({:.2}x)",
            ms / one,
            np / one_pdl
        );
    }
    let out = json!({
        "config": args.config,
        "gpu": name,
        "parameters": shape.parameters(),
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "copy_gbps": gbps,
        "bytes_per_token": bytes,
        "limit_tok_s": limit,
        "decode_tok_s": graph_tps,
        "decode_eager_tok_s": eager_tps,
        "decode_pdl_tok_s": pdl_tps,
        "fraction_of_limit": graph_tps / limit,
        "same_ids_graph_eager_pdl": same,
        "windows": curve.iter().map(|(w, ms)| json!({"rows": w, "ms": ms, "ratio": ms / one})).collect::<Vec<_>>(),
        "gemm": gemms,
        "windows_pdl": curve_pdl.iter().map(|(w, ms)| json!({"rows": w, "ms": ms, "ratio": ms / one_pdl})).collect::<Vec<_>>(),
        "load_s": load_s,
        "capture_ms": capture_ms,
    });
    if let Some(path) = args.out {
        std::fs::write(&path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
