#!/usr/bin/env bash
# Installs what `cargo build --features cuda` needs, without a GPU and without Debian CUDA
# packages (Debian has none): the CUDA 13 compiler, headers and link libraries from PyPI's
# NVIDIA wheels, unpacked into .cuda/ (git-ignored), laid out like a toolkit:
#   .cuda/nvidia/cu13/{bin,nvvm,include,lib,lib64}   nvcc, cicc, ptxas, headers, libcublas, ...
#   .cuda/nvidia/cu13/lib/stubs/libcuda.so       the driver's link stub (see below)
# Idempotent: a wheel already unpacked is not fetched again. Prints the environment the build
# needs; `source <(scripts/install-cuda-toolkit.sh --env)` sets it in the calling shell.
#
# The driver library (libcuda.so.1) comes with the NVIDIA driver, not with any wheel, and
# candle's cudarc links it by name. Like the toolkit's own lib/stubs/libcuda.so, the stub here
# only defines the driver's function names (taken from cudarc's bindings, so it always matches
# what we link) with SONAME libcuda.so.1: the binary is linked against it here and loads the
# real driver on a GPU machine. Put the stubs directory on LD_LIBRARY_PATH only where there is
# no driver (to see the GPU tests skip), never on a GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD/.cuda"
cuda="$root/nvidia/cu13"
# CUDA 13.5 wheels; cudarc 0.19 knows up to 13.4, which the 13.5 headers and libraries serve.
wheels=(
    nvidia-cuda-nvcc==13.5.37
    nvidia-nvvm==13.5.37
    nvidia-cuda-runtime==13.5.37
    nvidia-cuda-crt==13.5.37
    nvidia-cuda-nvrtc==13.5.37
    nvidia-cuda-cccl==13.3.5.0.6
    nvidia-cublas==13.10.0.20
    nvidia-curand==10.4.5.25
)

env_lines() {
    cat <<EOF
export CUDA_ROOT="$cuda"
export CUDA_PATH="$cuda"
export PATH="$cuda/bin:\$PATH"
export CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13040
export LIBRARY_PATH="$cuda/lib:$cuda/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
EOF
}

if [[ "${1:-}" == "--env" ]]; then
    env_lines
    exit 0
fi

mkdir -p "$root/wheels" "$root/installed"
for w in "${wheels[@]}"; do
    marker="$root/installed/$w"
    [[ -f "$marker" ]] && continue
    echo "install-cuda-toolkit: fetching $w" >&2
    rm -f "$root/wheels/"*.whl
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$root/wheels" "$w"
    python3 -m zipfile -e "$root"/wheels/*.whl "$root/"
    rm -f "$root/wheels/"*.whl
    touch "$marker"
done
chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/* 2>/dev/null || true

# Toolkit layout: lib64 beside lib, unversioned names for the linker.
ln -sfn lib "$cuda/lib64"
for f in "$cuda"/lib/lib*.so.*; do
    base="${f%%.so.*}.so"
    [[ -e "$base" ]] || ln -s "$(basename "$f")" "$base"
done

# The driver stub, from the function names cudarc's bindings declare.
if [[ ! -f "$cuda/lib/stubs/libcuda.so" ]]; then
    cargo fetch --quiet
    bindings=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -path '*cudarc-0.19*/src/driver/sys/mod.rs' | head -1)
    [[ -n "$bindings" ]] || { echo "install-cuda-toolkit: cudarc's driver bindings not found after cargo fetch" >&2; exit 1; }
    mkdir -p "$cuda/lib/stubs"
    grep -oP '^\s+fn \Kcu\w+(?=\()' "$bindings" | sort -u | sed 's/.*/int &(void) { return 999; }/' >"$root/libcuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/stubs/libcuda.so" "$root/libcuda-stub.c"
    # For running CUDA builds on a machine without a driver (the GPU tests then skip: every
    # stub function fails, so no device is found): LD_LIBRARY_PATH=$cuda/lib/stubs:$cuda/lib.
    ln -sfn libcuda.so "$cuda/lib/stubs/libcuda.so.1"
    echo "install-cuda-toolkit: driver stub with $(wc -l <"$root/libcuda-stub.c") functions" >&2
fi

"$cuda/bin/nvcc" --version | tail -2 >&2
echo "# the build environment (source <(scripts/install-cuda-toolkit.sh --env)):" >&2
env_lines
