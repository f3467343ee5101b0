#!/usr/bin/env bash
# Tools the deployment checks (tests/tests/deploy.rs) need, if missing: kubectl (renders the
# kustomize overlays offline) and kubernetes-validate from PyPI (offline schema validation
# against Kubernetes 1.32, with PyYAML, which the test also uses to read the render).
set -euo pipefail
if ! command -v kubectl >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && apt-get install -y -qq kubectl >/dev/null 2>&1; then
        :
    else
        echo "install-k8s-tools: kubectl is missing (needed for 'kubectl kustomize'); install kubectl >= 1.27" >&2
        exit 1
    fi
fi
if ! python3 -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "kubernetes-validate==1.32.0"
fi
