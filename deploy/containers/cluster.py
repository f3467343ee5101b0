#!/usr/bin/env python3
"""The containerized pd cluster, as the Kubernetes manifests describe it, on one podman network.

Each container runs what the rendered base (`kubectl kustomize deploy/k8s/base`) gives its
Deployment: the command, the args and the pd-config ConfigMap's environment. A podman network
alias per pool (`pd-prefill`, `pd-decode`) stands in for the headless Service of that name: the
routers' PD_PREFILL_WORKERS / PD_DECODE_WORKERS resolve it to every container of the pool, as
they resolve the Service's DNS name in a cluster, so a container that joins or leaves the pool
is found by the routers' own re-resolution. What differs from a cluster, and why:

- `$(POD_IP)` and `$(POD_NAME)` become the container's name (the network's DNS resolves it);
- `--threads=1` where the manifest sets threads: six containers share two cores here;
- OTEL_EXPORTER_OTLP_ENDPOINT is dropped: no collector runs on the network;
- the model comes from the host's models/ folder (read-only) instead of the init container.

Used by up.sh (the cluster for a user) and check.py (the fault check). As a command:
    cluster.py up | down | args ROLE
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "containers"
IMAGE = os.environ.get("PD_IMAGE", "localhost/pd:cpu-0.1.0")
NETWORK = os.environ.get("PD_NETWORK", "pd-net")
HTTP_PORT = int(os.environ.get("PD_HTTP_PORT", "8080"))
MODELS = Path(os.environ.get("PD_MODEL_DIR", ROOT / "models"))
ROLES = ("router", "prefill", "decode")
# Every container started here carries it (value: the network), so `down` finds them all.
LABEL = "pd.cluster"
# The containers up.sh starts: two of each role.
DEFAULT = [f"pd-{role}-{i}" for role in ("decode", "prefill", "router") for i in (0, 1)]


def podman(*args, check=True, capture=True):
    """Runs podman with runc and this folder's containers.conf (see ../shared/FINDINGS.md)."""
    env = dict(os.environ, CONTAINERS_CONF=str(HERE / "containers.conf"))
    out = subprocess.run(
        ["podman", "--runtime", "runc", *args], env=env, text=True, capture_output=capture, check=False
    )
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: {(out.stderr or '').strip()[-400:]}")
    return out


def manifest():
    """Per role, (command, args, env) from the rendered base manifests."""
    try:
        import yaml
    except ImportError:
        sys.exit("cluster.py: PyYAML is missing (scripts/install-k8s-tools.sh installs it)")
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "base")], text=True, capture_output=True, check=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    config = next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pd-config")
    roles = {}
    for d in docs:
        if d["kind"] != "Deployment" or not d["metadata"]["name"].startswith("pd-"):
            continue
        role = d["metadata"]["name"].removeprefix("pd-")
        container = d["spec"]["template"]["spec"]["containers"][0]
        env = dict(config)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        roles[role] = (container["command"], container.get("args", []), env)
    missing = [r for r in ROLES if r not in roles]
    if missing:
        sys.exit(f"cluster.py: the rendered base has no Deployment for {missing}")
    return roles


def role_of(name):
    """`router`, `prefill` or `decode` of a container named pd-ROLE-N."""
    return name.split("-")[1]


def run_args(name, spec):
    """The `podman run` arguments of container `name` (pd-ROLE-N)."""
    role = role_of(name)
    command, args, env = spec[role]
    args = [a.replace("$(POD_IP)", name).replace("$(POD_NAME)", name) for a in args]
    args = ["--threads=1" if a.startswith("--threads=") else a for a in args]
    env = dict(env, POD_NAME=name)
    out = ["-d", "--name", name, "--hostname", name, "--network", NETWORK, "--network-alias", f"pd-{role}"]
    out += ["--label", f"{LABEL}={NETWORK}"]
    out += ["-v", f"{MODELS}:/models:ro"]
    index = int(name.rsplit("-", 1)[1])
    if role == "router" and index < 2:  # the two routers users reach; check.py's surge ones by address
        out += ["-p", f"127.0.0.1:{HTTP_PORT + index}:8080"]
    for k, v in sorted(env.items()):
        out += ["-e", f"{k}={v}"]
    return out + [IMAGE, *command, *args]


def start(name, spec):
    """Starts container `name` (replacing a stopped one of that name)."""
    podman("rm", "-f", "-t", "0", name, check=False)
    podman("run", *run_args(name, spec))


def address(name):
    """The container's address on the network, reachable from the host."""
    out = podman("inspect", "-f", "{{json .NetworkSettings.Networks}}", name).stdout
    return json.loads(out)[NETWORK]["IPAddress"]


def running(name):
    out = podman("inspect", "-f", "{{.State.Running}}", name, check=False)
    return out.returncode == 0 and out.stdout.strip() == "true"


def probe(name, path="/ready"):
    """HTTP status of the container's probe endpoint (the port its manifest probes), or None."""
    try:
        ip = address(name)
    except RuntimeError:
        return None
    return probe_address(ip, 8080 if role_of(name) == "router" else 9090, path)


def probe_address(ip, port, path="/ready"):
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def metrics(name):
    """The container's /metrics as {sample: value} (labels kept in the key)."""
    port = 8080 if role_of(name) == "router" else 9090
    with urllib.request.urlopen(f"http://{address(name)}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def wait_ready(name, timeout=60.0):
    """Waits for /ready to answer 200 (the startup probe); the log tail if the container died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe(name) == 200:
            return
        if not running(name):
            tail = podman("logs", "--tail", "20", name, check=False)
            raise RuntimeError(f"{name} exited before it was ready:\n{tail.stdout}{tail.stderr}")
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready within {timeout:.0f} s")


def up(names=DEFAULT):
    """A fresh network and `names` started, workers first; waits until all are ready."""
    if not (MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        subprocess.run([str(ROOT / "scripts" / "fetch-model.sh"), str(MODELS)], check=True)
    spec = manifest()
    down()
    podman("network", "create", NETWORK)
    for name in names:
        start(name, spec)
    for name in names:
        wait_ready(name)
    return spec


def down():
    """Removes every container started here on NETWORK at once (no drain), then the network."""
    ids = podman("ps", "-a", "-q", "--filter", f"label={LABEL}={NETWORK}", check=False).stdout.split()
    if ids:
        podman("rm", "-f", "-t", "0", *ids, check=False)
    podman("network", "rm", "-f", NETWORK, check=False)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "up"
    if command == "up":
        began = time.monotonic()
        up()
        print(f"cluster.py: {len(DEFAULT)} containers ready in {time.monotonic() - began:.1f} s on network {NETWORK}")
    elif command == "down":
        down()
    elif command == "args" and len(sys.argv) == 3:
        print(" ".join(run_args(f"pd-{sys.argv[2]}-0", manifest())))
    else:
        sys.exit("usage: cluster.py up | down | args ROLE")
