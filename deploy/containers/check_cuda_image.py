"""Checks the CUDA runtime image on a machine without a GPU (deploy/containers/build-images.sh cuda).

What can go wrong with such an image shows before any GPU is involved: a library the workers
link that the image lacks, build tools or sources shipped, root as the user. So, in a container
of the image:

  1. every library the workers link resolves, except the driver (libcuda.so.1), which the
     NVIDIA container toolkit mounts from the node;
  2. with no driver, a worker stops with the loader's error naming libcuda.so.1 (what a pod
     scheduled without the NVIDIA runtime shows), not with anything else;
  3. with the driver's link stub mounted in its place (scripts/install-cuda-toolkit.sh makes it:
     every driver entry point, no device), `pd-decode --device cuda` gets as far as CUDA's own
     initialisation and exits non-zero with the engine's error naming the device, not a panic;
  4. the image runs as user 10001 and holds no compiler (nvcc, cc) and no sources.

Usage: check_cuda_image.py IMAGE STUB_DIR
"""

import os
import subprocess
import sys

WORKERS = ("pd-decode", "pd-prefill")


def podman(*args, check=True):
    env = dict(os.environ)
    return subprocess.run(
        ["podman", "--runtime", "runc", *args], capture_output=True, text=True, check=check, env=env, timeout=120
    )


def in_container(image, script, volumes=()):
    """Runs `sh -c script` in a fresh container of image; returns (exit code, stdout + stderr)."""
    args = ["run", "--rm", "--network", "none", "--entrypoint", "/bin/sh"]
    for host, inside in volumes:
        args += ["-v", f"{host}:{inside}:ro"]
    r = podman(*args, image, "-c", script, check=False)
    return r.returncode, r.stdout + r.stderr


def main():
    image, stub = sys.argv[1], sys.argv[2]
    failures = []

    def expect(ok, what, detail=""):
        print(f"check-cuda-image: {'ok' if ok else 'FAILED'}: {what}" + ("" if ok else f"\n{detail}"))
        if not ok:
            failures.append(what)

    for worker in WORKERS:
        _, out = in_container(image, f"ldd /usr/local/bin/{worker}")
        missing = sorted({line.split()[0] for line in out.splitlines() if "not found" in line})
        expect(missing == ["libcuda.so.1"], f"{worker} links every library but the driver", out)

    code, out = in_container(image, "pd-decode --device cuda")
    expect(code != 0 and "libcuda.so.1" in out and "panicked" not in out,
           "without a driver, pd-decode stops with the loader's error naming libcuda.so.1", out)

    # The model is not needed to reach CUDA's initialisation: the device comes first.
    code, out = in_container(image, "LD_LIBRARY_PATH=/stub:$LD_LIBRARY_PATH pd-decode --device cuda",
                             volumes=[(stub, "/stub")])
    expect(code != 0 and "cannot open CUDA device 0" in out and "panicked" not in out and "shared libraries" not in out,
           "with the driver stub, pd-decode reaches CUDA's initialisation and exits with its error", out)
    print(f"check-cuda-image: pd-decode without a device says: {out.strip().splitlines()[-1] if out.strip() else ''}")

    _, out = in_container(image, "id -u; command -v nvcc cc gcc cargo; ls -d /src /usr/local/cuda/bin 2>/dev/null")
    expect(out.split() == ["10001"], "user 10001, no compiler, no sources", out)

    if failures:
        print(f"check-cuda-image: {len(failures)} failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
