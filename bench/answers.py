"""n answers against n = 1 on a running pd cluster: the time to the first token of answer 0
(the prefill), the time until every answer has its first token, the whole request, and the KV
bytes the decode worker received, per request, medians over distinct prompts (a random
leading number per prompt, so no prefix cache helps either side).

Usage: python3 bench/answers.py ROUTER_URL DECODE_METRICS_URL [PROMPT_WORDS] [REPEATS]
"""

import json
import random
import statistics
import sys
import time
import urllib.request

router, metrics = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
words = int(sys.argv[3]) if len(sys.argv) > 3 else 900
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
TEXT = "the lighthouse keeper climbed the stairs every evening and lit the lamp".split()


def kv_bytes():
    with urllib.request.urlopen(metrics + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pd_kv_transfer_bytes_total "):
                return float(line.split()[1])
    raise SystemExit("no pd_kv_transfer_bytes_total")


def run(n, prompt):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 1, "n": n, "stream": True, "ignore_eos": True}
    # The batch class: a long prompt outlasts the interactive class's TTFT target.
    headers = {"content-type": "application/json", "x-pd-class": "batch"}
    req = urllib.request.Request(router + "/v1/completions", json.dumps(body).encode(), headers)
    before, start = kv_bytes(), time.monotonic()
    first, started = None, {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                if c.get("text"):
                    started.setdefault(c["index"], time.monotonic() - start)
                    if c["index"] == 0 and first is None:
                        first = started[0]
    total = time.monotonic() - start
    if len(started) != n:
        raise SystemExit(f"n={n}: only answers {sorted(started)} streamed")
    return first, max(started.values()), total, kv_bytes() - before


rows = {}
for n in (1, 4):
    rows[n] = []
    for i in range(repeats):
        prompt = f"{random.randrange(10**9)} " + " ".join(TEXT[j % len(TEXT)] for j in range(words))
        rows[n].append(run(n, prompt))
med = lambda n, k: statistics.median(r[k] for r in rows[n])
print(f"prompt of {words} words (+ a random number), max_tokens 8, {repeats} distinct prompts per n")
print("| n | first token of answer 0 (ms) | first token of every answer (ms) | whole request (ms) | KV bytes received |")
print("|---|---|---|---|---|")
for n in (1, 4):
    print(f"| {n} | {med(n, 0) * 1e3:.0f} | {med(n, 1) * 1e3:.0f} | {med(n, 2) * 1e3:.0f} | {med(n, 3):.0f} |")
print(f"\nn=4 / n=1: first token x{med(4, 0) / med(1, 0):.2f}, every answer's first token x{med(4, 1) / med(1, 1):.2f}, "
      f"whole request x{med(4, 2) / med(1, 2):.2f}, KV bytes x{med(4, 3) / med(1, 3):.2f}")
