#!/usr/bin/env bash
# The engine against llama.cpp on this machine: pd-engine-bench and llama.cpp's llama-bench
# and llama-batched-bench on the same model file, pinned to the same core, one thread, one
# after the other. llama.cpp is built from the source vendored in llama-cpp-python's sdist
# (PyPI; cmake from PyPI into a venv), once, under target/llamacpp/.
# Cells: prefill pp128/512/2048; decode tg at depth 512 (batch 1); batched decode at depth
# 512 with 1, 4 and 16 sequences (aggregate tok/s). Writes bench/results/engine/.
#   bench/engine-vs-llamacpp.sh            (CORE=1, WEIGHTS="wq f16", OUT=bench/results/engine)
#   PD_MODEL=target/bench-models/llama-3.2-1b.q4_1.gguf OUT=bench/results/engine-1b WEIGHTS=wq \
#       bench/engine-vs-llamacpp.sh         (random weights at Llama-3.2-1B geometry: bench/random_gguf.py)
#   bench/engine-vs-llamacpp.sh --build    (only build llama.cpp)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-bench/results/engine}"
work=target/llamacpp
core="${CORE:-1}"
weights="${WEIGHTS:-wq f16}"
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
scripts/fetch-model.sh >/dev/null
mkdir -p "$work" "$out"

if [[ ! -x "$work/build/bin/llama-batched-bench" ]]; then
    [[ -x "$work/venv/bin/cmake" ]] || { python3 -m venv "$work/venv" && "$work/venv/bin/pip" install --quiet cmake; }
    if [[ ! -d "$work/src" ]]; then
        url=$(python3 -c '
import json, urllib.parse, urllib.request
base = "https://pypi.org/pypi/llama-cpp-python/json"
info = json.load(urllib.request.urlopen(base))
sdist = [u["url"] for u in info["urls"] if u["packagetype"] == "sdist"][0]
print(urllib.parse.urljoin(base, sdist))')
        echo "llama.cpp source: $url" >&2
        curl -sSfL "$url" -o "$work/sdist.tar.gz"
        mkdir -p "$work/src" && tar xzf "$work/sdist.tar.gz" -C "$work/src" --strip-components=1
    fi
    "$work/venv/bin/cmake" -S "$work/src/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF >"$work/cmake.log"
    "$work/venv/bin/cmake" --build "$work/build" --target llama-bench llama-batched-bench -j "$(nproc)" \
        >"$work/build.log"
fi
[[ "${1:-}" == "--build" ]] && exit 0
cargo build --release --quiet -p pd-engine --bin pd-engine-bench

pin() { taskset -c "$core" "$@"; }
bin="$work/build/bin"
# On CPUs with AMX, llama.cpp (as vendored in llama-cpp-python 0.3.36) runs Q4_1/Q8_0 matmuls
# through its AMX buffers, reached by weight repacking; there they crash with SIGSEGV in
# ggml_backend_amx_mul_mat on the first prompt (Sapphire Rapids here). llama.cpp runs with
# repacking off on such machines: its AVX-512 VNNI kernels, as on every other machine.
repack=(--repack 1) batched_repack=()
if grep -qw amx_tile /proc/cpuinfo; then repack=(--repack 0) batched_repack=(--no-repack); fi
echo "== llama.cpp" >&2
pin "$bin/llama-bench" -m "$model" -t 1 -p 128,512,2048 -n 0 -r 3 "${repack[@]}" -o json >"$out/llamacpp-prefill.json"
pin "$bin/llama-bench" -m "$model" -t 1 -p 0 -n 64 -d 512 -r 3 "${repack[@]}" -o json >"$out/llamacpp-decode.json"
pin "$bin/llama-batched-bench" -m "$model" -t 1 -c 9216 -b 2048 -ub 512 -npp 512 -ntg 32 -npl 1,4,16 \
    "${batched_repack[@]}" --output-format jsonl 2>/dev/null | grep '^{' >"$out/llamacpp-batched.jsonl"
for w in $weights; do
    echo "== pd ($w)" >&2
    pin target/release/pd-engine-bench --model "$model" --threads 1 --weights "$w" --prefill 128,512,2048 \
        --batch 1,4,16 --context 512 --steps 128 --breakdown >"$out/pd-$w.md"
done
{
    echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), core $core of $(nproc), one thread."
    echo "CPU flags used: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512f|avx512_vnni|avx_vnni)$' | xargs)."
    echo "llama.cpp: the source vendored in llama-cpp-python $(awk '/^Version:/ {print $2; exit}' "$work/src/PKG-INFO") (PyPI sdist), built with GGML_NATIVE (its AVX-512 / VNNI kernels)$(grep -qw amx_tile /proc/cpuinfo && echo "; weight repacking off, as its AMX kernels crash here")."
    echo "Command: \`PD_MODEL=$model OUT=$out WEIGHTS=\"$weights\" bench/engine-vs-llamacpp.sh\` ($(date -u +%Y-%m-%d)); model $(basename "$model")."
    echo
    python3 bench/engine_vs_llamacpp.py "$out" $weights
    echo
    if [[ -f "$out/analysis.md" ]]; then
        echo "Profiles and what was tried: [analysis.md](analysis.md) (written by hand, not by this script)."
    fi
} >"$out/README.md"
cat "$out/README.md"
