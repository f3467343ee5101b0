#!/usr/bin/env bash
# The client libraries the client tests (tests/clients/, run by tests/tests/cluster.rs) drive
# the real cluster with, from PyPI, if missing: the official `openai` Python client (with
# pydantic, its dependency) and `instructor`, a structured-output library users pick
# (instructor 1.17 takes openai up to 3.3).
set -euo pipefail
if ! python3 -c 'import openai, instructor' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
        "openai==3.3.0" "instructor==1.17.0"
fi
python3 -c 'import openai, instructor; print("install-clients: openai", openai.__version__, "instructor", instructor.__version__)'
