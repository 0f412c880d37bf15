"""Read a GGUF file: metadata fields and dequantized tensors under HF names (Llama family,
Gemma 3)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from engine.gguf_reader import read_gguf, tensor_float32
from engine.model_config import ModelConfig, model_config_from_gguf

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 (gguf-py's MODEL_TENSORS[GEMMA3]): four norms per layer, q/k norms; `ffn_norm` is the
# pre-feed-forward norm there (Llama's post-attention one).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """A GGUF tensor name -> its HF name. Raises ValueError for a name no layer reads."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m is None or m.group(2) not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"


def _to_hf_values(w: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """Undo what llama.cpp's converter changed: the q/k row permutation of `llama` files, and the
    `+ 1` it adds to every Gemma norm weight (HF's Gemma3RMSNorm scales by 1 + w; transformers'
    GGUF loader subtracts the 1 again, so the float32 values match it bit for bit)."""
    if config.architecture == "llama" and ".attn_q." in name:
        return unpermute_qk(w, config.num_heads)
    if config.architecture == "llama" and ".attn_k." in name:
        return unpermute_qk(w, config.num_kv_heads)
    if config.architecture == "gemma3" and name.endswith("norm.weight"):
        return w - 1
    return w


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a q/k weight [n_head*head_dim, in] (or bias)."""
    shape = w.shape
    w = w.reshape(n_head, shape[0] // n_head // 2, 2, -1)
    return w.swapaxes(1, 2).reshape(shape)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return (ModelConfig, state dict of float32 tensors named like HF LlamaForCausalLM, or
    Gemma3ForCausalLM for a gemma3 file).

    Raises ValueError for unsupported architectures or tensor names.
    """
    meta, infos, data = read_gguf(path)
    config = model_config_from_gguf(meta, {t.name for t in infos})
    state: dict[str, torch.Tensor] = {}
    for t in infos:
        w = np.ascontiguousarray(_to_hf_values(tensor_float32(data, t), t.name, config))
        state[_hf_name(t.name, config.architecture)] = torch.from_numpy(
            w if w.flags.writeable else w.copy())
    return config, state
