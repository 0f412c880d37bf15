"""Llama-family decoder (Llama, Mistral, Qwen2 q/k/v bias) over a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.layers import RotaryTable, apply_rope, linear, rms_norm, swiglu
from engine.model_config import ModelConfig
from engine.tp import NO_TP, TPContext, all_reduce, kv_head_range, split_range


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor      # [H]
    qkv: torch.Tensor            # [(heads + 2*kv_heads) * hd, H]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor         # [H, heads*hd]
    mlp_norm: torch.Tensor       # [H]
    gate_up: torch.Tensor        # [2*I, H]
    down: torch.Tensor           # [H, I]


@dataclass(frozen=True)
class Shard:
    """The slice of a layer this TP rank holds: heads and FFN columns, as row ranges."""

    q: slice       # rows of q_proj (and o_proj columns): this rank's query heads * head_dim
    kv: slice      # rows of k_proj / v_proj: this rank's KV heads * head_dim
    ffn: slice     # rows of gate/up (and down columns) in the intermediate dimension
    num_heads: int
    num_kv_heads: int

    @classmethod
    def of(cls, c: ModelConfig, tp: TPContext) -> "Shard":
        """Contiguous GQA groups by kv_head_range; the intermediate dim split as evenly."""
        group = c.num_heads // c.num_kv_heads
        k0, k1 = kv_head_range(c.num_kv_heads, tp.rank, tp.size)
        f0, f1 = split_range(c.intermediate_size, tp.rank, tp.size)
        hd = c.head_dim
        return cls(q=slice(k0 * group * hd, k1 * group * hd), kv=slice(k0 * hd, k1 * hd),
                   ffn=slice(f0, f1), num_heads=(k1 - k0) * group, num_kv_heads=k1 - k0)


def _layer_weights(state: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                   sh: Shard) -> LayerWeights:
    """Column-parallel q/k/v and gate/up (rows), row-parallel o_proj and down (columns)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    rows = {"q": sh.q, "k": sh.kv, "v": sh.kv}
    qkv_bias = None
    if a + "q_proj.bias" in state:
        qkv_bias = torch.cat([state[a + n + "_proj.bias"][rows[n]] for n in "qkv"]).to(dtype)
    return LayerWeights(
        attn_norm=state[p + "input_layernorm.weight"].to(dtype),
        qkv=torch.cat([state[a + n + "_proj.weight"][rows[n]] for n in "qkv"])
        .to(dtype).contiguous(),
        qkv_bias=qkv_bias,
        o_proj=state[a + "o_proj.weight"][:, sh.q].to(dtype).contiguous(),
        mlp_norm=state[p + "post_attention_layernorm.weight"].to(dtype),
        gate_up=torch.cat([state[p + "mlp.gate_proj.weight"][sh.ffn],
                           state[p + "mlp.up_proj.weight"][sh.ffn]]).to(dtype).contiguous(),
        down=state[p + "mlp.down_proj.weight"][:, sh.ffn].to(dtype).contiguous(),
    )


class LlamaModel:
    """Weights plus a forward pass; owns no KV memory (the cache is passed in).

    With TP each rank keeps its Shard of every layer (heads, FFN) and all-reduces the outputs of
    o_proj and down; embeddings, norms and lm_head are replicated.
    """

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 tp: TPContext = NO_TP):
        """state: HF LlamaForCausalLM names (full, unsharded). Raises KeyError when a weight is
        missing, ValueError when the KV heads cannot be split over tp.size."""
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.shard = Shard.of(config, tp)
        self.embed = state["model.embed_tokens.weight"].to(dtype)
        self.layers = [_layer_weights(state, i, dtype, self.shard)
                       for i in range(config.num_layers)]
        self.norm = state["model.norm.weight"].to(dtype)
        lm_head = state.get("lm_head.weight")
        self.lm_head = self.embed if lm_head is None or config.tie_word_embeddings \
            else lm_head.to(dtype)
        self.rope = RotaryTable(config.head_dim, config.rope_theta, dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                compute_logits: bool = True, max_position: int | None = None
                ) -> torch.Tensor | None:
        """input_ids, positions: [T] int64; sample_rows: [S] rows to project to the vocabulary.

        kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, hd], written in place.
        max_position: the largest entry of positions when the caller knows it (saves a
        device-to-host read; the RoPE table grows to cover it).
        Returns float32 logits [S, vocab_size], or None when compute_logits is False (TP
        followers: the forward still writes the KV and joins every all-reduce).
        """
        c = self.config
        x = F.embedding(input_ids, self.embed)
        if max_position is None:
            max_position = int(positions.max())
        cos, sin = self.rope.lookup(positions, max_position)
        for i, w in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, w.attn_norm, c.rms_norm_eps), w, cos, sin,
                                    kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
            h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
            x = x + all_reduce(linear(swiglu(linear(h, w.gate_up)), w.down), self.tp)
        if not compute_logits:
            return None
        x = rms_norm(x[sample_rows], self.norm, c.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def _attention(self, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                   cache_k: torch.Tensor, cache_v: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        hd, sh = self.config.head_dim, self.shard
        t = x.shape[0]
        qkv = linear(x, w.qkv, w.qkv_bias).view(t, sh.num_heads + 2 * sh.num_kv_heads, hd)
        qk = apply_rope(qkv[:, :sh.num_heads + sh.num_kv_heads], cos, sin)  # q and k at once
        q, k = qk[:, :sh.num_heads], qk[:, sh.num_heads:]
        v = qkv[:, sh.num_heads + sh.num_kv_heads:]
        out = paged_attention(q, k, v, cache_k, cache_v, meta)
        return all_reduce(linear(out.reshape(t, sh.num_heads * hd), w.o_proj), self.tp)
