#!/usr/bin/env bash
# The fault check of the containerized cluster, run by .ci/run after the tests: builds the pd
# image from the release binaries (build-images.sh: podman, runc, debootstrap and the dnsname
# plugin installed when missing, each checked by its dpkg status), then check.py starts two
# routers, two prefill and two decode workers with the Kubernetes manifests' flags (cluster.py),
# kills, partitions, rolls and scales them under load, and ends with `N passed, N failed`.
# Needs root (podman), kubectl and PyYAML (scripts/install-k8s-tools.sh), the model
# (scripts/fetch-model.sh) and target/release's binaries.
#
#   deploy/containers/check.sh [SCENARIO ...]    all scenarios when none is named
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
deploy/containers/build-images.sh
exec python3 deploy/containers/check.py "$@"
