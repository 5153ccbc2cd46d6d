//! Benchmark of the CUDA step on random bf16 weights of a preset shape (run on the GPU
//! machine by `scripts/gpu-bench`):
//!
//!   cuda-bench --config qwen3-8b --context 512 --decode-tokens 128 --out specula-cuda-qwen3-8b.json
//!
//! Prints and writes: device-to-device copy bandwidth (bytes read + written), the bandwidth
//! limit of decode (that bandwidth over the bytes one step reads: bf16 weights + bf16 KV at
//! the context), plain decode tokens/s with graph replay (each token read back by the host, as
//! a server must) and with eager launches, and the verify-window curve (median wall time of a
//! forward of 1–16 rows at the context, read back included).

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
    println!("decode (graph) {graph_tps:.1} tok/s = {:.1}% of the limit; eager {eager_tps:.1} tok/s; graph ids = eager ids: {}", 100.0 * graph_tps / limit, graph_ids == eager_ids);
    for (w, ms) in &curve {
        println!("window {w:2}: {ms:.3} ms ({:.2}x)", ms / one);
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
        "fraction_of_limit": graph_tps / limit,
        "graph_ids_equal_eager": graph_ids == eager_ids,
        "windows": curve.iter().map(|(w, ms)| json!({"rows": w, "ms": ms, "ratio": ms / one})).collect::<Vec<_>>(),
        "load_s": load_s,
        "capture_ms": capture_ms,
    });
    if let Some(path) = args.out {
        std::fs::write(&path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
