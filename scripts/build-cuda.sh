#!/usr/bin/env bash
# The GPU build, so that a change breaking it does not land (run by .ci/run after the tests):
# the CUDA 13 toolkit from PyPI (scripts/install-cuda-toolkit.sh), then both workers and
# pd-engine-bench with `--features cuda` into target/cuda/ (a folder of its own: the CPU
# binaries in target/release stay free of CUDA libraries), then the engine's GPU tests. On a
# machine without an NVIDIA driver the toolkit's driver stub lets the test binary start, and
# every GPU test says "skipped: no CUDA device"; with a driver they run on the device.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
scripts/install-cuda-toolkit.sh >/dev/null
# shellcheck source=/dev/null
source <(scripts/install-cuda-toolkit.sh --env)
export CARGO_TARGET_DIR=target/cuda
cargo build --release -p pd-decode -p pd-prefill -p pd-engine --bins \
    --features pd-decode/cuda,pd-prefill/cuda,pd-engine/cuda
libs="$CUDA_ROOT/lib"
if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    libs="$CUDA_ROOT/lib/stubs:$libs"
fi
LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --release -p pd-engine --features cuda --test gpu
echo "build-cuda.sh: GPU build and tests in $(($(date +%s) - start)) s ($(du -sh target/cuda | cut -f1) in target/cuda)"
