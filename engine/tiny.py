"""A tiny random-weight Llama HF directory with the real SmolLM2 tokenizer (tests, benchmarks)."""
from __future__ import annotations

from pathlib import Path

from engine.model_files import resolve_model_path
from engine.tokenizer import Tokenizer

_DEFAULTS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.2)


def make_tiny_llama(path: Path, seed: int = 0, tokenizer_from: str = "smollm2",
                    **overrides) -> Path:
    """Write config.json + model.safetensors + tokenizer files into path; return path.

    overrides: LlamaConfig fields (e.g. num_hidden_layers=4). tokenizer_from: a model spec, or a
    directory holding only tokenizer files (fast), whose tokenizer is saved alongside (its
    vocabulary should be <= vocab_size).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**{**_DEFAULTS, **overrides})
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    src = Path(tokenizer_from)
    if not (src.is_dir() and (src / "tokenizer_config.json").is_file()):
        src = resolve_model_path(tokenizer_from)
    Tokenizer.from_model_path(src).hf.save_pretrained(str(path))
    return path
