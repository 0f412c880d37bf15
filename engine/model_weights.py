"""Per-layer weights of the Llama-family decoder, cut to this TP rank's shard.

Reads a full (unsharded) state dict under HF names (`model.layers.{i}.self_attn.q_proj.weight`,
...) and refuses one that holds weights the forward would not use (an MLP bias, a per-layer rope
table, ...): a weight silently ignored gives plausible but wrong tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig
from engine.tp import TPContext, kv_head_range, split_range

# Buffers some checkpoints carry that the engine recomputes (RoPE frequencies).
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor      # [H]
    qkv: torch.Tensor            # [(heads + 2*kv_heads) * hd, H]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor         # [H, heads*hd]
    o_bias: torch.Tensor | None  # [H] added once, after the all-reduce
    mlp_norm: torch.Tensor       # [H]
    gate_up: torch.Tensor        # [2*I, H]
    down: torch.Tensor           # [H, I]
    q_norm: torch.Tensor | None  # [hd] Qwen3 per-head RMSNorm of q (shared by every head)
    k_norm: torch.Tensor | None  # [hd]


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


class StateReader:
    """A state dict that records which names were read, so leftovers can be refused."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def __getitem__(self, name: str) -> torch.Tensor:
        """Raises KeyError when the checkpoint lacks `name`."""
        self.used.add(name)
        return self.state[name]

    def optional(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self.state else None

    def check_all_used(self) -> None:
        """Raises ValueError naming (up to 5 of) the weights nothing read."""
        left = sorted(n for n in set(self.state) - self.used if not n.endswith(_DERIVED_SUFFIXES))
        if left:
            raise ValueError(f"{len(left)} weights the engine does not implement, e.g. {left[:5]}")


def projections(state: StateReader, i: int, dtype: torch.dtype,
                sh: Shard) -> dict[str, torch.Tensor | None]:
    """Layer i's linear weights cut to shard sh, as LayerWeights fields: column-parallel q/k/v
    (`qkv`, `qkv_bias`) and gate/up (`gate_up`), row-parallel `o_proj` (+ `o_bias`) and `down`.
    Raises KeyError when one is missing."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    rows = {"q": sh.q, "k": sh.kv, "v": sh.kv}
    qkv_bias = None
    if a + "q_proj.bias" in state:
        qkv_bias = torch.cat([state[a + n + "_proj.bias"][rows[n]] for n in "qkv"]).to(dtype)
    o_bias = state.optional(a + "o_proj.bias")
    return dict(
        qkv=torch.cat([state[a + n + "_proj.weight"][rows[n]] for n in "qkv"])
        .to(dtype).contiguous(),
        qkv_bias=qkv_bias,
        o_proj=state[a + "o_proj.weight"][:, sh.q].to(dtype).contiguous(),
        o_bias=None if o_bias is None else o_bias.to(dtype),
        gate_up=torch.cat([state[p + "mlp.gate_proj.weight"][sh.ffn],
                           state[p + "mlp.up_proj.weight"][sh.ffn]]).to(dtype).contiguous(),
        down=state[p + "mlp.down_proj.weight"][:, sh.ffn].to(dtype).contiguous(),
    )


def layer_weights(state: StateReader, i: int, dtype: torch.dtype, sh: Shard,
                  qk_norm: bool) -> LayerWeights:
    """Layer i of a Llama-family model (projections() plus its norms). Raises KeyError when a
    weight of layer i is missing (q_norm/k_norm when qk_norm)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    return LayerWeights(
        attn_norm=state[p + "input_layernorm.weight"].to(dtype),
        mlp_norm=state[p + "post_attention_layernorm.weight"].to(dtype),
        q_norm=state[a + "q_norm.weight"].to(dtype) if qk_norm else None,
        k_norm=state[a + "k_norm.weight"].to(dtype) if qk_norm else None,
        **projections(state, i, dtype, sh),
    )


def lm_head_weight(state: StateReader, embed: torch.Tensor, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The vocabulary projection [vocab, hidden]: ``lm_head.weight`` in ``dtype``, or the embedding
    itself when the checkpoint has none or ties them (``tie_word_embeddings``)."""
    lm_head = state.optional("lm_head.weight")
    return embed if lm_head is None or config.tie_word_embeddings else lm_head.to(dtype)
