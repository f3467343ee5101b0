#!/usr/bin/env bash
# Installs the Debian packages pd builds against, if missing (Debian/Ubuntu, needs root):
# protoc (gRPC code generation), libucx + libclang + pkg-config (the `ucx` transport and its
# bindgen step), a C toolchain, Python with pip (model fetch), curl (the local launcher) and
# iproute2 + procps (`ip netns` and `kill` in the chaos test) and openssl (test certificates).
#
# Each package is checked by its dpkg status, never by a file: another package may ship a
# look-alike (the image carries libclang-cpp.so.14, which is not the libclang bindgen loads).
#
#   scripts/install-deps.sh           install what is missing
#   scripts/install-deps.sh --check   install nothing; exit 1 naming any package not installed
set -euo pipefail

packages=(build-essential pkg-config python3 python3-pip protobuf-compiler curl libucx-dev libclang-dev iproute2 procps openssl)

installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }

missing() {
    local p out=()
    for p in "${packages[@]}"; do installed "$p" || out+=("$p"); done
    echo "${out[*]}"
}

command -v dpkg-query >/dev/null || { echo "install-deps: not a Debian-family system (no dpkg-query); install by hand: ${packages[*]}" >&2; exit 1; }

need=($(missing))
if [[ "${1:-}" == "--check" ]]; then
    if ((${#need[@]})); then echo "install-deps: not installed: ${need[*]}" >&2; exit 1; fi
    echo "install-deps: all installed: ${packages[*]}"
    exit 0
fi
((${#need[@]} == 0)) && exit 0
if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages: ${need[*]}; run as root or: sudo apt-get install ${need[*]}" >&2
    exit 1
fi
echo "install-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
still=($(missing))
if ((${#still[@]})); then echo "install-deps: still not installed after apt-get: ${still[*]}" >&2; exit 1; fi
