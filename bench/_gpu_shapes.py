"""Model shapes and prompts of bench/gpu_check.py: random weights of real shapes, prompts as token ids."""
from __future__ import annotations

from pathlib import Path

import torch

# LlamaConfig fields (engine.tiny.make_tiny_llama overrides); random weights, no checkpoint needed
SHAPES = {
    "tiny": {},  # engine.tiny's defaults: 2 layers, hidden 64 (the CPU run of the check)
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.1),
    # the ~1B Llama shape of issue 12 (Llama 3.2 1B's body with a 32k vocabulary)
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=32000, rope_theta=500000.0,
                    max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.1),
}


def build_model_dir(root: Path, shape: str, tokenizer_dir: str) -> Path:
    """A HF directory with random weights of ``shape`` (seeded) and the tokenizer of ``tokenizer_dir``."""
    from engine.tiny import make_tiny_llama

    path = root / shape
    if (path / "config.json").is_file():
        return path
    return make_tiny_llama(path, seed=0, tokenizer_from=tokenizer_dir, **SHAPES[shape])


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths as token ids in [3, vocab_size) (no special ids), seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
