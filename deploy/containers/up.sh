#!/usr/bin/env bash
# A containerized pd cluster on this machine: two routers, two prefill and two decode
# workers from the pd image (deploy/containers/build-images.sh builds it when missing), on a
# private podman network where they reach each other by name, with the flags of the
# Kubernetes manifests (deploy/k8s/base) and the model mounted read-only from models/. The
# routers publish HTTP on 127.0.0.1 only (PD_HTTP_PORT and the port after it: 8080, 8081).
#
#   deploy/containers/up.sh          start (replacing containers of an earlier run), wait
#                                    until both routers are ready, stream one answer from each
#   deploy/containers/up.sh down     remove the containers and the network
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CONTAINERS_CONF="$PWD/deploy/containers/containers.conf"
podman() { command podman --runtime runc "$@"; }
image=${PD_IMAGE:-localhost/pd:cpu-0.1.0}
net=${PD_NETWORK:-pd-net}
http_port=${PD_HTTP_PORT:-8080}
names=(pd-router-0 pd-router-1 pd-prefill-0 pd-prefill-1 pd-decode-0 pd-decode-1)

down() {
    podman rm -f -t 5 "${names[@]}" >/dev/null 2>&1 || true
    podman network rm "$net" >/dev/null 2>&1 || true
}
if [[ ${1:-} == down ]]; then
    down
    exit 0
fi
command -v podman >/dev/null && podman image exists "$image" || deploy/containers/build-images.sh
model_dir=${PD_MODEL_DIR:-$PWD/models}
[[ -f $model_dir/SmolLM2-135M-Instruct.Q4_1.gguf ]] || scripts/fetch-model.sh "$model_dir"
down
podman network create "$net" >/dev/null
run() { podman run -d --name "$1" --network "$net" -v "$model_dir:/models:ro" "${@:2}" >/dev/null; }
start=$(date +%s.%N)
for i in 0 1; do
    run "pd-decode-$i" "$image" pd-decode --listen=0.0.0.0:50062 --metrics-listen=0.0.0.0:9090 \
        --advertise="pd-decode-$i:50062" --threads=1 --kv-blocks=1024 --max-batch=64 --grace-ms=30000
    run "pd-prefill-$i" "$image" pd-prefill --listen=0.0.0.0:50061 --metrics-listen=0.0.0.0:9090 \
        --threads=1 --chunk=256 --grace-ms=30000
done
for i in 0 1; do
    run "pd-router-$i" -p "127.0.0.1:$((http_port + i)):8080" "$image" pd-router --http-listen=0.0.0.0:8080 \
        --grpc-listen=0.0.0.0:50051 --drain-delay-ms=5000 \
        --prefill=pd-prefill-0:50061,pd-prefill-1:50061 --decode=pd-decode-0:50062,pd-decode-1:50062
done
for i in 0 1; do
    port=$((http_port + i))
    for _ in $(seq 1 600); do
        curl -sf "127.0.0.1:$port/ready" >/dev/null && break
        [[ "$(podman inspect -f '{{.State.Running}}' "pd-router-$i")" == true ]] ||
            { podman logs "pd-router-$i" 2>&1 | tail -n 20 >&2; exit 1; }
        sleep 0.1
    done
    curl -sf "127.0.0.1:$port/ready" >/dev/null || { echo "up.sh: pd-router-$i not ready within 60 s" >&2; exit 1; }
done
echo "up.sh: 2 routers, 2 prefill, 2 decode workers ready in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $start}") s on network $net"
for i in 0 1; do
    port=$((http_port + i))
    echo "--- streamed through pd-router-$i (http://127.0.0.1:$port)"
    curl -sN "127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0,"stream":true}' |
        sed -n 's/^data: //p' | grep -v '^\[DONE\]' |
        python3 -c 'import json,sys; print("".join((json.loads(l)["choices"] or [{}])[0].get("delta", {}).get("content") or "" for l in sys.stdin))'
done
echo "up.sh: 'deploy/containers/up.sh down' removes it"
