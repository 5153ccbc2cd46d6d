//! Compiles `kernels/step.cu` to PTX with nvcc when one is found (`SPECULA_NVCC`, then
//! `$CUDA_HOME/bin/nvcc`, then `nvcc` on PATH; `scripts/build-cuda` provides one from the pinned
//! PyPI wheels). Without nvcc the crate still builds (CI has no CUDA): the PTX is empty and
//! loading the kernels fails with an error that says how to build them.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(specula_ptx)");
    println!("cargo::rerun-if-changed=kernels/step.cu");
    for var in ["SPECULA_NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP", "PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("step.ptx");
    let Some(nvcc) = find_nvcc() else {
        println!("cargo::warning=specula-cuda: no nvcc (set SPECULA_NVCC); kernels not built");
        std::fs::write(&out, "").expect("write empty PTX");
        return;
    };
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=sm_{cap}"))
        .arg("kernels/step.cu")
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    assert!(
        status.success(),
        "nvcc failed on kernels/step.cu ({status})"
    );
    println!("cargo::rustc-cfg=specula_ptx");
}

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("SPECULA_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Ok(home) = std::env::var("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}
