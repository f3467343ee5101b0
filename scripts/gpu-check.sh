#!/usr/bin/env bash
# The prepared GPU check (issue 15), in two halves:
#
#   scripts/gpu-check.sh pack    here, no GPU needed: builds the `cuda` binaries (the engine's
#                                GPU tests, pd-engine-bench, both workers; the router needs no
#                                CUDA) into target/cuda, strips and xz-compresses them into
#                                .gpu-pack/ (git-ignored, ~35 MB).
#   scripts/gpu-check.sh run     on the GPU machine (the device tool: carry .gpu-pack), under 8
#                                minutes: the GPU tests; random-weight checkpoints in Llama-3.2-1B
#                                and Llama-3.1-8B shapes made there with its PyTorch
#                                (scripts/gpu/make_models.py); pd-engine-bench on each (prefill
#                                512/2,048/8,192 tokens, decode batch 1/16/64/256 at 1,024 tokens
#                                of context, KV export/import); a table against the H200's limits
#                                (scripts/gpu/summarize.py); the local cluster on the GPU answering
#                                four completions (scripts/gpu/cluster.sh). Everything lands in $OUT (default
#                                ./gpu-out): copy it to bench/results/gpu/<date>/ and commit.
#
# The device machine has no Rust toolchain and no network: the binaries travel, and the CUDA
# libraries they link (cuBLAS, cuRAND, the runtime) come from its PyTorch's NVIDIA wheels.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pack=.gpu-pack

if [[ "${1:-}" == "pack" ]]; then
    set -e
    scripts/install-cuda-toolkit.sh >/dev/null
    # shellcheck source=/dev/null
    source <(scripts/install-cuda-toolkit.sh --env)
    export CARGO_TARGET_DIR=target/cuda
    cargo build --release -p pd-engine --features cuda --bins --tests
    cargo build --release -p pd-decode -p pd-prefill --features pd-decode/cuda,pd-prefill/cuda --bins
    cargo build --release -p pd-router --bins
    tests=$(cargo test --release -p pd-engine --features cuda --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "gpu"][-1])')
    rm -rf "$pack" && mkdir -p "$pack"
    strip -o "$pack/gpu-tests" "$tests"
    for b in pd-engine-bench pd-decode pd-prefill pd-router; do strip -o "$pack/$b" "target/cuda/release/$b"; done
    # xz: the binaries are mostly candle's PTX text (55 MB -> 7 MB each); all five fit one transfer.
    xz -9 -T2 "$pack"/*
    git rev-parse --short HEAD > "$pack/commit"
    grep -qx '/.gpu-pack/' .gitignore || echo "add /.gpu-pack/ to .gitignore" >&2
    du -sh "$pack"
    exit 0
fi
[[ "${1:-}" == "run" ]] || { echo "usage: $0 pack|run" >&2; exit 2; }

# Here a skip is a failure, and so is any step that fails: the check exits non-zero then.
export PD_REQUIRE_GPU=1
failures=()
failed() { failures+=("$1"); echo "FAILED: $1"; }

out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out" /tmp/pd-gpu/bin /tmp/pd-gpu/models
log="$out/gpu-check.log"
exec > >(tee -a "$log") 2>&1
started=$(date +%s)
elapsed() { echo "$(($(date +%s) - started)) s"; }
echo "gpu-check: commit $(cat "$pack/commit" 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia-smi.csv"
for f in gpu-tests pd-engine-bench pd-decode pd-prefill pd-router; do
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$pack/$f.xz" "/tmp/pd-gpu/bin/$f" && chmod +x "/tmp/pd-gpu/bin/$f"
done

# The CUDA 13 libraries of the machine's PyTorch wheels (nvidia-cublas, -curand, -cuda-runtime, ...).
libdirs=$(python3 - <<'PY'
import glob, os
import nvidia
dirs = set()
for root in nvidia.__path__:
    for so in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== libraries"; ldd /tmp/pd-gpu/bin/pd-engine-bench | grep -E "cuda|cublas|curand|not found"

echo "== GPU tests ($(elapsed))"
timeout 90 /tmp/pd-gpu/bin/gpu-tests --test-threads 1 --nocapture 2>&1 | tee "$out/gpu-tests.txt"
rc=${PIPESTATUS[0]}
echo "gpu tests exit $rc" | tee -a "$out/gpu-tests.txt"
[[ $rc == 0 ]] || failed "gpu tests (exit $rc)"
grep -q "skipped: no CUDA device" "$out/gpu-tests.txt" && failed "a GPU test skipped"

echo "== checkpoints ($(elapsed))"
timeout 120 python3 scripts/gpu/make_models.py /tmp/pd-gpu/models llama-3.2-1b llama-3.1-8b || failed "checkpoints"

bench() { # model, timeout, extra args
    local model=$1 limit=$2
    shift 2
    [[ -f /tmp/pd-gpu/models/$model/model.safetensors ]] || { failed "no $model checkpoint"; return; }
    echo "== pd-engine-bench $model ($(elapsed))"
    timeout "$limit" /tmp/pd-gpu/bin/pd-engine-bench --model "/tmp/pd-gpu/models/$model" --device cuda \
        --weights f16 --kv-cache f16 --chunk 2048 --context 1024 --steps 16 "$@" 2>&1 | tee "$out/bench-$model.md"
    local rc=${PIPESTATUS[0]}
    echo "exit $rc after $(elapsed)" | tee -a "$out/bench-$model.md"
    [[ $rc == 0 ]] || failed "pd-engine-bench $model (exit $rc)"
}
bench llama-3.2-1b 80 --prefill 512,2048,8192 --batch 1,16,64,256
bench llama-3.1-8b 150 --prefill 512,2048,8192 --batch 1,16,64,256

echo "== the local cluster on the GPU ($(elapsed))"
timeout 90 scripts/gpu/cluster.sh /tmp/pd-gpu/bin /tmp/pd-gpu/models/llama-3.2-1b cuda "$out"
rc=$?
echo "cluster exit $rc"
[[ $rc == 0 ]] || failed "the cluster on the GPU (exit $rc)"

echo "== against the limits ($(elapsed))"
python3 scripts/gpu/summarize.py /tmp/pd-gpu/models "$out"/bench-*.md | tee "$out/summary.md"
[[ ${PIPESTATUS[0]} == 0 ]] || failed "summary"
if ((${#failures[@]})); then
    echo "gpu-check: ${#failures[@]} failed after $(elapsed): ${failures[*]}"
    exit 1
fi
echo "gpu-check: done in $(elapsed), every step passed"
