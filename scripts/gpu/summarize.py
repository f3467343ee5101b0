"""Reads pd-engine-bench tables written by scripts/gpu-check.sh and sets each number against
the H200's physical limits: decode at batch 1 as a fraction of (weight + KV bytes) / HBM
bandwidth, prefill as a fraction of dense half-precision peak FLOP/s.

usage: python3 summarize.py MODELS_DIR BENCH.md [BENCH.md ...]  (file names: bench-<model>.md)
"""

import json
import os
import re
import sys

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
PEAK_FLOPS = 989e12  # dense bf16/f16 tensor cores, H100/H200 SXM datasheet


def geometry(folder):
    c = json.load(open(os.path.join(folder, "config.json")))
    h, i, n, heads, kvh = (c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads"))
    hd = c.get("head_dim") or h // heads
    per_layer = h * heads * hd + 2 * h * kvh * hd + heads * hd * h + 3 * h * i
    matmul_params = n * per_layer + c["vocab_size"] * h  # projections + lm_head
    return matmul_params, n, kvh * hd, heads * hd


def main():
    models_dir = sys.argv[1]
    print("| model | measurement | value | physical limit | fraction |")
    print("|---|---|---|---|---|")
    for path in sys.argv[2:]:
        name = os.path.basename(path)[len("bench-"):-len(".md")]
        params, layers, kv_width, q_width = geometry(os.path.join(models_dir, name))
        text = open(path).read()
        for m in re.finditer(r"\| prefill (\d+) tokens \(chunk \d+\) \| (\d+) tok/s", text):
            n, tps = int(m.group(1)), float(m.group(2))
            # 2 FLOP per weight per token, plus causal attention (QK^T and PV: 2 * 2 * n^2/2 * q_width).
            flops = 2 * params * n + 2 * layers * n * n * q_width
            achieved = flops * tps / n
            print(f"| {name} | prefill {n} tokens | {tps:,.0f} tok/s | {PEAK_FLOPS / 1e12:.0f} TFLOP/s f16 |"
                  f" {achieved / PEAK_FLOPS:.1%} ({achieved / 1e12:.0f} TFLOP/s) |")
        for m in re.finditer(r"\| decode batch (\d+) at (\d+) context \| ([\d.]+) ms/step", text):
            b, ctx, ms = int(m.group(1)), int(m.group(2)), float(m.group(3))
            bytes_per_step = 2 * params + b * (ctx + 1) * layers * 2 * kv_width * 2  # f16 weights, f16 KV
            ideal_ms = bytes_per_step / HBM_BYTES_PER_S * 1e3
            print(f"| {name} | decode batch {b}, {ctx} context | {ms:.2f} ms/step ({b * 1e3 / ms:,.0f} tok/s) |"
                  f" {ideal_ms:.2f} ms ({bytes_per_step / 1e9:.2f} GB at 4.8 TB/s) | {ideal_ms / ms:.1%} |")
        for m in re.finditer(r"\| KV export / import (F16|F32), (\d+) tokens \(([\d.]+) MB\) \| ([\d.]+) / ([\d.]+) GB/s", text):
            print(f"| {name} | KV export / import {m.group(1)}, {m.group(2)} tokens ({m.group(3)} MB) |"
                  f" {m.group(4)} / {m.group(5)} GB/s | PCIe 5.0 x16 ~55 GB/s | {float(m.group(4)) / 55:.0%} / {float(m.group(5)) / 55:.0%} |")


if __name__ == "__main__":
    main()
