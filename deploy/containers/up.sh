#!/usr/bin/env bash
# A containerized pd cluster on this machine: two routers, two prefill and two decode
# workers from the pd image (deploy/containers/build-images.sh builds it when missing), on a
# private podman network, each with the command, flags and environment of its Deployment in
# the rendered Kubernetes base and a network alias per pool standing in for its headless
# Service (cluster.py says what differs), the model mounted read-only from models/. The
# routers publish HTTP on 127.0.0.1 only (PD_HTTP_PORT and the port after it: 8080, 8081).
#
#   deploy/containers/up.sh          start (replacing containers of an earlier run), wait
#                                    until both routers are ready, stream one answer from each
#   deploy/containers/up.sh down     remove the containers and the network
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CONTAINERS_CONF="$PWD/deploy/containers/containers.conf"
image=${PD_IMAGE:-localhost/pd:cpu-0.1.0}
http_port=${PD_HTTP_PORT:-8080}
if [[ ${1:-} == down ]]; then
    python3 deploy/containers/cluster.py down
    exit 0
fi
command -v podman >/dev/null && podman --runtime runc image exists "$image" || deploy/containers/build-images.sh
python3 deploy/containers/cluster.py up
for i in 0 1; do
    port=$((http_port + i))
    echo "--- streamed through pd-router-$i (http://127.0.0.1:$port)"
    curl -sN "127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0,"stream":true}' |
        sed -n 's/^data: //p' | grep -v '^\[DONE\]' |
        python3 -c 'import json,sys; print("".join((json.loads(l)["choices"] or [{}])[0].get("delta", {}).get("content") or "" for l in sys.stdin))'
done
echo "up.sh: 'deploy/containers/up.sh down' removes it"
