"""Read a GGUF file: metadata fields and dequantized tensors under HF Llama names."""
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
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a q/k weight [n_head*head_dim, in] (or bias)."""
    shape = w.shape
    w = w.reshape(n_head, shape[0] // n_head // 2, 2, -1)
    return w.swapaxes(1, 2).reshape(shape)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return (ModelConfig, state dict of float32 tensors named like HF LlamaForCausalLM).

    Raises ValueError for unsupported architectures or tensor names.
    """
    meta, infos, data = read_gguf(path)
    config = model_config_from_gguf(meta, {t.name for t in infos})
    state: dict[str, torch.Tensor] = {}
    for t in infos:
        w = tensor_float32(data, t)
        if config.architecture == "llama" and ".attn_q." in t.name:
            w = unpermute_qk(w, config.num_heads)
        elif config.architecture == "llama" and ".attn_k." in t.name:
            w = unpermute_qk(w, config.num_kv_heads)
        w = np.ascontiguousarray(w)
        state[_hf_name(t.name)] = torch.from_numpy(w if w.flags.writeable else w.copy())
    return config, state
