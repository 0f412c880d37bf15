"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`) over the paged KV cache.

What it adds to the Llama-family decoder (engine.model), as HF transformers computes it:
embeddings times sqrt(hidden_size) (the factor cast to the model dtype first); RMSNorm scaled by
(1 + w) in float32; four norms per layer (input, post-attention, pre- and post-feed-forward:
`x + post_attn(attn(input(x)))`, then `x + post_ffn(mlp(pre_ffn(x)))`); q/k RMSNorm per head;
attention scale query_pre_attn_scalar ** -0.5; GeGLU MLP (tanh GELU); sliding layers with their
own, unscaled rope theta and full layers with rope_theta (+ linear scaling); an optional final
tanh soft-capping of the logits; tied embeddings.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.cpu_linear import pack_decoder_linears
from engine.layers import RotaryTable, apply_rope, geglu, linear, offset_rms_norm, softcap
from engine.model_config import ModelConfig
from engine.model_weights import Shard, StateReader, lm_head_weight, projections
from engine.tp import NO_TP, TPContext, all_reduce


@dataclass
class Gemma3LayerWeights:
    """One layer cut to this rank's shard; every norm is float32 `1 + w` ([H], q/k: [head_dim])."""

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor
    post_ffn_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv: torch.Tensor            # [(heads + 2*kv_heads) * hd, H]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor         # [H, heads*hd]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor        # [2*I, H]
    down: torch.Tensor           # [H, I]


def offset_scale(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Gemma norm weight -> float32 `1 + w` (w first cast to the model dtype, as HF holds it)."""
    return 1.0 + w.to(dtype).float()


def gemma3_layer(state: StateReader, i: int, dtype: torch.dtype, sh: Shard) -> Gemma3LayerWeights:
    """Layer i under HF names. Raises KeyError when a weight is missing."""
    p = f"model.layers.{i}."

    def norm(name: str) -> torch.Tensor:
        return offset_scale(state[p + name + ".weight"], dtype)
    return Gemma3LayerWeights(
        input_norm=norm("input_layernorm"), post_attn_norm=norm("post_attention_layernorm"),
        pre_ffn_norm=norm("pre_feedforward_layernorm"),
        post_ffn_norm=norm("post_feedforward_layernorm"),
        q_norm=norm("self_attn.q_norm"), k_norm=norm("self_attn.k_norm"),
        **projections(state, i, dtype, sh))


class Gemma3Model:
    """Weights plus a forward pass; the same interface as engine.model.LlamaModel (config, dtype,
    tp, shard, layers, windows, forward), so ModelRunner and the engine take either."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 tp: TPContext = NO_TP, pack_cpu_linears: bool = False):
        """state: HF Gemma3ForCausalLM names (full, unsharded). Raises KeyError when a weight is
        missing, ValueError when the KV heads cannot be split over tp.size or when the state
        holds weights this forward would ignore. pack_cpu_linears: as LlamaModel's."""
        self.config, self.dtype, self.tp = config, dtype, tp
        self.shard = Shard.of(config, tp)
        reader = StateReader(state)
        self.embed = reader["model.embed_tokens.weight"].to(dtype)
        # HF: sqrt(hidden) as a float32 tensor cast to the weights' dtype (bf16 rounds it)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(dtype=dtype,
                                                                         device=self.embed.device)
        self.layers = [gemma3_layer(reader, i, dtype, self.shard) for i in range(config.num_layers)]
        self.norm = offset_scale(reader["model.norm.weight"], dtype)
        self.lm_head = lm_head_weight(reader, self.embed, config, dtype)
        reader.check_all_used()
        if pack_cpu_linears:
            pack_decoder_linears(self)  # each linear weight -> its oneDNN-packed form
        self.windows = tuple(config.window(i) for i in range(config.num_layers))
        # full layers: rope_theta (+ scaling); sliding ones: local_rope_theta, unscaled (HF's
        # rope per layer type: by the layer's type, not by whichever window a test ablates)
        self.sliding = tuple(w is not None for w in self.windows)
        self.full_rope = RotaryTable(config.head_dim, config.rope_theta, dtype,
                                     scaling=config.rope_scaling)
        self.local_rope = self.full_rope if config.local_rope_theta is None else \
            RotaryTable(config.head_dim, config.local_rope_theta, dtype)
        self.attn_scale = config.attn_scale
        self.final_softcap = config.final_logit_softcap

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_cache: torch.Tensor, metas: Mapping[int | None, AttentionMetadata],
                compute_logits: bool = True, max_position: int | None = None
                ) -> torch.Tensor | None:
        """Shapes and arguments as LlamaModel.forward: input_ids, positions [T] int64; sample_rows
        [S]; kv_cache [num_blocks, num_layers, 2, block_size, kv_heads, hd] written in place;
        metas per window. Returns float32 logits [S, vocab_size] (soft-capped when the config
        says so), or None when compute_logits is False."""
        eps = self.config.rms_norm_eps
        x = F.embedding(input_ids, self.embed) * self.embed_scale
        if max_position is None:
            max_position = int(positions.max())
        full = self.full_rope.lookup(positions, max_position)
        local = full if self.local_rope is self.full_rope else \
            self.local_rope.lookup(positions, max_position)
        for i, w in enumerate(self.layers):
            h = self._attention(offset_rms_norm(x, w.input_norm, eps), w,
                                *(local if self.sliding[i] else full),
                                kv_cache, i, metas[self.windows[i]])
            x = x + offset_rms_norm(h, w.post_attn_norm, eps)
            h = linear(geglu(linear(offset_rms_norm(x, w.pre_ffn_norm, eps), w.gate_up)), w.down)
            x = x + offset_rms_norm(all_reduce(h, self.tp), w.post_ffn_norm, eps)
        if not compute_logits:
            return None
        logits = linear(offset_rms_norm(x[sample_rows], self.norm, eps), self.lm_head)
        cap = self.final_softcap
        return (logits if cap is None else softcap(logits, cap)).float()

    def _attention(self, x: torch.Tensor, w: Gemma3LayerWeights, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                   meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] (normed) -> the attention output [T, H], summed over the TP ranks."""
        hd, sh, eps = self.config.head_dim, self.shard, self.config.rms_norm_eps
        t = x.shape[0]
        qkv = linear(x, w.qkv, w.qkv_bias).view(t, sh.num_heads + 2 * sh.num_kv_heads, hd)
        q = offset_rms_norm(qkv[:, :sh.num_heads], w.q_norm, eps)
        k = offset_rms_norm(qkv[:, sh.num_heads:sh.num_heads + sh.num_kv_heads], w.k_norm, eps)
        qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # q and k at once
        v = qkv[:, sh.num_heads + sh.num_kv_heads:]
        out = paged_attention(qk[:, :sh.num_heads], qk[:, sh.num_heads:], v, kv_cache, layer,
                              meta, scale=self.attn_scale)
        out = all_reduce(linear(out.reshape(t, sh.num_heads * hd), w.o_proj), self.tp)
        return out if w.o_bias is None else out + w.o_bias
