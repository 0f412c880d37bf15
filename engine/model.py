"""Llama-family decoder over a paged KV cache: Llama 2/3.x (llama3 rope scaling), Mistral
(sliding window), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, attend, paged_attention
from engine.cpu_linear import DualWeight, pack_decoder_linears
from engine.cpu_ops import TORCH_OPS, KernelOps, TorchOps
from engine.layers import RotaryTable, apply_rope, linear, rms_norm
from engine.model_config import ModelConfig
from engine.model_weights import LayerWeights, Shard, StateReader, layer_weights, lm_head_weight
from engine.tp import NO_TP, TPContext, all_reduce


class LlamaModel:
    """Weights plus a forward pass; owns no KV memory (the cache is passed in).

    With TP each rank keeps its Shard of every layer (heads, FFN) and all-reduces the outputs of
    o_proj and down; embeddings, norms and lm_head are replicated.
    """

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 tp: TPContext = NO_TP, pack_cpu_linears: bool = False,
                 ops: TorchOps | KernelOps = TORCH_OPS):
        """state: HF LlamaForCausalLM names (full, unsharded). Raises KeyError when a weight is
        missing, ValueError when the KV heads cannot be split over tp.size or when the state
        holds weights this forward would ignore.

        pack_cpu_linears: reorder every linear weight (qkv, o_proj, gate_up, down, lm_head) for
        oneDNN once (engine.cpu_linear; CPU weights only, a no-op elsewhere). A tied lm_head then
        gets its own packed copy (vocab x hidden more memory) while the embedding stays dense.
        ops: the fusable steps (engine.cpu_ops): ATen ops, or pdserve's float32 CPU kernels
        (residual add + RMSNorm, SwiGLU, RoPE + KV write, decode attention in one pass each).
        """
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.shard = Shard.of(config, tp)
        reader = StateReader(state)
        self.embed = reader["model.embed_tokens.weight"].to(dtype)
        self.layers = [layer_weights(reader, i, dtype, self.shard, config.qk_norm)
                       for i in range(config.num_layers)]
        self.norm = reader["model.norm.weight"].to(dtype)
        self.lm_head = lm_head_weight(reader, self.embed, config, dtype)
        reader.check_all_used()
        if pack_cpu_linears:  # each linear weight -> its oneDNN-packed form (+ its GEMV panels)
            pack_decoder_linears(self, keep_panels=isinstance(ops, KernelOps))
        self.rope = RotaryTable(config.head_dim, config.rope_theta, dtype,
                                scaling=config.rope_scaling)
        self.windows = tuple(config.window(i) for i in range(config.num_layers))
        self.ops = ops
        # id(layer list) -> (that list, its decode_layers weights or None): _fused_decode_weights
        self._fused: dict[int, tuple[list[LayerWeights], tuple | None]] = {}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor,
                kv_cache: torch.Tensor, metas: Mapping[int | None, AttentionMetadata],
                compute_logits: bool = True, max_position: int | None = None
                ) -> torch.Tensor | None:
        """input_ids, positions: [T] int64; sample_rows: [S] rows to project to the vocabulary.

        kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, hd], written in place.
        metas: attention metadata per sliding window (None: full attention), one entry for each
        value of self.windows; layer i attends with metas[self.windows[i]].
        max_position: the largest entry of positions when the caller knows it (saves a
        device-to-host read; the RoPE table grows to cover it).
        Returns float32 logits [S, vocab_size], or None when compute_logits is False (TP
        followers: the forward still writes the KV and joins every all-reduce).
        """
        c, ops = self.config, self.ops
        x = F.embedding(input_ids, self.embed)
        if max_position is None:
            max_position = int(positions.max())
        rope = self._rope_inputs(positions, max_position)
        delta = None  # the last sublayer's output, not yet added to the residual stream x
        fused = self._fused_decode_weights(input_ids.shape[0], metas)
        if fused is not None:  # one decode token: every layer in one kernel call, same bits
            meta = metas[None]
            delta = ops.decode_layers(x, *fused, kv_cache, rope, meta.slot_blocks, meta.slot_offsets,
                                      meta.decode_tables, meta.decode_key_ranges, c.rms_norm_eps,
                                      c.head_dim ** -0.5, self.shard.num_heads)
        else:
            for i, w in enumerate(self.layers):
                x, h = ops.add_rms_norm(x, delta, w.attn_norm, c.rms_norm_eps)
                x, h = ops.add_rms_norm(x, self._attention(h, w, rope, kv_cache, i, metas[self.windows[i]]),
                                        w.mlp_norm, c.rms_norm_eps)
                delta = all_reduce(linear(ops.silu_mul(linear(h, w.gate_up)), w.down), self.tp)
        if not compute_logits:
            return None
        _, x = ops.add_rms_norm((x + delta)[sample_rows], None, self.norm, c.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def _fused_decode_weights(self, num_tokens: int, metas: Mapping[int | None, AttentionMetadata]
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """(weights, qkv_biases) for KernelOps.decode_layers when this step can run it, else None:
        kernels with fuse_decode_layers, one token and it a decode row, no TP, full attention in
        every layer, no Qwen3 q/k norm, no o_proj bias, every linear a DualWeight (the path whose
        bits the fused kernel reproduces: the GEMV kernel)."""
        ops = self.ops
        if not (isinstance(ops, KernelOps) and ops.fuse_decode_layers and num_tokens == 1):
            return None
        meta = metas.get(None)
        if meta is None or meta.num_decodes != 1 or meta.prefills or meta.decode_key_ranges is None:
            return None
        layers, fused = self._fused.get(id(self.layers), (None, None))
        if layers is not self.layers:  # built once per layer list (a benchmark swaps lists)
            if len(self._fused) >= 4:
                self._fused.clear()
            fused = self._flat_decode_weights()
            self._fused[id(self.layers)] = (self.layers, fused)
        return fused

    def _flat_decode_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The layers' dense weights in decode_layers' order, or None when a layer cannot fuse."""
        if self.tp.size != 1 or any(win is not None for win in self.windows):
            return None
        weights, biases = [], []
        for w in self.layers:
            linears = (w.qkv, w.o_proj, w.gate_up, w.down)
            if (w.q_norm is not None or w.o_bias is not None
                    or not all(isinstance(m, DualWeight) for m in linears)):
                return None
            weights += [w.attn_norm, w.qkv.panels, w.o_proj.panels, w.mlp_norm, w.gate_up.panels, w.down.panels]
            if w.qkv_bias is not None:
                biases.append(w.qkv_bias)
        if biases and len(biases) != len(self.layers):
            return None
        return weights, biases

    def _rope_inputs(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, ...]:
        """What _attention rotates with: (cos, signed sin) rows [T, hd] for ATen ops; the whole
        tables and the positions for the kernels' rope_store_kv."""
        if isinstance(self.ops, KernelOps):
            return (*self.rope.tables(max_position, positions.device), positions)
        return self.rope.lookup(positions, max_position)

    def _attention(self, x: torch.Tensor, w: LayerWeights, rope: tuple[torch.Tensor, ...],
                   kv_cache: torch.Tensor, layer: int,
                   meta: AttentionMetadata) -> torch.Tensor:
        hd, sh = self.config.head_dim, self.shard
        t = x.shape[0]
        qkv = linear(x, w.qkv, w.qkv_bias).view(t, sh.num_heads + 2 * sh.num_kv_heads, hd)
        qk = qkv[:, :sh.num_heads + sh.num_kv_heads]
        if w.q_norm is not None:  # Qwen3: RMSNorm over each head's dims, before RoPE
            eps = self.config.rms_norm_eps
            qk = torch.cat([rms_norm(qk[:, :sh.num_heads], w.q_norm, eps),
                            rms_norm(qk[:, sh.num_heads:], w.k_norm, eps)], dim=1)
        v = qkv[:, sh.num_heads + sh.num_kv_heads:]
        if isinstance(self.ops, KernelOps):
            out = self._kernel_attention(qkv, qk, rope, kv_cache, layer, meta)
        else:
            qk = apply_rope(qk, *rope)  # q and k at once
            q, k = qk[:, :sh.num_heads], qk[:, sh.num_heads:]
            out = paged_attention(q, k, v, kv_cache, layer, meta)
        out = all_reduce(linear(out.reshape(t, sh.num_heads * hd), w.o_proj), self.tp)
        return out if w.o_bias is None else out + w.o_bias

    def _kernel_attention(self, qkv: torch.Tensor, qk: torch.Tensor, rope: tuple[torch.Tensor, ...],
                          kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE + KV write in one kernel pass over qkv [T, heads + 2 kv_heads, hd] (in place),
        then decode rows on the decode kernel and prefill chunks on SDPA. -> [T, heads, hd]."""
        nh, ops = self.shard.num_heads, self.ops
        if qk.data_ptr() != qkv.data_ptr():  # Qwen3's normed q/k: back into qkv for the kernel
            qkv[:, :qk.shape[1]] = qk
        cos, sin, positions = rope
        ops.rope_store_kv(qkv, cos, sin, positions, kv_cache, layer, meta.slot_blocks,
                          meta.slot_offsets, nh)
        scale = self.config.head_dim ** -0.5

        def decode(q, cache, lyr, m, _scale):
            return ops.decode_attention(q, cache, lyr, m.decode_tables, m.decode_key_ranges, scale)

        return attend(qkv[:, :nh], qkv[:, nh:nh + self.shard.num_kv_heads],
                      qkv[:, nh + self.shard.num_kv_heads:], kv_cache, layer, meta, decode=decode)
