#!/usr/bin/env python3
"""The acceptance table of bench/slo.sh from its runs' summary.json and requests.json:
python3 bench/slo_summary.py OUT CAPACITY RATE (markdown on stdout)."""
import json
import sys

out, capacity, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])


def load(run):
    with open(f"{out}/runs/{run}/summary.json") as f:
        summary = json.load(f)
    with open(f"{out}/runs/{run}/requests.json") as f:
        requests = json.load(f)
    return summary, requests


def row(summary, cls):
    for r in summary["rows"]:
        if r["class"] == cls and r["input_bucket"] == "all":
            return r
    for r in summary["rows"]:  # a class with one input bucket has no "all" row
        if r["class"] == cls:
            return r
    return None


def ratio(a, b):
    return a / b if a is not None and b else float("nan")


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


base, _ = load("interference-base")
docs, docs_requests = load("interference-docs")
b, d = row(base, "interactive"), row(docs, "interactive")
doc = row(docs, "batch")
checks = [
    ("interactive ITL p95", d["itl_ms"]["p95"], b["itl_ms"]["p95"], "<= 1.10", lambda r: r <= 1.10),
    ("interactive ITL p99", d["itl_ms"]["p99"], b["itl_ms"]["p99"], "<= 1.5", lambda r: r <= 1.5),
    ("interactive TTFT p95", d["ttft_ms"]["p95"], b["ttft_ms"]["p95"], "<= 1.25", lambda r: r <= 1.25),
    ("interactive output tok/s", d["output_tokens_per_s"], b["output_tokens_per_s"], ">= 0.9", lambda r: r >= 0.9),
]
print("## 1. Interference (one configuration: deploy/local/up.sh defaults)\n")
print("| metric | with documents | without | ratio | target | met |\n|---|---|---|---|---|---|")
for name, with_docs, without, target, ok in checks:
    r = ratio(with_docs, without)
    print(f"| {name} | {fmt(with_docs)} | {fmt(without)} | {r:.2f} | {target} | {'yes' if ok(r) else 'no'} |")
doc_done = [r for r in docs_requests if r["class"] == "batch" and r["error"] is None and r["token_ms"]]
doc_ttft = sorted(r["token_ms"][0] - r["sent_ms"] for r in doc_done)
print(f"\nDocuments (batch class): {doc['requests']} sent, {len(doc_done)} completed, "
      f"TTFT {', '.join(f'{t:.0f}' for t in doc_ttft)} ms.\n")

over, over_requests = load("overload")
oi, ob = row(over, "interactive"), row(over, "batch")
refused = [r for r in over_requests if r.get("status") == 429]
refused_i = [r for r in refused if r["class"] == "interactive"]
latency = sorted(r["end_ms"] - r["sent_ms"] for r in refused if r.get("end_ms") is not None)
with_retry = sum(1 for r in refused if r.get("retry_after_s"))
other_errors = [r for r in over_requests if r["error"] is not None and r.get("status") != 429]
batch_all = [r for r in over_requests if r["class"] == "batch"]
batch_ok = [r for r in batch_all if r["error"] is None and r["token_ms"]]
batch_429 = [r for r in batch_all if r.get("status") == 429]
print(f"## 2-3. Overload: 3 x {capacity:.2f} req/s capacity = {rate:.2f} interactive req/s, plus batch\n")
print("| metric | value | target | met |\n|---|---|---|---|")
ttft95 = oi["ttft_ms"]["p95"]
print(f"| admitted interactive TTFT p95 ms | {fmt(ttft95, 0)} | <= 1500 (class SLO) | "
      f"{'yes' if ttft95 is not None and ttft95 <= 1500 else 'no'} |")
print(f"| interactive sent / completed / 429 | {oi['requests']} / {oi['requests'] - oi['errors']} / {len(refused_i)} | | |")
lat_max = latency[-1] if latency else None
lat_p99 = latency[int(0.99 * (len(latency) - 1))] if latency else None
late = [t for t in latency if t > 100]
print(f"| 429 answer time p99 / max ms | {fmt(lat_p99)} / {fmt(lat_max)} | <= 100 | "
      f"{'yes' if lat_max is not None and lat_max <= 100 else 'no'} |")
print(f"| 429s later than 100 ms (queue age expired) | {len(late)} of {len(latency)} | 0 | {'yes' if not late else 'no'} |")
print(f"| 429s with Retry-After | {with_retry} of {len(refused)} | all | {'yes' if with_retry == len(refused) else 'no'} |")
print(f"| errors other than 429 | {len(other_errors)} | 0 | {'yes' if not other_errors else 'no'} |")
print(f"| batch sent / completed / 429 | {len(batch_all)} / {len(batch_ok)} / {len(batch_429)} | none lost | "
      f"{'yes' if len(batch_ok) + len(batch_429) == len(batch_all) else 'no'} |")
try:
    with open(f"{out}/runs/overload/peak-rss.txt") as f:
        rss = "; ".join(line.strip() for line in f if line.strip())
except OSError:
    rss = "-"
print(f"| peak RSS | {rss} | bounded | |")

colo, _ = load("colocated-docs")
ci = row(colo, "interactive")
g_disagg, g_colo = d["goodput_rps"], ci["goodput_rps"]
print("\n## 4. Goodput at fixed SLOs (interactive: TTFT p95 1000 ms, ITL p95 100 ms; same load)\n")
print("| setup | interactive goodput req/s | interactive TTFT p95 ms | ITL p95 ms | tok/s |\n|---|---|---|---|---|")
print(f"| disaggregated (up.sh) | {g_disagg:.3f} | {fmt(d['ttft_ms']['p95'], 0)} | {fmt(d['itl_ms']['p95'])} | {fmt(d['output_tokens_per_s'])} |")
print(f"| colocated (1 decode worker, 2 threads) | {g_colo:.3f} | {fmt(ci['ttft_ms']['p95'], 0)} | {fmt(ci['itl_ms']['p95'])} | {fmt(ci['output_tokens_per_s'])} |")
print(f"\nRatio disaggregated / colocated: {ratio(g_disagg, g_colo):.2f} (goal >= 1.5).")
