"""llama.cpp's log probabilities for a GGUF file, written as a JSON fixture that pd's logprobs can
be checked against: for each prompt (fixed token ids, so no tokenizer can differ), the log-softmax
of every prompt token given the ones before it, and the first 8 greedy tokens with their top-1
logprobs (the prompt evaluated in one batch, then each greedy token fed back one at a time).
Log-softmax is taken in float64 over llama.cpp's f32 logits (`Llama.scores[i]`, the logits after
token i, kept for every position by `logits_all=True`). No BOS is prepended, as pd adds none.
The prompt ids are those of SmolLM2's tokenizer (llama.cpp's own, `add_bos=False`, and the
transformers tokenizer built from the same GGUF agree); the script checks llama.cpp still gives
them. Run by hand (llama-cpp-python builds llama.cpp from source, ~10 minutes on one core):

  python3 -m venv target/llamaenv && target/llamaenv/bin/pip install cmake ninja numpy
  PATH=$PWD/target/llamaenv/bin:$PATH CMAKE_BUILD_PARALLEL_LEVEL=1 \
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" target/llamaenv/bin/pip install llama-cpp-python==0.3.36
  target/llamaenv/bin/python scripts/reference/llamacpp_logprobs.py \
    models/SmolLM2-135M-Instruct.Q4_1.gguf tests/fixtures/llamacpp_logprobs.json
"""

import json
import os
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

gguf, out = sys.argv[1], sys.argv[2]
N_THREADS = 1
GREEDY_STEPS = 8
# SmolLM2 token ids of each text, no BOS.
PROMPTS = [
    ("The capital of France is", [504, 3575, 282, 4649, 314]),
    ("Water boils at a temperature of", [12615, 36411, 418, 253, 2779, 282]),
    (
        "Once upon a time, in a small village by the sea, there lived",
        [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161],
    ),
]

llm = Llama(model_path=gguf, logits_all=True, n_ctx=512, n_threads=N_THREADS, verbose=False, seed=0)


def log_softmax(row):
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def r6(x):
    return round(float(x), 6)


fixture = {
    "llama_cpp_python_version": llama_cpp.__version__,
    "model_file": os.path.basename(gguf),
    "n_threads": N_THREADS,
    "n_ctx": 512,
    "bos_added": False,
    "prompts": [],
}
for text, ids in PROMPTS:
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
    llm.reset()
    llm.eval(ids)
    assert llm.n_tokens == len(ids)
    # scores[i - 1] holds the logits after prompt token i - 1: the distribution of token i.
    prompt_lp = [r6(log_softmax(llm.scores[i - 1])[ids[i]]) for i in range(1, len(ids))]
    greedy_ids, greedy_lp = [], []
    for _ in range(GREEDY_STEPS):
        lp = log_softmax(llm.scores[llm.n_tokens - 1])
        tok = int(np.argmax(lp))
        greedy_ids.append(tok)
        greedy_lp.append(r6(lp[tok]))
        llm.eval([tok])
    fixture["prompts"].append(
        {
            "text": text,
            "prompt_ids": ids,
            "prompt_logprobs": prompt_lp,
            "greedy_ids": greedy_ids,
            "greedy_text": llm.detokenize(greedy_ids).decode("utf-8", "replace"),
            "greedy_logprobs": greedy_lp,
        }
    )
    print(f"{text!r} -> {fixture['prompts'][-1]['greedy_text']!r} {greedy_ids}")

os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
with open(out, "w") as f:
    json.dump(fixture, f, indent=1)
    f.write("\n")
