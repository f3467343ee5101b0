//! With the `cuda` feature: compiles the engine's own CUDA kernels (`src/cuda/*.cu`) to PTX
//! with nvcc, for the compute capability in `CUDA_COMPUTE_CAP` (default 90, Hopper), the
//! same variable candle's kernels use. The driver JIT-compiles the PTX for the GPU it finds,
//! so one build serves that capability and newer. nvcc is taken from `CUDA_ROOT/bin`, else
//! from PATH (`scripts/install-cuda-toolkit.sh --env` sets both).
use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["paged_attention"];

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var_os("CUDA_ROOT")
        .map(|root| PathBuf::from(root).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    for name in KERNELS {
        let src = format!("src/cuda/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "--std=c++17", &format!("--gpu-architecture=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {} for {src}: {e} (run scripts/install-cuda-toolkit.sh)", nvcc.display())
            });
        assert!(status.success(), "nvcc failed on {src} ({status})");
    }
}
