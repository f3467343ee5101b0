#!/usr/bin/env bash
# SLO scheduling under mixed traffic, against the local cluster exactly as
# deploy/local/up.sh starts it (router + prefill on core 0, decode on core 1, default flags):
#   1. interference: 4 interactive streams, with and without a 2,048-token document (batch
#      class) every 10 s: ITL / TTFT / throughput ratios, one configuration;
#   2. capacity: closed loop at concurrency 16 (interactive), completed requests/s;
#   3. overload: open loop at 3x that rate for DURATION plus a batch class: admitted TTFT
#      p95 vs the class SLO, 429s with Retry-After and how fast they came, batch losses,
#      peak RSS of every process;
#   4. goodput at fixed SLOs, disaggregated (up.sh) vs colocated (one pd-decode, 2 threads,
#      chunked prefill) on the same 2 cores, same load.
# The load generator runs on core 0 (with the router and the prefill worker).
#   bench/slo.sh [DURATION_S]      (default 60; writes bench/results/slo/). The interference
#                                  and goodput runs take INTERFERENCE_S (default twice that):
#                                  their p95s are over ~200 requests instead of ~100, which a
#                                  few colliding short prompts no longer decide.
#   PARTS="overload" bench/slo.sh 30   (rerun some parts: interference capacity overload
#                                       goodput; the summary reads every part's last run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
duration="${1:-60}"
interference_s="${INTERFERENCE_S:-$((2 * duration))}"
out=bench/results/slo
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
bin=target/release
port=18180
scripts/fetch-model.sh >/dev/null
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
parts="${PARTS:-interference capacity overload goodput}"
has() { [[ " $parts " == *" $1 "* ]]; }
[[ -z "${PARTS:-}" ]] && rm -rf "$out/runs"
rm -rf "$out/logs"
mkdir -p "$out/runs" "$out/logs" "$out/scenarios"
cluster_pid=""
stop() {
    [[ -n "$cluster_pid" ]] && { kill -TERM "$cluster_pid" 2>/dev/null || true; wait "$cluster_pid" 2>/dev/null || true; }
    cluster_pid=""
}
trap stop EXIT

up() { # deploy/local/up.sh as a user runs it, on our ports
    PD_HTTP_PORT=$port PD_GRPC_PORT=$((port + 1)) PD_DECODE_METRICS_PORT=$((port + 2)) \
        PD_PREFILL_METRICS_PORT=$((port + 3)) deploy/local/up.sh >"$out/logs/up-$1.log" 2>&1 &
    cluster_pid=$!
    for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return; sleep 0.2; done
    echo "slo: the cluster did not become ready" >&2; return 1
}

colocated() { # one pd-decode with both cores' threads, prefilling in its batch
    "$bin/pd-decode" --model "$model" --threads 2 --metrics-listen 127.0.0.1:0 --prefill-policy chunked \
        --grace-ms 0 >"$out/logs/colocated-decode.log" 2>&1 &
    local dpid=$!
    local addr=""
    for _ in $(seq 1 300); do
        addr=$(grep -oE 'listening on [0-9.:]+' "$out/logs/colocated-decode.log" | awk '{print $3}' || true)
        [[ -n "$addr" ]] && break; sleep 0.1
    done
    "$bin/pd-router" --model "$model" --http-listen "127.0.0.1:$port" --grpc-listen 127.0.0.1:0 --decode "$addr" \
        --drain-delay-ms 0 >"$out/logs/colocated-router.log" 2>&1 &
    local rpid=$!
    cluster_pid=$rpid
    colocated_pids="$dpid $rpid"
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return; sleep 0.1; done
    echo "slo: the colocated setup did not become ready" >&2; return 1
}

bench() { # LABEL SCENARIO [DURATION]
    taskset -c 0 "$bin/pd-bench" run --quiet --url "http://127.0.0.1:$port" --model "$model" --scenario "$2" \
        --duration-s "${3:-$duration}" --label "$1" --out "$out/runs/${1//\//-}" >/dev/null
}

peak_rss() { # the peak resident memory of every pd process now running, in MB
    for p in $(pgrep -f "$bin/pd-(router|prefill|decode)"); do
        printf '%s %s MB\n' "$(basename "$(readlink /proc/"$p"/exe)")" \
            "$(awk '/VmHWM/ {printf "%.0f", $2 / 1024}' /proc/"$p"/status)"
    done
}

# 1. interference, one configuration (up.sh as it starts)
has interference && for variant in base docs; do
    echo "== interference / $variant ($interference_s s)" >&2
    up "interference-$variant"
    bench "interference/$variant" "bench/scenarios/interference-$variant.txt" "$interference_s"
    stop
done

# 2. capacity
cat >"$out/scenarios/capacity.txt" <<EOF
# Closed loop at concurrency 16: what the cluster completes per second when saturated.
duration=30 max_requests=4000 seed=21
class interactive concurrency=16 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
EOF
if has capacity; then
    echo "== capacity (30 s)" >&2
    up capacity
    bench capacity "$out/scenarios/capacity.txt" 30
    stop
fi
capacity=$(python3 -c "
import json; s = json.load(open('$out/runs/capacity/summary.json'))
rows = [r for r in s['rows'] if r['class'] == 'interactive']
rows = [r for r in rows if r['input_bucket'] == 'all'] or rows
print(round((rows[0]['requests'] - rows[0]['errors']) / s['duration_s'], 3))")
rate=$(python3 -c "print(round(3 * $capacity, 3))")
echo "capacity $capacity interactive req/s -> overload at $rate req/s" >&2

# 3. overload
cat >"$out/scenarios/overload.txt" <<EOF
# 3x the measured interactive capacity ($capacity req/s), Poisson, plus batch work.
duration=$duration max_requests=20000 seed=23
class interactive rate=$rate input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=0.1 input=512..1024 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOF
if has overload; then
    echo "== overload at $rate req/s ($duration s)" >&2
    up overload
    bench overload "$out/scenarios/overload.txt"
    sleep 5 # batch work still in flight completes before the memory is read
    peak_rss >"$out/runs/overload/peak-rss.txt"
    stop
fi

# 4. goodput: colocated on the same cores and load
if has goodput; then
    echo "== colocated / docs ($interference_s s)" >&2
    colocated
    bench "colocated/docs" bench/scenarios/interference-docs.txt "$interference_s"
    for p in $colocated_pids; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    cluster_pid=""
fi

header="Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores.
Command: \`bench/slo.sh $duration\` (interference and goodput runs $interference_s s; $(date -u +%Y-%m-%d)); cluster: \`deploy/local/up.sh\` defaults.

"
"$bin/pd-bench" compare --out "$out" --class interactive --header "$header" \
    "$out/runs/interference-base" "$out/runs/interference-docs" "$out/runs/colocated-docs" >/dev/null
python3 bench/slo_summary.py "$out" "$capacity" "$rate" >"$out/summary.md"
cat "$out/summary.md"
