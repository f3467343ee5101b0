#!/usr/bin/env python3
"""Writes a GGUF model of a realistic geometry with random weights, for speed comparisons
(pd-engine-bench against llama.cpp's llama-bench / llama-batched-bench on the same file:
PD_MODEL=target/bench-models/llama-3.2-1b.q4_1.gguf bench/engine-vs-llamacpp.sh).
The output is noise; only its shapes and storage types are meant to match the real model.

    random_gguf.py PRESET TYPE OUT.gguf [--untied | --tied] [--embd-type T] [--layers N] [--seed S]

  PRESET  llama-3.2-1b  hidden 2048, 16 layers, 32 heads / 8 KV heads of 64, FFN 8192,
                        rope theta 500000, tied embeddings (arch `llama`)
          qwen3-0.6b    hidden 1024, 28 layers, 16 heads / 8 KV heads of 128, FFN 3072,
                        rope theta 1e6, q/k RMS norms, tied embeddings (arch `qwen3`)
  TYPE    q8_0 | q4_1   type of every 2-D weight matrix (gguf.quants.quantize); norms are f32.
                        token_embd is quantized too (by default to TYPE; --embd-type q8_0|q4_1|f16
                        picks another: llama.cpp's own Q4_1 files often keep it at Q8_0 or Q6_K).
  --untied / --tied     write a separate output.weight (same type as the other matrices) or
                        reuse token_embd as the output projection; default: the preset's.
  --layers N            fewer (or more) blocks than the preset, e.g. for a quick check.

Vocabulary: the tokenizer (every `tokenizer.ggml.*` key, and the chat template) is copied
from the SmolLM2-135M GGUF in models/ (scripts/fetch-model.sh), so both llama.cpp and pd
accept the file. Its vocabulary is 49152 tokens, so token_embd (and output) have 49152 rows
instead of the real models' 128256 (Llama 3.2) or 151936 (Qwen3): the output projection
costs less than in the real model (about 100M instead of 263M weights for Llama 3.2 1B).
Llama 3.2's `rope_freqs` (llama3 rope scaling) is left out: it changes no shape or cost.

Weights are normal with std 0.02 from a fixed seed (norm weights are 1); tensors are
generated, quantized and written one at a time, in row chunks, so memory stays bounded
(a few hundred MB). Needs numpy and the `gguf` package (target/refenv/bin/python has both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf.quants import quant_shape_to_byte_shape, quantize

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_SOURCE = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152

PRESETS = {
    "llama-3.2-1b": dict(
        arch="llama", name="Llama 3.2 1B geometry (random weights)", hidden=2048, layers=16, heads=32,
        kv_heads=8, head_dim=64, ffn=8192, rope_theta=500000.0, rms_eps=1e-5, context=131072, tied=True,
        qk_norm=False,
    ),
    "qwen3-0.6b": dict(
        arch="qwen3", name="Qwen3 0.6B geometry (random weights)", hidden=1024, layers=28, heads=16,
        kv_heads=8, head_dim=128, ffn=3072, rope_theta=1000000.0, rms_eps=1e-6, context=40960, tied=True,
        qk_norm=True,
    ),
}

QTYPES = {
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
}

CHUNK_VALUES = 16 * 1024 * 1024  # f32 values generated at a time (64 MB)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copies every tokenizer.* key of `source`; returns its vocabulary size."""
    if not source.is_file():
        sys.exit(f"random_gguf: tokenizer source {source} is missing (run scripts/fetch-model.sh)")
    reader = gguf.GGUFReader(source)
    n_tokens = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type)
        if key == "tokenizer.ggml.tokens":
            n_tokens = len(value)
    if n_tokens != VOCAB:
        sys.exit(f"random_gguf: {source} has {n_tokens} tokens, expected {VOCAB}")
    return n_tokens


def tensor_plan(p: dict, tied: bool, mat_type, embd_type) -> list[tuple[str, tuple[int, int] | tuple[int], object]]:
    """(name, numpy shape (rows, cols) or (n,), ggml type), in llama.cpp's converter order."""
    h, hd = p["hidden"], p["head_dim"]
    f32 = gguf.GGMLQuantizationType.F32
    plan = [("token_embd.weight", (VOCAB, h), embd_type)]
    for i in range(p["layers"]):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (h,), f32),
            (f"{b}.attn_q.weight", (p["heads"] * hd, h), mat_type),
            (f"{b}.attn_k.weight", (p["kv_heads"] * hd, h), mat_type),
            (f"{b}.attn_v.weight", (p["kv_heads"] * hd, h), mat_type),
            (f"{b}.attn_output.weight", (h, p["heads"] * hd), mat_type),
        ]
        if p["qk_norm"]:
            plan += [(f"{b}.attn_q_norm.weight", (hd,), f32), (f"{b}.attn_k_norm.weight", (hd,), f32)]
        plan += [
            (f"{b}.ffn_norm.weight", (h,), f32),
            (f"{b}.ffn_gate.weight", (p["ffn"], h), mat_type),
            (f"{b}.ffn_up.weight", (p["ffn"], h), mat_type),
            (f"{b}.ffn_down.weight", (h, p["ffn"]), mat_type),
        ]
    plan.append(("output_norm.weight", (h,), f32))
    if not tied:
        plan.append(("output.weight", (VOCAB, h), mat_type))
    return plan


def stored_shape(shape, qtype) -> tuple[tuple[int, ...], np.dtype]:
    if qtype == gguf.GGMLQuantizationType.F32:
        return shape, np.dtype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16)
    return quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8)


def make_tensor(rng: np.random.Generator, shape, qtype) -> np.ndarray:
    if len(shape) == 1:  # norm weights
        return np.ones(shape, dtype=np.float32)
    rows, cols = shape
    step = max(1, CHUNK_VALUES // cols)
    parts = []
    for r in range(0, rows, step):
        n = min(step, rows - r)
        x = rng.standard_normal((n, cols), dtype=np.float32)
        x *= np.float32(0.02)
        parts.append(quantize(x, qtype))
        del x
    return np.concatenate(parts, axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("type", choices=["q8_0", "q4_1"])
    ap.add_argument("out", type=Path)
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None)
    tie.add_argument("--untied", dest="tied", action="store_false")
    ap.add_argument("--embd-type", choices=sorted(QTYPES), default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", type=Path, default=TOKENIZER_SOURCE)
    args = ap.parse_args()

    p = dict(PRESETS[args.preset])
    if args.layers is not None:
        p["layers"] = args.layers
    tied = p["tied"] if args.tied is None else args.tied
    mat_type, file_type = QTYPES[args.type]
    embd_type = QTYPES[args.embd_type or args.type][0]
    arch = p["arch"]

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_type("model")
    writer.add_name(p["name"])
    writer.add_context_length(p["context"])
    writer.add_embedding_length(p["hidden"])
    writer.add_block_count(p["layers"])
    writer.add_feed_forward_length(p["ffn"])
    writer.add_head_count(p["heads"])
    writer.add_head_count_kv(p["kv_heads"])
    writer.add_layer_norm_rms_eps(p["rms_eps"])
    writer.add_rope_freq_base(p["rope_theta"])
    writer.add_rope_dimension_count(p["head_dim"])
    if p["head_dim"] * p["heads"] != p["hidden"]:  # Qwen3: heads wider than hidden / heads
        writer.add_key_length(p["head_dim"])
        writer.add_value_length(p["head_dim"])
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_tokenizer(writer, args.tokenizer_from)

    plan = tensor_plan(p, tied, mat_type, embd_type)
    for name, shape, qtype in plan:
        sshape, sdtype = stored_shape(shape, qtype)
        nbytes = int(np.prod(sshape)) * sdtype.itemsize
        writer.add_tensor_info(name, sshape, sdtype, nbytes, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    n_params = 0
    for i, (name, shape, qtype) in enumerate(plan):
        data = make_tensor(rng, shape, qtype)
        writer.write_tensor_data(data)
        n_params += int(np.prod(shape))
        if name.endswith("ffn_down.weight") or i == len(plan) - 1:
            print(f"  {name} ({i + 1}/{len(plan)})", file=sys.stderr, flush=True)
    writer.close()
    tmp.replace(args.out)
    size = args.out.stat().st_size
    print(
        f"{args.out}: {args.preset} {args.type} ({'tied' if tied else 'untied'}, token_embd "
        f"{embd_type.name}), {p['layers']} layers, {n_params / 1e6:.0f}M params, {size / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
