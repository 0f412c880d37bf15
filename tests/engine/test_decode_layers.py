"""The fused batch-1 decode forward (KernelOps.decode_layers, engine/csrc/cpu_ops.cpp) against the
per-op kernel path it replaces: the same logits and the same KV cache, bit for bit, step after
step across block boundaries, float32 and bfloat16, on tiny and SmolLM2-shaped random weights;
and LlamaModel keeps the per-op path wherever the fused kernel does not apply.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention_meta import build_metadata
from engine.cpu_ops import KernelOps, load_library
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.tp import TPContext

pytestmark = pytest.mark.skipif(load_library() is not None,
                                reason=f"pdserve CPU kernels: {load_library()} (make install builds them)")

FUSED, PER_OP = KernelOps(fuse_decode_layers=True), KernelOps(fuse_decode_layers=False)
TINY = dict(num_layers=3, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=512)
SMOLLM2 = dict(num_layers=3, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
               head_dim=64, vocab_size=2048)  # SmolLM2-135M's layer shape, 3 of its 30 layers


def _config(dims: dict, **kw) -> ModelConfig:
    return ModelConfig(architecture="llama", rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                       tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=[],
                       **dims, **kw)


def _state(c: ModelConfig, seed: int, qkv_bias: bool = False) -> dict[str, torch.Tensor]:
    """Random HF-named weights (norms and biases randomized too, so every input matters)."""
    g = torch.Generator().manual_seed(seed)
    h, hd = c.hidden_size, c.head_dim

    def rnd(*shape, scale=0.08, mean=0.0):
        return torch.randn(*shape, generator=g) * scale + mean

    s = {"model.embed_tokens.weight": rnd(c.vocab_size, h, scale=1.0), "model.norm.weight": rnd(h, mean=1.0)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = rnd(h, mean=1.0)
        s[p + "post_attention_layernorm.weight"] = rnd(h, mean=1.0)
        for n, rows in (("q", c.num_heads * hd), ("k", c.num_kv_heads * hd), ("v", c.num_kv_heads * hd)):
            s[p + f"self_attn.{n}_proj.weight"] = rnd(rows, h)
            if qkv_bias:
                s[p + f"self_attn.{n}_proj.bias"] = rnd(rows)
        s[p + "self_attn.o_proj.weight"] = rnd(h, c.num_heads * hd)
        s[p + "mlp.gate_proj.weight"] = rnd(c.intermediate_size, h)
        s[p + "mlp.up_proj.weight"] = rnd(c.intermediate_size, h)
        s[p + "mlp.down_proj.weight"] = rnd(h, c.intermediate_size)
        if c.qk_norm:
            s[p + "self_attn.q_norm.weight"] = rnd(hd, mean=1.0)
            s[p + "self_attn.k_norm.weight"] = rnd(hd, mean=1.0)
    return s


class _Item:
    def __init__(self, num_computed: int, num_new: int, block_ids: list[int]):
        self.num_computed, self.num_new, self.block_ids = num_computed, num_new, block_ids


def _step(model: LlamaModel, cache: torch.Tensor, items: list[_Item], tokens: torch.Tensor) -> torch.Tensor:
    """One forward over items' new tokens (decodes first); logits of each item's last token."""
    bs = cache.shape[3]
    pos = torch.cat([torch.arange(it.num_computed, it.num_computed + it.num_new) for it in items])
    metas = {w: build_metadata(items, pos, bs, w, model.config.num_layers) for w in set(model.windows)}
    last = torch.tensor(list(torch.tensor([it.num_new for it in items]).cumsum(0) - 1))
    return model.forward(tokens, pos, last, cache, metas)


def _cache(c: ModelConfig, dtype: torch.dtype, blocks: int = 16, bs: int = 4) -> torch.Tensor:
    return torch.zeros(blocks, c.num_layers, 2, bs, c.num_kv_heads, c.head_dim, dtype=dtype)


class _Spy:
    """Counts KernelOps.decode_layers calls (monkeypatched onto the class)."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, KernelOps.decode_layers

        def counted(ops, *a, **kw):
            self.calls += 1
            return real(ops, *a, **kw)
        monkeypatch.setattr(KernelOps, "decode_layers", counted)


def _same_decodes(model: LlamaModel, prompt_len: int, steps: int, bs: int, seed: int = 0) -> None:
    """Prefill prompt_len tokens, then `steps` single-token decodes, once per path on its own
    cache (the same blocks, scattered); logits and caches must be equal after every step."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(16, generator=g)[: -(-(prompt_len + steps) // bs)].tolist()
    tokens = torch.randint(0, c.vocab_size, (prompt_len + steps,), generator=g)
    caches = {FUSED: _cache(c, model.dtype, bs=bs), PER_OP: _cache(c, model.dtype, bs=bs)}
    for ops, cache in caches.items():
        model.ops = ops
        _step(model, cache, [_Item(0, prompt_len, blocks)], tokens[:prompt_len])  # prefill: per-op path
    for n in range(prompt_len, prompt_len + steps):
        logits = {}
        for ops, cache in caches.items():
            model.ops = ops
            logits[ops] = _step(model, cache, [_Item(n, 1, blocks)], tokens[n:n + 1])
        assert torch.equal(logits[FUSED], logits[PER_OP]), f"logits differ at position {n}"
        assert torch.equal(caches[FUSED], caches[PER_OP]), f"KV cache differs at position {n}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims,bs,prompt_len,steps", [(TINY, 4, 6, 8), (SMOLLM2, 16, 13, 6)],
                         ids=["tiny", "smollm2-shaped"])
def test_fused_decode_bit_identical_to_per_op_kernels(monkeypatch, dtype, dims, bs, prompt_len, steps):
    """Positions cross block boundaries (tiny: 8 and 12; SmolLM2-shaped: 16), blocks scattered."""
    spy = _Spy(monkeypatch)
    model = LlamaModel(_config(dims), _state(_config(dims), 1), dtype, pack_cpu_linears=True, ops=FUSED)
    _same_decodes(model, prompt_len, steps, bs)
    assert spy.calls == steps  # the fused arm ran every decode, never the prefill


def test_fused_decode_with_qkv_bias(monkeypatch):
    """Qwen2's q/k/v biases go into the fused GEMV (the same rounding as gemv's bias)."""
    spy = _Spy(monkeypatch)
    c = dataclasses.replace(_config(TINY), attention_bias=True)
    model = LlamaModel(c, _state(c, 2, qkv_bias=True), torch.float32, pack_cpu_linears=True, ops=FUSED)
    _same_decodes(model, 5, 4, 4)
    assert spy.calls == 4


def _decode_once(model: LlamaModel, items: list[_Item], n_tokens: int) -> None:
    cache = _cache(model.config, model.dtype)
    _step(model, cache, items, torch.arange(n_tokens) % model.config.vocab_size)


@pytest.mark.parametrize("case", ["two decode rows", "prefill chunk", "decode + prefill chunk"])
def test_fused_decode_not_used_beyond_one_decode_token(monkeypatch, case):
    spy = _Spy(monkeypatch)
    model = LlamaModel(_config(TINY), _state(_config(TINY), 3), torch.float32, pack_cpu_linears=True, ops=FUSED)
    items, n = {"two decode rows": ([_Item(3, 1, [0]), _Item(5, 1, [1, 2])], 2),
                "prefill chunk": ([_Item(0, 3, [0])], 3),
                "decode + prefill chunk": ([_Item(3, 1, [0]), _Item(0, 2, [1])], 3)}[case]
    _decode_once(model, items, n)
    assert spy.calls == 0
    _decode_once(model, [_Item(3, 1, [0])], 1)  # while one decode token does fuse
    assert spy.calls == 1


@pytest.mark.parametrize("case", ["qwen3 q/k norm", "sliding window", "tp", "switched off", "not packed"])
def test_fused_decode_not_used_where_it_does_not_apply(monkeypatch, case):
    spy = _Spy(monkeypatch)
    c = _config(TINY, qk_norm=case == "qwen3 q/k norm",
                layer_windows=(None, 8, None) if case == "sliding window" else ())
    model = LlamaModel(c, _state(c, 4), torch.float32, pack_cpu_linears=case != "not packed",
                       ops=PER_OP if case == "switched off" else FUSED)
    if case == "tp":  # a TP rank's shard (the check reads tp.size only)
        model.tp = TPContext(rank=0, size=2)
        metas = {None: build_metadata([_Item(3, 1, [0])], torch.tensor([3]), 4, None, c.num_layers)}
        assert model._fused_decode_weights(1, metas) is None
        return
    _decode_once(model, [_Item(3, 1, [0])], 1)
    assert spy.calls == 0


def test_decode_layers_rejects_bad_shapes():
    c = _config(TINY)
    model = LlamaModel(c, _state(c, 5), torch.float32, pack_cpu_linears=True, ops=FUSED)
    metas = {None: build_metadata([_Item(3, 1, [0])], torch.tensor([3]), 4, None, c.num_layers)}
    weights, biases = model._fused_decode_weights(1, metas)
    meta, cache = metas[None], _cache(c, torch.float32)
    rope = (*model.rope.tables(3, "cpu"), torch.tensor([3]))
    args = (cache, rope, meta.slot_blocks, meta.slot_offsets, meta.decode_tables, meta.decode_key_ranges,
            1e-5, 0.25, c.num_heads)
    x = torch.randn(1, c.hidden_size)
    with pytest.raises(RuntimeError, match="6 per layer"):
        FUSED.decode_layers(x, weights[:-1], biases, *args)
    with pytest.raises(RuntimeError, match="qkv must be"):
        FUSED.decode_layers(x, [weights[0], weights[1][:-1].contiguous()] + weights[2:], biases, *args)
    with pytest.raises(RuntimeError, match="x must be"):
        FUSED.decode_layers(torch.randn(2, c.hidden_size), weights, biases, *args)
    with pytest.raises(RuntimeError, match="dtype"):
        FUSED.decode_layers(x, [w.bfloat16() for w in weights], biases, *args)
