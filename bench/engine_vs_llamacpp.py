"""Summary table of bench/engine-vs-llamacpp.sh: llama.cpp's llama-bench / llama-batched-bench
against pd-engine-bench for each weight format, as tok/s with ratios (pd / llama.cpp: above 1
means pd is faster).
  python3 bench/engine_vs_llamacpp.py OUT_DIR FORMAT..."""
import json
import re
import sys

out, formats = sys.argv[1], sys.argv[2:]


def llama():
    cells = {}
    for name in ("llamacpp-prefill.json", "llamacpp-decode.json"):
        for r in json.load(open(f"{out}/{name}")):
            if r["n_gen"] == 0:
                cells[f"prefill {r['n_prompt']}"] = r["avg_ts"]
            else:
                cells[f"decode batch 1 at {r['n_depth']}"] = r["avg_ts"]
    for line in open(f"{out}/llamacpp-batched.jsonl"):
        r = json.loads(line)
        cells[f"batched decode {r['pl']} at {r['pp']}"] = r["speed_tg"]
    return cells


def pd(fmt):
    cells = {}
    for line in open(f"{out}/pd-{fmt}.md"):
        m = re.match(r"\| prefill (\d+) tokens .*\| ([\d.]+) tok/s", line)
        if m:
            cells[f"prefill {m[1]}"] = float(m[2])
        m = re.match(r"\| decode batch (\d+) at (\d+) context \| .*, ([\d.]+) tok/s", line)
        if m:
            cells[f"batched decode {m[1]} at {m[2]}"] = float(m[3])
            if m[1] == "1":
                cells[f"decode batch 1 at {m[2]}"] = float(m[3])
    return cells


ll = llama()
pds = {f: pd(f) for f in formats}
head = "| cell (tok/s) | llama.cpp | " + " | ".join(f"pd {f} | ratio" for f in formats) + " |"
print(head)
print("|---" * (2 + 2 * len(formats)) + "|")
def order(cell):
    words = cell.split()
    return (words[0] != "prefill", words[0] == "batched", [int(w) for w in words if w.isdigit()])


for cell in sorted(ll, key=order):
    row = [cell, f"{ll[cell]:.1f}"]
    for f in formats:
        v = pds[f].get(cell)
        row += [f"{v:.1f}" if v else "-", f"{v / ll[cell]:.2f}" if v else "-"]
    print("| " + " | ".join(row) + " |")
print()
for f in formats:
    c = pds[f]
    b1, b16 = c.get("batched decode 1 at 512"), c.get("batched decode 16 at 512")
    l16 = ll.get("batched decode 16 at 512")
    if b1 and b16 and l16:
        print(f"- pd {f}: batch 16 = {b16 / l16:.2f}x llama.cpp's batch 16 (target 2x), {b16 / b1:.2f}x its own batch 1 (target 4x); "
              f"batch 1 at 512 context {1000 / b1:.2f} ms/token vs llama.cpp {1000 / ll['decode batch 1 at 512']:.2f}.")
