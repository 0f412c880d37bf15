"""Tiny random-weight checkpoints of each supported model family, built with HF transformers in
the test (no download), and the prompts the family tests run.

Every feature must change the tokens, so: q/k/v biases and every norm weight are randomized (HF's
init leaves them 0 and 1), windows are shorter than every prompt, llama3's
original_max_position_embeddings is small next to the positions reached.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WINDOW = 12          # tokens; every prompt is longer
VOCAB = 2048
PROMPT_LENS = (19, 27, 36, 45, 58)
N_NEW = 32

_DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.2)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# Gemma 3: distinct local / global thetas, linear scaling on the global layers only
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_SOFTCAP = 30.0

# name -> (transformers config class, its kwargs, keys rewritten in the saved config.json)
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    # Llama 3.1's file form: legacy `rope_scaling` + `rope_theta` (transformers 5 writes
    # `rope_parameters`; both must read the same)
    "llama3": ("LlamaConfig", dict(num_hidden_layers=3, rope_parameters={
        **LLAMA3_SCALING, "rope_theta": 500000.0}),
        {"rope_parameters": None, "rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
    # Qwen2.5's file form: a window set but switched off, so full attention on every layer
    "qwen2.5": ("Qwen2Config", dict(num_hidden_layers=3),
                {"sliding_window": WINDOW, "use_sliding_window": False, "max_window_layers": 1,
                 "layer_types": None}),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=3), {}),
    # Qwen3 with its window switched on: layer 0 full, layers 1-2 sliding
    "qwen3_window": ("Qwen3Config", dict(num_hidden_layers=3, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=1), {}),
    "mistral": ("MistralConfig", dict(num_hidden_layers=3, sliding_window=WINDOW), {}),
    # Gemma 3 as transformers 5 saves it (per-layer-type rope_parameters, layer_types); a query
    # scale (36 ** -0.5) other than head_dim's; tied embeddings, as every Gemma 3 checkpoint
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, sliding_window=WINDOW, layer_types=GEMMA3_LAYERS,
        rope_parameters=GEMMA3_ROPE, query_pre_attn_scalar=36,
        final_logit_softcapping=GEMMA3_SOFTCAP, tie_word_embeddings=True), {}),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Biases ~ N(0, 0.3), norm weights ~ U(0.5, 1.5), in place (other weights: HF's init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_family_dir(path: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save the family's random model into path (HF format, fp32) with the tokenizer files of
    tokenizer_dir (any model directory: only TOKENIZER_FILES are copied); return path."""
    import transformers
    cls_name, kwargs, patch = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(**{**_DIMS, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    randomize_(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    cfg_file = path / "config.json"
    cfg = {**json.loads(cfg_file.read_text()), **patch}
    cfg_file.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def prompts(seed: int = 0) -> list[list[int]]:
    """len(PROMPT_LENS) prompts of random token ids in [3, VOCAB)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def hf_reference(path: Path, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of HF transformers on the saved checkpoint (its own KV cache)."""
    from transformers import AutoModelForCausalLM

    from engine_testutil import hf_greedy
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return [hf_greedy(model, p, n) for p in prompt_ids]
