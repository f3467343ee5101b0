#!/usr/bin/env bash
# The client libraries the client tests (tests/clients/, run by tests/tests/cluster.rs) drive
# the real cluster with, from PyPI, if missing: the official `openai` Python client.
set -euo pipefail
if ! python3 -c 'import openai' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "openai==3.57.0"
fi
python3 -c 'import openai; print("install-clients: openai", openai.__version__)'
