#!/usr/bin/env bash
# Overload with hostile clients, against the local cluster exactly as deploy/local/up.sh
# starts it: open-loop interactive load at 3x the cluster's measured capacity (plus batch
# work) while 500 connections stay open and silent, 20 slow readers take a streaming answer
# one byte per second from a 4 KiB receive buffer, and /health is probed on a fresh
# connection every 100 ms. Reports /health latency, what the admitted requests got, peak RSS
# of every process, and the decode worker's KV use once the load stops (must reach 0).
#   bench/hostile.sh [DURATION_S]     (default 60; writes bench/results/hostile/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
duration="${1:-60}"
out=bench/results/hostile
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
bin=target/release
port=18280
scripts/fetch-model.sh >/dev/null
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
rm -rf "$out"
mkdir -p "$out/runs" "$out/logs" "$out/scenarios"
cluster_pid=""
stop() {
    [[ -n "$cluster_pid" ]] && { kill -TERM "$cluster_pid" 2>/dev/null || true; wait "$cluster_pid" 2>/dev/null || true; }
    cluster_pid=""
}
trap stop EXIT
PD_HTTP_PORT=$port PD_GRPC_PORT=$((port + 1)) PD_DECODE_METRICS_PORT=$((port + 2)) \
    PD_PREFILL_METRICS_PORT=$((port + 3)) deploy/local/up.sh >"$out/logs/up.log" 2>&1 &
cluster_pid=$!
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { echo "hostile: the cluster did not become ready" >&2; exit 1; }

bench() { # LABEL SCENARIO
    taskset -c 0 "$bin/pd-bench" run --quiet --url "http://127.0.0.1:$port" --model "$model" --scenario "$2" \
        --label "$1" --out "$out/runs/$1" >/dev/null
}

cat >"$out/scenarios/capacity.txt" <<EOS
# Closed loop at concurrency 16: what the cluster completes per second when saturated.
duration=30 max_requests=4000 seed=21
class interactive concurrency=16 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
EOS
echo "== capacity (30 s)" >&2
bench capacity "$out/scenarios/capacity.txt"
capacity=$(python3 -c "
import json; s = json.load(open('$out/runs/capacity/summary.json'))
r = [r for r in s['rows'] if r['class'] == 'interactive' and r['input_bucket'] == 'all'] or s['rows']
print(round((r[0]['requests'] - r[0]['errors']) / s['duration_s'], 3))")
rate=$(python3 -c "print(round(3 * $capacity, 3))")
cat >"$out/scenarios/overload.txt" <<EOS
# 3x the measured interactive capacity ($capacity req/s), Poisson, plus batch work.
duration=$duration max_requests=20000 seed=23
class interactive rate=$rate input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=0.1 input=512..1024 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOS
echo "== overload at $rate req/s with hostile clients ($duration s)" >&2
taskset -c 0 "$bin/pd-bench" hostile --url "http://127.0.0.1:$port" --out "$out/hostile.json" \
    --duration-s "$duration" >/dev/null &
hostile_pid=$!
bench overload "$out/scenarios/overload.txt"
wait "$hostile_pid"

# Every KV block free once the load stops (batch work still in flight may take a while).
usage=""
for _ in $(seq 1 120); do
    usage=$(curl -sf "http://127.0.0.1:$((port + 2))/metrics" | awk '/^pd_kv_cache_usage_ratio/ {print $2}')
    [[ "$usage" == "0" ]] && break
    sleep 1
done
{
    echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores."
    echo "Command: \`bench/hostile.sh $duration\` ($(date -u +%Y-%m-%d)); cluster: \`deploy/local/up.sh\` defaults."
    echo
    echo "Capacity (closed loop, concurrency 16): $capacity interactive req/s; overload at $rate req/s."
    echo
    echo "## Hostile clients (500 idle connections, 20 slow readers, /health every 100 ms)"
    echo
    echo '```json'
    cat "$out/hostile.json"
    echo
    echo '```'
    echo
    echo "## Admitted and refused requests under overload"
    echo
    grep '^|' "$out/runs/overload/report.md" || true
    echo
    echo "## Peak RSS"
    echo
    for p in $(pgrep -f "$bin/pd-(router|prefill|decode)"); do
        printf -- '- %s: %s MB\n' "$(basename "$(readlink /proc/"$p"/exe)")" \
            "$(awk '/VmHWM/ {printf "%.0f", $2 / 1024}' /proc/"$p"/status)"
    done
    echo
    echo "Decode worker KV cache usage after the load stopped: ${usage:-unknown} (0 = every block free)."
} >"$out/summary.md"
cat "$out/summary.md"
