"""Tiny random checkpoints of each model family the engine serves, made by Hugging Face
transformers, with transformers' own logits and greedy tokens as the reference pd is tested
against (engine/tests/families.rs). Run by hand when a family is added (torch is not a CI
dependency); the outputs are small and committed:

  python3 -m venv target/refenv && target/refenv/bin/pip install torch transformers gguf safetensors
  target/refenv/bin/python scripts/reference/families.py engine/tests/data/families [CASE...]

Each case is a folder with config.json, model.safetensors (bf16: the weights are rounded to
bf16 once, and transformers computes in f32 from those values, as pd does) and
model.gguf for the families llama.cpp converts (written here with the `gguf` package in
llama.cpp's layout: tensor names, Q/K permuted for Llama, Llama 3.1's scaling as the
`rope_freqs` tensor; matrices f16, which holds these bf16 values exactly), and
reference.json: the prompt's token ids, 32 greedy tokens after it, and the logits (f32) at
every position of prompt + greedy tokens. Weights are drawn wider than transformers'
initialisation (std 0.02 gives near-uniform logits, where greedy tokens are ties) and every
norm weight and bias is random, so each part of the math shows in the output.
"""

import json
import os
import sys

import math
import zlib

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# Gemma 3's small text model, served from both of its checkpoint layouts.
GEMMA3 = {
    "tie_word_embeddings": True,
    "num_hidden_layers": 6,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 16,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "pad_token_id": 0,
}

QWEN3_MOE = {
    "head_dim": 32,
    "use_sliding_window": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "norm_topk_prob": True,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # Llama 3.1's scheme with the original context small enough that it changes most frequencies.
    "llama3-rope": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-yarn-rope": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "mistral": ("mistral", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": False}),
    # head_dim above hidden / heads, as in Qwen3-0.6B (1024 wide, 16 heads of 128).
    "qwen3": ("qwen3", {"head_dim": 32, "use_sliding_window": False}),
    # Phi-3 mini's layout (fused qkv_proj and gate_up_proj) with its sliding window above the
    # positions used (pd caps the context there).
    "phi3": ("phi3", {"sliding_window": 96, "pad_token_id": 0, "original_max_position_embeddings": 128}),
    # Gemma 2 with caps low enough to bite and a query scale other than head_dim.
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
            "sliding_window": 96,
            "pad_token_id": 0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    # Windows of 16 positions, well inside the 44 used, so that they bite: Mistral's and
    # Phi-3's on every layer, Gemma 2's on every other one. The Gemma cases below are tied
    # and scale queries by head_dim, as llama.cpp's GGUF files of Gemma (but 27B) assume;
    # their embeddings are drawn narrower (`EMBED_STD`), or the scaled, tied embedding of
    # the last token outweighs everything and greedy decoding repeats it.
    "mistral-window": ("mistral", {"sliding_window": 16, "head_dim": 16}),
    "phi3-window": ("phi3", {"sliding_window": 16, "pad_token_id": 0, "original_max_position_embeddings": 128}),
    # LongRoPE (Phi-3.5-mini, Phi-3 128k) past its original context: the 12-token prompt is
    # already longer than the original 8 positions, so transformers uses the long factors for
    # every position, as pd does for a model serving more than the original context.
    "phi3-longrope": (
        "phi3",
        {
            "sliding_window": 96,
            "pad_token_id": 0,
            "original_max_position_embeddings": 8,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
            },
        },
    ),
    # Phi-4-mini's layout: tied, 3/4 of each head rotating, LongRoPE within its original
    # context (the short factors), with an attention factor of its own.
    "phi4-mini": (
        "phi3",
        {
            "tie_word_embeddings": True,
            "sliding_window": 96,
            "pad_token_id": 0,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                "attention_factor": 1.2,
            },
        },
    ),
    # Qwen2 with use_sliding_window: layers from max_window_layers (1) on slide.
    "qwen2-window": (
        "qwen2",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    "gemma2-window": (
        "gemma2",
        {
            "tie_word_embeddings": True,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
            "sliding_window": 16,
            "pad_token_id": 0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    # Gemma 3: Q/K norms, sliding layers 0-4 on a rotary base of their own, the global layer
    # 5 with linear scaling (the pattern llama.cpp assumes for every Gemma 3 file), no
    # soft-capping.
    "gemma3": ("gemma3_text", GEMMA3),
    # Gemma 3's multimodal layout (Gemma3ForConditionalGeneration, as gemma-3-4b/12b/27b ship):
    # the same language model under `text_config`, written as the Hub's files are (only the
    # settings that differ from Gemma3TextConfig's defaults; tensors under transformers 4's
    # `language_model.model.*` names) beside a tiny vision tower pd does not run.
    "gemma3-multimodal": ("gemma3", GEMMA3),
    # Qwen3-MoE: 4 experts of width 48, 2 per token, the chosen weights renormalised (as every
    # Qwen3-MoE checkpoint sets); one file per expert matrix, as the Hub's files are.
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE),
    # Experts in every second layer only (`decoder_sparse_step`); the first keeps a dense MLP.
    "qwen3-moe-step": ("qwen3_moe", {**QWEN3_MOE, "decoder_sparse_step": 2, "norm_topk_prob": False}),
}

# Standard deviation of the embeddings drawn, where not 1.
EMBED_STD = {"gemma2-window": 0.05, "gemma3": 0.05, "gemma3-multimodal": 0.05, "phi4-mini": 0.5}

# GGUF architecture of each case llama.cpp converts (Mistral's files use llama's).
GGUF_ARCH = {
    "llama": "llama",
    "llama-tied": "llama",
    "llama3-rope": "llama",
    "llama-linear-rope": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "phi3-window": "phi3",
    "phi3-longrope": "phi3",
    "phi4-mini": "phi3",
    "gemma2-window": "gemma2",
    "gemma3": "gemma3",
    "qwen3-moe": "qwen3moe",
}

PROMPT = [1, 17, 99, 5, 64, 23, 88, 41, 7, 120, 33, 56]
GREEDY = 32


def randomise(model, seed, embed_std=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(1.5 * torch.randn(p.shape, generator=g) / fan_in**0.5)
            # Round once to bf16: the file holds exactly the values the reference computes with.
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def permute(w, heads):
    """llama.cpp's reordering of Llama's Q and K rows for interleaved rotary pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config, head_dim):
    """What llama.cpp's converter stores as `rope_freqs` for Llama 3.1's scaling."""
    p = config.rope_parameters
    base, factor = p["rope_theta"], p["factor"]
    low, high, old = p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, arch, config, model):
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope_params = c.rope_parameters.get("full_attention", c.rope_parameters)
    rotary_dim = int(head_dim * rope_params.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotary_dim)
    # Gemma 3 keys its rotary parameters by layer type; llama.cpp stores the global ones (and,
    # in newer files, the local base as `rope.freq_base_swa`).
    w.add_rope_freq_base(rope_params["rope_theta"])
    if arch == "gemma3":
        w.add_float32("gemma3.rope.freq_base_swa", c.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch in ("phi3", "gemma2", "gemma3") and c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
    rope = rope_params.get("rope_type", "default")
    if rope == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_params["factor"])
    tensors = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if rope == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c, head_dim))
    if rope == "longrope":
        # llama.cpp's Phi-3 converter: the factor lists as tensors, the original context and
        # the attention factor as metadata.
        original = rope_params["original_max_position_embeddings"]
        attention = rope_params.get("attention_factor")
        if attention is None:
            scale = c.max_position_embeddings / original
            attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(attention)
        w.add_tensor("rope_factors_long.weight", np.array(rope_params["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope_params["short_factor"], dtype=np.float32))
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        # Phi-3: fused, and llama.cpp names the fused gate/up `ffn_up`.
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
        # Qwen3-MoE (transformers keeps each layer's experts stacked, gate and up fused).
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
    }
    if arch.startswith("gemma"):
        names = {
            **names,
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        }
    for name, t in tensors.items():
        # llama.cpp stores Gemma's norms as the 1 + w they multiply by.
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1.0
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            layer, part = name.removeprefix("model.layers.").split(".", 1)
            if part == "mlp.experts.gate_up_proj":
                half = t.shape[1] // 2
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", t[:, :half].astype(np.float16))
                w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", t[:, half:].astype(np.float16))
                continue
            out = f"blk.{layer}.{names[part]}"
            if arch == "llama" and part == "self_attn.q_proj.weight":
                t = permute(t, c.num_attention_heads)
            if arch == "llama" and part == "self_attn.k_proj.weight":
                t = permute(t, c.num_key_value_heads)
        w.add_tensor(out, t.astype(np.float16) if t.ndim >= 2 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tokenizer(folder, vocab_size):
    """A word-level vocabulary `t0` ... `t{n-1}` (whitespace-separated), so the cluster can
    be driven with token ids and its text read back as ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(os.path.join(folder, "tokenizer.json"))


def multimodal_config(extra):
    """A Gemma3Config around the small text config, with a tiny SigLIP vision tower."""
    from transformers import Gemma3Config

    text = {**SMALL, **extra, "model_type": "gemma3_text"}
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


def as_hub_files(folder):
    """Rewrites a saved multimodal Gemma 3 the way the Hub's files are: text_config holding
    only what differs from Gemma3TextConfig's defaults, tensors under transformers 4's names."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3TextConfig

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    defaults = Gemma3TextConfig().to_dict()
    text = config["text_config"]
    kept = {k: v for k, v in text.items() if k not in defaults or defaults[k] != v or k == "model_type"}
    # transformers 4 wrote the scaling as `rope_scaling` and the local base on its own.
    rope = kept.pop("rope_parameters", None) or text["rope_parameters"]
    kept["rope_scaling"] = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    kept["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    if rope["full_attention"]["rope_theta"] != 1_000_000.0:
        kept["rope_theta"] = rope["full_attention"]["rope_theta"]
    kept.pop("layer_types", None)
    config["text_config"] = kept
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    renamed = {}
    for name, t in tensors.items():
        for new, old in [("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")]:
            if name.startswith(new):
                name = old + name[len(new):]
        renamed[name] = t
    save_file(renamed, file, metadata={"format": "pt"})


def main(out_dir, only=None):
    for name, (model_type, extra) in sorted(CASES.items()):
        if only and name not in only:
            continue
        # A seed of the case's own (adding a case leaves the others' fixtures as they are).
        seed = zlib.crc32(name.encode()) % 10_000
        if model_type == "gemma3":
            config = multimodal_config(extra)
        else:
            config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
        torch.manual_seed(seed)
        # Eager attention: the one transformers applies Gemma 2's soft-capping in.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
        randomise(model, 1000 + seed, EMBED_STD.get(name, 1.0))
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=GREEDY,
                min_new_tokens=GREEDY,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens = out[0].tolist()
            logits = model(out).logits[0].float()
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        if model_type == "gemma3":
            as_hub_files(folder)
        write_tokenizer(folder, config.get_text_config().vocab_size)
        if name in GGUF_ARCH:
            write_gguf(os.path.join(folder, "model.gguf"), GGUF_ARCH[name], config, model)
        for extra_file in ["generation_config.json"]:
            path = os.path.join(folder, extra_file)
            if os.path.exists(path):
                os.remove(path)
        reference = {
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
            "prompt": PROMPT,
            "greedy": tokens[len(PROMPT) :],
            "logits": [[round(v, 5) for v in row] for row in logits.tolist()],
        }
        with open(os.path.join(folder, "reference.json"), "w") as f:
            json.dump(reference, f, separators=(",", ":"))
        spread = (logits.max(-1).values - logits.topk(2, -1).values[:, 1]).min().item()
        print(f"{name}: greedy {reference['greedy'][:8]}..., smallest top-2 gap {spread:.4f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "engine/tests/data/families", sys.argv[2:])
