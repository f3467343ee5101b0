#!/usr/bin/env bash
# One-command local cluster: one decode worker and one prefill worker, each pinned to its own
# core with one compute thread, and the router, all on 127.0.0.1, in the foreground. The
# binaries' defaults are the measured configuration (bench/results/slo/): the built-in
# traffic classes (deploy/classes/default.toml: interactive, batch), admission control with
# 429 + Retry-After, request-parallel prefill in ~150 ms steps (25 ms while short prompts are
# about; a document's step stops between layers for a short prompt), prompts prefilled on the
# prefill worker.
# Builds (when a binary is missing or older than the sources) and fetches what is missing,
# refuses ports already in use, prints a line when ready (the last log lines when not), stops
# every child on Ctrl-C / SIGTERM.
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

# The fixed ports must be free: with another cluster on them, this one's router would fail to
# bind while the other answered the readiness check.
for spec in "PD_HTTP_PORT:$http_port" "PD_GRPC_PORT:$grpc_port" \
    "PD_DECODE_METRICS_PORT:$decode_metrics_port" "PD_PREFILL_METRICS_PORT:$prefill_metrics_port"; do
    port=${spec#*:}
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "up.sh: port $port (${spec%%:*}) on 127.0.0.1 is already in use (another pd cluster?); stop it or set ${spec%%:*}" >&2
        exit 1
    fi
done

# Build only when a binary is missing or a source is newer than it (same features as
# scripts/test.sh, so one set of build artifacts serves both).
bin=target/release
stale=false
for name in pd-router pd-prefill pd-decode; do
    if [[ ! -x "$bin/$name" ]] || [[ -n "$(find . -path ./target -prune -o \( -name '*.rs' -o -name Cargo.toml \
        -o -name Cargo.lock -o -name '*.proto' \) -newer "$bin/$name" -print -quit)" ]]; then
        stale=true
    fi
done
if $stale; then
    echo "up.sh: building the binaries (cargo build --release)"
    cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
fi
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

# The last lines of every log (backtraces left out), when the cluster cannot start or a
# process exits.
show_logs() {
    for log in "$logs"/*.log; do
        echo "--- $(basename "$log") (last 20 lines)" >&2
        sed '/^Stack backtrace:/,$d' "$log" | grep -vE '^ +([0-9]+: |at )' | tail -n 20 >&2
    done
}

# Waits for the address a worker printed and echoes it.
address_of() {
    local name=$1 pid=$2 addr
    for _ in $(seq 1 600); do
        addr=$(grep -oE 'listening on [0-9.:]+' "$logs/$name.log" | awk '{print $3}' || true)
        [[ -n "$addr" ]] && { echo "$addr"; return; }
        kill -0 "$pid" 2>/dev/null || { echo "up.sh: $name exited" >&2; show_logs; return 1; }
        sleep 0.1
    done
    echo "up.sh: $name did not start within 60 s" >&2
    show_logs
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
router_pid=${pids[-1]}

# Ready: the router is running (it, not another process on the port, answers) and says so.
ready() { kill -0 "$router_pid" 2>/dev/null && curl -sf "http://127.0.0.1:$http_port/ready" >/dev/null 2>&1; }
for _ in $(seq 1 600); do
    if ready; then
        echo "pd local cluster ready: http://127.0.0.1:$http_port (OpenAI API), grpc 127.0.0.1:$grpc_port; decode $decode, prefill $prefill"
        echo "metrics: http://127.0.0.1:$http_port/metrics (router), :$decode_metrics_port/metrics (decode), :$prefill_metrics_port/metrics (prefill); logs in $logs"
        break
    fi
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "up.sh: a process of the cluster exited" >&2; show_logs; exit 1; }
    done
    sleep 0.1
done
ready || { echo "up.sh: the cluster did not become ready within 60 s" >&2; show_logs; exit 1; }

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
show_logs
exit 1
