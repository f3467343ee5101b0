#!/usr/bin/env bash
# The property-based fuzz targets, long: each target runs for about MINUTES (default 10)
# with many cases. The test suite runs the same targets with 256 cases each.
#   scripts/fuzz.sh [MINUTES]
# Targets: router/tests/fuzz.rs (HTTP body decoder + validator), kv-transfer/tests/fuzz.rs
# (KV receiver operations, pd.v1 sender messages and worker requests from raw bytes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
minutes="${1:-10}"
cargo build --release --tests -p pd-router -p pd-kv-transfer --quiet
run() { # PACKAGE TEST
    local deadline=$((SECONDS + minutes * 60)) rounds=0
    while ((SECONDS < deadline)); do
        # Each round: new random inputs, 20,000 cases per property (a failure prints the
        # smallest input that still fails).
        PROPTEST_CASES=20000 cargo test --release --quiet -p "$1" --test "$2" >/tmp/pd-fuzz-$2.log 2>&1 || {
            echo "fuzz: $1/$2 failed; see /tmp/pd-fuzz-$2.log" >&2
            tail -40 "/tmp/pd-fuzz-$2.log" >&2
            return 1
        }
        rounds=$((rounds + 1))
    done
    echo "fuzz: $1 $2: $rounds rounds of 20,000 cases per property in $minutes min, no failure"
}
run pd-router fuzz
run pd-kv-transfer fuzz
