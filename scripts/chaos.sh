#!/usr/bin/env bash
# The chaos suite, long: FAULTS faults (default 60) from SEED (default: the time), as root.
# The test suite runs the same test with 8 faults and a fixed seed.
#   scripts/chaos.sh [FAULTS] [SEED]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
faults="${1:-60}"
seed="${2:-$(date +%s)}"
cargo build --release --quiet --workspace --bins --features pd-kv-transfer/ucx
PD_CHAOS_FAULTS="$faults" PD_CHAOS_SEED="$seed" cargo test --release --quiet --workspace --features pd-kv-transfer/ucx --test chaos -- --nocapture
