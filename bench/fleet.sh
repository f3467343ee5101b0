#!/usr/bin/env bash
# The real pd-router against simulated fleets (pd-sim-worker), on this machine:
#   1. profile:  the real prefill + decode pair measured over pd.v1 -> cost-cpu.json;
#   2. validate: the same traffic against the real 1 + 1 cluster (deploy/local/up.sh) and
#                against 1 + 1 simulated workers with that cost model: TTFT / ITL p95 agree?
#   2b. ucx:     the same traffic on the simulated 1 + 1 with KV over gRPC and over UCX (pd-sim-worker
#                --kv-transport ucx: every frame moved) -> hand-off time and TTFT of each;
#   3. scale:    a fast cost model (cost-fast.json: 1 ms prefill steps, 5 ms decode steps) so
#                the router is the bottleneck: 8, 32 and 128 workers (half each pool) at a
#                fixed open-loop rate -> client latency, router CPU per request, router CPU
#                while idle (its Load polling); then a closed loop of 64 clients -> req/s and
#                router CPU per request (PERF=1: a perf profile of the router at 128 workers);
#   4. goodput:  disaggregated (4 prefill + 4 decode) vs colocated (8 decode, prompts
#                prefilled in their batches) simulated CPU workers, same traffic and SLOs, and
#                8 workers split as `pd-bench plan` sizes the pools for that load test;
#   5. loss:     64 + 64 simulated CPU workers, one decode worker lost mid-run; then
#                `pd-bench plan` on that load test;
#   6. virtual:  the same traffic and fleets in virtual time (`pd-bench simulate`: the real
#                scheduler and planners, no router process), 20 replicas each, compared with
#                the real-time runs above; each plan's own traffic replayed on the planned
#                fleet; one hour of 125x the goodput traffic on 500 + 500 workers.
# Router on core 0; simulated workers and the load generator on core 1 (the real cluster of
# part 2 as up.sh pins it, load generator on core 0).
#   bench/fleet.sh                 (writes bench/results/fleet/)
#   PARTS="scale loss" bench/fleet.sh   (rerun some parts; the summary reads every part's last run)
#   SIZES="8 128 1000" PARTS=scale bench/fleet.sh   (the fleet sizes of part 3; default 8 32 128)
#   ROUTER_BIN=/path/to/old/pd-router ...   (another router binary over the simulated fleets: before/after)
#   KV_TRANSPORT=ucx ...   (simulated decode workers take KV over UCX, every frame moved; loopback)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=bench/results/fleet
model="${PD_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
bin=target/release
port=18280
scripts/fetch-model.sh >/dev/null
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
parts="${PARTS:-profile validate ucx scale goodput loss virtual}"
has() { [[ " $parts " == *" $1 "* ]] && note_machine "$1"; }
[[ -z "${PARTS:-}" ]] && rm -rf "$out/runs" "$out/logs"
mkdir -p "$out/runs" "$out/logs" "$out/scenarios"
# Which machine each part last ran on (parts rerun later may run elsewhere).
note_machine() { # PART
    echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(date -u +%F)" \
        >"$out/runs/$1.machine"
}
pids=()
stop() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap stop EXIT

ready() { # PORT
    for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$1/ready" >/dev/null && return; sleep 0.2; done
    echo "fleet: nothing ready on port $1" >&2; return 1
}

address_of() { # LOG
    for _ in $(seq 1 300); do
        grep -oE 'listening on [0-9.:]+' "$1" | awk '{print $3}' && return
        sleep 0.1
    done
    echo "fleet: no address in $1" >&2; return 1
}

sim() { # NAME COST PREFILL DECODE [--lose ...]: simulated workers, then the router over them
    local name=$1 cost=$2 np=$3 nd=$4
    shift 4
    rm -f "$out/logs/$name.env"
    UCX_NET_DEVICES=lo UCX_TLS="${UCX_TLS:-posix,sysv,cma,tcp}" taskset -c 1 "$bin/pd-sim-worker" --cost "$cost" \
        --prefill "$np" --decode "$nd" --kv-transport "${KV_TRANSPORT:-grpc}" \
        --addresses "$out/logs/$name.env" "$@" >"$out/logs/$name-sim.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 100); do [[ -s "$out/logs/$name.env" ]] && break; sleep 0.1; done
    local prefill decode
    prefill=$(sed -n 's/^PD_PREFILL_WORKERS=//p' "$out/logs/$name.env")
    decode=$(sed -n 's/^PD_DECODE_WORKERS=//p' "$out/logs/$name.env")
    local args=(--decode "$decode")
    [[ -n "$prefill" ]] && args+=(--prefill "$prefill")
    PD_LOG_FORMAT=json taskset -c 0 "${ROUTER_BIN:-$bin/pd-router}" --model "$model" --http-listen "127.0.0.1:$port" \
        --grpc-listen 127.0.0.1:0 --drain-delay-ms 0 "${args[@]}" >"$out/logs/$name-router.log" 2>&1 &
    router_pid=$!
    pids+=("$router_pid")
    ready "$port"
}

bench() { # LABEL SCENARIO CORE
    taskset -c "$3" "$bin/pd-bench" run --quiet --url "http://127.0.0.1:$port" --model "$model" --scenario "$2" \
        --label "$1" --out "$out/runs/$1" >/dev/null
}

cpu_s() { # PID: user + system CPU seconds so far
    awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"
}

# 1. profile
if has profile; then
    echo "== profile" >&2
    taskset -c 1 "$bin/pd-decode" --model "$model" --listen 127.0.0.1:0 >"$out/logs/profile-decode.log" 2>&1 &
    pids+=($!)
    taskset -c 0 "$bin/pd-prefill" --model "$model" --listen 127.0.0.1:0 --step-target-ms 60000 --chunk 128 \
        >"$out/logs/profile-prefill.log" 2>&1 &
    pids+=($!)
    decode=$(address_of "$out/logs/profile-decode.log")
    prefill=$(address_of "$out/logs/profile-prefill.log")
    machine="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, one thread per worker"
    taskset -c 0 "$bin/pd-bench" profile --prefill "$prefill" --decode "$decode" --machine "$machine" \
        --out "$out/cost-cpu.json" >/dev/null 2>"$out/logs/profile.log"
    stop
fi

# 2. validate
cat >"$out/scenarios/validate.txt" <<EOF
# Interactive at about 60% of the real cluster's capacity, Poisson, plus documents.
duration=60 max_requests=2000 seed=31
class interactive rate=1.2 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=0.05 input=512..1024 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOF
if has validate; then
    echo "== validate: real cluster" >&2
    PD_LOG_FORMAT=json PD_HTTP_PORT=$port PD_GRPC_PORT=$((port + 1)) PD_DECODE_METRICS_PORT=$((port + 2)) \
        PD_PREFILL_METRICS_PORT=$((port + 3)) deploy/local/up.sh >"$out/logs/validate-real.log" 2>&1 &
    pids+=($!)
    ready "$port"
    bench validate-real "$out/scenarios/validate.txt" 0
    real_logs=$(grep -oE 'logs in [^ ]+' "$out/logs/validate-real.log" | head -1 | awk '{print $3}')
    stop
    cp "$real_logs/pd-router.log" "$out/logs/validate-real-router.log" || true
    echo "== validate: simulated 1 + 1" >&2
    sim validate-sim "$out/cost-cpu.json" 1 1
    bench validate-sim "$out/scenarios/validate.txt" 1
    stop
fi

# 2b. ucx: the validate traffic on 1 + 1 simulated workers with KV over gRPC (control messages,
# the modelled hand-off) and over UCX (every frame moved through the real UCX receiver).
if has ucx; then
    : >"$out/runs/ucx-kv.txt"
    for t in grpc ucx; do
        echo "== ucx: simulated 1 + 1, KV over $t" >&2
        KV_TRANSPORT=$t sim "validate-sim-$t" "$out/cost-cpu.json" 1 1
        bench "validate-sim-$t" "$out/scenarios/validate.txt" 1
        stop
        python3 - "$t" "$out/logs/validate-sim-$t-router.log" "$out/logs/validate-sim-$t-sim.log" \
            >>"$out/runs/ucx-kv.txt" <<'PY'
import json, sys
t, router, sim = sys.argv[1:]
ms = sorted(json.loads(l)["kv_transfer_ms"] for l in open(router) if '"kv_transfer_ms"' in l)
pct = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))] if ms else float("nan")
line = next((l.split("pd-sim-worker: ", 1)[1].strip() for l in open(sim) if "KV hand-offs" in l), "no summary")
print(f"transport={t} requests={len(ms)} kv_ms_p50={pct(0.5):.2f} kv_ms_p95={pct(0.95):.2f} kv_ms_max={ms[-1] if ms else 0:.2f} | {line}")
PY
    done
fi

# 3. scale
cat >"$out/cost-fast.json" <<EOF
{"source": "fast: 1 ms prefill steps, 5 ms decode steps, nothing else (the router is the bottleneck)",
 "prefill": {"fixed_ms": 1.0, "per_token_ms": 0.0, "per_pair_us": 0.0},
 "decode": {"fixed_ms": 5.0, "per_row_ms": 0.0, "per_context_us": 0.0},
 "kv": {"bytes_per_token": 23040, "commit_fixed_ms": 0.0, "commit_ms_per_mb": 0.0},
 "worker": {"block_size": 16, "kv_blocks": 100000, "max_batch": 256, "max_position": 8192}}
EOF
cat >"$out/scenarios/scale.txt" <<EOF
# Open loop, short requests: the router's work per request.
duration=20 max_requests=5000 seed=41
class interactive rate=100 input=32..64 output=16 ttft_p95_ms=1500 itl_p95_ms=100
EOF
cat >"$out/scenarios/scale-closed.txt" <<EOF
# Closed loop, 64 clients: what the router sustains.
duration=20 max_requests=100000 seed=42
class interactive concurrency=64 input=32..64 output=16 ttft_p95_ms=1500 itl_p95_ms=100
EOF
if has scale; then
    : >"$out/runs/scale-cpu.txt"
    for n in ${SIZES:-8 32 128}; do
        echo "== scale: $n workers" >&2
        sim "scale-$n" "$out/cost-fast.json" $((n / 2)) $((n / 2))
        sleep 2
        idle0=$(cpu_s "$router_pid"); sleep 10; idle1=$(cpu_s "$router_pid")
        busy0=$(cpu_s "$router_pid")
        bench "scale-$n" "$out/scenarios/scale.txt" 1
        busy1=$(cpu_s "$router_pid")
        # Closed loop: what the router sustains, and its CPU per request when it is the bottleneck.
        # PERF=1: a perf profile of the router (DWARF call graphs) over 10 s of the closed loop.
        if [[ -n "${PERF:-}" && $n == 128 ]]; then
            perf record -q -F 499 --call-graph dwarf,16384 -p "$router_pid" -o "$out/logs/router-$n.perf.data" \
                -- sleep 10 >/dev/null 2>&1 &
            perf_pid=$!
        fi
        closed0=$(cpu_s "$router_pid")
        bench "scale-closed-$n" "$out/scenarios/scale-closed.txt" 1
        closed1=$(cpu_s "$router_pid")
        [[ -n "${perf_pid:-}" ]] && { wait "$perf_pid" || true; perf_pid=; }
        echo "workers=$n idle_cpu_s_per_s=$(python3 -c "print(round(($idle1 - $idle0) / 10, 4))") run_cpu_s=$(python3 -c "print(round($busy1 - $busy0, 3))") closed_cpu_s=$(python3 -c "print(round($closed1 - $closed0, 3))")" \
            >>"$out/runs/scale-cpu.txt"
        stop
    done
fi

# 4. goodput at fixed SLOs: disaggregated vs colocated fleets of 8 simulated CPU workers
cat >"$out/scenarios/goodput.txt" <<EOF
# Interactive traffic plus documents keeping about 3 of the 4 prefill workers busy.
duration=60 max_requests=5000 seed=51
class interactive rate=6 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=0.3 input=1500..2000 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOF
if has goodput; then
    echo "== goodput: disaggregated 4 + 4" >&2
    sim goodput-disagg "$out/cost-cpu.json" 4 4
    bench goodput-disagg "$out/scenarios/goodput.txt" 1
    stop
    # What the capacity plan of that load test says such traffic needs (no spare, no growth).
    "$bin/pd-bench" plan --cost "$out/cost-cpu.json" --requests "$out/runs/goodput-disagg/requests.json" \
        --spare 0 --scale-out-s 0 --window-s 60 --out "$out/plan-goodput" >/dev/null
    # ... and the same 8 workers split in the proportion of that plan's pools.
    np=$(python3 -c "import json; p = json.load(open('$out/plan-goodput/plan.json')); n, d = p['prefill']['serving'], p['decode']['serving']; print(min(7, max(1, round(8 * n / (n + d)))))")
    echo "== goodput: planned split $np + $((8 - np))" >&2
    sim goodput-planned "$out/cost-cpu.json" "$np" $((8 - np))
    bench goodput-planned "$out/scenarios/goodput.txt" 1
    stop
    echo "== goodput: colocated 8" >&2
    sim goodput-colocated "$out/cost-cpu.json" 0 8
    bench goodput-colocated "$out/scenarios/goodput.txt" 1
    stop
fi

# 5. loss of one decode worker in a 64 + 64 fleet, then the capacity plan of that load test
cat >"$out/scenarios/loss.txt" <<EOF
# About half of 64 pairs' interactive capacity; decode worker 0 is lost 30 s in.
duration=60 max_requests=20000 seed=61
class interactive rate=50 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=2 input=512..1024 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOF
if has loss; then
    echo "== loss: 64 + 64, decode 0 lost at 30 s" >&2
    sim loss "$out/cost-cpu.json" 64 64 --lose decode:0@30
    bench loss "$out/scenarios/loss.txt" 1
    stop
    "$bin/pd-bench" plan --cost "$out/cost-cpu.json" --requests "$out/runs/loss/requests.json" --window-s 10 \
        --scale-out-s 30 --out "$out/plan-loss" >/dev/null
fi

# 6. virtual time: the runs above again in `pd-bench simulate`, and the plans checked
cat >"$out/scenarios/hour.txt" <<EOF
# One hour of the goodput traffic x125, for 500 + 500 workers.
duration=3600 max_requests=3000000 seed=71
class interactive rate=750 input=32..96 output=64..128 ttft_p95_ms=1500 itl_p95_ms=100
class batch rate=37.5 input=1500..2000 output=64 ttft_p95_ms=600000 itl_p95_ms=1000
EOF
virtual() { # NAME SCENARIO COST PREFILL DECODE [ARGS...]
    taskset -c 1 target/fleet/pd-bench simulate --scenario "$2" --cost "$3" --prefill "$4" --decode "$5" \
        --label "$1" --out "$out/runs/$1" "${@:6}" >/dev/null
}
serving() { # PLAN_DIR POOL: the plan's serving replicas of a pool
    python3 -c "import json; print(json.load(open('$1/plan.json'))['$2']['serving'])"
}
if has virtual; then
    echo "== virtual time" >&2
    # The whole-program build (Cargo.toml's `fleet` profile): the scheduler inlined into the loop.
    cargo build --profile fleet --quiet -p pd-bench
    virtual virtual-validate "$out/scenarios/validate.txt" "$out/cost-cpu.json" 1 1 --replicas 20
    for n in 8 128; do
        virtual "virtual-scale-$n" "$out/scenarios/scale.txt" "$out/cost-fast.json" $((n / 2)) $((n / 2)) --replicas 20
    done
    virtual virtual-goodput-disagg "$out/scenarios/goodput.txt" "$out/cost-cpu.json" 4 4 --replicas 20
    np=$(python3 -c "import json; p = json.load(open('$out/plan-goodput/plan.json')); n, d = p['prefill']['serving'], p['decode']['serving']; print(min(7, max(1, round(8 * n / (n + d)))))")
    virtual virtual-goodput-planned "$out/scenarios/goodput.txt" "$out/cost-cpu.json" "$np" $((8 - np)) --replicas 20
    virtual virtual-goodput-colocated "$out/scenarios/goodput.txt" "$out/cost-cpu.json" 0 8 --replicas 20
    # Each plan's own traffic on the fleet it plans (serving replicas, no spare).
    virtual plan-check-goodput "$out/scenarios/goodput.txt" "$out/cost-cpu.json" \
        "$(serving "$out/plan-goodput" prefill)" "$(serving "$out/plan-goodput" decode)" --replicas 20
    virtual plan-check-loss "$out/scenarios/loss.txt" "$out/cost-cpu.json" \
        "$(serving "$out/plan-loss" prefill)" "$(serving "$out/plan-loss" decode)" --replicas 20
    # Speed: an hour of traffic on 1,000 workers (only the tally kept).
    virtual virtual-hour "$out/scenarios/hour.txt" "$out/cost-cpu.json" 500 500 --summary-only
    python3 bench/fleet_virtual.py "$out" >"$out/virtual.md"
fi

# The big raw files of the router-overhead and loss runs stay out of the repository (their
# summaries and plans are kept; goodput-disagg/requests.json is the committed load test).
rm -f "$out"/runs/scale-*/requests.json "$out"/runs/scale-*/timeline.svg "$out"/runs/loss/requests.json \
    "$out"/runs/validate-sim-{grpc,ucx}/requests.json "$out"/runs/validate-sim-{grpc,ucx}/timeline.svg \
    "$out"/runs/loss/timeline.svg "$out"/runs/virtual-*/requests.json "$out"/runs/plan-check-*/requests.json
python3 bench/fleet_summary.py "$out" >"$out/README.md"
cat "$out/README.md"
