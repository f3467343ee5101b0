#!/usr/bin/env bash
# Prefix caching and cache-aware routing, measured on this machine's 2 cores with the real
# binaries and model (prefill worker and router on core 0 with the load generator, decode
# workers on core 1):
#   1. warm vs cold: one prefill + one decode worker; 1,500-token shared system prompts (6 of
#      them) + 50-token user turns, one request at a time: TTFT of cold (first use of a prefix)
#      and warm requests, and the KV bytes each shipped (from the router's request records);
#      the same traffic with --no-prefix-cache on both workers as the reference;
#   2. routing: one prefill + two decode workers with room for two running requests or one
#      cached prefix beside them (--kv-blocks 200); 2 prefixes, 2 clients: share of requests that
#      land on a decode worker holding their prefix, cache-aware (--prefix-weight 2, the
#      default) vs cache-blind (--prefix-weight 0);
#   3. hot prefix: the same with 90% of requests on one prefix and 4 clients: how the load
#      spreads over the two decode workers.
#   bench/prefix-cache.sh               (writes bench/results/prefix-cache/)
#   PARTS="routing hot" bench/prefix-cache.sh   (rerun some parts: warm routing hot; the
#                                                summary reads every part's last run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=bench/results/prefix-cache
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
bin=target/release
port=18280
scripts/fetch-model.sh >/dev/null
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
parts="${PARTS:-warm routing hot}"
has() { [[ " $parts " == *" $1 "* ]]; }
[[ -z "${PARTS:-}" ]] && rm -rf "$out/runs" "$out/logs"
mkdir -p "$out/runs" "$out/logs" "$out/scenarios"
pids=()
stop() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap stop EXIT

addr_of() { # LOG: the gRPC address a worker printed
    local a=""
    for _ in $(seq 1 300); do
        a=$(grep -oE 'listening on [0-9.:]+' "$1" | awk '{print $3}' || true)
        [[ -n "$a" ]] && { echo "$a"; return; }
        sleep 0.1
    done
    echo "prefix-cache: no address in $1" >&2; return 1
}

start() { # NAME DECODE_WORKERS "PREFILL FLAGS" "DECODE FLAGS" "ROUTER FLAGS"
    local name=$1 n=$2 pflags=$3 dflags=$4 rflags=$5 logs="$out/logs/$1"
    mkdir -p "$logs"
    PD_LOG_FORMAT=json taskset -c 0 "$bin/pd-prefill" --model "$model" --listen 127.0.0.1:0 \
        --metrics-listen 127.0.0.1:0 $pflags >"$logs/prefill.out" 2>"$logs/prefill.log" &
    pids+=($!)
    local prefill decode=""
    prefill=$(addr_of "$logs/prefill.out")
    for i in $(seq 1 "$n"); do
        PD_LOG_FORMAT=json taskset -c 1 "$bin/pd-decode" --model "$model" --listen 127.0.0.1:0 \
            --metrics-listen 127.0.0.1:0 --grace-ms 0 $dflags >"$logs/decode-$i.out" 2>"$logs/decode-$i.log" &
        pids+=($!)
        decode="${decode:+$decode,}$(addr_of "$logs/decode-$i.out")"
    done
    PD_LOG_FORMAT=json taskset -c 0 "$bin/pd-router" --model "$model" --http-listen "127.0.0.1:$port" \
        --grpc-listen 127.0.0.1:0 --prefill "$prefill" --decode "$decode" --drain-delay-ms 0 $rflags \
        >"$logs/router.out" 2>"$logs/router.log" &
    pids+=($!)
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return; sleep 0.1; done
    echo "prefix-cache: $name did not become ready" >&2; return 1
}

bench() { # LABEL SCENARIO
    taskset -c 0 "$bin/pd-bench" run --quiet --url "http://127.0.0.1:$port" --model "$model" --scenario "$2" \
        --duration-s 600 --label "$1" --out "$out/runs/$1" >/dev/null
}

cat >"$out/scenarios/warm-cold.txt" <<EOF
# 6 shared 1,500-token system prompts, 50-token user turns, one request at a time.
duration=600 max_requests=36 seed=31
class support concurrency=1 input=1550 output=16 prefix=1500 prefixes=6 as=batch
EOF
cat >"$out/scenarios/routing.txt" <<EOF
# 2 shared prefixes, 2 clients.
duration=600 max_requests=40 seed=32
class support concurrency=2 input=1550 output=16 prefix=1500 prefixes=2 as=batch
EOF
cat >"$out/scenarios/hot.txt" <<EOF
# 90% of the requests on one prefix, 4 clients.
duration=600 max_requests=40 seed=33
class support concurrency=4 input=1550 output=16 prefix=1500 prefixes=2 hot=0.9 as=batch
EOF

run() { # NAME SCENARIO DECODE_WORKERS "PREFILL FLAGS" "DECODE FLAGS" "ROUTER FLAGS"
    echo "== $1" >&2
    rm -rf "${out:?}/runs/$1" "${out:?}/logs/$1"
    start "$1" "$3" "$4" "$5" "$6"
    bench "$1" "$out/scenarios/$2.txt"
    stop
}
if has warm; then
    run warm-cold warm-cold 1 "--kv-blocks 1024" "" ""
    run no-cache warm-cold 1 "--kv-blocks 1024 --no-prefix-cache" "--no-prefix-cache" ""
fi
# Decode workers with 200 blocks: two running requests of 98 blocks each (prompt + output),
# or one prefix cached beside them, not both prefixes and the requests.
if has routing; then
    run routing-w2 routing 2 "--kv-blocks 1024" "--kv-blocks 200" "--prefix-weight 2"
    run routing-w0 routing 2 "--kv-blocks 1024" "--kv-blocks 200" "--prefix-weight 0"
fi
has hot && run hot hot 2 "--kv-blocks 1024" "--kv-blocks 200" ""

python3 bench/prefix_cache_summary.py "$out" >"$out/summary.md"
cat "$out/summary.md"
