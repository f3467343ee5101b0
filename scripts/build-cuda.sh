#!/usr/bin/env bash
# The GPU build, so that a change breaking it does not land (run by .ci/run after the tests):
# the CUDA 13 toolkit from PyPI (scripts/install-cuda-toolkit.sh), then pd-engine (the one
# crate with CUDA code: its binaries and its GPU tests) with `--features cuda` into
# target/cuda/ (a folder of its own: the CPU binaries in target/release stay free of CUDA
# libraries), then the engine's GPU tests. The workers' `cuda` features only forward to
# pd-engine's; `cargo tree` checks that they reach candle, which costs seconds where building
# the workers again (tonic, OpenTelemetry, ... with CUDA's candle) cost minutes of CI time.
# On a machine without an NVIDIA driver the toolkit's driver stub lets the test binary start,
# and every GPU test says "skipped: no CUDA device"; with a driver they run on the device.
# `scripts/gpu-check.sh pack` builds the workers with CUDA for the device machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
scripts/install-cuda-toolkit.sh >/dev/null
# shellcheck source=/dev/null
source <(scripts/install-cuda-toolkit.sh --env)
export CARGO_TARGET_DIR=target/cuda
for worker in pd-decode pd-prefill; do
    tree=$(cargo tree --quiet -p "$worker" --features "$worker/cuda" -e features -i candle-core)
    if ! grep -q 'candle-core feature "cuda"' <<<"$tree"; then
        echo "build-cuda.sh: $worker's cuda feature does not enable candle-core's" >&2
        exit 1
    fi
done
cargo build --release -p pd-engine --bins --features pd-engine/cuda
libs="$CUDA_ROOT/lib"
if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    libs="$CUDA_ROOT/lib/stubs:$libs"
fi
LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --release -p pd-engine --features cuda --test gpu
echo "build-cuda.sh: GPU build and tests in $(($(date +%s) - start)) s ($(du -sh target/cuda | cut -f1) in target/cuda)"
