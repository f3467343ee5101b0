#!/usr/bin/env bash
# The interference experiment: N interactive chat streams with and without 2,048-token
# documents arriving periodically, against four setups of the same engine on this machine:
#   colocated-naive           one pd-decode (2 threads) prefilling each prompt whole in one step
#   colocated-chunked         one pd-decode (2 threads), chunked prefill (256 tokens per step)
#   disaggregated             pd-prefill on core 0 + pd-decode on core 1 (1 thread each)
#   disaggregated-conditional the same, prompts <= 256 tokens prefilled on the decode worker
# Colocated: the router and the load generator share both cores with the engine.
# Disaggregated: they run on core 0 with the prefill worker, so core 1 is the decode
# worker's alone (as a decode GPU would be). Writes every run under
# bench/results/interference/runs/, the comparison table and plots under
# bench/results/interference/.
#   bench/interference.sh [DURATION_S]   (default 60 per run; 8 runs)
#   SETUPS="disaggregated" bench/interference.sh 60   (rerun some setups, compare all)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
duration="${1:-60}"
out=bench/results/interference
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
features=pd-kv-transfer/ucx
scripts/fetch-model.sh >/dev/null
cargo build --release --quiet --workspace --bins --features "$features"
bin=target/release
setups="${SETUPS:-colocated-naive colocated-chunked disaggregated disaggregated-conditional}"
[[ -z "${SETUPS:-}" ]] && rm -rf "$out/runs"
rm -rf "$out/logs"
mkdir -p "$out/runs" "$out/logs"
port=18080
pids=()
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap stop EXIT

# Starts a binary in the background; its stdout/stderr go to $out/logs/NAME.log.
launch() { local name=$1; shift; "$@" >"$out/logs/$name.log" 2>&1 & pids+=($!); }
addr_of() {
    for _ in $(seq 1 300); do
        a=$(grep -oE 'listening on [0-9.:]+' "$out/logs/$1.log" | awk '{print $3}' || true)
        [[ -n "$a" ]] && { echo "$a"; return; }
        sleep 0.1
    done
    echo "interference: $1 did not start" >&2; return 1
}

# The command prefix that places the router and the load generator (see the header).
placement() { case $1 in disaggregated*) echo "taskset -c 0" ;; *) echo "" ;; esac; }

start_setup() {
    local setup=$1 tag=$2 router_args=()
    case $setup in
        colocated-naive|colocated-chunked)
            launch "$tag-decode" "$bin/pd-decode" --model "$model" --threads 2 --metrics-listen 127.0.0.1:0 \
                --prefill-policy "${setup#colocated-}" --grace-ms 0
            ;;
        disaggregated|disaggregated-conditional)
            launch "$tag-decode" taskset -c 1 "$bin/pd-decode" --model "$model" --threads 1 --metrics-listen 127.0.0.1:0 --grace-ms 0
            launch "$tag-prefill" taskset -c 0 "$bin/pd-prefill" --model "$model" --threads 1 --metrics-listen 127.0.0.1:0 --grace-ms 0
            router_args+=(--prefill "$(addr_of "$tag-prefill")")
            [[ $setup == disaggregated-conditional ]] && router_args+=(--local-prefill-max-tokens 256)
            ;;
    esac
    launch "$tag-router" $(placement "$setup") "$bin/pd-router" --model "$model" --http-listen "127.0.0.1:$port" --grpc-listen 127.0.0.1:0 \
        --decode "$(addr_of "$tag-decode")" --drain-delay-ms 0 "${router_args[@]}"
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return; sleep 0.1; done
    echo "interference: $setup did not become ready" >&2; return 1
}

for setup in $setups; do
    for variant in base docs; do
        echo "== $setup / $variant ($duration s)" >&2
        start_setup "$setup" "$setup-$variant"
        $(placement "$setup") "$bin/pd-bench" run --quiet --url "http://127.0.0.1:$port" --model "$model" \
            --scenario "bench/scenarios/interference-$variant.txt" --duration-s "$duration" \
            --label "$setup/$variant" --out "$out/runs/$setup-$variant" >/dev/null
        stop
    done
done
header="Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores.
Command: \`bench/interference.sh $duration\` ($(date -u +%Y-%m-%d)); scenarios bench/scenarios/interference-{docs,base}.txt.

"
"$bin/pd-bench" compare --out "$out" --class interactive --header "$header" "$out"/runs/*
