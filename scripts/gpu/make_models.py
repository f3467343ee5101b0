"""Random-weight Llama checkpoints in real shapes, written as Hugging Face folders that
pd-engine loads (config.json, tokenizer.json, model.safetensors): the shapes decide the
speed, not the values. Runs on the GPU machine with its PyTorch (scripts/gpu-check.sh).

usage: python3 make_models.py OUT_DIR NAME [NAME ...]   (names: llama-3.2-1b, llama-3.1-8b)
"""

import json
import os
import sys
import time

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

GEOMETRY = {
    # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
}


def write(out_dir, name):
    hidden, inter, layers, heads, kv_heads, vocab, tied = GEOMETRY[name]
    head_dim = hidden // heads
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not tied:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    # A word-level tokenizer over the whole vocabulary: the benchmark feeds token ids.
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    params = sum(t.numel() for t in tensors.values())
    print(f"{name}: {params / 1e9:.2f} B parameters written in {time.time() - start:.0f} s", flush=True)
    return folder


if __name__ == "__main__":
    for n in sys.argv[2:]:
        write(sys.argv[1], n)
