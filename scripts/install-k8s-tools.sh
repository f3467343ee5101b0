#!/usr/bin/env bash
# Tools the deployment checks (tests/tests/deploy.rs) need, if missing: kubectl (renders the
# kustomize overlays offline) and kubernetes-validate from PyPI (offline schema validation
# against Kubernetes 1.32, with PyYAML, which the test also uses to read the render), and
# Debian's Prometheus, which evaluates the autoscalers' queries against a running cluster
# (tests/tests/autoscaling.rs; checked by its dpkg status; the test starts its own instance
# on a loopback port).
set -euo pipefail
installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }
if ! installed prometheus; then
    if [[ $(id -u) -eq 0 ]]; then
        echo "install-k8s-tools: installing prometheus"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
    fi
    installed prometheus || { echo "install-k8s-tools: prometheus is not installed (sudo apt-get install prometheus)" >&2; exit 1; }
fi
if ! installed kubectl; then
    if [[ $(id -u) -eq 0 ]] && apt-get install -y -qq kubectl >/dev/null 2>&1; then
        :
    else
        echo "install-k8s-tools: the kubectl package is not installed (needed for 'kubectl kustomize'); install kubectl >= 1.27" >&2
        exit 1
    fi
fi
if ! python3 -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "kubernetes-validate==1.32.0"
fi
