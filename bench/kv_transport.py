"""KV over gRPC or UCX, in the cluster: per request with a long distinct prompt (no prefix
cache helps), the time to the first token (a streamed completion's first chunk) and the
decode worker's KV receive time (header to commit, `pd_kv_transfer_time_seconds`; most of it
overlaps the prefill, layer by layer) and bytes, medians over the requests. Run it against
`deploy/local/up.sh` started once per transport:

  PD_HTTP_PORT=18080 PD_DECODE_METRICS_PORT=19091 deploy/local/up.sh &
  PD_KV_TRANSPORT=ucx UCX_TLS=posix,sysv,cma,tcp UCX_NET_DEVICES=lo PD_HTTP_PORT=18080 \\
    PD_DECODE_METRICS_PORT=19091 deploy/local/up.sh &
  python3 bench/kv_transport.py http://127.0.0.1:18080 http://127.0.0.1:19091 [WORDS] [REQUESTS]
"""

import json
import random
import statistics
import sys
import time
import urllib.request

router, metrics = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
words = int(sys.argv[3]) if len(sys.argv) > 3 else 900
requests = int(sys.argv[4]) if len(sys.argv) > 4 else 8
TEXT = "the lighthouse keeper climbed the stairs every evening and lit the lamp".split()


def scrape():
    with urllib.request.urlopen(metrics + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    total = lambda name: sum(float(l.split()[-1]) for l in lines if l.startswith(name))
    return total("pd_kv_transfer_time_seconds_sum"), total("pd_kv_transfer_time_seconds_count"), total("pd_kv_transfer_bytes_total")


def ttft(prompt):
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    req = urllib.request.Request(router + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", "x-pd-class": "batch"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        first = None
        for line in r:
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter() - start
    return first


ttfts, receive, sizes = [], [], []
for i in range(requests):
    prompt = f"{random.randint(0, 10**9)} " + " ".join(TEXT[j % len(TEXT)] for j in range(words))
    s0, c0, b0 = scrape()
    ttfts.append(ttft(prompt) * 1e3)
    s1, c1, b1 = scrape()
    if c1 > c0:
        receive.append((s1 - s0) / (c1 - c0) * 1e3)
        sizes.append(b1 - b0)
print(json.dumps({
    "requests": requests,
    "ttft_ms_median": round(statistics.median(ttfts), 1),
    "kv_receive_ms_median": round(statistics.median(receive), 2) if receive else None,
    "kv_bytes_median": statistics.median(sizes) if sizes else None,
}))
