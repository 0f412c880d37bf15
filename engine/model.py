"""Llama-family decoder (Llama, Mistral, Qwen2 q/k/v bias) over a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from engine.model_config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor      # [H]
    qkv: torch.Tensor            # [(heads + 2*kv_heads) * hd, H]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor         # [H, heads*hd]
    mlp_norm: torch.Tensor       # [H]
    gate_up: torch.Tensor        # [2*I, H]
    down: torch.Tensor           # [H, I]


def _layer_weights(state: dict[str, torch.Tensor], i: int, dtype: torch.dtype) -> LayerWeights:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    qkv_bias = None
    if a + "q_proj.bias" in state:
        qkv_bias = torch.cat([state[a + n + "_proj.bias"] for n in "qkv"]).to(dtype)
    return LayerWeights(
        attn_norm=state[p + "input_layernorm.weight"].to(dtype),
        qkv=torch.cat([state[a + n + "_proj.weight"] for n in "qkv"]).to(dtype).contiguous(),
        qkv_bias=qkv_bias,
        o_proj=state[a + "o_proj.weight"].to(dtype).contiguous(),
        mlp_norm=state[p + "post_attention_layernorm.weight"].to(dtype),
        gate_up=torch.cat([state[p + "mlp.gate_proj.weight"],
                           state[p + "mlp.up_proj.weight"]]).to(dtype).contiguous(),
        down=state[p + "mlp.down_proj.weight"].to(dtype).contiguous(),
    )


class LlamaModel:
    """Weights plus a forward pass; owns no KV memory (the cache is passed in)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype):
        """state: HF LlamaForCausalLM names. Raises KeyError when a weight is missing."""
        self.config = config
        self.dtype = dtype
        self.embed = state["model.embed_tokens.weight"].to(dtype)
        self.layers = [_layer_weights(state, i, dtype) for i in range(config.num_layers)]
        self.norm = state["model.norm.weight"].to(dtype)
        lm_head = state.get("lm_head.weight")
        self.lm_head = self.embed if lm_head is None or config.tie_word_embeddings \
            else lm_head.to(dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; sample_rows: [S] rows to project to the vocabulary.

        kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, hd], written in place.
        Returns float32 logits [S, vocab_size].
        """
        c = self.config
        x = F.embedding(input_ids, self.embed)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype)
        for i, w in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, w.attn_norm, c.rms_norm_eps), w, cos, sin,
                                    kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
            h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
            x = x + F.linear(swiglu(F.linear(h, w.gate_up)), w.down)
        x = rms_norm(x[sample_rows], self.norm, c.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    def _attention(self, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                   cache_k: torch.Tensor, cache_v: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        out = paged_attention(q, k, v, cache_k, cache_v, meta)
        return F.linear(out.reshape(t, q_size), w.o_proj)
