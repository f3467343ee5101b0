#!/usr/bin/env bash
# Installs the system packages pd builds against, if missing (Debian/Ubuntu, needs root):
# protoc (gRPC code generation), libucx + libclang + pkg-config (the `ucx` transport),
# a C toolchain, Python with pip (model fetch) and curl (the local launcher).
set -euo pipefail
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v python3 >/dev/null || need+=(python3 python3-pip)
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v curl >/dev/null || need+=(curl)
pkg-config --exists ucx 2>/dev/null || need+=(libucx-dev)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if ((${#need[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages: ${need[*]}; run as root or: sudo apt-get install ${need[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}"
