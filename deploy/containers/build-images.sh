#!/usr/bin/env bash
# Builds pd's images with podman on a machine without a registry: each base is made once with
# debootstrap from Debian's packages and `podman import` (with a registry, BASE=debian:bookworm-slim
# and RUST_IMAGE=rust:1.94-bookworm give the same images).
#
#   build-images.sh [cpu]    `pd:cpu-0.1.0` from the release binaries built on this (Debian 12)
#                            host: deploy/docker/Dockerfile's `runtime-prebuilt` stage over
#                            `pd-base:bookworm` (minbase, ca-certificates, the UCX runtime the
#                            binaries link). What deploy/containers/check.sh runs.
#   build-images.sh cuda     `pd:cuda-0.1.0` from the CUDA workers in target/cuda (scripts/gpu-check.sh
#                            pack builds them) and the CUDA runtime libraries of the PyPI toolkit
#                            (scripts/install-cuda-toolkit.sh), over the same base:
#                            Dockerfile.cuda's `runtime-prebuilt` stage; then checks in a container
#                            that every library but the driver resolves and that, with the driver's
#                            link stub in place of a GPU, a worker fails with CUDA's own error.
#   build-images.sh in-image `pd:cpu-0.1.0-src` by Dockerfile's multi-stage `runtime` target: the
#                            workspace compiled inside the build stage, on `rust:1.94-bookworm`
#                            made here (debootstrap with build-essential, rustup-init from
#                            static.rust-lang.org). Cold, this compiles every crate (minutes).
#
# podman, runc, debootstrap and the CNI dnsname plugin (containers reach each other by name on a
# podman network) are installed when missing, each checked by its dpkg status. Podman runs with
# runc and a containers.conf of its own (deploy/containers/containers.conf: cgroupfs, no default
# ulimits), as ../shared/FINDINGS.md found these machines need. No image holds build tools or
# sources except the build stage's; every runtime image runs as user 10001.
# Environment: BASE, TAG, RUST_IMAGE, DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
here=deploy/containers
mode=${1:-cpu}
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
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
size() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# debootstrapped IMAGE PACKAGES: a Debian 12 minbase image with PACKAGES, made once.
debootstrapped() {
    local image=$1 packages=$2 root="$scratch/rootfs-${1##*:}" start
    podman image exists "$image" && return 0
    start=$(date +%s)
    debootstrap --variant=minbase --include="$packages" bookworm "$root" \
        "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$scratch/debootstrap.log" 2>&1 ||
        { tail -n 20 "$scratch/debootstrap.log" >&2; exit 1; }
    # Package lists and caches are not needed at run time (apt-get update restores the lists).
    rm -rf "$root/var/lib/apt/lists/"* "$root/var/cache/apt/"*.bin "$root/var/cache/apt/archives/"*.deb
    tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
    rm -rf "$root"
    echo "build-images: $image made with debootstrap in $(($(date +%s) - start)) s ($(size "$image"))"
}

base=${BASE:-localhost/pd-base:bookworm}
[[ $base == localhost/pd-base:* ]] && debootstrapped "$base" ca-certificates,libucx0

# stripped SRC DEST: a binary without its debug info (a third of its size).
stripped() { objcopy --strip-debug "$1" "$2"; }

case $mode in
cpu)
    tag=${TAG:-localhost/pd:cpu-0.1.0}
    mkdir "$scratch/bin"
    for b in pd-router pd-prefill pd-decode; do
        [[ -x target/release/$b ]] || { echo "build-images: target/release/$b is missing: cargo build --release --workspace --bins --features pd-kv-transfer/ucx" >&2; exit 1; }
        stripped "target/release/$b" "$scratch/bin/$b"
    done
    podman build --quiet -f deploy/docker/Dockerfile --target runtime-prebuilt --build-arg "BASE=$base" \
        -t "$tag" "$scratch" >/dev/null
    ;;
cuda)
    tag=${TAG:-localhost/pd:cuda-0.1.0}
    # shellcheck source=/dev/null
    source <(scripts/install-cuda-toolkit.sh --env)
    mkdir "$scratch/bin" "$scratch/cuda"
    for b in pd-prefill pd-decode; do
        [[ -x target/cuda/release/$b ]] || { echo "build-images: target/cuda/release/$b is missing: scripts/gpu-check.sh pack builds it" >&2; exit 1; }
        stripped "target/cuda/release/$b" "$scratch/bin/$b"
    done
    # The router does no model math: the CPU build's.
    [[ -x target/release/pd-router ]] || { echo "build-images: target/release/pd-router is missing" >&2; exit 1; }
    stripped target/release/pd-router "$scratch/bin/pd-router"
    # The toolkit's libraries the workers load, found by what the binaries need (ldd, with the
    # toolkit on the library path): the driver (libcuda.so.1) is the node's, mounted by the
    # NVIDIA container toolkit, never in the image.
    for lib in $(LD_LIBRARY_PATH="$CUDA_ROOT/lib" ldd "$scratch"/bin/pd-{prefill,decode} |
        awk -v root="$CUDA_ROOT/lib/" 'index($3, root) == 1 {print $3}' | sort -u); do
        cp -L "$lib" "$scratch/cuda/"
    done
    for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnvrtc-builtins.so.13.5 libcudart.so.13; do
        [[ -e $scratch/cuda/$lib ]] || cp -L "$CUDA_ROOT/lib/$lib" "$scratch/cuda/"
    done
    podman build --quiet -f deploy/docker/Dockerfile.cuda --target runtime-prebuilt --build-arg "BASE=$base" \
        -t "$tag" "$scratch" >/dev/null
    python3 "$here/check_cuda_image.py" "$tag" "$CUDA_ROOT/lib/stubs"
    ;;
in-image)
    tag=${TAG:-localhost/pd:cpu-0.1.0-src}
    # Downloads at build time (rustup, crates.io) trust the host's CA bundle, mounted for the
    # RUN steps only (a machine behind a TLS-inspecting proxy has its own CA there); no image
    # keeps it.
    trust=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
    rust=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
    rust_image=${RUST_IMAGE:-localhost/rust:$rust-bookworm}
    if [[ $rust_image == localhost/rust:* ]] && ! podman image exists "$rust_image"; then
        debootstrapped localhost/pd-buildpack:bookworm ca-certificates,curl,build-essential
        # rustup-init from static.rust-lang.org (sh.rustup.rs is not reachable from every
        # build machine), checked against its published SHA-256; the layout of the official
        # rust images (RUSTUP_HOME, CARGO_HOME under /usr/local).
        podman build --quiet "${trust[@]}" -t "$rust_image" -f - "$scratch" >/dev/null <<EOF
FROM localhost/pd-buildpack:bookworm
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN url=https://static.rust-lang.org/rustup/dist/x86_64-unknown-linux-gnu/rustup-init \
    && curl -sSfo /tmp/rustup-init "\$url" \
    && echo "\$(curl -sSf "\$url.sha256" | cut -d' ' -f1)  /tmp/rustup-init" | sha256sum -c - \
    && chmod +x /tmp/rustup-init \
    && /tmp/rustup-init -y --no-modify-path --profile minimal --default-toolchain $rust \
    && rm /tmp/rustup-init && rustc --version
EOF
        echo "build-images: $rust_image made ($(size "$rust_image"))"
    fi
    start=$(date +%s)
    podman build --quiet "${trust[@]}" -f deploy/docker/Dockerfile --target runtime --build-arg "BASE=$base" \
        --build-arg "RUST_IMAGE=$rust_image" -t "$tag" . >/dev/null
    echo "build-images: $tag compiled inside the build stage in $(($(date +%s) - start)) s"
    # A runtime image holds no toolchain and no sources, and runs as user 10001.
    facts=$(podman run --rm --entrypoint /bin/sh "$tag" -c \
        'echo "uid $(id -u)"; ls -d /usr/local/cargo /usr/local/rustup /src 2>/dev/null; command -v cc rustc cargo; pd-router --version')
    grep -qx 'uid 10001' <<<"$facts" && [[ $(wc -l <<<"$facts") == 2 ]] ||
        { echo "build-images: $tag: expected user 10001, no toolchain and no sources, found:" >&2; echo "$facts" >&2; exit 1; }
    echo "build-images: $tag runs $(tail -n 1 <<<"$facts") as user 10001, without toolchain or sources"
    ;;
*)
    echo "usage: $0 [cpu|cuda|in-image]" >&2
    exit 2
    ;;
esac
echo "build-images: $tag ($(size "$tag"), base $base)"
