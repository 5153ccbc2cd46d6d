//! Whether CUDA IPC works on this machine's runtime, between two processes, and what the
//! alternative (taps staged through pinned host memory) costs (run on the GPU machine).
//!
//! The parent fills a device buffer with a pattern, exports it (`cuIpcGetMemHandle`) and runs
//! itself as a child with the handle in hex; the child opens it (`cuIpcOpenMemHandle`), checks
//! the pattern, writes another into it and exits; the parent checks the child's write. Then the
//! parent times a device → pinned host → device round of tap-sized buffers (a drafter that reads
//! its taps through the host pays that twice a round: out of the target, into its own GPU).
//!
//!   cuda-ipc [--bytes N] [--json OUT]
//!
//! Prints one line per result and exits 1 if IPC fails.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys;
use half::bf16;
use specula_cuda::device::Timer;
use specula_cuda::Gpu;

const CHILD: &str = "--child";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(CHILD) {
        return child(&args[2], args[3].parse()?);
    }
    let mut bytes = 64usize << 20;
    let mut json = None;
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--bytes" => bytes = it.next().context("--bytes N")?.parse()?,
            "--json" => json = Some(it.next().context("--json PATH")?.clone()),
            other => bail!("unknown argument {other} (cuda-ipc [--bytes N] [--json OUT])"),
        }
    }
    let gpu = Gpu::new(0).context("opening the GPU")?;
    println!("cuda-ipc on {}", gpu.name());
    let n = bytes / 2;
    let buf = gpu.alloc(2 * n)?;
    gpu.fill_const(buf.ptr(), n, 1.5)?;
    gpu.sync()?;
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    let t = Instant::now();
    // SAFETY: buf is a live cuMemAlloc allocation of this context.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.ptr()).result() }
        .context("cuIpcGetMemHandle")?;
    let export_us = t.elapsed().as_secs_f64() * 1e6;
    let hex: String = handle
        .reserved
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect();
    let t = Instant::now();
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([CHILD, &hex, &n.to_string()])
        .output()
        .context("running the child")?;
    let child_ms = t.elapsed().as_secs_f64() * 1e3;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let mut back = vec![0u16; n];
    gpu.download(&mut back, &buf, 0)?;
    gpu.sync()?;
    let want = bf16::from_f32(-2.25).to_bits();
    let written = back.iter().filter(|&&b| b == want).count();
    let ipc_ok = out.status.success() && written == n;
    println!(
        "ipc: export {export_us:.1} us; child (start, open, check, write, exit) {child_ms:.1} ms; \
         child's write seen in {written} of {n} values: {}",
        if ipc_ok { "PASS" } else { "FAIL" }
    );

    // Taps through the host: rows × hidden f32 values, device → pinned → device.
    let mut staging = Vec::new();
    for (rows, hidden) in [(5usize, 576usize), (5, 896), (17, 896), (5, 4096)] {
        let len = rows * hidden * 4;
        let src = gpu.alloc(len)?;
        let dst = gpu.alloc(len)?;
        let pinned = gpu.pinned::<u8>(len)?;
        let timer = Timer::new(&gpu)?;
        let reps = 200;
        let mut ms = Vec::new();
        for _ in 0..reps {
            timer.start(&gpu)?;
            // SAFETY: src, dst and pinned hold len bytes each and outlive the synced copies.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    pinned.raw().cast(),
                    src.ptr(),
                    len,
                    gpu.stream.cu_stream(),
                )
                .result()
                .context("DtoH")?;
                sys::cuMemcpyHtoDAsync_v2(
                    dst.ptr(),
                    pinned.raw().cast(),
                    len,
                    gpu.stream.cu_stream(),
                )
                .result()
                .context("HtoD")?;
            }
            ms.push(timer.stop_ms(&gpu)? as f64);
        }
        ms.sort_by(f64::total_cmp);
        let med_us = ms[reps / 2] * 1e3;
        println!("host staging of {rows}x{hidden} f32 taps (D2H + H2D): median {med_us:.1} us");
        staging.push(
            serde_json::json!({"rows": rows, "hidden": hidden, "bytes": len, "median_us": med_us}),
        );
    }
    if let Some(path) = json {
        let report = serde_json::json!({
            "device": gpu.name(),
            "ipc_ok": ipc_ok,
            "export_us": export_us,
            "child_ms": child_ms,
            "values_checked": n,
            "values_written_by_child": written,
            "host_staging": staging,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {path}"))?;
    }
    if !ipc_ok {
        bail!("CUDA IPC failed");
    }
    Ok(())
}

/// Opens the parent's buffer from `hex`, checks its `n` values and overwrites them.
fn child(hex: &str, n: usize) -> Result<()> {
    let gpu = Gpu::new(0).context("child: opening the GPU")?;
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    for (i, b) in handle.reserved.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)? as std::ffi::c_char;
    }
    let mut ptr: sys::CUdeviceptr = 0;
    let t = Instant::now();
    gpu.ctx.bind_to_thread().context("child: binding")?;
    // SAFETY: the handle names a live allocation of the parent, which waits for this process.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            handle,
            sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
        .result()
    }
    .context("child: cuIpcOpenMemHandle")?;
    let open_us = t.elapsed().as_secs_f64() * 1e6;
    let mut host = vec![0u16; n];
    // SAFETY: ptr maps the parent's n bf16 values.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut host, ptr).context("child: reading")?;
    }
    let want = bf16::from_f32(1.5).to_bits();
    let seen = host.iter().filter(|&&b| b == want).count();
    gpu.fill_const(ptr, n, -2.25)?;
    gpu.sync()?;
    // SAFETY: ptr came from cuIpcOpenMemHandle above and is closed once.
    unsafe { sys::cuIpcCloseMemHandle(ptr).result() }.context("child: closing")?;
    println!("child: open {open_us:.1} us; parent's pattern seen in {seen} of {n} values");
    if seen != n {
        bail!("the child read {seen} of {n} values as written");
    }
    Ok(())
}
