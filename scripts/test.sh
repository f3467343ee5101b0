#!/usr/bin/env bash
# The test command of the README: system packages (each checked by its dpkg status after
# installing), the model, formatting and lints, then every test of the workspace (UCX
# transport included), built once in release mode into target/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The disk may be shared with other jobs: say how much is free before building (a cold build
# needs about 4 GB under target/).
echo "test.sh: $(df -h . | awk 'NR == 2 {print $4}') free for target/"
scripts/install-deps.sh
scripts/install-deps.sh --check
scripts/install-k8s-tools.sh
scripts/install-clients.sh
scripts/fetch-model.sh
# Tests and local runs keep UCX on loopback (the code sets these too; this covers child tools).
export UCX_NET_DEVICES=lo UCX_TLS="${UCX_TLS:-posix,sysv,cma,tcp}"
features=pd-kv-transfer/ucx,pd-sim/ucx
cargo fmt --all --check
# Lints share the release profile's dependency builds (clippy checks, it does not link).
cargo clippy --release --workspace --all-targets --features "$features" -- -D warnings
# The end-to-end tests start the real binaries: build them first (same profile, reused).
cargo build --release --workspace --bins --features "$features"
cargo test --release --workspace --features "$features" "$@"
# The suites that move KV between real processes, once more with every decode worker taking
# KV over UCX (`--kv-transport ucx`; the tests that choose a transport keep theirs).
PD_TEST_KV_TRANSPORT=ucx cargo test --release --workspace --features "$features" \
    --test cluster --test faults --test restarts --test answers --test families --test chaos "$@"
# ... and the simulated fleet's loss test, its KV moved over UCX (pd-sim-worker --kv-transport).
PD_TEST_KV_TRANSPORT=ucx cargo test --release --workspace --features "$features" --test fleet "$@" \
    -- lost_mid_stream
