"""Gemma 3 (text) hyper-parameters from a HF `gemma3_text` config.json or a `gemma3` GGUF header.

Returns the keyword arguments of engine.model_config.ModelConfig (that module builds it), read as
HF transformers reads the same file (`Gemma3TextConfig`, transformers 5), with its defaults for
keys a file leaves out (transformers writes only the values that differ from them):

* rope: transformers 5's per-layer-type `rope_parameters` (`full_attention` / `sliding_attention`)
  or the Hub files' legacy keys: `rope_theta` (full layers, default 1e6), `rope_local_base_freq`
  (sliding layers, default 1e4) and `rope_scaling` (full layers only: `linear` or none);
* layers: `layer_types`, or every `sliding_window_pattern`-th layer full (default 6: layers 5, 11,
  ... full, the others sliding with `sliding_window` tokens);
* attention scale `query_pre_attn_scalar ** -0.5`; `final_logit_softcapping` when set.

Refused (ValueError) instead of ignored: `attn_logit_softcapping` (transformers' Gemma3 attention
does not apply it either), `use_bidirectional_attention`, an activation other than
`gelu_pytorch_tanh`, a scaled rope on sliding layers.
"""
from __future__ import annotations

from typing import Any

from engine.rope import LinearScaling, parse_linear_scaling

# Gemma3TextConfig's defaults (transformers 5.24) for the keys this module reads.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
    eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
    attn_logit_softcapping=None, use_bidirectional_attention=False)
FULL_THETA, LOCAL_THETA, WINDOW_PATTERN = 1_000_000.0, 10_000.0, 6
ACTIVATION = "gelu_pytorch_tanh"
_TYPES = ("sliding_attention", "full_attention")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every `pattern`-th layer full, the rest sliding (HF's rule for configs without layer_types:
    layer i slides unless (i + 1) % pattern == 0). Raises ValueError for pattern < 1."""
    if pattern < 1:
        raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
    return [_TYPES[(i + 1) % pattern == 0] for i in range(num_layers)]


def windows_of(types: list[str], window: int | None) -> tuple[int | None, ...]:
    """Per-layer windows (None = full) from layer types. Raises ValueError on an unknown type, a
    sliding layer without a window, or a window < 1."""
    bad = set(types) - set(_TYPES)
    if bad:
        raise ValueError(f"unsupported layer_types {sorted(bad)}")
    if "sliding_attention" in types and (window is None or int(window) < 1):
        raise ValueError(f"sliding layers need a sliding_window >= 1, got {window}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, LinearScaling | None, float]:
    """(full-layer theta, full-layer scaling, sliding-layer theta) from either rope form."""
    params = cfg.get("rope_parameters") or {}
    flat = set(params) - set(_TYPES)
    if flat:
        raise ValueError(f"gemma3_text rope_parameters must be per layer type {_TYPES}, "
                         f"got {sorted(params)}")
    full = dict(params.get("full_attention") or {})
    sliding = dict(params.get("sliding_attention") or {})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta") or FULL_THETA)
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq") or LOCAL_THETA)
    if parse_linear_scaling(sliding) is not None:
        raise ValueError(f"scaled rope on sliding layers is not supported: {sliding}")
    return float(full["rope_theta"]), parse_linear_scaling(full), float(sliding["rope_theta"])


def _check_supported(cfg: dict[str, Any]) -> None:
    """Raises ValueError for the Gemma 3 options this engine does not compute."""
    if cfg["attn_logit_softcapping"] is not None:
        raise ValueError("attn_logit_softcapping is not supported (HF transformers' Gemma3 "
                         "attention does not apply it either)")
    if cfg["use_bidirectional_attention"]:
        raise ValueError("use_bidirectional_attention is not supported (causal decoding only)")
    if cfg["hidden_activation"] != ACTIVATION:  # (a legacy `hidden_act` key: ignored, as by HF)
        raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r} "
                         f"(supported: {ACTIVATION})")


def gemma3_hf_fields(file_cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig kwargs of a `gemma3_text` config.json (a dict). Raises ValueError as the module
    docstring lists, and for rope types other than default / linear."""
    # a null in the file means HF's default, except where null is a value (no window, no cap)
    cfg = {**HF_DEFAULTS, **{k: v for k, v in file_cfg.items() if v is not None or k in (
        "sliding_window", "final_logit_softcapping")}}
    _check_supported(cfg)
    theta, scaling, local_theta = _hf_rope(cfg)
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or pattern_layer_types(
        n, int(cfg.get("sliding_window_pattern") or WINDOW_PATTERN))
    if len(types) != n:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {n}")
    softcap = cfg["final_logit_softcapping"]
    return dict(
        architecture="gemma3", num_layers=n, hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=int(cfg["num_attention_heads"]), num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg["head_dim"]), vocab_size=int(cfg["vocab_size"]), rope_theta=theta,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        attention_bias=bool(cfg["attention_bias"]), bos_token_id=cfg["bos_token_id"],
        eos_token_ids=_ids(cfg["eos_token_id"]), rope_scaling=scaling,
        layer_windows=windows_of(list(types), cfg["sliding_window"]), qk_norm=True,
        local_rope_theta=local_theta, attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        final_logit_softcap=None if softcap is None else float(softcap))


def _gguf_layer_types(fields: dict[str, Any], n: int) -> list[str]:
    """`gemma3.attention.sliding_window_pattern`: an int (every n-th layer full) or one bool per
    layer (True = sliding); absent: 6, the value llama.cpp fixes for gemma3."""
    pattern = fields.get("gemma3.attention.sliding_window_pattern", WINDOW_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"sliding_window_pattern names {len(pattern)} layers, "
                             f"the model has {n}")
        return [_TYPES[not bool(p)] for p in pattern]
    return pattern_layer_types(n, int(pattern))


def gguf_query_pre_attn_scalar(hidden: int, heads: int, head_dim: int, num_layers: int) -> float:
    """llama.cpp's Gemma 3 attention scale rule (the GGUF header has no key for it): 27B (62
    layers) uses hidden / heads, every other size head_dim (= query_pre_attn_scalar of their
    config.json files: 256)."""
    return hidden / heads if num_layers == 62 else float(head_dim)


def gemma3_gguf_fields(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """ModelConfig kwargs of a `gemma3` GGUF (`fields`: metadata key -> value; tensor_names: every
    tensor's name). Rope scaling (`gemma3.rope.scaling.type/factor`) applies to the full layers;
    the sliding layers' theta is `gemma3.rope.freq_base_swa` (absent: 1e4, llama.cpp's value).
    Raises ValueError for attention soft-capping or a rope scaling type other than linear."""
    a = "gemma3."
    hidden, heads = int(fields[a + "embedding_length"]), int(fields[a + "attention.head_count"])
    n = int(fields[a + "block_count"])
    head_dim = int(fields.get(a + "attention.key_length", hidden // heads))
    if fields.get(a + "attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported")
    kind = fields.get(a + "rope.scaling.type")
    scaling = parse_linear_scaling(None if kind in (None, "none") else {
        "rope_type": kind, "factor": fields.get(a + "rope.scaling.factor")})
    vocab = fields.get(a + "vocab_size") or len(fields["tokenizer.ggml.tokens"])
    softcap = fields.get(a + "final_logit_softcapping")
    scalar = gguf_query_pre_attn_scalar(hidden, heads, head_dim, n)
    return dict(
        architecture="gemma3", num_layers=n, hidden_size=hidden,
        intermediate_size=int(fields[a + "feed_forward_length"]), num_heads=heads,
        num_kv_heads=int(fields.get(a + "attention.head_count_kv", heads)), head_dim=head_dim,
        vocab_size=int(vocab), rope_theta=float(fields.get(a + "rope.freq_base", FULL_THETA)),
        rms_norm_eps=float(fields[a + "attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(fields.get(a + "context_length", 131_072)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_ids(fields.get("tokenizer.ggml.eos_token_id")), rope_scaling=scaling,
        layer_windows=windows_of(_gguf_layer_types(fields, n),
                                 fields.get(a + "attention.sliding_window")),
        qk_norm=True, local_rope_theta=float(fields.get(a + "rope.freq_base_swa", LOCAL_THETA)),
        attn_scale=scalar ** -0.5, final_logit_softcap=None if softcap is None else float(softcap))
