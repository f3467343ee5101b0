"""What every client script reports: one line per check, and exit 1 at the first failure
(so the cluster test that runs the script fails with the check's name)."""

import sys


def check(name, ok, detail=""):
    if not ok:
        print(f"FAIL {name}: {detail}")
        sys.exit(1)
    print(f"ok   {name}")
