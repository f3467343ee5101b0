"""pd's log probabilities against Hugging Face transformers' on the same GGUF file (dequantized
by transformers' GGUF loader, run in f32 on CPU): each prompt scored with `echo` + `logprobs`
through a running pd cluster, and the first greedy tokens' logprobs of a normal completion,
compared position by position with transformers' log-softmax. Run by hand (torch is not a CI
dependency):

  python3 -m venv target/refenv && target/refenv/bin/pip install torch transformers gguf accelerate
  target/refenv/bin/python scripts/reference/logprobs_vs_transformers.py http://127.0.0.1:8080 MODEL.gguf
"""

import json
import sys
import urllib.request

import torch
from transformers import AutoModelForCausalLM

router, gguf = sys.argv[1].rstrip("/"), sys.argv[2]
folder, name = gguf.rsplit("/", 1)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived",
]


def post(path, body):
    req = urllib.request.Request(router + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def reference(tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


worst_prompt, worst_greedy = 0.0, 0.0
for prompt in PROMPTS:
    ids = post("/tokenize", {"prompt": prompt})["tokens"]
    scored = post("/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
    ours = scored["choices"][0]["logprobs"]["token_logprobs"][1:]
    ref = reference(ids)
    theirs = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    worst_prompt = max(worst_prompt, diff)
    gen = post("/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    out = gen["choices"][0]["logprobs"]
    gen_ids = post("/tokenize", {"prompt": gen["choices"][0]["text"]})["tokens"]
    ref = reference(ids + gen_ids)
    top1 = [ref[len(ids) - 1 + i].max().item() for i in range(len(out["token_logprobs"]))]
    gdiff = max(abs(a - b) for a, b in zip(out["token_logprobs"], top1))
    worst_greedy = max(worst_greedy, gdiff)
    print(f"{prompt!r}: prompt tokens max |diff| {diff:.4f}; greedy top-1 logprobs max |diff| {gdiff:.4f}")
print(f"worst: prompt scoring {worst_prompt:.4f}, greedy top-1 {worst_greedy:.4f} (target 0.05)")
