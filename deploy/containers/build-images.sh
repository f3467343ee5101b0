#!/usr/bin/env bash
# Builds pd's CPU runtime image with podman on a machine without a registry, from the release
# binaries built on this (Debian 12) host:
#
#   1. podman, runc, debootstrap and the CNI dnsname plugin (containers reach each other by
#      name on a podman network), installed when missing (each checked by its dpkg status);
#   2. a base image, `localhost/pd-base:bookworm`, made once with debootstrap (minbase, plus
#      ca-certificates and the UCX runtime the binaries link) and `podman import`;
#   3. `pd:cpu-0.1.0` from deploy/docker/Dockerfile's `runtime-prebuilt` stage, over that base
#      (BASE=debian:bookworm-slim where a registry is at hand): the three binaries with their
#      debug info stripped, no build tools, no sources, user 10001.
#
# Podman runs with runc and a containers.conf of its own (deploy/containers/containers.conf:
# cgroupfs, no default ulimits), as ../shared/FINDINGS.md found these machines need.
# Usage: deploy/containers/build-images.sh   (BASE=... and TAG=... to change them)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
here=deploy/containers
export CONTAINERS_CONF="$PWD/$here/containers.conf"
installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }
missing=()
for pkg in podman runc debootstrap golang-github-containernetworking-plugin-dnsname; do installed "$pkg" || missing+=("$pkg"); done
if ((${#missing[@]})); then
    [[ $(id -u) -eq 0 ]] || { echo "build-images: install ${missing[*]} (sudo apt-get install ${missing[*]})" >&2; exit 1; }
    echo "build-images: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
    for pkg in "${missing[@]}"; do installed "$pkg" || { echo "build-images: $pkg did not install" >&2; exit 1; }; done
fi
podman() { command podman --runtime runc "$@"; }

base=${BASE:-localhost/pd-base:bookworm}
tag=${TAG:-localhost/pd:cpu-0.1.0}
if [[ $base == localhost/pd-base:* ]] && ! podman image exists "$base"; then
    start=$(date +%s)
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=ca-certificates,libucx0 bookworm "$root/rootfs" \
        "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root/debootstrap.log" 2>&1 ||
        { tail -n 20 "$root/debootstrap.log" >&2; exit 1; }
    # Package lists and caches are not needed at run time.
    rm -rf "$root/rootfs/var/lib/apt/lists/"* "$root/rootfs/var/cache/apt/"*.bin "$root/rootfs/var/cache/apt/archives/"*.deb
    tar -C "$root/rootfs" -c . | podman import - "$base" >/dev/null
    echo "build-images: $base made with debootstrap in $(($(date +%s) - start)) s"
fi

bins=(pd-router pd-prefill pd-decode)
for b in "${bins[@]}"; do
    [[ -x target/release/$b ]] || { echo "build-images: target/release/$b is missing: cargo build --release --workspace --bins --features pd-kv-transfer/ucx" >&2; exit 1; }
done
context=$(mktemp -d)
trap 'rm -rf "$context" ${root:+"$root"}' EXIT
mkdir "$context/bin"
for b in "${bins[@]}"; do
    objcopy --strip-debug "target/release/$b" "$context/bin/$b"
done
podman build --quiet -f deploy/docker/Dockerfile --target runtime-prebuilt --build-arg "BASE=$base" \
    -t "$tag" "$context" >/dev/null
echo "build-images: $tag ($(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}'), base $base)"
