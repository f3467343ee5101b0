#!/usr/bin/env bash
# One-command local cluster: one decode worker and one prefill worker, each pinned to its own
# core with one compute thread, and the router, all on 127.0.0.1, in the foreground. The
# binaries' defaults are the measured configuration (bench/results/slo/): the built-in
# traffic classes (deploy/classes/default.toml: interactive, batch), admission control with
# 429 + Retry-After, request-parallel prefill in ~150 ms steps (25 ms while short prompts are
# about; a document's step stops between layers for a short prompt), prompts prefilled on the
# prefill worker.
# Builds and fetches what is missing, prints a line when ready, stops every child on
# Ctrl-C / SIGTERM.
#
#   deploy/local/up.sh          # serve until Ctrl-C
#   deploy/local/up.sh --demo   # also stream one chat answer once ready
#
# Environment: PD_HTTP_PORT (8080), PD_GRPC_PORT (50051), PD_DECODE_METRICS_PORT (9091),
# PD_PREFILL_METRICS_PORT (9092), PD_MODEL (the fetched model), and the OpenTelemetry
# variables (OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 with
# deploy/observability/compose.yaml running sends every request's trace to Jaeger).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

demo=false
[[ "${1:-}" == "--demo" ]] && demo=true
http_port="${PD_HTTP_PORT:-8080}"
grpc_port="${PD_GRPC_PORT:-50051}"
decode_metrics_port="${PD_DECODE_METRICS_PORT:-9091}"
prefill_metrics_port="${PD_PREFILL_METRICS_PORT:-9092}"
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"

scripts/install-deps.sh
if [[ -z "${PD_MODEL:-}" ]]; then
    scripts/fetch-model.sh >/dev/null
fi
[[ -f "$model" ]] || { echo "up.sh: model $model not found" >&2; exit 1; }
# Same features as scripts/test.sh, so one set of build artifacts serves both.
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
bin=target/release
logs="$(mktemp -d)"
pids=()

stop() {
    trap - INT TERM EXIT
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    echo "pd local cluster stopped (logs were in $logs)"
}
trap stop INT TERM EXIT

# Pin to separate cores where the machine has them.
cores=$(nproc)
# Used as `pin CORE CMD... &`: exec, so the background job's pid is the worker's own.
pin() { if command -v taskset >/dev/null && ((cores > 1)); then exec taskset -c "$1" "${@:2}"; else exec "${@:2}"; fi; }

# Starts a worker on port 0 (in this shell, so `stop` knows its pid).
start_worker() {
    local name=$1 core=$2 metrics_port=$3
    pin "$core" "$bin/$name" --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$metrics_port" \
        --model "$model" --threads 1 >"$logs/$name.log" 2>&1 &
    pids+=($!)
}

# Waits for the address a worker printed and echoes it.
address_of() {
    local name=$1 pid=$2 addr
    for _ in $(seq 1 600); do
        addr=$(grep -oE 'listening on [0-9.:]+' "$logs/$name.log" | awk '{print $3}' || true)
        [[ -n "$addr" ]] && { echo "$addr"; return; }
        kill -0 "$pid" 2>/dev/null || { cat "$logs/$name.log" >&2; return 1; }
        sleep 0.1
    done
    echo "up.sh: $name did not start" >&2
    return 1
}

start_worker pd-decode $((cores > 1 ? 1 : 0)) "$decode_metrics_port"
decode_pid=${pids[-1]}
start_worker pd-prefill 0 "$prefill_metrics_port"
prefill_pid=${pids[-1]}
decode=$(address_of pd-decode "$decode_pid")
prefill=$(address_of pd-prefill "$prefill_pid")
"$bin/pd-router" --http-listen "127.0.0.1:$http_port" --grpc-listen "127.0.0.1:$grpc_port" \
    --prefill "$prefill" --decode "$decode" --model "$model" --drain-delay-ms 0 >"$logs/pd-router.log" 2>&1 &
pids+=($!)

for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$http_port/ready" >/dev/null 2>&1; then
        echo "pd local cluster ready: http://127.0.0.1:$http_port (OpenAI API), grpc 127.0.0.1:$grpc_port; decode $decode, prefill $prefill"
        echo "metrics: http://127.0.0.1:$http_port/metrics (router), :$decode_metrics_port/metrics (decode), :$prefill_metrics_port/metrics (prefill); logs in $logs"
        break
    fi
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { tail -n 20 "$logs"/*.log >&2; exit 1; }
    done
    sleep 0.1
done
curl -sf "http://127.0.0.1:$http_port/ready" >/dev/null || { echo "up.sh: the cluster did not become ready" >&2; exit 1; }

if $demo; then
    echo '> What is the capital of France?'
    curl -sN "http://127.0.0.1:$http_port/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":64,"temperature":0,"stream":true}' |
        python3 -c '
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    chunk = json.loads(line[6:])
    for choice in chunk.get("choices", []):
        print(choice.get("delta", {}).get("content", ""), end="", flush=True)
print()'
    echo "(serving until Ctrl-C)"
fi
wait -n "${pids[@]}"
echo "up.sh: a process of the cluster exited" >&2
exit 1
