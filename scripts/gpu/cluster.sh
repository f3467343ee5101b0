#!/usr/bin/env bash
# The local cluster (pd-router + pd-prefill + pd-decode on loopback) on one device, answering
# a few completions: part of scripts/gpu-check.sh run (on a GPU), and runnable here on CPU to
# check the script itself:
#   scripts/gpu/cluster.sh BIN_DIR MODEL DEVICE OUT_DIR     (DEVICE: cpu or cuda)
# Writes OUT_DIR/cluster.md (each answer's TTFT and tokens/s as the client saw them, the
# router's per-request record) and the three processes' logs.
set -uo pipefail
bin=$1 model=$2 device=$3 out=$4
mkdir -p "$out/cluster-logs"
logs="$out/cluster-logs"
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap stop EXIT

start() { # NAME: a worker on port 0; echoes its address
    local name=$1 addr=""
    "$bin/$name" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --model "$model" --device "$device" \
        >"$logs/$name.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 1200); do
        addr=$(grep -oE 'listening on [0-9.:]+' "$logs/$name.log" | awk '{print $3}' | head -1)
        [[ -n "$addr" ]] && { echo "$addr"; return 0; }
        kill -0 "${pids[-1]}" 2>/dev/null || break
        sleep 0.1
    done
    echo "cluster: $name did not start:" >&2
    tail -n 5 "$logs/$name.log" >&2
    return 1
}

decode=$(start pd-decode) || exit 1
prefill=$(start pd-prefill) || exit 1
port=$((20000 + RANDOM % 20000))
"$bin/pd-router" --http-listen "127.0.0.1:$port" --grpc-listen 127.0.0.1:0 --prefill "$prefill" \
    --decode "$decode" --model "$model" --drain-delay-ms 0 >"$logs/pd-router.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { echo "cluster: router not ready" >&2; tail -n 5 "$logs/pd-router.log" >&2; exit 1; }

{
    echo "Cluster on $device: decode $decode, prefill $prefill, router 127.0.0.1:$port, model $model"
    echo
    echo "| request | prompt words | text events | TTFT (client) ms | total ms | finish |"
    echo "|---|---|---|---|---|---|"
} >"$out/cluster.md"
ok=0
for i in 1 2 3 4; do
    words=$((16 * i * i))
    prompt=$(python3 -c "print(' '.join(f't{(j * 37 + $i) % 1000 + 10}' for j in range($words)))")
    body=$(python3 -c "import json,sys; print(json.dumps({'prompt': sys.argv[1], 'max_tokens': 32, 'temperature': 0, 'stream': True, 'ignore_eos': True}))" "$prompt")
    python3 - "$port" "$body" "$i" "$words" >>"$out/cluster.md" <<'PY' && ok=$((ok + 1))
import http.client, json, sys, time
port, body, i, words = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=120)
start = time.time()
c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
r = c.getresponse()
if r.status != 200:
    print(f"| {i} | {words} | HTTP {r.status}: {r.read()[:200]!r} | | | |")
    sys.exit(1)
first, tokens, finish = None, 0, ""
for line in r:
    line = line.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        continue
    event = json.loads(line[6:])
    for ch in event.get("choices", []):
        if ch.get("text"):
            tokens += 1
            first = first or time.time()
        finish = ch.get("finish_reason") or finish
total = time.time() - start
print(f"| {i} | {words} | {tokens} | {1e3 * ((first or time.time()) - start):.1f} | {1e3 * total:.1f} | {finish} |")
sys.exit(0 if tokens > 0 else 1)
PY
done
{
    echo
    echo "$ok of 4 answered. Router records:"
    echo
    grep "request finished" "$logs/pd-router.log" | sed 's/^.*request finished /    /' | cut -c1-400
} >>"$out/cluster.md"
cat "$out/cluster.md"
[[ $ok == 4 ]]
