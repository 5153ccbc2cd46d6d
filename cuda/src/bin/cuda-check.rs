//! The device check of the CUDA step (run on the GPU machine; `scripts/gpu-bench` runs it
//! first): every kernel against the CPU reference on fresh random inputs.
//!
//! 1. The projection kernels alone (plain and 64-register), in their three epilogues, with and
//!    without the RMS norm folded in, at the real models' widths (K up to 12288) and 1–16
//!    rows, outputs poisoned with NaN first so that an unwritten one fails.
//! 2. Whole forwards of three tiny models (llama-like; qwen2-like with q/k/v bias and tied
//!    embeddings, head_dim 128; qwen3-like with q/k norm): a prompt in windows of 16, 16 and 5
//!    (attention over several splits), greedy decode steps, a verify window of 8, and a
//!    rewritten window (rollback), each against the reference's logits; graph replay and
//!    eager launches must agree bit for bit, a window of 8 must equal 8 single steps bit for
//!    bit (batch invariance; once across the first attention split's end), and launches with
//!    programmatic dependent launch likewise. Each model runs under six kernel sequences:
//!    the default (norms folded), last session's unfused one with the plain projection kernel,
//!    the 64-register kernel everywhere with the merge inside the attention kernel at 1-2 rows
//!    (so a window of 8, merged by its own kernel, is held to the bits of single steps merged
//!    in the attention kernel), the norms apart with the deep kernel and every window merging
//!    in the attention kernel, K split over clusters of 2 and 4 blocks, and the 16-column
//!    kernels.
//!
//! Prints one line per check and exits 1 if any fails.

use anyhow::{bail, Context, Result};
use half::bf16;
use rand::{Rng, SeedableRng};
use specula_cuda::reference::{matmul, rel_err, HostWeights, Reference};
use specula_cuda::{GemmPlan, Gpu, Shape, Step, StepOptions};

/// Largest ‖gpu − ref‖ / ‖ref‖ accepted: bf16 operands with f32 sums land near 1e-3.
const TOL: f64 = 1e-2;
/// The fixed point of the folded norms' sums of squares (`SSQ_ONE` in step.cu).
const SSQ_ONE: f64 = 1_048_576.0;

fn main() -> Result<()> {
    let gpu = Gpu::new(0).context("opening the GPU")?;
    println!("cuda-check on {}", gpu.name());
    let mut failures = 0;
    let mut rng = rand::rngs::StdRng::seed_from_u64(std::process::id() as u64);
    let plans = GemmPlan::ALL;
    for (m, n, k, mode) in [
        (1, 1024, 4096, 0),
        (3, 512, 12288, 1),
        (16, 2048, 4096, 2),
        (7, 136, 96, 0),
        (16, 4096, 12288, 1),
        (9, 96, 1536, 2),
    ] {
        let bias = mode == 0 && m == 1;
        for norm in [false, true] {
            if norm && mode == 1 {
                continue; // the step folds norms into qkv and gate|up only
            }
            // Every residual add (mode 1) is checked handing the next norm over too.
            for (plan, err) in check_gemm(&gpu, &mut rng, &plans, (m, n, k), mode, bias, norm)? {
                let what = format!(
                    "projection {plan} m={m} n={n} k={k} mode={mode} bias={bias} norm={norm}"
                );
                failures += report(&what, err);
            }
        }
    }
    let tiny = |hidden, heads, kv, hd, bias: bool, qk: bool| Shape {
        vocab: 512,
        hidden,
        intermediate: 2 * hidden,
        layers: 2,
        heads,
        kv_heads: kv,
        head_dim: hd,
        rms_eps: 1e-6,
        rope_theta: 10_000.0,
        tied_embeddings: bias,
        qkv_bias: bias,
        qk_norm: qk,
    };
    for (name, shape) in [
        ("llama-like", tiny(256, 4, 2, 64, false, false)),
        ("qwen2-like", tiny(256, 2, 1, 128, true, false)),
        ("qwen3-like", tiny(512, 8, 2, 64, false, true)),
    ] {
        let occ = gpu.occupancy();
        let seed = rng.random();
        let variant = |spec: &str| StepOptions::parse(spec, &shape, occ).expect("variant");
        for (variant, options) in [
            ("default", variant("auto")),
            (
                "unfused, plain",
                variant("unfused+qkv=plain+o_proj=plain+gate_up=plain+down=plain+lm_head=plain"),
            ),
            (
                "folded, b4, merged in kernel at 1-2 rows",
                variant("auto+fold+merge=2+qkv=b4+o_proj=b4+gate_up=b4+down=b4+lm_head=b4"),
            ),
            (
                "norms apart, deep, merge in kernel",
                variant(
                    "auto+nofold+merge=16+qkv=deep+o_proj=deep+gate_up=deep+down=deep+lm_head=deep",
                ),
            ),
            (
                "split 2 and 4, folded",
                variant("auto+fold+qkv=b4x2+o_proj=plainx4+gate_up=plainx2+down=b4x4+lm_head=b4x2"),
            ),
            (
                "16 columns a block, folded",
                variant("auto+fold+qkv=w16+o_proj=w16d+gate_up=w16d+down=w16+lm_head=w16"),
            ),
        ] {
            failures += check_forward(&format!("{name} {variant}"), shape.clone(), options, seed)?;
        }
    }
    if failures > 0 {
        bail!("{failures} checks failed");
    }
    println!("all checks passed");
    Ok(())
}

fn report(what: &str, err: f64) -> usize {
    let ok = err < TOL;
    println!(
        "{} {what}: rel err {err:.2e}",
        if ok { "PASS" } else { "FAIL" }
    );
    usize::from(!ok)
}

fn rand_bf16(rng: &mut impl Rng, n: usize, a: f32) -> Vec<u16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-a..a)).to_bits())
        .collect()
}

fn to_f32(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// One projection shape against the CPU under each plan that tiles it: `(plan, rel err)`.
fn check_gemm(
    gpu: &Gpu,
    rng: &mut impl Rng,
    plans: &[GemmPlan],
    (m, n, k): (usize, usize, usize),
    mode: i32,
    with_bias: bool,
    norm: bool,
) -> Result<Vec<(GemmPlan, f64)>> {
    let eps = 1e-6f32;
    let w = rand_bf16(rng, n * k, 0.05);
    let b = rand_bf16(rng, n, 0.5);
    // X has 16 rows as in the step; rows >= m are poison the kernel must not read. With the
    // norm folded in, X holds bf16(x * nw) of a residual stream x and `ssq` its rows' sums of
    // squares in fixed point (as embed or a residual add hands them over).
    let mut ssq = vec![0u64; 16];
    let (x, acc) = if norm {
        let xr: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
        let nw = rand_bf16(rng, k, 1.0);
        let mut x = vec![bf16::NAN.to_bits(); 16 * k];
        let mut scale = vec![0f32; m];
        for r in 0..m {
            let row = &xr[r * k..(r + 1) * k];
            let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            ssq[r] = (ss * SSQ_ONE).round() as u64;
            scale[r] = 1.0 / (ss as f32 / k as f32 + eps).sqrt();
            for i in 0..k {
                x[r * k + i] = bf16::from_f32(row[i] * bf16::from_bits(nw[i]).to_f32()).to_bits();
            }
        }
        let mut acc = matmul(&to_f32(&x[..m * k]), m, &w, n, k);
        for (i, v) in acc.iter_mut().enumerate() {
            *v *= scale[i / n];
        }
        (x, acc)
    } else {
        let mut x = rand_bf16(rng, 16 * k, 1.0);
        for v in &mut x[m * k..] {
            *v = bf16::NAN.to_bits();
        }
        let acc = matmul(&to_f32(&x[..m * k]), m, &w, n, k);
        (x, acc)
    };
    let out_len = if mode == 2 { m * n / 2 } else { m * n };
    let init: Vec<f32> = if mode == 1 {
        (0..out_len).map(|_| rng.random_range(-1.0..1.0)).collect()
    } else {
        vec![f32::NAN; out_len]
    };
    let want: Vec<f32> = if mode == 2 {
        acc.chunks(2)
            .map(|p| p[0] / (1.0 + (-p[0]).exp()) * p[1])
            .collect()
    } else {
        acc.iter()
            .enumerate()
            .map(|(i, &a)| match mode {
                1 => init[i] + a,
                _ if with_bias => a + bf16::from_bits(b[i % n]).to_f32(),
                _ => a,
            })
            .collect()
    };
    // The residual add also hands the next norm over: bf16(x * nw_out) and the sums of squares.
    let nw_out = rand_bf16(rng, n, 1.0);
    let (want_xb, want_ssq): (Vec<f32>, Vec<f32>) = if mode == 1 {
        let xb = want
            .iter()
            .enumerate()
            .map(|(i, &v)| v * bf16::from_bits(nw_out[i % n]).to_f32())
            .collect();
        let ss = want
            .chunks(n)
            .map(|r| r.iter().map(|v| v * v).sum())
            .collect();
        (xb, ss)
    } else {
        (Vec::new(), Vec::new())
    };
    let (dx, dssq) = (gpu.alloc(2 * x.len())?, gpu.alloc(8 * 16)?);
    gpu.upload(&dx, 0, &x)?;
    gpu.upload(&dssq, 0, &ssq)?;
    let (dw, db, dnw) = (
        gpu.alloc(2 * w.len())?,
        gpu.alloc(2 * n)?,
        gpu.alloc(2 * n)?,
    );
    gpu.upload(&dw, 0, &w)?;
    gpu.upload(&db, 0, &b)?;
    gpu.upload(&dnw, 0, &nw_out)?;
    let dout = gpu.alloc(4 * out_len.max(1))?;
    let (dxb, dssq_out) = (gpu.alloc(2 * m * n)?, gpu.alloc(8 * 16)?);
    let px = dx.ptr();
    let pssq = if norm { dssq.ptr() } else { 0 };
    let (pw, pout) = (dw.ptr(), dout.ptr());
    let pb = if with_bias { db.ptr() } else { 0 };
    let (pxb, pnw, pso) = match mode {
        1 => (dxb.ptr(), dnw.ptr(), dssq_out.ptr()),
        _ => (0, 0, 0),
    };
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let mut results = Vec::new();
    for &plan in plans.iter().filter(|p| p.fits(n, k)) {
        if mode == 2 {
            // bf16 output: poison with bf16 NaN.
            gpu.upload(&dout, 0, &vec![bf16::NAN.to_bits(); out_len])?;
        } else {
            gpu.upload(&dout, 0, &init)?;
        }
        gpu.upload(&dxb, 0, &vec![bf16::NAN.to_bits(); m * n])?;
        gpu.upload(&dssq_out, 0, &[0u64; 16])?;
        let ptrs = [&px, &pssq, &pw, &pb, &pout];
        let ints = [&mi, &ni, &ki, &mode];
        let mut args: Vec<*mut std::ffi::c_void> = ptrs
            .iter()
            .map(|p| std::ptr::from_ref(*p).cast_mut().cast())
            .collect();
        args.extend(
            ints.iter()
                .map(|p| std::ptr::from_ref(*p).cast_mut().cast::<std::ffi::c_void>()),
        );
        args.push(std::ptr::from_ref(&eps).cast_mut().cast());
        args.extend(
            [&pxb, &pnw, &pso].map(|p| std::ptr::from_ref(p).cast_mut().cast::<std::ffi::c_void>()),
        );
        // SAFETY: buffers sized above for the kernel's arguments.
        unsafe { gpu.launch(gpu.gemm(plan, norm), plan.grid(n), 256, false, &mut args) }?;
        let got = if mode == 2 {
            let mut o = vec![0u16; out_len];
            gpu.download(&mut o, &dout, 0)?;
            gpu.sync()?;
            to_f32(&o)
        } else {
            let mut o = vec![0f32; out_len];
            gpu.download(&mut o, &dout, 0)?;
            gpu.sync()?;
            o
        };
        let mut err = rel_err(&got, &want);
        if mode == 1 {
            let mut xb = vec![0u16; m * n];
            let mut sq = vec![0u64; 16];
            gpu.download(&mut xb, &dxb, 0)?;
            gpu.download(&mut sq, &dssq_out, 0)?;
            gpu.sync()?;
            let sq: Vec<f32> = sq[..m]
                .iter()
                .map(|&q| (q as f64 / SSQ_ONE) as f32)
                .collect();
            err = err
                .max(rel_err(&to_f32(&xb), &want_xb))
                .max(rel_err(&sq, &want_ssq));
        }
        results.push((plan, err));
    }
    Ok(results)
}

/// Greedy argmax with the lowest index among ties, as the kernel.
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn check_forward(name: &str, shape: Shape, options: StepOptions, seed: u64) -> Result<usize> {
    let max_ctx = 100;
    let weights = HostWeights::random(&shape, seed);
    let gpu = Gpu::new(0)?;
    let dev_weights = weights.upload(&gpu)?;
    let mut step = Step::new(gpu, shape.clone(), max_ctx, dev_weights)?;
    println!("{name}: {}", options.describe());
    step.set_options(options)?;
    let mut reference = Reference::new(shape.clone(), weights, max_ctx);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vocab = shape.vocab;
    let mut failures = 0;
    let mut worst: f64 = 0.0;
    let mut argmax_diff = 0;
    let mut rows_total = 0;
    let mut run = |step: &mut Step,
                   reference: &mut Reference,
                   tokens: &[u32],
                   pos: usize,
                   graph: bool|
     -> Result<(Vec<i32>, f64)> {
        let ids = step.forward(tokens, pos, graph)?.to_vec();
        let got = step.logits(tokens.len())?;
        let want = reference.forward(tokens, pos);
        for (r, id) in ids.iter().enumerate() {
            let row = &got[r * vocab..(r + 1) * vocab];
            if *id as usize != argmax(row) {
                bail!(
                    "{name}: row {r} at {pos}: kernel argmax {id}, logits argmax {}",
                    argmax(row)
                );
            }
            rows_total += 1;
            if argmax(&want[r * vocab..(r + 1) * vocab]) != *id as usize {
                argmax_diff += 1;
            }
        }
        Ok((ids, rel_err(&got, &want)))
    };
    let prompt: Vec<u32> = (0..37).map(|_| rng.random_range(0..vocab as u32)).collect();
    let mut pos = 0;
    let mut last = 0;
    for chunk in [&prompt[..16], &prompt[16..32], &prompt[32..]] {
        let (ids, err) = run(&mut step, &mut reference, chunk, pos, true)?;
        worst = worst.max(err);
        pos += chunk.len();
        last = *ids.last().expect("rows") as u32;
    }
    for _ in 0..6 {
        let (ids, err) = run(&mut step, &mut reference, &[last], pos, true)?;
        worst = worst.max(err);
        pos += 1;
        last = ids[0] as u32;
    }
    let window: Vec<u32> = (0..8).map(|_| rng.random_range(0..vocab as u32)).collect();
    let (_, err) = run(&mut step, &mut reference, &window, pos, true)?;
    worst = worst.max(err);
    // Roll back 5 positions and write a different window there.
    pos -= 5;
    let (_, err) = run(&mut step, &mut reference, &window[..3], pos, true)?;
    worst = worst.max(err);
    failures += report(
        &format!(
            "{name}: forwards vs CPU reference ({rows_total} rows, {argmax_diff} argmax differ)"
        ),
        worst,
    );
    // Eager launches and graph replay of the same step: bit-identical logits.
    let eager_ids = step.forward(&window[..3], pos, false)?.to_vec();
    let eager = step.logits(3)?;
    let graph_ids = step.forward(&window[..3], pos, true)?.to_vec();
    let graph = step.logits(3)?;
    let same = eager_ids == graph_ids
        && eager
            .iter()
            .zip(&graph)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    println!(
        "{} {name}: graph replay = eager launches, bit for bit",
        if same { "PASS" } else { "FAIL" }
    );
    failures += usize::from(!same);
    // Batch invariance: a verify window's rows equal the same tokens run one by one, bit for
    // bit (every row's sums run in one fixed order whatever the window), so speculation cannot
    // change greedy output through rounding.
    // At 28 the window's rows straddle the first 32-key split's end: its first rows attend
    // within one split, the rest across two (merged), as single steps there do.
    for at in [28, pos + 3] {
        step.forward(&window, at, true)?;
        let win = step.logits(8)?;
        let mut same_rows = 0;
        for (i, &t) in window.iter().enumerate() {
            step.forward(&[t], at + i, true)?;
            let row = step.logits(1)?;
            same_rows += usize::from(
                row.iter()
                    .zip(&win[i * vocab..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            );
        }
        let ok = same_rows == window.len();
        println!(
            "{} {name}: window of 8 at {at} = 8 single steps, bit for bit ({same_rows}/8 rows)",
            if ok { "PASS" } else { "FAIL" }
        );
        failures += usize::from(!ok);
    }
    let at = pos + 3;
    step.forward(&window, at, true)?;
    let win = step.logits(8)?;
    // Programmatic dependent launch changes scheduling only.
    step.set_pdl(true);
    step.forward(&window, at, true)?;
    let with_pdl = step.logits(8)?;
    step.set_pdl(false);
    let ok = with_pdl
        .iter()
        .zip(&win)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    println!(
        "{} {name}: launches with PDL give the same logits",
        if ok { "PASS" } else { "FAIL" }
    );
    failures += usize::from(!ok);
    // Bad inputs are refused before anything runs.
    let refused = step.forward(&[vocab as u32], 0, true).is_err()
        && step.forward(&[0; 17], 0, true).is_err()
        && step.forward(&[0; 2], max_ctx - 1, true).is_err()
        && step.forward(&[], 0, true).is_err();
    println!(
        "{} {name}: bad inputs refused",
        if refused { "PASS" } else { "FAIL" }
    );
    failures += usize::from(!refused);
    Ok(failures)
}
