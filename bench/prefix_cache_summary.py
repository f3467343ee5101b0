#!/usr/bin/env python3
"""Summary of bench/prefix-cache.sh: reads the pd-bench reports (runs/*/summary.json) and
the router's per-request records (logs/*/router.log, JSON lines) and prints Markdown."""
import json
import os
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
PREFIX_BLOCKS_TOKENS = 1500 // 16 * 16  # the whole blocks of a 1,500-token shared prefix


def rows(run):
    s = json.loads((out / "runs" / run / "summary.json").read_text())
    return {r["input_bucket"]: r for r in s["rows"] if r["class"] == "support"}


def records(run):
    recs = []
    for line in (out / "logs" / run / "router.log").read_text().splitlines():
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if v.get("message") == "request finished" and v.get("outcome") == "ok":
            recs.append(v)
    return recs


def overall(r):
    """The class's row over all its requests (its input bucket, or `all`)."""
    return r.get("all") or next(v for k, v in r.items() if k not in ("cold", "warm"))


def p(row, what, q):
    v = row[what][q]
    return "-" if v is None else f"{v:.0f}"


def mean(xs):
    return statistics.mean(xs) if xs else float("nan")


print("# Prefix cache and cache-aware routing\n")
print("Command: `bench/prefix-cache.sh`; the scenarios are in `scenarios/`, every run's pd-bench report in")
print("`runs/`, the processes' logs (JSON) in `logs/`.")
cpu = json.loads((out / "runs" / "warm-cold" / "summary.json").read_text())["machine"].split(",")[0]
print(f"Machine: {cpu}, {os.cpu_count()} cores; prefill worker, router and load generator on core 0, decode workers on core 1.\n")

# 1. warm vs cold
wc, nc = rows("warm-cold"), rows("no-cache")
recs = records("warm-cold")
cold_bytes = [r["kv_bytes"] for r in recs if r.get("decode_cached_tokens", 0) == 0]
warm_bytes = [r["kv_bytes"] for r in recs if r.get("decode_cached_tokens", 0) > 0]
plain_bytes = [r["kv_bytes"] for r in records("no-cache")]
print("## 1. Warm vs cold: 1,500-token shared system prompt + 50-token user turn\n")
print("One request at a time, 6 different prefixes, 36 requests; 1 prefill + 1 decode worker.\n")
print("| requests | n | TTFT p50 / p95 ms | prompt cached % | KV bytes shipped per request (mean) |")
print("|---|---|---|---|---|")
for name, row, kv in [("cold (prefix first seen)", wc["cold"], cold_bytes), ("warm", wc["warm"], warm_bytes)]:
    print(f"| {name} | {row['requests']} | {p(row, 'ttft_ms', 'p50')} / {p(row, 'ttft_ms', 'p95')} | "
          f"{row['cached_fraction'] * 100:.0f} | {mean(kv):,.0f} |")
allnc = overall(nc)
print(f"| --no-prefix-cache (all) | {allnc['requests']} | {p(allnc, 'ttft_ms', 'p50')} / {p(allnc, 'ttft_ms', 'p95')} | "
      f"0 | {mean(plain_bytes):,.0f} |")
ratio = wc["cold"]["ttft_ms"]["p50"] / wc["warm"]["ttft_ms"]["p50"]
print(f"\nWarm TTFT p50 is **{ratio:.1f}x** lower than cold (target >= 5x); a warm request ships "
      f"**{mean(warm_bytes) / mean(cold_bytes) * 100:.1f}%** of a cold one's KV bytes (target <= 10%).\n")

# 2. routing
print("## 2. Routing: 2 decode workers, 2 prefixes, 2 clients\n")
print("A request *lands on a holder* when the decode worker it went to already held all of its prefix's")
print(f"whole blocks ({PREFIX_BLOCKS_TOKENS} tokens, from the router's record `decode_cached_tokens`); the")
print("first request of each prefix cannot (2 of them).\n")
print("| router | requests | landed on a holder | per decode worker | KV MB shipped | TTFT p50 / p95 ms |")
print("|---|---|---|---|---|---|")
for run, label in [("routing-w2", "cache-aware (--prefix-weight 2)"), ("routing-w0", "cache-blind (--prefix-weight 0)"),
                   ("hot", "cache-aware, hot prefix (90%), 4 clients")]:
    recs = records(run)
    hits = sum(1 for r in recs if r.get("decode_cached_tokens", 0) >= PREFIX_BLOCKS_TOKENS)
    eligible = max(len(recs) - 2, 1)
    workers = {}
    for r in recs:
        workers[r["decode_worker"]] = workers.get(r["decode_worker"], 0) + 1
    per = " / ".join(str(n) for _, n in sorted(workers.items()))
    row = overall(rows(run))
    mb = sum(r["kv_bytes"] for r in recs) / 1e6
    print(f"| {label} | {len(recs)} | {hits}/{eligible} = {hits / eligible * 100:.0f}% | {per} | {mb:.0f} | "
          f"{p(row, 'ttft_ms', 'p50')} / {p(row, 'ttft_ms', 'p95')} |")
