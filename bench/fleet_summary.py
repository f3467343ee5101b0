#!/usr/bin/env python3
"""The tables of bench/fleet.sh from its runs: python3 bench/fleet_summary.py OUT (markdown on stdout)."""
import json
import os
import platform
import sys

out = sys.argv[1]


def summary(run):
    path = f"{out}/runs/{run}/summary.json"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def row(s, cls):
    if s is None:
        return None
    rows = [r for r in s["rows"] if r["class"] == cls]
    return next((r for r in rows if r["input_bucket"] == "all"), rows[0] if rows else None)


def q(r, metric, p):
    return None if r is None else r[metric].get(p)


def fmt(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def log_count(name, needle):
    path = f"{out}/logs/{name}"
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(needle in line for line in f)


cpu = "unknown CPU"
with open("/proc/cpuinfo") as f:
    for line in f:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
print("# Fleet runs: the real router against simulated workers\n")
machines = {}
for part in ["profile", "validate", "ucx", "scale", "goodput", "loss"]:
    path = f"{out}/runs/{part}.machine"
    if os.path.exists(path):
        with open(path) as f:
            machines.setdefault(f.read().strip(), []).append(part)
if len(machines) > 1:
    where = "; ".join(f"{', '.join(parts)} on {m}" for m, parts in machines.items())
    print(f"Command: `bench/fleet.sh`; the parts last ran on different machines: {where} ({platform.machine()}).")
else:
    print(f"Command: `bench/fleet.sh`; machine: {cpu}, {os.cpu_count()} cores ({platform.machine()}).")
print("Router on core 0; simulated workers and the load generator on core 1. Every run's pd-bench")
print("report is in `runs/`, process logs in `logs/`, the scenarios in `scenarios/`.\n")

cost_path = f"{out}/cost-cpu.json"
if os.path.exists(cost_path):
    with open(cost_path) as f:
        cost = json.load(f)
    m = cost["measured"]
    print("## 1. Cost model of the real workers (`pd-bench profile`, `cost-cpu.json`)\n")
    p, d, k = cost["prefill"], cost["decode"], cost["kv"]
    print(f"- prefill step: {p['fixed_ms']:.1f} ms + {p['per_token_ms']:.2f} ms/token + {p['per_pair_us']:.2f} us per token x context"
          f" + {p.get('per_prompt_ms', 0):.1f} ms per prompt starting "
          f"(largest error on the measured prompts {m['prefill_max_error'] * 100:.0f}%)")
    print(f"- decode step: {d['fixed_ms']:.1f} ms + {d['per_row_ms']:.2f} ms/row + {d['per_context_us']:.2f} us per token of context "
          f"(largest error on the measured cells {m['decode_max_error'] * 100:.0f}%)")
    if cost.get("wide"):
        w = cost["wide"]
        print(f"- a forward over more than {w['rows']} rows: +{w['extra_ms']:.1f} ms (the CPU engine's small-batch kernel ends there)")
    print(f"- KV: {k['bytes_per_token']:,} bytes/token, commit {k['commit_fixed_ms']:.2f} ms + {k['commit_ms_per_mb']:.3f} ms/MB\n")
    print("| prompt tokens | measured ms | model ms |\n|---|---|---|")
    for pt in m["prefill"]:
        print(f"| {pt['tokens']} | {pt['prefill_ms']:.0f} | {pt['predicted_ms']:.0f} |")
    print("\n| batch | context | measured step ms | model ms |\n|---|---|---|---|")
    for c in m["decode"]:
        print(f"| {c['batch']} | {c['context']} | {c['step_ms']:.1f} | {c['predicted_ms']:.1f} |")
    print()

real, simulated = summary("validate-real"), summary("validate-sim")
if real and simulated:
    print("## 2. Validation: the same traffic, real 1 + 1 cluster vs 1 + 1 simulated workers\n")
    print("Scenario `scenarios/validate.txt` (interactive 1.2 req/s Poisson + documents). Target: TTFT p95 and ITL p95 within 20%.\n")
    print("| class | metric | real | simulated | simulated / real | within 20% |\n|---|---|---|---|---|---|")
    for cls in ["interactive", "batch"]:
        a, b = row(real, cls), row(simulated, cls)
        for metric, p in [("ttft_ms", "p50"), ("ttft_ms", "p95"), ("itl_ms", "p50"), ("itl_ms", "p95")]:
            x, y = q(a, metric, p), q(b, metric, p)
            ratio = y / x if x and y else None
            ok = "" if ratio is None or p != "p95" else ("yes" if abs(ratio - 1) <= 0.2 else "**no**")
            print(f"| {cls} | {metric[:-3].upper()} {p} | {fmt(x)} | {fmt(y)} | {fmt(ratio, 2)} | {ok} |")
    print()

ucx_kv = f"{out}/runs/ucx-kv.txt"
grpc_run, ucx_run = summary("validate-sim-grpc"), summary("validate-sim-ucx")
if os.path.exists(ucx_kv) and grpc_run and ucx_run:
    print("## 2b. KV over UCX in the simulated fleet\n")
    print("The validate traffic on 1 + 1 simulated workers, once with KV over gRPC (header and commit only, the cost")
    print("model's hand-off time) and once over UCX (`--kv-transport ucx`: every frame of the modelled 23,040 bytes")
    print("per token moved through the real UCX receiver and registry on loopback, committed no earlier than the")
    print("modelled time). Hand-off: the prefill worker's `kv_commit_ms` as the router logs it. Both simulated")
    print("workers, their UCX receiver thread and the load generator share one core, which is where UCX's tail comes from.\n")
    print("| KV over | requests | hand-off p50 / p95 / max ms | interactive TTFT p50 / p95 ms | interactive ITL p95 ms | pd-sim-worker's count |")
    print("|---|---|---|---|---|---|")
    with open(ucx_kv) as f:
        for line in f:
            head, count = line.split(" | ", 1)
            kv = dict(x.split("=") for x in head.split())
            r = row(grpc_run if kv["transport"] == "grpc" else ucx_run, "interactive")
            print(f"| {kv['transport']} | {kv['requests']} | {kv['kv_ms_p50']} / {kv['kv_ms_p95']} / {kv['kv_ms_max']} | "
                  f"{fmt(q(r, 'ttft_ms', 'p50'))} / {fmt(q(r, 'ttft_ms', 'p95'))} | {fmt(q(r, 'itl_ms', 'p95'))} | {count.strip()} |")
    print()

scale_cpu = {}
if os.path.exists(f"{out}/runs/scale-cpu.txt"):
    with open(f"{out}/runs/scale-cpu.txt") as f:
        for line in f:
            kv = dict(x.split("=") for x in line.split())
            scale_cpu[int(kv["workers"])] = kv
if scale_cpu:
    sizes = sorted(scale_cpu)
    named = ", ".join(str(n) for n in sizes[:-1]) + (" and " if len(sizes) > 1 else "") + str(sizes[-1])
    print(f"## 3. Scale: the router with {named} simulated workers (`cost-fast.json`)\n")
    print("Open loop at 100 req/s for 20 s (`scenarios/scale.txt`), 32-64 prompt tokens, 16 output tokens; a")
    print("simulated prefill step takes 1 ms and a decode step 5 ms, so the client's TTFT is the router's path")
    print("(HTTP in, decode reservation, prefill call, KV header and commit between the simulated workers,")
    print("first token out) plus 1 ms. Router CPU per request is its CPU time during the run / requests; idle")
    print("CPU is its background work (a load query to every worker every 100 ms on the `LoadStream` it keeps open to each, or less often with more than 200 workers: `--max-load-calls-per-s`).\n")
    print("| workers | requests | errors | client TTFT p50 / p99 ms | ITL p50 / p99 ms | router CPU ms per request | router CPU idle |")
    print("|---|---|---|---|---|---|---|")
    for n in sorted(scale_cpu):
        r = row(summary(f"scale-{n}"), "interactive")
        if r is None:
            continue
        per_req = float(scale_cpu[n]["run_cpu_s"]) * 1e3 / max(r["requests"], 1)
        idle = float(scale_cpu[n]["idle_cpu_s_per_s"]) * 100
        print(f"| {n} | {r['requests']} | {r['errors']} | {fmt(q(r, 'ttft_ms', 'p50'))} / {fmt(q(r, 'ttft_ms', 'p99'))} | "
              f"{fmt(q(r, 'itl_ms', 'p50'))} / {fmt(q(r, 'itl_ms', 'p99'))} | {per_req:.2f} | {idle:.1f}% of a core |")
    print("\nClosed loop, 64 clients (`scenarios/scale-closed.txt`), the load generator on the other core:\n")
    print("| workers | requests/s completed | requests | errors | client TTFT p50 / p99 ms | router CPU ms per request |")
    print("|---|---|---|---|---|---|")
    for n in sorted(scale_cpu):
        s = summary(f"scale-closed-{n}")
        r = row(s, "interactive")
        if r is None:
            continue
        rps = (r["requests"] - r["errors"]) / s["duration_s"]
        closed = scale_cpu[n].get("closed_cpu_s")
        per_req = "-" if closed is None else f"{float(closed) * 1e3 / max(r['requests'], 1):.3f}"
        print(f"| {n} | **{rps:,.0f}** | {r['requests']} | {r['errors']} | {fmt(q(r, 'ttft_ms', 'p50'))} / "
              f"{fmt(q(r, 'ttft_ms', 'p99'))} | {per_req} |")
    print("\nThese figures move with the machine and its neighbours by more than most changes do; router")
    print("binaries are compared before and after in `router-cpu.md`, alternating on one machine.")
    print()

dis, col, planned = summary("goodput-disagg"), summary("goodput-colocated"), summary("goodput-planned")
split = "as planned"
if os.path.exists(f"{out}/plan-goodput/plan.json"):
    with open(f"{out}/plan-goodput/plan.json") as f:
        gp = json.load(f)
    n, d = gp["prefill"]["serving"], gp["decode"]["serving"]
    np_ = min(7, max(1, round(8 * n / (n + d))))
    split = f"{np_} + {8 - np_} as planned"
if dis and col:
    print("## 4. Goodput at fixed SLOs: 8 simulated CPU workers split 4 + 4, split as the plan says, or colocated\n")
    print("Scenario `scenarios/goodput.txt`: interactive 6 req/s (TTFT p95 1.5 s, ITL p95 100 ms) + documents of")
    print("1,500-2,000 tokens at 0.3 req/s (the batch class, which the router defers behind interactive work).")
    print("Goodput: requests/s that met both SLOs.\n")
    print("| fleet | class | requests | errors | TTFT p95 ms | ITL p95 / p99 / max ms | goodput req/s |\n|---|---|---|---|---|---|---|")
    for name, s in [("disaggregated 4 + 4", dis), (f"disaggregated {split}", planned), ("colocated 8", col)]:
        for cls in ["interactive", "batch"]:
            r = row(s, cls)
            if r:
                print(f"| {name} | {cls} | {r['requests']} | {r['errors']} | {fmt(q(r, 'ttft_ms', 'p95'))} | "
                      f"{fmt(q(r, 'itl_ms', 'p95'))} / {fmt(q(r, 'itl_ms', 'p99'))} / {fmt(q(r, 'itl_ms', 'max'))} | "
                      f"{fmt(r.get('goodput_rps'), 2)} |")
    b = row(col, "interactive")
    for name, s in [("4 + 4", dis), (split, planned)]:
        a = row(s, "interactive")
        if a and b and b.get("goodput_rps"):
            print(f"\nInteractive goodput, disaggregated {name} / colocated: **{a['goodput_rps'] / b['goodput_rps']:.2f}x**.")
    if os.path.exists(f"{out}/plan-goodput/plan.json"):
        with open(f"{out}/plan-goodput/plan.json") as f:
            gp = json.load(f)
        print(f"\n`pd-bench plan` on the 4 + 4 run's load test (no spare, no growth; `plan-goodput/plan.md`): "
              f"{gp['prefill']['serving']} prefill + {gp['decode']['serving']} decode workers serve this traffic "
              f"(prefill {gp['prefill']['peak']:.2f} workers busy at the peak, planned at 0.7 each; decode "
              f"{gp['batch']['peak_sequences']:.0f} sequences at the p95 over time, planned at 0.8 of a "
              f"{gp['batch']['planned']}-row batch each); the 8 workers are split in that proportion.")
    print()

loss = summary("loss")
if loss:
    print("## 5. Loss of one decode worker in a 64 + 64 fleet\n")
    print("Scenario `scenarios/loss.txt` (interactive 50 req/s + documents 2 req/s, 60 s); decode worker 0 is lost")
    print("30 s in (its streams end unfinished, every call to it is UNAVAILABLE).\n")
    print("| class | requests | errors | TTFT p95 ms | ITL p95 ms | ITL max ms |\n|---|---|---|---|---|---|")
    for cls in ["interactive", "batch"]:
        r = row(loss, cls)
        if r:
            print(f"| {cls} | {r['requests']} | {r['errors']} | {fmt(q(r, 'ttft_ms', 'p95'))} | {fmt(q(r, 'itl_ms', 'p95'))} | "
                  f"{fmt(q(r, 'itl_ms', 'max'))} |")
    migrated = log_count("loss-router.log", "migrat")
    print(f"\nRouter log lines about migration: {migrated}. The capacity plan of this load test (10 s windows, "
          "cost-cpu.json, scale-out 30 s) is `plan-loss/plan.md`.\n")

if os.path.exists(f"{out}/virtual.md"):
    print("## 6. Virtual time\n")
    print("Every run above again in virtual time (`pd-bench simulate`: the router's own scheduler and the workers' "
          "planners in one thread, no processes), compared run by run; the capacity plans replayed on the fleets "
          "they size; an hour of traffic on 1,000 workers: `virtual.md`.\n")
