"""Model hyper-parameters read from a GGUF header or a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyper-parameters (sizes in elements, rope_theta in radians base)."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def model_config_from_hf(model_dir: Path) -> ModelConfig:
    """Read config.json of a HF directory. Raises ValueError for non-Llama-family models."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {SUPPORTED_ARCHS})")
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ValueError(f"unsupported rope_scaling {scaling}")
    heads = cfg["num_attention_heads"]
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        architecture=arch,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_list(cfg.get("eos_token_id")),
    )


def model_config_from_gguf(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build from GGUF metadata (`fields`: key -> python value) and the set of tensor names.

    Raises ValueError for architectures other than the Llama family.
    """
    arch = fields["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    hidden = int(fields[f"{arch}.embedding_length"])
    heads = int(fields[f"{arch}.attention.head_count"])
    vocab = fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        num_layers=int(fields[f"{arch}.block_count"]),
        hidden_size=hidden,
        intermediate_size=int(fields[f"{arch}.feed_forward_length"]),
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        vocab_size=int(vocab),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_list(fields.get("tokenizer.ggml.eos_token_id")),
    )
