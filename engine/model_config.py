"""Model hyper-parameters read from a GGUF header or a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.gemma3_config import gemma3_gguf_fields, gemma3_hf_fields
from engine.rope import LinearScaling, RopeScaling, parse_rope_scaling

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "gemma3")          # GGUF files
# HF config.json model_type
SUPPORTED_HF_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters, Llama family and Gemma 3 (sizes in elements, rope_theta in
    radians base).

    rope_scaling: Llama 3.x `llama3` or (Gemma 3's full layers) `linear` frequency scaling
        (engine.rope), None = default RoPE.
    layer_windows: per layer, the sliding attention window in tokens (a query at position i sees
        keys j with i - window < j <= i, HF's rule) or None for full attention; () = every layer
        full.
    qk_norm: per-head RMSNorm of q and k (weights [head_dim]) before RoPE (Qwen3, Gemma 3).
    local_rope_theta: the rope theta of the sliding-window layers, whose RoPE is never scaled
        (Gemma 3's `rope_local_base_freq`); None = every layer uses rope_theta and rope_scaling.
    attn_scale: the factor of q.k before the softmax (Gemma 3: query_pre_attn_scalar ** -0.5);
        None = head_dim ** -0.5.
    final_logit_softcap: logits = tanh(logits / cap) * cap (Gemma's soft-capping); None = off.
    """

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
    rope_scaling: RopeScaling | LinearScaling | None = None
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False
    local_rope_theta: float | None = None
    attn_scale: float | None = None
    final_logit_softcap: float | None = None

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding_window(self) -> int | None:
        """The reach in tokens a prefix-cache hit must cover (see Scheduler, BlockManager.
        match_prefix): when *every* layer slides, the widest of their windows (a query of the
        widest layer reads furthest back; the narrower ones read a subset of it); None when any
        layer attends fully (Gemma 3's global layers, Qwen's layers below `max_window_layers`):
        such a layer reads every key, so a hit needs every block of the prefix."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from a legacy (`rope_theta` + `rope_scaling`) or a transformers 5
    (`rope_parameters`) config. Raises ValueError for per-layer-type rope parameters and for
    scaling types other than default / llama3."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {sorted(params)}")
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return float(theta), parse_rope_scaling(params)


def _layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows, as HF transformers reads the same config.json.

    mistral: `sliding_window` (null = none) on every layer. qwen2/qwen3: only with
    `use_sliding_window: true` (Qwen2.5 ships `sliding_window` set with `use_sliding_window:
    false`: full attention), then on the layers `layer_types` names `sliding_attention`, or on
    layers >= `max_window_layers` (default 28) without it. llama: none. Raises ValueError on an
    unknown layer type or a window < 1.
    """
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:
        return ()
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    types = cfg.get("layer_types") if arch != "mistral" else None  # HF's Mistral ignores them
    if types is None:
        first = cfg.get("max_window_layers", 28) if arch != "mistral" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    bad = set(types) - {"sliding_attention", "full_attention"}
    if bad or len(types) != num_layers:
        raise ValueError(f"unsupported layer_types {sorted(bad) or len(types)}")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def model_config_from_hf(model_dir: Path) -> ModelConfig:
    """Read config.json of a HF directory. Raises ValueError for model types other than
    SUPPORTED_HF_ARCHS and for features the engine does not implement (rope scaling types
    other than llama3, per-layer rope, unknown layer types; gemma3_text: engine.gemma3_config)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg.get("model_type", "llama")
    if arch == "gemma3":
        raise ValueError("unsupported model_type 'gemma3' (Gemma 3's image-text model): only its "
                         "text-only form, model_type 'gemma3_text', is supported")
    if arch not in SUPPORTED_HF_ARCHS:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {SUPPORTED_HF_ARCHS})")
    if arch == "gemma3_text":
        return ModelConfig(**gemma3_hf_fields(cfg))
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_list(cfg.get("eos_token_id")),
        rope_scaling=scaling,
        layer_windows=_layer_windows(cfg, arch, cfg["num_hidden_layers"]),
        qk_norm=arch == "qwen3",
    )


def model_config_from_gguf(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build from GGUF metadata (`fields`: key -> python value) and the set of tensor names.

    Raises ValueError for architectures other than SUPPORTED_ARCHS (gemma3: engine.gemma3_config).
    """
    arch = fields["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    if arch == "gemma3":
        return ModelConfig(**gemma3_gguf_fields(fields, tensor_names))
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
