"""RoPE frequencies: the default schedule, Llama 3.x's `llama3` rope scaling and the `linear` type
(Gemma 3's global layers; only Gemma 3's config reader parses it: parse_linear_scaling).

Formula of the `llama3` type: Meta's Llama 3.1 release (`apply_scaling` in the llama-models
reference code), as HF transformers applies it to config.json's `rope_scaling` /
`rope_parameters`. With wavelength w_i = 2*pi / f_i of the default frequency f_i, a context of
L = original_max_position_embeddings tokens, factors a = low_freq_factor, b = high_freq_factor:

* w_i < L / b (high frequency): f_i unchanged;
* w_i > L / a (low frequency): f_i / factor;
* between: (1 - s) * f_i / factor + s * f_i with s = (L / w_i - a) / (b - a).

The attention scaling of this type is 1 (cos and sin are not rescaled).

The `linear` type (HF transformers' `_compute_linear_scaling_rope_parameters`, position
interpolation): every f_i / factor, attention scaling 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """`llama3` rope scaling parameters (original_max_position_embeddings in tokens)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def parse_rope_scaling(params: dict[str, Any] | None) -> RopeScaling | None:
    """config.json's `rope_scaling` (or transformers 5's `rope_parameters`) -> RopeScaling, or None
    for the default schedule.

    Raises ValueError naming the type for any other `rope_type`/`type` (yarn, dynamic, linear,
    longrope, ...), for a partial rotary factor, and for a llama3 entry missing a field.
    """
    params = params or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']} "
                         "(only full rotary embeddings)")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        return None
    try:
        return RopeScaling(factor=float(params["factor"]),
                           low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]),
                           original_max_position_embeddings=int(
                               params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"rope_scaling type 'llama3' lacks {e.args[0]!r}") from None


@dataclass(frozen=True)
class LinearScaling:
    """`linear` rope scaling: every frequency divided by factor (> 0)."""

    factor: float


def parse_linear_scaling(params: dict[str, Any] | None) -> LinearScaling | None:
    """A `rope_scaling` / `rope_parameters` entry of type `default` or `linear` -> LinearScaling,
    or None for the default schedule. Raises ValueError for any other type, a partial rotary
    factor, or a linear entry without a positive `factor`."""
    params = params or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']} "
                         "(only full rotary embeddings)")
    if kind not in ("default", "linear"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear)")
    if kind == "default":
        return None
    factor = float(params.get("factor") or 0.0)
    if factor <= 0:
        raise ValueError("rope_scaling type 'linear' needs a factor > 0, "
                         f"got {params.get('factor')}")
    return LinearScaling(factor)


def default_inv_freq(head_dim: int, theta: float,
                     device: torch.device | None = None) -> torch.Tensor:
    """[head_dim // 2] float32: 1 / theta^(2i / head_dim) (HF's order of operations)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exps)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | LinearScaling | None,
             device: torch.device | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 rotary frequencies (radians per position), scaled when given."""
    freq = default_inv_freq(head_dim, theta, device)
    if scaling is None:
        return freq
    if isinstance(scaling, LinearScaling):
        return freq / scaling.factor
    s = scaling
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor       # longer waves: divided by factor
    high_wavelen = old_len / s.high_freq_factor     # shorter waves: kept
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
