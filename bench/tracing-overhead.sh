#!/usr/bin/env bash
# Cost of trace export: TTFT and ITL at 4 concurrent streams on the local cluster
# (deploy/local/up.sh), with OTLP export to pd-otlp-sink on and off, alternating
# off/on/off/on so drift on a shared machine hits both alike. Results: stdout, and the raw
# pd-load output under bench/results/tmp/.
#   bench/tracing-overhead.sh [ROUNDS_PER_RUN]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds="${1:-4}"
out=bench/results/tmp
mkdir -p "$out"
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
target/release/pd-otlp-sink --listen 127.0.0.1:4317 --report-s 3600 >"$out/sink.log" &
sink=$!
trap 'kill $sink 2>/dev/null || true' EXIT

run() { # run NAME [ENV...]
    local name=$1; shift
    env "$@" deploy/local/up.sh >"$out/up-$name.log" 2>&1 &
    local up=$!
    for _ in $(seq 1 600); do
        grep -q "cluster ready" "$out/up-$name.log" && break
        sleep 0.2
    done
    target/release/pd-load --url http://127.0.0.1:8080 --concurrency 4 --rounds "$rounds" --max-tokens 64 >"$out/load-$name.txt"
    kill -TERM $up; wait $up 2>/dev/null || true
    echo "== $name"; cat "$out/load-$name.txt"
}
run off-1
run on-1 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_BSP_SCHEDULE_DELAY=1000
run off-2
run on-2 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_BSP_SCHEDULE_DELAY=1000
kill -INT $sink; wait $sink 2>/dev/null || true
echo "== sink"; tail -1 "$out/sink.log"
